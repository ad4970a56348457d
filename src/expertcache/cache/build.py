"""Building an expert cache: the budget shared among its parts, a policy for each, their checks, and the
cache with its step driver over a transport.

The engine and the timing simulator build their caches here, from the same miss path and capacities, so
both hold the same parts with the same policies, prefetch limit, preemption, reordering and governor;
only the bytes of one slot (the engine's real layouts, the simulator's cost model), the transport (slots
and a transfer worker, or a virtual link) and the governor's clock differ:

    parts = build_parts(miss, part_capacities(miss, budget, slot_bytes, top_k), policy, ctx)
    driver = assemble(parts, transport, miss, ctx, limit=..., predictor=..., governor_clock=...)
    driver.cache  # the ExpertCache
"""

from __future__ import annotations

from dataclasses import replace

from expertcache.cache.expert_cache import ExpertCache
from expertcache.cache.governor import PrefetchGovernor
from expertcache.cache.recorder import Recorder
from expertcache.cache.residency import Residency
from expertcache.cache.step import PredictorRunner, StepDriver
from expertcache.cache.tiers import HostLevel, TieredTransport, exclusive_reserve
from expertcache.cache.transfers import Transport
from expertcache.errors import ExpertcacheError
from expertcache.miss.base import MissPath
from expertcache.policy.base import PolicyContext
from expertcache.policy.registry import (
    capacity_reason,
    fixed_capacity,
    make_policy,
    min_capacity,
    parse_policy,
)
from expertcache.units import format_bytes


def part_capacities(
    miss: MissPath, budget: int, slot_bytes: dict[str, object], top_k: int
) -> dict[str, object]:
    """Keys each part holds out of ``budget`` bytes (per layer for parts whose slots differ by layer);
    a part below what it needs is one clear error."""
    caps = miss.capacities(int(budget), slot_bytes)
    for spec in miss.parts():
        need = spec.least_room(top_k)
        have = caps.get(spec.name, 0)
        have = min(have) if isinstance(have, list) else have
        size = slot_bytes[spec.name]
        slot = format_bytes(max(size) if isinstance(size, list) else size)
        if have < need and len(miss.host_layers()) < miss.ctx.num_layers:
            raise ExpertcacheError(
                f"expert memory of {format_bytes(budget)} gives the {spec.name!r} part of miss path "
                f"{miss.describe()} {have} slot(s) of {slot}; it needs at least {need}"
            )
    return caps


def build_parts(
    miss: MissPath, capacities: dict[str, int], policy: str, ctx: PolicyContext
) -> dict[str, Residency]:
    """One residency per part of ``miss``, the primary under ``policy`` (``name[:k=v,...]``), the others
    under their own policy or the same one; each checked to give every layer room for its needs."""
    parts: dict[str, Residency] = {}
    host = miss.host_layers()
    cached = len(host) < ctx.num_layers  # some layer's experts enter the cache
    for spec in miss.parts():
        name, params = parse_policy(spec.policy or policy)
        cap = capacities[spec.name]
        if isinstance(cap, list):  # a budget per layer: the -dist form of the policy holds it
            name, params = _per_layer(name, params, cap)
            cap = sum(cap)
        cap = max(1, cap)
        need = spec.least_room(ctx.top_k)
        low = min_capacity(name, ctx.num_layers, params, min_room=need)
        why = capacity_reason(name, params, need)
        if cached and cap < low:
            raise ExpertcacheError(
                f"the {spec.name!r} part holds {cap} expert(s); policy {name} needs at least {low} ({why})"
            )
        fixed = fixed_capacity(name, params)
        if cached and fixed is not None and cap > fixed:
            raise ExpertcacheError(
                f"the {spec.name!r} part holds {cap} expert(s) but policy {name}'s budgets sum to {fixed}; "
                f"give budgets that sum to {cap}, or a capacity or expert memory of {fixed} expert(s)"
            )
        pol = make_policy(name, replace(ctx, capacity=max(cap, low)), **params)
        short = [layer for layer in range(ctx.num_layers) if layer not in host and pol.room(layer) < need]
        if short:
            raise ExpertcacheError(
                f"policy {name} gives layer {short[0]} of the {spec.name!r} part {pol.room(short[0])} "
                f"slot(s), below the {need} it needs (a token's experts of a layer must be resident together)"
            )
        parts[spec.name] = Residency(pol)
    return parts


def build_host_level(config, capacity: int, ctx: PolicyContext) -> HostLevel:
    """The host level (``cache.tiers``) of ``capacity`` experts under ``config`` (a ``HostConfig``):
    one clear error where it cannot hold a layer's experts."""
    name, params = config.name, config.params
    low = max(min_capacity(name, ctx.num_layers, params, min_room=ctx.top_k), ctx.top_k)
    what = "the host level" if config.memory is None else f"host memory {config.memory}"
    held = f"{capacity} expert(s)"
    if config.exclusive:  # its memory holds a reserve beside them, which the user's figure included
        held += f" beside its reserve of {exclusive_reserve(ctx.top_k)} for hits in flight"
    if capacity < low:
        raise ExpertcacheError(
            f"{what} holds {held}; a host level under policy {name} needs at least {low} "
            f"({capacity_reason(name, params, ctx.top_k)})"
        )
    fixed = fixed_capacity(name, params)
    if fixed is not None and capacity != fixed:
        raise ExpertcacheError(f"host policy {name}'s budgets sum to {fixed}; {what} holds {held}")
    policy = make_policy(name, replace(ctx, capacity=capacity), **params)
    return HostLevel(policy, ctx.num_layers, exclusive=config.exclusive, stage=config.stage)


def assemble(
    parts: dict[str, Residency],
    transport: Transport,
    miss: MissPath,
    ctx: PolicyContext,
    *,
    limit: int | None = None,
    preemption: bool = True,
    reorder: bool = True,
    predictor: PredictorRunner | None = None,
    governor_clock=None,
    recorder: Recorder | None = None,
    host_level: HostLevel | None = None,
) -> StepDriver:
    """The expert cache over ``transport`` and the step driver that serves it: ``limit`` experts
    prefetched per predicted layer (default: top-k, as ProMoE), a prefetch governor on ``governor_clock``
    (the engine's wall clock, the simulator's virtual one) when one is given and there is a predictor.
    ``host_level``: a host cache between ``transport`` and the disk (``cache.tiers``)."""
    L, limit = ctx.num_layers, ctx.top_k if limit is None else int(limit)
    if limit > ctx.num_experts:
        raise ExpertcacheError(
            f"prefetch limit {limit} is more than the {ctx.num_experts} experts of a layer (at most "
            f"{ctx.num_experts}; top-k, {ctx.top_k}, by default)"
        )
    if host_level is not None:
        transport = TieredTransport(transport, host_level)
    cache = ExpertCache(parts, transport, miss, L, limit, preemption, reorder)
    if host_level is not None:
        transport.bind(cache)
    governed = predictor is not None and governor_clock is not None
    return StepDriver(cache, L, predictor, recorder, PrefetchGovernor(governor_clock) if governed else None)


def _per_layer(name: str, params: dict, budgets: list[int]) -> tuple[str, dict]:
    """``name``'s -dist form holding ``budgets`` (one per layer)."""
    from expertcache.policy.registry import POLICIES

    dist = name if name.endswith("-dist") else f"{name}-dist"
    if dist not in POLICIES or "budgets" in params:
        raise ExpertcacheError(
            f"per-layer budgets need a policy with a -dist form and no budgets of its own, not {name!r}"
        )
    return dist, {**params, "budgets": list(budgets)}
