"""Miss paths: what the cache does for an expert a step needs that is not resident on the device.

One decision per missing ``(layer, expert)`` of a layer, taken when the router has chosen, returns a
``Route``: fetch the whole expert into the cache (``FETCH``), fetch a smaller variant of it (a
low-precision copy, a part), compute it where its weights lie (``ON_HOST``), compute the resident part
and fetch the rest (a split expert), or skip it (lossy, opt-in only). The decision sees each missing
expert's ``Need`` (tokens routed to it, its gate weight, rank and HOBBIT's importance), what is
resident or moving (a ``CacheView``) and the ``CostModel``; it never sees tensors. The engine and the
timing simulator run the same decisions, so a recorded trace replays to the engine's counts.

A miss path also says which **parts** the cache holds (``PartSpec``): ``full`` experts by default,
separate full- and low-precision caches for HOBBIT, top segments and a buffer of bottom segments for
MoEpic. Each part is its own residency under its own policy, with keys ``(layer, expert)``; the expert
memory is shared among the parts by ``capacities``. Adding a miss path is one file (a subclass) and one
line in ``miss/registry.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from expertcache.costs import CostModel
from expertcache.errors import ExpertcacheError
from expertcache.policy.base import Key

FULL = "full"
DEVICE, HOST, SKIP = "device", "host", "skip"


class MissPathError(ExpertcacheError):
    """An unknown miss path, bad parameters, or a variant that was not built."""


@dataclass(frozen=True)
class Route:
    """How one requested expert is served this step: on the device from the cache parts it needs
    resident (each moved in if missing), on the host (with parts: moved into the cache in the
    background too, for later steps), or not at all."""

    where: str
    parts: tuple[str, ...] = ()

    @functools.cached_property  # asked for every expert of every layer
    def lossy(self) -> bool:
        """Skipped, or computed from a low-precision copy."""
        return self.where == SKIP or any(p.startswith("int") for p in self.parts)


FETCH = Route(DEVICE, (FULL,))
ON_HOST = Route(HOST)
ON_HOST_FILL = Route(HOST, (FULL,))  # computed on the host now, moved into the cache in the background
SKIPPED = Route(SKIP)


@dataclass(frozen=True)
class PartSpec:
    """One cache part: its name, what one key of it holds, and its policy (None: the user's).

    ``kind`` is ``full`` (the whole expert), ``segment`` (the intermediate neurons ``[lo, hi)`` as
    fractions, per layer or one pair for all) or ``quantized`` (``bits`` per weight, group-wise)."""

    name: str
    kind: str = "full"
    segment: tuple[tuple[float, float], ...] | None = None  # per layer (lo, hi) for kind "segment"
    bits: int | None = None  # for kind "quantized"
    group: int | None = None  # for kind "quantized": weights per scale and zero
    policy: str | None = None
    min_room: int | None = None  # slots each layer needs at least (None: top-k)
    shared: bool = False  # one pool for every layer, slots sized for the largest layer's key

    def least_room(self, top_k: int) -> int:
        """Slots each layer needs at least in this part: ``min_room``, or a token's top-k."""
        return top_k if self.min_room is None else self.min_room

    def bounds(self, layer: int) -> tuple[float, float]:
        segment = self.segment or ((0.0, 1.0),)
        return segment[layer] if len(segment) > 1 else segment[0]


FULL_PART = PartSpec(FULL)


@dataclass(frozen=True)
class Need:
    """One expert a layer needs in this step, as a miss path sees it."""

    key: Key
    tokens: int  # tokens of the step routed to it in this layer
    weight: float  # its largest renormalised gate weight over those tokens
    importance: float  # HOBBIT's s: the least, over its tokens, of the weight of the experts ranked above it
    rank: int  # its best rank among those tokens (0: some token's top-1)
    mass: float = 0.0  # its renormalised gate weight summed over those tokens (its routing score)


class CacheView(Protocol):
    """What a miss path may ask of the cache."""

    def resident(self, part: str, key: Key) -> bool:
        """Resident in the part and not moving any more."""

    def present(self, part: str, key: Key) -> bool:
        """Resident in the part, or moving in (queued or in flight)."""

    def admits(self, part: str, keys: Sequence[Key]) -> list[bool]:
        """For each of ``keys`` (missing from the part), whether the part's policy would cache it: its
        value exceeds the value of what it would evict (``Policy.admits``)."""


@dataclass(frozen=True)
class MissContext:
    """What a miss path knows of the model and the machine."""

    num_layers: int
    num_experts: int
    top_k: int
    costs: CostModel | None = None  # the machine's costs (required by cost-based paths)


class MissPath:
    """The default answer, ``fetch``: every missing expert is fetched whole (exact)."""

    name: ClassVar[str] = "fetch"
    lossy: ClassVar[bool] = False
    needs_costs: ClassVar[bool] = False  # decides by the CostModel (the engine calibrates one)
    # parameters the path lays out by its own rule from the memory where not given (a stream buffer's
    # slots): ``describe`` names what was laid out, and a replay of a recorded run that leaves one out
    # takes the run's
    laid_out: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: MissContext) -> None:
        self.ctx = ctx

    # -- the cache's shape ------------------------------------------------------------------------
    def parts(self) -> list[PartSpec]:
        """The cache parts, the first one primary (the user's policy and -dist budgets apply to it)."""
        return [FULL_PART]

    def capacities(self, budget: int, slot_bytes: dict[str, object]) -> dict[str, object]:
        """Keys each part holds out of ``budget`` bytes, given the bytes of one slot of each part (one
        figure, or one per layer for a part whose slots differ by layer: then a capacity per layer)."""
        return {FULL: budget // slot_bytes[FULL]}

    def host_layers(self) -> frozenset[int]:
        """Layers whose experts never enter the cache (always computed on the host)."""
        return frozenset()

    def fills(self) -> bool:
        """Whether the path moves experts into the cache in the background (``ON_HOST_FILL``: computed on
        the host now, filled for later steps): speculative transfers, which move in chunks as a
        predictor's do. Every other transfer a path asks for is a demand one, moved whole."""
        return False

    def preloads(self) -> bool:
        """Whether, with an expert memory that holds every expert, filling it at load is this path's
        answer too: every expert then a hit, computed from its slot (nothing to offload). True for a
        path of whole experts alone that keeps no layer on the host; a path that divides the memory
        (segments, low-precision copies, a stream buffer) or places layers on the host does not."""
        return [spec.kind for spec in self.parts()] == ["full"] and not self.host_layers()

    def capacity_notes(self, capacities: dict[str, object]) -> list[str]:
        """What the split of the memory (``capacities``'s result) changed of the options given: one line
        each, for the user (a part smaller than asked for)."""
        return []

    def policy_notes(self, policy, capacities: dict[str, object]) -> list[str]:
        """What the primary part's policy (built) leaves unused of this path: one line each."""
        return []

    # -- the decisions ----------------------------------------------------------------------------
    def hit(self, layer: int) -> Route:
        """The route of an expert whose primary parts are all present (resident or moving in)."""
        return FETCH

    def decide(
        self, layer: int, needs: Sequence[Need], view: CacheView, hits: Sequence[Need] = ()
    ) -> list[Route]:
        """One route for each expert of ``needs`` (the layer's experts not present in the primary part);
        ``hits`` are the layer's other experts (present: computed on the device from the cache)."""
        return [FETCH] * len(needs)

    def prefetch(self, key: Key, view: CacheView) -> tuple[str, ...]:
        """The parts to prefetch for a predicted expert (those already present are skipped)."""
        return self.hit(key[0]).parts

    def costs(self) -> CostModel:
        """The machine's costs, for a path that decides by them (``needs_costs``); one clear error without."""
        if self.ctx.costs is None:
            raise MissPathError(
                f"miss path {self.name!r} decides by the machine's costs, and none were given"
            )
        return self.ctx.costs

    def describe(self) -> str:
        return self.name
