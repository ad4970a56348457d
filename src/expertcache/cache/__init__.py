"""The step logic shared by the simulator and the engine: residency, the expert cache, the step driver."""

from expertcache.cache.expert_cache import ExpertCache, LayerWork
from expertcache.cache.needs import needs_of
from expertcache.cache.residency import Residency, group_experts
from expertcache.cache.step import InlinePredictor, StepDriver

__all__ = [
    "ExpertCache",
    "InlinePredictor",
    "LayerWork",
    "Residency",
    "StepDriver",
    "group_experts",
    "needs_of",
]
