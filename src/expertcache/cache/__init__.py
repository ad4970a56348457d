"""Cache mechanism shared by the simulator and the engine: residency and the serving of a step."""

from expertcache.cache.residency import Residency, group_experts

__all__ = ["Residency", "group_experts"]
