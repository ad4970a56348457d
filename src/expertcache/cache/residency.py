"""Which experts are resident, and how one layer's request group is served. One place for both.

The engine and the simulator call the same methods, so they agree hit for hit by construction:

- ``chunks(layer, keys)``: a layer's distinct experts in first-use order are one group, pinned
  together (none may be evicted to make room for another of the same group). When the group is
  larger than the room the policy gives that layer (a prefill layer, or a small per-layer budget),
  it is served one chunk after another: the resident experts first (they need no transfer and must
  not be evicted before use), then the missing ones, ``room`` at a time.
- ``insert(key, pinned)``: the one place a key becomes resident: the policy's victim (never a pinned
  key) leaves, the key enters. ``admit`` (a chunk of demand requests) and a prefetch both go through it.
- ``admit(chunk)``: every key of the chunk becomes resident; returns the misses as
  ``(key, evicted key or None)`` pairs, the transfers the engine must make.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence

from expertcache.errors import NoVictim, PolicyError
from expertcache.policy.base import Key, Policy

_SET_PIN_THRESHOLD = 8  # larger chunks are pinned through a set rather than a tuple scan


def group_experts(rows: Iterable[Iterable[int]]) -> list[int]:
    """Distinct expert ids of one layer over tokens, in first-use order, unknown (-1) skipped."""
    seen: dict[int, None] = {}
    for row in rows:
        for e in row:
            if e >= 0:
                seen[e] = None
    return list(seen)


class Residency:
    """The set of resident keys under a policy, and the serving of request groups."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.resident: set[Key] = set()

    def __len__(self) -> int:
        return len(self.resident)

    def __contains__(self, key: object) -> bool:
        return key in self.resident

    def chunks(self, layer: int, keys: Sequence[Key]) -> list[Sequence[Key]]:
        """Split a layer's group into chunks that fit the layer's room: resident first, then missing."""
        room = self.policy.room(layer)
        if len(keys) <= room:
            return [keys]
        if room < 1:
            raise PolicyError(f"{self.policy.name}: layer {layer} has no room for any expert")
        res = self.resident
        ordered = [k for k in keys if k in res] + [k for k in keys if k not in res]
        return [ordered[i : i + room] for i in range(0, len(ordered), room)]

    def insert(self, key: Key, pinned: Container[Key]) -> Key | None:
        """Make a missing key resident, evicting the policy's victim (never one in ``pinned``); return
        the victim. Raises ``NoVictim``, with nothing changed, when every candidate is pinned (the policy
        says so, or returns None with the cache full), and ``PolicyError`` when it chose wrong (a victim
        not resident or pinned): a prefetch skipped for that hid a broken policy."""
        victim = self.policy.victim(key, pinned)
        if victim is None and len(self.resident) >= self.policy.capacity:
            # full, and nothing to evict: a policy that says None rather than raising ``no_victim`` (as
            # the documented example once did) would overfill the cache
            raise NoVictim(
                f"{self.policy.name}: no victim for {key} with the cache full ({self.policy.capacity} "
                "experts): victim() returns None only while there is room, and raises no_victim when every "
                "key is pinned"
            )
        if victim is not None and (victim not in self.resident or victim in pinned):
            why = "not resident" if victim not in self.resident else "pinned (in use, or moving)"
            raise PolicyError(f"{self.policy.name}: victim() chose {victim!r} for {key}, which is {why}")
        if victim is not None:
            self.resident.remove(victim)
            self.policy.on_evict(victim)
        self.resident.add(key)
        self.policy.on_insert(key)
        return victim

    def remove(self, key: Key) -> None:
        """Take a key out (a prefetch dropped before it arrived): the policy sees an eviction."""
        self.resident.remove(key)
        self.policy.on_evict(key)

    def admit(
        self,
        chunk: Sequence[Key],
        pinned: Container[Key] | None = None,
        make_room: Callable[[], None] | None = None,
        scores: Mapping[Key, float] | None = None,
    ) -> list[tuple[Key, Key | None]]:
        """Make every key of the chunk resident, never evicting one in ``pinned`` (default: the chunk);
        return (miss, evicted) pairs. When every candidate is pinned, ``make_room`` (if given) is called
        once to unpin some, and the insertion tried again. ``scores`` (routing scores by key, when known)
        go to policies that observe requests."""
        res, policy, misses = self.resident, self.policy, []
        if policy.observes:
            policy.on_request(chunk, None if scores is None else [scores.get(k, 0.0) for k in chunk])
        if pinned is None:
            pinned = chunk if len(chunk) <= _SET_PIN_THRESHOLD else frozenset(chunk)
        for key in chunk:
            if key in res:
                policy.on_hit(key)
                continue
            try:
                victim = self.insert(key, pinned)
            except NoVictim:
                if make_room is None:
                    raise
                make_room()
                victim = self.insert(key, pinned)
            misses.append((key, victim))
        return misses

    def serve(self, layer: int, keys: Sequence[Key], scores: Mapping[Key, float] | None = None) -> int:
        """Serve a whole group (chunk after chunk, as the engine computes them); return its misses."""
        if len(keys) <= self.policy.room(layer):
            return len(self.admit(keys, scores=scores))
        return sum(len(self.admit(chunk, scores=scores)) for chunk in self.chunks(layer, keys))
