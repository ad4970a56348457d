"""The inference engine: Hugging Face MoE checkpoints with experts streamed through a bounded cache."""

from expertcache.lazy import defer_transformers_hqq

defer_transformers_hqq()  # before anything imports transformers' models (expertcache.lazy says why)

from expertcache.engine.families import FAMILIES  # noqa: E402
from expertcache.engine.link import EmulatedLink  # noqa: E402
from expertcache.engine.offloaded import Generation, OffloadedModel, default_model_path, load  # noqa: E402

__all__ = ["FAMILIES", "EmulatedLink", "Generation", "OffloadedModel", "default_model_path", "load"]
