"""LCP, least cache priority (MoEpic, Sec. 3.3).

Each expert has an activation count mu (all requests so far) and nu, the tokens since its last
activation; its priority is P = mu * rho^(nu / omega) (rho = 0.25, omega = 128 by default) and the
lowest priority is evicted. Since ln P = ln mu + c * t_last - c * t_now with c = -ln(rho) / omega,
and the last term is the same for every key, ranking by s = ln mu + c * t_last, fixed at each touch,
orders the keys exactly as P does at any later time, so no rescan is needed. Time is the clock's
token count (a prefill step counts from its first token; the K rounds of a token share its time).
"""

from __future__ import annotations

import math

from expertcache.errors import PolicyError
from expertcache.policy.base import Key, PolicyContext
from expertcache.policy.scored import ScoredPolicy


class LCP(ScoredPolicy):
    name = "lcp"

    def __init__(self, ctx: PolicyContext, *, rho: float = 0.25, omega: float = 128.0) -> None:
        super().__init__(ctx)
        if not 0.0 < rho < 1.0:
            raise PolicyError(f"lcp: rho must be in (0, 1), got {rho}")
        if not 0 < omega < math.inf:  # nan and inf too
            raise PolicyError(f"lcp: omega must be a positive finite number, got {omega}")
        self.rho, self.omega = rho, omega
        self._decay = -math.log(rho) / omega
        self._count: dict[Key, int] = {}

    def score(self, key: Key) -> float:
        count = self._count.get(key, 0) + 1
        self._count[key] = count
        return math.log(count) + self._decay * self.clock.token
