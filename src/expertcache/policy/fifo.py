"""FIFO: evict the expert that became resident first; hits change nothing (Belady 1966 baseline)."""

from __future__ import annotations

from expertcache.policy.lru import LRU


class FIFO(LRU):
    name = "fifo"
    move_on_hit = False
