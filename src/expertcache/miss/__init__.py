"""Miss paths: fetch, host compute, low precision, split experts, skipping (see ``miss.base``)."""

from expertcache.miss.base import (
    DEVICE,
    FETCH,
    FULL,
    HOST,
    ON_HOST,
    SKIP,
    SKIPPED,
    CacheView,
    MissContext,
    MissPath,
    MissPathError,
    Need,
    PartSpec,
    Route,
)
from expertcache.miss.registry import MISS_PATHS, make_miss, miss_class, parse_miss

__all__ = [
    "DEVICE",
    "FETCH",
    "FULL",
    "HOST",
    "MISS_PATHS",
    "ON_HOST",
    "SKIP",
    "SKIPPED",
    "CacheView",
    "MissContext",
    "MissPath",
    "MissPathError",
    "Need",
    "PartSpec",
    "Route",
    "make_miss",
    "miss_class",
    "parse_miss",
]
