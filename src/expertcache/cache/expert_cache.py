"""The expert cache: its parts, the transfers in flight, prefetching, preemption, reordering and routes.

One ``ExpertCache`` serves both the engine (over its transfer worker) and the timing simulator (over a
virtual link): it moves nothing itself, a ``Transport`` does, so both take the very same decisions.

- **Parts.** The cache holds one or more parts, each a ``Residency`` under its own policy: ``full``
  experts by default; HOBBIT's separate full- and low-precision caches; MoEpic's top segments and a
  buffer of bottom segments. The miss path (``miss``) says which parts there are and which an expert
  needs. The first part is primary: an expert present there (resident, or moving in) is a hit.
- **Routes** (``begin_layer``): when the router has chosen, each expert the layer needs gets a route:
  hits the miss path's ``hit`` route, misses what its ``decide`` returns (fetch, a low-precision copy,
  host compute, a split expert, skip). Device routes need their parts resident; the missing ones are
  demand transfers.
- **Prefetch** (ProMoE, Sec. 5): every predicted expert's parts (``miss.prefetch``) not present enter
  their part through its policy (they may evict) as speculative transfers. A prefetch never evicts an
  expert of the layer being computed, one in flight, or one prefetched for a layer still to come in this
  step; when nothing else can go the prediction is skipped.
- **Early preemption**: when the router has chosen, that layer's queued speculative transfers the router
  did not choose are dropped (their keys leave the cache) and the chosen ones become demand transfers.
- **Reordering**: a layer's units (one per part of each device expert) are computed resident first, then
  in flight, then not started in the link's order (the router's first-use order without it).
- **Plain layers**: a layer with nothing moving and nothing prefetched for it, whose experts fit one
  chunk of a one-part route and whose misses (if any) are fetched whole (every decode step of a model
  that fits, and most of one that does not, without prefetching), is served by a shortcut that makes the
  same counts, policy calls and transfers without the routing and admission machinery: the cache's
  Python per layer and per miss is what the engine adds to the model's own and to the copy (a property
  test replays traces both ways and compares every count and virtual time).
- A key is resident from the moment its transfer is queued; keys in flight are pinned. When a demand miss
  finds every other key pinned (the minimum budget, say), the queued speculative transfers are dropped and
  the started ones awaited, so serving never deadlocks. A group larger than a part's room for the layer is
  served in chunks that fit every part (resident experts first).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from types import MappingProxyType

from expertcache.cache.needs import LayerNeeds
from expertcache.cache.residency import Residency
from expertcache.cache.stats import CacheStats
from expertcache.cache.transfers import DEMAND, FAILED, READY, SPECULATIVE, Transport
from expertcache.errors import NoVictim, PolicyError
from expertcache.miss.base import DEVICE, FETCH, HOST, SKIP, MissPath, Need, Route
from expertcache.policy.base import Key

PartKey = tuple[str, Key]  # (part, (layer, expert))
_NOTHING: Mapping = MappingProxyType({})  # a layer with nothing prefetched for it
Unit = tuple[Key, str]  # one device computation: an expert's part


class ExpertCache:
    """Parts + in-flight transfers + speculative bookkeeping + routes, driven layer by layer."""

    def __init__(
        self,
        parts: dict[str, Residency],
        transport: Transport,
        miss: MissPath,
        num_layers: int,
        limit: int,
        preemption: bool = True,
        reorder: bool = True,
    ) -> None:
        self.parts, self.primary = parts, next(iter(parts))
        self.transport, self.miss = transport, miss
        self.limit = max(1, limit)  # experts prefetched per predicted layer at most
        self.preemption, self.reorder = preemption, reorder
        self.inflight: dict[PartKey, object] = {}
        self.demand: set[PartKey] = set()  # in-flight transfers some layer now waits for (never dropped)
        self.spec: dict[int, dict[PartKey, None]] = {}  # target layer -> its prefetched transfers
        self.predicted: dict[int, set[int]] = {}  # target layer -> predicted experts, this step
        self.shadowed: dict[int, set[Key]] = {}  # target layer -> what a shadow prediction would move
        self.stats = CacheStats(num_layers)
        self.phase = 0  # 1 while a prefill step is served
        self._fetches = type(miss).decide is MissPath.decide  # every miss fetched whole (``_plain_layer``)
        self._scores: dict[Key, float] = {}  # the layer being served: each expert's routing score
        self._current: Sequence[Key] = ()  # the layer being served: its experts (pinned while it is)
        self._missed: set[Key] = set()  # the layer being served: its experts missing from the primary part

    @property
    def residency(self) -> Residency:
        """The primary part's residency."""
        return self.parts[self.primary]

    @property
    def policy(self):
        return self.residency.policy

    # -- what a miss path may ask (CacheView) ----------------------------------------------------
    def present(self, part: str, key: Key) -> bool:
        return key in self.parts[part]

    def admits(self, part: str, keys: Sequence[Key]) -> list[bool]:
        residency = self.parts[part]
        return residency.policy.admits(keys, _Pins(part, self._current, self.inflight, self.spec))

    def resident(self, part: str, key: Key) -> bool:
        if key not in self.parts[part]:
            return False
        handle = self.inflight.get((part, key))
        return handle is None or self.transport.poll(handle) == READY

    # -- steps -------------------------------------------------------------------------------------
    def begin_step(self, prefill: bool = False) -> None:
        self.spec.clear()
        self.predicted.clear()
        self.shadowed.clear()
        self.phase = int(prefill)

    def prefetch(self, predictions: dict[int, list[int]], current: Collection[Key] = ()) -> int:
        """Queue speculative transfers for predicted experts; return how many were queued."""
        queued = 0
        stats, parts = self.stats, self.parts
        self._reap()  # finished transfers are no longer pinned (what this call queues is still moving)
        staging = getattr(self.transport, "stage_limit", 0)  # a host level below stages what is left
        for target, ranked in predictions.items():
            chosen = ranked[: self.limit]
            self.predicted.setdefault(target, set()).update(chosen)
            waiting = self.spec.setdefault(target, {})
            left = []  # predicted, not moved to the device now: for the host level to stage
            for expert in chosen:
                key = (target, expert)
                for part in self.miss.prefetch(key, self):
                    if key in parts[part]:
                        continue
                    try:
                        victim = parts[part].insert(key, _Pins(part, current, self.inflight, self.spec))
                    except NoVictim:  # every key pinned: skipped (a victim of the policy's fault is raised)
                        stats.skipped_prefetches[target] += 1
                        left.append(key)
                        continue
                    self.inflight[(part, key)] = self.transport.submit(key, victim, SPECULATIVE, part)
                    waiting[(part, key)] = None
                    stats.issued[target] += 1
                    stats.part_prefetches[part] = stats.part_prefetches.get(part, 0) + 1
                    queued += 1
            if staging:
                more = [(target, e) for e in ranked[self.limit : self.limit + staging]]
                self.transport.stage([k for k in dict.fromkeys(left + more) if k not in parts[self.primary]])
        return queued

    def shadow(self, predictions: dict[int, list[int]]) -> int:
        """Score predictions without acting on them (the governor's warm-up): each predicted expert not
        in the primary part is a guess that prefetching would move; when its layer comes, a guess the
        router chose and still missing is a hit (a demand transfer it would have saved), the others
        were wrong (a transfer for nothing, and an eviction). Nothing is queued or evicted; returns the
        guesses counted."""
        primary, counted = self.parts[self.primary], 0
        for target, ranked in predictions.items():
            guesses = self.shadowed.setdefault(target, set())
            for expert in ranked[: self.limit]:
                key = (target, expert)
                if key not in primary and key not in guesses:
                    guesses.add(key)
                    counted += 1
        return counted

    # -- serving a layer -------------------------------------------------------------------------
    def begin_layer(self, layer: int, needs: Sequence[Need]) -> LayerWork:
        """The router has chosen ``needs`` (distinct experts, first-use order): preempt, route, and queue
        the first chunk's demand transfers. The returned work yields the device units to compute."""
        lazy = isinstance(needs, LayerNeeds)
        keys = needs.keys_in_order if lazy else [n.key for n in needs]
        policy = self.parts[self.primary].policy
        if policy.weighs:  # every expert the layer needs, with its tokens, whatever will serve it
            policy.on_use(keys, needs.tokens if lazy else [n.tokens for n in needs])
        spec = self.spec.pop(layer, _NOTHING) if self.spec else _NOTHING
        predicted = self.predicted.pop(layer, None) if self.predicted else None
        guesses = self.shadowed.pop(layer, None) if self.shadowed else None
        if guesses:
            primary = self.parts[self.primary]
            self.stats.shadow_guesses += len(guesses)
            self.stats.shadow_hits += sum(k in guesses and k not in primary for k in keys)
        if self.inflight:  # nothing to preempt or reap otherwise
            if self.preemption:
                self._preempt(layer, keys, spec)
            self._reap()
        elif not spec and predicted is None:
            work = self._plain_layer(layer, needs, keys)
            if work is not None:
                return work
        self._current = keys
        if len(self.parts) > 1:  # for ``part_reused`` (``admit``): the misses, before any is admitted
            primary = self.parts[self.primary]
            self._missed = {key for key in keys if key not in primary}
        routes = self._routes(layer, needs)
        self._account(layer, keys, routes, spec, predicted)
        work = LayerWork(self, layer, needs, routes)
        self._scores = {n.key: n.mass for n in needs}
        work.start()
        fills = [(n.key, routes[n.key].parts) for n in work.host if routes[n.key].parts]
        if fills:
            self._fill(layer, fills, keys)
        return work

    def _plain_layer(self, layer: int, needs: Sequence[Need], keys: list[Key]) -> LayerWork | None:
        """``begin_layer`` for a plain layer, served without the routing and admission machinery: nothing
        moving and nothing prefetched for it, a policy that does not observe requests (one that weighs its
        keys has had them in ``on_use``), its experts in one chunk of a one-part route, and each miss (if
        any) fetched whole (the ``fetch`` miss path). Every decode step of a model that fits, and most of
        one that does not: the same counts, policy calls and transfers in the same order as the full path
        (a property test replays traces both ways). A miss whose transfer has landed by the time
        ``submit`` returns (copied by the submitting thread) is never in flight. None where that does not
        apply."""
        hit = self.miss.hit(layer)
        primary = self.parts[self.primary]
        policy = primary.policy
        if hit.where != DEVICE or hit.parts != (self.primary,) or policy.observes:  # (``on_use``: above)
            return None
        if len(keys) > policy.room(layer):
            return None
        resident = primary.resident
        missed = 0 if resident.issuperset(keys) else sum(key not in resident for key in keys)
        if missed and not (self._fetches and hit == FETCH):
            return None
        stats, phase = self.stats, self.phase
        stats.requests[phase, layer] += len(keys)
        if hit.lossy:
            stats.low_precision[phase, layer] += len(keys)
        self._scores = {}
        if not missed:
            policy.on_hits(keys)
        else:
            stats.misses[phase, layer] += missed
            part, transport = self.primary, self.transport
            self._current = keys  # pinned in a host level below (``cache.tiers``) while they move
            for key, victim in primary.admit(keys):  # the layer's keys pinned, as ``admit`` pins a chunk
                handle = transport.submit(key, victim, DEMAND, part)
                stats.part_misses[part] = stats.part_misses.get(part, 0) + 1
                if transport.poll(handle) != READY:
                    self.inflight[(part, key)] = handle
                    self.demand.add((part, key))
        items = [(key, hit.parts) for key in keys]
        return LayerWork(self, layer, needs, dict.fromkeys(keys, hit), chunks=[items] if items else [])

    def _fill(self, layer: int, items, current: list[Key]) -> None:
        """Experts computed on the host now, moved into the cache in the background for later steps:
        speculative transfers no layer of this step waits for."""
        for key, parts in items:
            for part in parts:
                if key in self.parts[part]:
                    continue
                try:
                    victim = self.parts[part].insert(key, _Pins(part, current, self.inflight, self.spec))
                except NoVictim:
                    continue
                self.inflight[(part, key)] = self.transport.submit(key, victim, SPECULATIVE, part)
                self.stats.filled[layer] += 1
                self.stats.part_fills[part] = self.stats.part_fills.get(part, 0) + 1

    def serve(self, layer: int, experts: Sequence[int]) -> Iterator[Key]:
        """Serve a layer's experts (one token each, weights unknown) and yield each key once its parts
        are ready: ``begin_layer`` and the work's units, for callers that only need keys."""
        needs = [Need((layer, e), 1, 1.0, 0.0, 0, 1.0) for e in experts]
        for key, _ in self.begin_layer(layer, needs).units():
            yield key

    def _preempt(self, layer: int, keys: list[Key], spec: dict[PartKey, None]) -> None:
        """Drop the layer's queued prefetches the router did not choose; make the chosen ones demand."""
        chosen = set(keys)
        inflight, transport = self.inflight, self.transport
        for pk in spec:
            handle = inflight.get(pk)
            if handle is not None and pk[1] not in chosen and transport.cancel(handle):
                self._cancelled(pk)
        for key in keys:  # chosen and still moving, whenever it was prefetched: now a demand
            for part in self.parts:
                handle = inflight.get((part, key))
                if handle is not None and (part, key) not in self.demand:
                    transport.promote(handle)
                    self.demand.add((part, key))

    def _routes(self, layer: int, needs: Sequence[Need]) -> dict[Key, Route]:
        primary = self.parts[self.primary]
        missing = [n for n in needs if n.key not in primary]
        hit = self.miss.hit(layer)
        routes = {n.key: hit for n in needs}
        if missing:
            hits = [n for n in needs if n.key in primary]
            decided = self.miss.decide(layer, missing, self, hits)
            if len(decided) != len(missing):
                name, n = self.miss.name, len(missing)
                raise PolicyError(f"miss path {name}: {len(decided)} routes for {n} experts")
            routes.update(zip((n.key for n in missing), decided, strict=True))
        return routes

    def _account(self, layer, keys, routes, spec, predicted) -> None:
        stats, phase, primary = self.stats, self.phase, self.primary
        if predicted is not None:
            stats.actual[layer] += len(keys)
            for key in keys:
                if key[1] in predicted:
                    stats.correct[layer] += 1
                    stats.in_time[layer] += self.resident(primary, key)
        for part, key in spec:
            if key in routes:
                if key not in self.parts[part]:  # a demand of a layer in between took its place
                    stats.evicted[layer] += 1
                    continue
                stats.used[layer] += 1
                stats.late[layer] += not self.resident(part, key)
        stats.requests[phase, layer] += len(keys)
        residency = self.parts[primary]
        missed = sum(key not in residency for key in keys)
        if missed:
            stats.misses[phase, layer] += missed
        for route in routes.values():
            if route.where == HOST:
                stats.host[phase, layer] += 1
            elif route.where == SKIP:
                stats.skipped[phase, layer] += 1
            elif route.lossy:
                stats.low_precision[phase, layer] += 1

    def chunks(self, layer: int, items: list[tuple[Key, tuple[str, ...]]]) -> list[list]:
        """Device experts in chunks that fit each part's room for the layer: all at once when they fit,
        else present first, then the others, as many as every part has room for."""
        if not items:
            return []
        rooms = {p: self.parts[p].policy.room(layer) for p in {p for _, ps in items for p in ps}}
        if min(rooms.values()) >= len(items):  # each item takes a part once at most: they all fit
            return [items]
        counts = Counter(p for _, ps in items for p in ps)
        if all(counts[p] <= room for p, room in rooms.items()):
            return [items]
        short = [p for p, room in rooms.items() if room < 1]
        if short:
            raise PolicyError(f"part {short[0]}: layer {layer} has no room for any expert")
        # present first: whole, then those missing the fewest parts that are short of room for the layer,
        # then by the primary part: a part's present keys must be served, and so become evictable, before
        # its missing ones need their room (a split expert whose bottom was prefetched goes before one
        # whose top is cached, where the bottoms have room for one)
        parts, primary = self.parts, self.parts[self.primary]
        tight = [p for p, room in rooms.items() if counts[p] > room]

        def rank(item) -> tuple[int, int]:
            key, ps = item
            if all(key in parts[p] for p in ps):
                return 0, 0
            return 1 + sum(p in ps and key not in parts[p] for p in tight), 0 if key in primary else 1

        ordered = sorted(items, key=rank)  # stable: first-use order within each rank
        out, current, used = [], [], Counter()
        for key, ps in ordered:
            if current and any(used[p] + 1 > rooms[p] for p in ps):
                out.append(current)
                current, used = [], Counter()
            current.append((key, ps))
            used.update(ps)
        out.append(current)
        return out

    def admit(self, layer: int, chunk: list[tuple[Key, tuple[str, ...]]]) -> None:
        """Make every part of the chunk's experts resident; queue a demand transfer for each miss."""

        def make_room() -> None:
            self._drain({(p, key) for key, ps in chunk for p in ps})

        stats, primary, missed = self.stats, self.primary, self._missed
        for part, residency in self.parts.items():
            keys = [key for key, ps in chunk if part in ps]
            if not keys:
                continue
            if part != primary and missed:  # a missed expert's part already there moves nothing
                reused = sum(key in missed and key in residency for key in keys)
                if reused:
                    stats.part_reused[part] = stats.part_reused.get(part, 0) + reused
            pins = _Pins(part, keys, self.inflight, {})
            for key, victim in residency.admit(keys, pins, make_room, self._scores):
                self.inflight[(part, key)] = self.transport.submit(key, victim, DEMAND, part)
                self.demand.add((part, key))
                self.stats.part_misses[part] = self.stats.part_misses.get(part, 0) + 1

    def order(self, chunk: list[tuple[Key, tuple[str, ...]]]) -> list[Unit]:
        """The chunk's units in compute order: ready, moving, queued (in the link's order)."""
        units = [(key, p) for key, ps in chunk for p in ps]
        if not self.reorder or not self.inflight:  # nothing moving: all ready, in first-use order
            return units
        ready, moving, queued = [], [], []
        for key, part in units:
            handle = self.inflight.get((part, key))
            if handle is None or self.transport.poll(handle) == READY:
                ready.append((key, part))
            elif self.transport.started(handle):
                moving.append((key, part))
            else:
                queued.append((key, part))
        if len(queued) > 1:  # in the order the link will take them: demand first, then by submission
            rank = {pk: i for i, pk in enumerate(self.inflight)}
            queued.sort(key=lambda u: ((u[1], u[0]) not in self.demand, rank[(u[1], u[0])]))
        return ready + moving + queued

    def wait(self, key: Key, part: str) -> None:
        """Until the unit's transfer (if any) has landed; it is no longer in flight."""
        if not self.inflight:
            return
        handle = self.inflight.get((part, key))
        if handle is not None:
            self.transport.wait(handle)
            del self.inflight[(part, key)]
            self.demand.discard((part, key))

    def settle(self) -> None:
        """Wait for every transfer in flight to land (a failed prefetch leaves the cache), cancelling none:
        the cache then holds what it would have held a moment later anyway, so a replay of the run counts
        the same, and what the transfers moved is in the counts taken now (a generation's own bytes)."""
        for handle in list(self.inflight.values()):
            try:
                self.transport.wait(handle)
            except Exception:  # a failed prefetch: it never arrived (``_reap`` lets it go)
                pass
        self._reap()

    def _drain(self, keep: Collection[PartKey]) -> None:
        """Drop every queued speculative transfer outside ``keep`` and wait for the rest to land."""
        for pk, handle in list(self.inflight.items()):
            if pk not in keep and self.transport.cancel(handle):
                self._cancelled(pk)
        for pk, handle in list(self.inflight.items()):
            if pk not in keep:
                try:
                    self.transport.wait(handle)
                except Exception:  # a failed prefetch: it never arrived
                    pass
        self._reap()

    def _reap(self) -> None:
        """Forget finished speculative transfers (no longer pinned); a failed one leaves the cache.
        Transfers a layer waits for stay until the layer waits on them (which raises if they failed)."""
        for pk, handle in list(self.inflight.items()):
            state = self.transport.poll(handle)
            if state == READY and pk not in self.demand:
                del self.inflight[pk]
            elif state == FAILED and pk not in self.demand:
                self._forget(pk)

    def _cancelled(self, pk: PartKey) -> None:
        """A queued prefetch the transport dropped before it moved: forgotten and counted."""
        self._forget(pk)
        stats, part = self.stats, pk[0]
        stats.cancelled[pk[1][0]] += 1
        stats.part_cancelled[part] = stats.part_cancelled.get(part, 0) + 1

    def _forget(self, pk: PartKey) -> None:
        """A speculative transfer that will not land: its key leaves the part and its place is freed."""
        part, key = pk
        del self.inflight[pk]
        self.parts[part].remove(key)
        self.transport.release(key, part)
        waiting = self.spec.get(key[0])
        if waiting is not None:
            waiting.pop(pk, None)


