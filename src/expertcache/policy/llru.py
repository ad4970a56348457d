"""LLRU, layered LRU (the LLRU paper Sec. 4).

With t the current time and tau(p) the last request time of page p, both counted in layer visits
(round * L + layer), R(p) = floor((t - tau) / L) is the number of whole rounds since p was used and
D(p) = (tau - t) mod L the number of layer visits until p's layer comes again. Evict the largest R,
ties broken by the largest D: a page of the layer just served is a better victim than one of the
layer about to run.

Finding the victim: resident pages are kept in last-use order (an LRU list). The pages with the
largest R are those whose tau lies in the one-round window that starts at the oldest tau, and inside
that window D grows with tau, except for tau = t - R*L where D = 0. So the victim is the page with
the most recent tau <= t - R*L - 1 in the window, or, if the window holds no such page, the first page
with tau = t - R*L. A scan from the old end stops at the window's end, at most one round of requests.
Pages that share a tau (one group) tie exactly; the first one touched goes first.
"""

from __future__ import annotations

from collections.abc import Container

from expertcache.policy.base import Key, Policy, PolicyContext, no_victim


class LLRU(Policy):
    name = "llru"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._L = ctx.num_layers
        self._tau: dict[Key, int] = {}  # resident key -> last use, in last-use order

    def __len__(self) -> int:
        return len(self._tau)

    def __contains__(self, key: object) -> bool:
        return key in self._tau

    def now(self) -> int:
        return self.clock.round * self._L + self.clock.layer

    def on_hit(self, key: Key) -> None:
        tau = self._tau
        del tau[key]
        tau[key] = self.clock.round * self._L + self.clock.layer

    def on_insert(self, key: Key) -> None:
        self._tau[key] = self.clock.round * self._L + self.clock.layer

    def on_evict(self, key: Key) -> None:
        del self._tau[key]

    def rank(self, key: Key) -> tuple[int, int]:
        """(R, D) of a resident key now; the victim maximises it."""
        t, tau = self.now(), self._tau[key]
        return (t - tau) // self._L, (tau - t) % self._L

    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        taus = self._tau
        if len(taus) < self.capacity:
            return None
        L = self._L
        t = self.clock.round * L + self.clock.layer
        oldest = next(iter(taus.values()))
        edge = t - (t - oldest) // L * L  # tau with D = 0 in the oldest window
        best, best_tau = None, oldest - 1
        for key, tau in taus.items():  # ascending tau
            if tau >= edge:
                break
            if tau > best_tau and key not in pinned:
                best, best_tau = key, tau
        if best is not None:
            return best
        for key, tau in taus.items():
            if tau > edge:
                break
            if tau == edge and key not in pinned:
                return key
        return self._victim_by_scan(incoming, pinned)

    def _victim_by_scan(self, incoming: Key, pinned: Container[Key]) -> Key:
        """The general rule over every unpinned key, for when the window holds only pinned ones."""
        free = [(self.rank(k), -i, k) for i, k in enumerate(self._tau) if k not in pinned]
        if not free:
            raise no_victim(self, incoming)
        return max(free)[2]
