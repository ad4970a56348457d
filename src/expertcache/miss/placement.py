"""Placement: the experts of chosen layers always run on the host, the others are cached (the baseline).

What users of llama.cpp (``--cpu-moe``, ``--n-cpu-moe N``, ``-ot exps=CPU``) and kTransformers run today:
dense weights on the device, the expert weights of some or all layers in host memory, computed there.
``layers=all`` (the default) puts every layer's experts on the host (no expert cache at all);
``layers=0/1/2`` names the layers; ``first=N`` takes the first N (llama.cpp's ``--n-cpu-moe N``). The
other layers' experts are fetched into the cache as usual, which gets the whole expert memory. Exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from expertcache.miss.base import (
    FETCH,
    FULL,
    ON_HOST,
    CacheView,
    MissContext,
    MissPath,
    MissPathError,
    Need,
    Route,
)
from expertcache.policy.base import Key


class Placement(MissPath):
    name = "placement"

    def __init__(self, ctx: MissContext, *, layers: object = None, first: int | None = None) -> None:
        super().__init__(ctx)
        L = ctx.num_layers
        if layers is not None and first is not None:
            raise MissPathError("miss path 'placement' takes layers=... or first=N, not both")
        if first is not None:
            if not isinstance(first, int) or not 0 <= first <= L:
                raise MissPathError(
                    f"placement: first must be a whole number of layers in 0..{L}, got {first!r}"
                )
            chosen = set(range(first))
        elif layers is None or layers == "all":
            chosen = set(range(L))
        else:
            items = layers if isinstance(layers, list) else [layers]
            if not all(isinstance(i, int) and 0 <= i < L for i in items):
                raise MissPathError(
                    f"placement: layers must be 'all' or layer numbers in 0..{L - 1} (as 0/1/2), "
                    f"got {layers!r}"
                )
            chosen = set(items)
        self._host = frozenset(chosen)

    def host_layers(self) -> frozenset[int]:
        return self._host

    def capacities(self, budget: int, slot_bytes: dict[str, int]) -> dict[str, int]:
        if len(self._host) == self.ctx.num_layers:
            return {FULL: 0}  # nothing is ever cached: no slot is allocated
        return super().capacities(budget, slot_bytes)

    def decide(
        self, layer: int, needs: Sequence[Need], view: CacheView, hits: Sequence[Need] = ()
    ) -> list[Route]:
        return [ON_HOST if layer in self._host else FETCH] * len(needs)

    def prefetch(self, key: Key, view: CacheView) -> tuple[str, ...]:
        return () if key[0] in self._host else (FULL,)

    def describe(self) -> str:
        if len(self._host) == self.ctx.num_layers:
            return "placement:layers=all"
        if not self._host:  # none on the host: a spec that parses and replays it (``layers=`` did not)
            return "placement:first=0"
        return "placement:layers=" + "/".join(map(str, sorted(self._host)))