class LayerWork:
    """One layer's experts as the cache serves them: ``units()`` yields the device units (an expert's
    part) in compute order, each ready when yielded; ``host`` are computed on the host; ``skipped`` not
    at all. The first chunk's transfers are queued on creation (``start``)."""

    def __init__(
        self,
        cache: ExpertCache,
        layer: int,
        needs: Sequence[Need],
        routes: dict[Key, Route],
        chunks: list[list] | None = None,
    ):
        """``chunks`` (every expert resident, on the device): the units' chunks, already admitted."""
        self.cache, self.layer, self.needs, self.routes = cache, layer, needs, routes
        if chunks is not None:
            self.host, self.skipped, self.chunks = [], [], chunks
            return
        device: list[tuple[Key, tuple[str, ...]]] = []
        self.host: list[Need] = []
        self.skipped: list[Need] = []
        for n in needs:
            route = routes[n.key]
            if route.where == DEVICE:
                device.append((n.key, route.parts))
            elif route.where == HOST:
                self.host.append(n)
            elif route.where == SKIP:
                self.skipped.append(n)
        self.chunks = cache.chunks(layer, device)

    def start(self) -> None:
        if self.chunks:
            self.cache.admit(self.layer, self.chunks[0])

    def units(self) -> Iterator[Unit]:
        cache = self.cache
        for i, chunk in enumerate(self.chunks):
            if i:
                cache.admit(self.layer, chunk)
            for key, part in cache.order(chunk):
                cache.wait(key, part)
                yield key, part

    def batches(self) -> Iterator[list[Unit]]:
        """The units as groups computed together (the engine's grouped kernel), streamed: each chunk's
        units ready now, then, until none is left, the next unit once it has landed with every later one
        that has landed meanwhile. A layer whose experts are moving (a long prompt's, a batch's misses)
        computes each group as it arrives rather than after the last, as the timing model's layer does;
        with nothing moving it is one group. The same admissions and waits, in the same order, as
        ``units()``; only where the groups break depends on timing, and a unit's output does not."""
        cache = self.cache
        for i, chunk in enumerate(self.chunks):
            if i:
                cache.admit(self.layer, chunk)
            order = cache.order(chunk)
            if not cache.inflight:  # nothing moving: every unit ready
                yield order
                continue
            start = 0
            while start < len(order):  # the next unit once landed, and every later one landed meanwhile
                cache.wait(*order[start])
                end = start + 1
                while end < len(order) and self._landed(order[end]):
                    cache.wait(*order[end])
                    end += 1
                yield order[start:end]
                start = end

    def _landed(self, unit: Unit) -> bool:
        handle = self.cache.inflight.get((unit[1], unit[0]))
        return handle is None or self.cache.transport.poll(handle) == READY


class _Pins:
    """Keys of one part that may not be evicted: the current group, in flight, awaited prefetches."""

    __slots__ = ("part", "current", "inflight", "spec")

    def __init__(self, part: str, current: Collection[Key], inflight: dict, spec: dict) -> None:
        self.part, self.current, self.inflight, self.spec = part, current, inflight, spec

    def __contains__(self, key: object) -> bool:
        if key in self.current:
            return True
        pk = (self.part, key)
        if pk in self.inflight:
            return True
        waiting = self.spec.get(key[0])  # type: ignore[index]
        return waiting is not None and pk in waiting
