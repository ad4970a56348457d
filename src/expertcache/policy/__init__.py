"""Eviction policies over (layer, expert) keys, shared by the simulator and the engine."""

from expertcache.policy.base import Clock, Key, Policy, PolicyContext
from expertcache.policy.dist import Dist, uniform_budgets
from expertcache.policy.registry import (
    POLICIES,
    is_offline,
    make_policy,
    min_capacity,
    parse_policy,
    policy_class,
)

__all__ = [
    "POLICIES",
    "Clock",
    "Dist",
    "Key",
    "Policy",
    "PolicyContext",
    "is_offline",
    "make_policy",
    "min_capacity",
    "parse_policy",
    "policy_class",
    "uniform_budgets",
]
