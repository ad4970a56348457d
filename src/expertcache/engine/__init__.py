"""The inference engine: Hugging Face MoE checkpoints with experts streamed through a bounded cache."""

from expertcache.engine.families import FAMILIES
from expertcache.engine.link import EmulatedLink
from expertcache.engine.offloaded import Generation, OffloadedModel, default_model_path, load

__all__ = ["FAMILIES", "EmulatedLink", "Generation", "OffloadedModel", "default_model_path", "load"]
