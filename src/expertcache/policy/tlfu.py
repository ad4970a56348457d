"""TLFU: token-weighted LFU with aging, and TinyLFU's admission test, for a cache shared by a batch.

Under a batch (many users, or a long prompt) one step needs the union of its tokens' experts, and an
expert used by 30 of the step's tokens is worth more than one used by 1: recency (LRU) sees only that
both were used, and collapses (a step of 64 requests needs nearly every expert of a layer). TLFU keeps
each expert's frequency ``F`` in tokens, aged: every use adds the tokens routed to the expert in that
step (``on_use``, whatever serves it: the cache, the host, a stream buffer), and ``F`` halves every
``half_life`` tokens of the workload (the clock's ``token``; so the window is the same in tokens at 1
and at 64 users). Prompt tokens count ``prompt`` each (default 1/4): a prompt's one-time experts must not
evict the decode working set. The victim is the resident expert of the lowest ``F`` (ties: the least
recently touched); ``ln F + ln 2 * t / half_life`` at the last use ``t`` ranks keys as ``F`` does at any
later time, so the ranking is fixed at each touch (``ScoredPolicy``).

Admission (``admits``, TinyLFU: Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache
Admission Policy", 2017): a missing expert is worth caching only if its ``F`` exceeds ``1 + margin``
times that of the resident expert it would evict (twice, at the default margin of 1); the missing experts
of a layer are matched, highest ``F`` first, against the victims in eviction order. A miss path that asks
(``batch``) computes the others elsewhere (on the host, or streamed through a small buffer): the bypass
of experts whose reuse is too far off for the cache. Exact counts (the keys are few: layers x experts),
not TinyLFU's sketch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container, Sequence

from expertcache.errors import PolicyError
from expertcache.policy.base import Key, PolicyContext
from expertcache.policy.scored import ScoredPolicy


class TLFU(ScoredPolicy):
    name = "tlfu"
    weighs = True
    selective = True

    def __init__(
        self, ctx: PolicyContext, *, half_life: float = 4096, prompt: float = 0.25, margin: float = 1.0
    ) -> None:
        super().__init__(ctx)
        if not (isinstance(half_life, int | float) and half_life > 0):
            raise PolicyError(f"tlfu: half_life must be a positive number of tokens, got {half_life!r}")
        if not (isinstance(prompt, int | float) and 0 < prompt <= 1):
            raise PolicyError(f"tlfu: prompt must be a weight in (0, 1], got {prompt!r}")
        if not (isinstance(margin, int | float) and margin >= 0):
            raise PolicyError(f"tlfu: margin must be a number >= 0, got {margin!r}")
        self.half_life, self.prompt, self.margin = float(half_life), float(prompt), float(margin)
        self._gap = math.log1p(self.margin)
        self._c = math.log(2.0) / self.half_life
        self._rank: dict[Key, float] = {}  # key -> ln F + c * t at its last use: F's rank at any time

    def on_use(self, keys: Sequence[Key], tokens: Sequence[int]) -> None:
        ct, ranks = self._c * self.clock.token, self._rank
        w = self.prompt if self.clock.prefill else 1.0
        for key, n in zip(keys, tokens, strict=True):
            old = ranks.get(key)
            # F_now = F_then * 2^(-(now - then)/h) + w n, in log space: ln(exp(old - ct) + w n) + ct
            add = math.log(w * n) + ct
            ranks[key] = add if old is None else max(old, add) + math.log1p(math.exp(-abs(old - add)))

    def score(self, key: Key) -> float:
        return self._rank.get(key, -math.inf)

    def admits(self, incoming: Sequence[Key], pinned: Container[Key]) -> list[bool]:
        free = self.capacity - len(self._entry)
        ranks = self._rank
        order = sorted(range(len(incoming)), key=lambda i: -ranks.get(incoming[i], -math.inf))
        out = [False] * len(incoming)
        heap, entry, taken = self._heap, self._entry, []
        try:
            for i in order:
                if free > 0:
                    free -= 1
                    out[i] = True
                    continue
                # the next victim in eviction order: the heap's next live, unpinned entry (popped, stale
                # ones dropped as ``victim`` drops them, live ones put back below), not a scan of all
                victim = None
                while heap:
                    top = heapq.heappop(heap)
                    if entry.get(top[2]) is top:
                        taken.append(top)
                        if top[2] not in pinned:
                            victim = top
                            break
                if victim is None or ranks.get(incoming[i], -math.inf) <= victim[0] + self._gap:
                    break  # the rest rank lower still
                out[i] = True
        finally:
            for e in taken:
                heapq.heappush(heap, e)
        return out
