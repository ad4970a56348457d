"""MRS, HybriMoE's score-based cache: evict the expert with the lowest decayed routing score.

Every expert keeps a score S. When a layer routes a step's tokens, each expert it chose is updated
``S <- alpha * s + (1 - alpha) * S`` with ``s`` its routing score (its renormalised gate weight, summed
over the step's tokens), and every other expert of the layer decays, ``S <- (1 - alpha) * S``
(HybriMoE, "Minus Recent Score"; alpha 0.5). The paper updates the top-p experts by routing score with
p = 2k; the router's scores beyond its top-k reach neither the engine's experts function nor a trace,
so here p = k: the chosen experts are updated and the rest decay. A layer is visited once per forward
step, so the decay is counted in steps (the clock's ``round``): S now is ``S_last * (1 - alpha) ^
(round - round_last)``, and ``ln S_last + c * round_last`` with ``c = -ln(1 - alpha)`` ranks the keys as S
does at any later time, fixed at each touch. Without scores (a replay of a trace with no gate
weights), every chosen expert scores 1/k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from expertcache.errors import PolicyError
from expertcache.policy.base import Key, PolicyContext
from expertcache.policy.scored import ScoredPolicy


class MRS(ScoredPolicy):
    name = "mrs"
    observes = True

    def __init__(self, ctx: PolicyContext, *, alpha: float = 0.5) -> None:
        super().__init__(ctx)
        if not 0.0 < alpha < 1.0:
            raise PolicyError(f"mrs: alpha must be in (0, 1), got {alpha}")
        self.alpha = alpha
        self._c = -math.log(1.0 - alpha)
        self._score: dict[Key, tuple[float, int]] = {}  # key -> (S, round of S)
        self._pending: dict[Key, float] = {}  # routing scores of the group being admitted

    def on_request(self, keys: Sequence[Key], scores: Sequence[float] | None = None) -> None:
        uniform = 1.0 / max(1, self.ctx.top_k)
        if scores is None:
            self._pending = dict.fromkeys(keys, uniform)
        else:
            self._pending = dict(zip(keys, scores, strict=True))

    def current(self, key: Key) -> float:
        """S of a key now (0 if never routed to)."""
        s, then = self._score.get(key, (0.0, 0))
        return s * (1.0 - self.alpha) ** (self.clock.round - then)

    def score(self, key: Key) -> float:
        now = self.clock.round
        s = self.current(key)
        routed = self._pending.pop(key, None)
        if routed is not None:
            s = self.alpha * routed + (1.0 - self.alpha) * s
        self._score[key] = (s, now)
        return math.log(s) + self._c * now if s > 0 else -math.inf
