"""The policy interface shared by the simulator and the engine.

A policy decides which resident expert to evict; it never sees tensors. It is told of every hit,
insert and eviction of a ``(layer, expert)`` key, and answers ``victim(incoming, pinned)``: the key
to evict so that ``incoming`` fits, or ``None`` when it fits already. Keys in ``pinned`` (the
experts of the group being served, transfers in flight) must never be chosen. Which keys are
resident is owned by the cache (``expertcache.cache.Residency``); a policy keeps whatever ordering
it needs over the same keys.

Time comes from a ``Clock`` owned by the driver: ``round`` counts passes over the layers (one per
decode token or prefill step in layer order, one per token in flat order, one per seed-000 round
in rounds order), ``layer`` is the layer being served, ``group`` indexes the request group, the unit in
which an offline policy's future is given, ``token`` counts tokens (the first token of a prefill
step; the K rounds of a token in rounds order share it), ``seq`` is the request being served, and
``prefill`` whether the step holds prompt tokens.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from expertcache.errors import NoVictim, PolicyError

Key = tuple[int, int]  # (layer, expert)


class Clock:
    """Mutable time cursor written by the driver (simulator or engine) and read by policies."""

    __slots__ = ("round", "layer", "group", "token", "seq", "prefill")

    def __init__(self) -> None:
        self.round = 0
        self.layer = 0
        self.group = 0
        self.token = 0
        self.seq = 0  # the request (sequence) the current step serves: its first row's id
        self.prefill = False  # the current step holds prompt tokens


@dataclass(frozen=True)
class PolicyContext:
    """Everything a policy may know about the cache it manages."""

    capacity: int  # experts the fast tier holds
    num_layers: int
    num_experts: int
    top_k: int = 1
    clock: Clock | None = None
    seed: int = 0
    future: Mapping[Key, Sequence[int]] | None = None  # key -> ascending group indices (offline)
    profile: Mapping[Key, int] | None = None  # key -> how often it is used (for Static)

    def __post_init__(self) -> None:
        for name in ("capacity", "num_layers", "num_experts", "top_k", "seed"):  # not 4.5, "4" or True
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise PolicyError(f"PolicyContext {name} must be a whole number, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.capacity < 1:
            raise PolicyError(f"capacity must be at least 1 expert, got {self.capacity}")
        if self.seed < 0:  # Python's random draws the same for -1 as for 1: two seeds, one run
            raise PolicyError(f"seed must be at least 0, got {self.seed}")
        if self.num_layers < 1 or self.num_experts < 1:
            raise PolicyError("num_layers and num_experts must be at least 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise PolicyError(f"top_k must be 1 .. num_experts ({self.num_experts}), got {self.top_k}")
        if self.clock is None:
            object.__setattr__(self, "clock", Clock())
        elif not isinstance(self.clock, Clock):
            raise PolicyError(f"PolicyContext clock must be a Clock (or None), got {self.clock!r}")

    def now(self) -> int:
        """The current time in layer visits: round * L + layer."""
        return self.clock.round * self.num_layers + self.clock.layer


class Policy(ABC):
    """An eviction policy over (layer, expert) keys; one subclass per algorithm."""

    name: ClassVar[str]
    offline: ClassVar[bool] = False  # needs ctx.future (the requests to come)
    needs_profile: ClassVar[bool] = False  # needs ctx.profile (usage counts)
    seeded: ClassVar[bool] = False  # draws from ctx.seed (two seeds, two different runs)
    observes: ClassVar[bool] = False  # wants on_request for every requested group
    weighs: ClassVar[bool] = False  # wants on_use for every layer's experts, with their tokens
    selective: ClassVar[bool] = False  # ``admits`` may refuse a key (tlfu): a miss path may bypass the cache
    text_params: ClassVar[frozenset[str]] = frozenset()  # parameters that are text (file names), not numbers

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.capacity = ctx.capacity
        self.clock = ctx.clock

    def room(self, layer: int) -> int:
        """How many experts of ``layer`` can be resident at once (a group larger than this is split)."""
        return self.capacity

    def __repr__(self) -> str:
        try:
            held = f"{len(self)} of {self.capacity} keys"
        except Exception:  # a policy whose own state is not set up yet (a subclass's __init__ failing)
            held = f"capacity {getattr(self, 'capacity', '?')}"
        return f"<{type(self).__name__} policy {getattr(self, 'name', '?')!r}: {held}>"

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys the policy tracks."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether the policy tracks ``key`` as resident."""

    def on_request(self, keys: Sequence[Key], scores: Sequence[float] | None = None) -> None:  # noqa: B027
        """A layer's group (or one chunk of it) was requested, before it is admitted; ``scores`` are the
        keys' routing scores (their gate weight summed over the step's tokens) when the driver knows
        them. Called only for policies with ``observes`` set (``eam``, ``mrs``, ``hobbit``)."""

    def on_use(self, keys: Sequence[Key], tokens: Sequence[int]) -> None:  # noqa: B027
        """A layer's step needs ``keys``, ``tokens`` of its tokens routed to each, whatever serves them (the
        cache, the host, a stream buffer); called once per layer and step, before any of them is routed
        or admitted. Called only for policies with ``weighs`` set (``tlfu``)."""

    def admits(self, incoming: Sequence[Key], pinned: Container[Key]) -> list[bool]:
        """For each missing key of ``incoming``, whether caching it is worth the evictions it causes (a
        miss path asks before routing; one that is not admitted is computed elsewhere, bypassing the
        cache). Every key by default: a classic cache admits whatever it is asked for."""
        return [True] * len(incoming)

    @abstractmethod
    def on_hit(self, key: Key) -> None:
        """A resident key was requested."""

    def on_hits(self, keys: Sequence[Key]) -> None:
        """Resident keys of one layer requested together (a layer whose experts are all resident), in this
        order: the same as ``on_hit`` for each, one call a layer (a policy may do it in one pass)."""
        on_hit = self.on_hit
        for key in keys:
            on_hit(key)

    @abstractmethod
    def on_insert(self, key: Key) -> None:
        """A key became resident (after a miss, or a prefetch)."""

    @abstractmethod
    def on_evict(self, key: Key) -> None:
        """A resident key was evicted."""

    @abstractmethod
    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        """The resident key to evict so that ``incoming`` fits, never one in ``pinned``; None if it fits."""


def no_victim(policy: Policy, incoming: Key) -> NoVictim:
    """The error for a cache whose every resident key is pinned (the caller over-committed)."""
    return NoVictim(
        f"{policy.name}: no evictable expert for {incoming} (capacity {policy.capacity}, all pinned)"
    )
