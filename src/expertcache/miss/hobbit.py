"""HOBBIT: on a miss of a less critical expert, use a low-precision copy instead of the full one.

Token-level dynamic loading (Tang et al., "HOBBIT: A Mixed Precision Expert Offloading System for Fast
MoE Inference"): the experts a token chose, sorted by their renormalised gate weights ``w``, get the
importance ``s_i = sum_{j<i} w_j`` (the top-1 has s = 0). A missed expert with ``s <= t1`` is fetched at
full precision; with ``t1 < s <= t2`` its low-precision copy (``bits``: 8, 4 or 2) is used, from a
separate low-precision cache or fetched into it; with ``s > t2`` it is skipped when ``skip=1`` (its
contribution dropped), else also low-precision. An expert routed by several tokens of a step takes its
most important use. Defaults: int4, t1 0.6, t2 0.9 (HOBBIT's for Mixtral: about 67/30/3%); ``t1 < 0``
sends every miss to the low-precision copy. The two caches share the expert memory: ``low_share`` of it
holds low-precision copies (default 0.25). A full-precision copy present is always used. The copies are
built once by ``expertcache quantize`` (``group`` must match). Lossy: every run reports how many experts
ran at low precision and how many were skipped; ``expertcache quality`` measures what that costs.
The int8 and int4 copies are
in the packed checkpoints' formats and computed by the packed kernels from their bytes (numba on a CPU,
Triton on a GPU, ``engine.packed``); int2 copies are HQQ's (needs the optional hqq), expanded per use.
HOBBIT's multi-dimensional cache score is the ``hobbit`` policy; its layer-adaptive prefetch the
``adaptive`` predictor.
"""

from __future__ import annotations

from collections.abc import Sequence

from expertcache.miss.base import (
    DEVICE,
    FETCH,
    FULL,
    FULL_PART,
    SKIPPED,
    CacheView,
    MissContext,
    MissPath,
    MissPathError,
    Need,
    PartSpec,
    Route,
)


class Hobbit(MissPath):
    name = "hobbit"
    lossy = True

    def __init__(
        self,
        ctx: MissContext,
        *,
        bits: int = 4,
        t1: float = 0.6,
        t2: float = 0.9,
        skip: int = 0,
        low_share: float = 0.25,
        group: int | None = None,
    ) -> None:
        super().__init__(ctx)
        if bits not in (8, 4, 2):
            raise MissPathError(f"hobbit: bits must be 8, 4 or 2, got {bits!r}")
        for name, value in (("t1", t1), ("t2", t2)):
            if not isinstance(value, int | float) or not -1 <= value <= 1:
                raise MissPathError(
                    f"hobbit: {name} must be in [-1, 1] (a share of gate weight), got {value!r}"
                )
        if t2 < t1:
            raise MissPathError(f"hobbit: t2 ({t2}) must be at least t1 ({t1})")
        if skip not in (0, 1):
            raise MissPathError(f"hobbit: skip is 0 or 1, got {skip!r}")
        if not isinstance(low_share, int | float) or not 0 < low_share < 1:
            raise MissPathError(f"hobbit: low_share must be in (0, 1), got {low_share!r}")
        if group is not None and bits == 8:  # taken in silence before: int8 copies are per channel
            raise MissPathError("hobbit: group applies to int4 and int2 copies only (int8 is per channel)")
        group = 64 if group is None else group
        if not isinstance(group, int) or group < 8 or group & (group - 1):
            raise MissPathError(f"hobbit: group must be a power of two of at least 8, got {group!r}")
        self.bits, self.t1, self.t2, self.skip = bits, float(t1), float(t2), bool(skip)
        self.low_share, self.group = float(low_share), group
        self.low = f"int{bits}"
        self.low_route = Route(DEVICE, (self.low,))

    def parts(self) -> list[PartSpec]:
        return [FULL_PART, PartSpec(self.low, "quantized", bits=self.bits, group=self.group, min_room=1)]

    def capacities(self, budget: int, slot_bytes: dict[str, object]) -> dict[str, object]:
        keys = self.ctx.num_layers * self.ctx.num_experts
        low_budget = int(budget * self.low_share)
        full = min(keys, (budget - low_budget) // slot_bytes[FULL])
        return {FULL: full, self.low: min(keys, low_budget // slot_bytes[self.low])}

    def decide(
        self, layer: int, needs: Sequence[Need], view: CacheView, hits: Sequence[Need] = ()
    ) -> list[Route]:
        out = []
        for n in needs:
            if n.importance <= self.t1:
                out.append(FETCH)
            elif n.importance > self.t2 and self.skip:
                out.append(SKIPPED)
            else:
                out.append(self.low_route)
        return out

    def describe(self) -> str:
        return (
            f"hobbit:bits={self.bits},t1={self.t1:g},t2={self.t2:g},skip={int(self.skip)},"
            f"low_share={self.low_share:g}"
        )
