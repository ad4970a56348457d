"""Replay a schedule through a policy at a capacity: the simulator's inner loop."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from expertcache.cache.residency import Residency
from expertcache.cache.schedule import Schedule, check_capacity
from expertcache.errors import ExpertcacheError, warn_notes
from expertcache.policy.base import Clock, Policy, PolicyContext
from expertcache.policy.registry import make_policy, policy_class, spec_and_params
from expertcache.units import one_capacity


@dataclass
class SimResult:
    """Requests and misses of one (policy, capacity, order) run, in total, per layer and per phase.

    ``layer_requests`` and ``layer_misses`` are [2, L] arrays by phase and layer: row 0 the decode steps,
    row 1 the prefill steps (their sum over rows is a layer's, as ``to_dict()["layers"]`` gives it)."""

    policy: str
    capacity: int
    order: str
    layer_requests: np.ndarray  # int64 [2, L]: row 0 decode, row 1 prefill
    layer_misses: np.ndarray  # int64 [2, L]
    opt_misses: int | None = None
    params: dict[str, object] = field(default_factory=dict)
    split_groups: bool = False  # some group was larger than its layer's room and served in chunks
    opt_is_bound: bool | None = None  # neither this run nor OPT split a group: OPT's misses are a bound
    seed: int | None = None  # the seed of a policy that draws at random (None: it draws nothing)

    def __repr__(self) -> str:
        opt = "" if self.opt_misses is None else f", OPT {self.opt_misses}"
        return (
            f"<SimResult {self.label} at {self.capacity} experts ({self.order} order): "
            f"{self.requests} requests, {self.hits} hits, {self.misses} misses ({self.miss_ratio:.1%}){opt}>"
        )

    @property
    def label(self) -> str:
        """The policy as it was asked for: its name, and its parameters if any (``lcp:rho=0.5``)."""
        if not self.params:
            return self.policy
        value = {k: "/".join(map(str, v)) if isinstance(v, list) else v for k, v in self.params.items()}
        return f"{self.policy}:" + ",".join(f"{k}={v}" for k, v in value.items())

    @property
    def requests(self) -> int:
        return int(self.layer_requests.sum())

    @property
    def misses(self) -> int:
        return int(self.layer_misses.sum())

    @property
    def hits(self) -> int:
        return self.requests - self.misses

    @property
    def miss_ratio(self) -> float:
        return self.misses / self.requests if self.requests else 0.0

    @property
    def ratio_to_opt(self) -> float | None:
        if self.opt_misses is None:
            return None
        return self.misses / self.opt_misses if self.opt_misses else 1.0

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary, per-layer and per-phase breakdowns included."""
        req, mis = self.layer_requests, self.layer_misses
        phase = {
            name: {"requests": int(req[i].sum()), "misses": int(mis[i].sum())}
            for i, name in ((0, "decode"), (1, "prefill"))
        }
        return {
            "policy": self.policy,
            "capacity": self.capacity,
            "order": self.order,
            "requests": self.requests,
            "hits": self.hits,
            "misses": self.misses,
            "miss_ratio": self.miss_ratio,
            "opt_misses": self.opt_misses,
            "ratio_to_opt": self.ratio_to_opt,
            "opt_is_bound": self.opt_is_bound,
            "split_groups": self.split_groups,
            "params": self.params,
            "seed": self.seed,
            "phases": phase,
            "layers": {
                "requests": req.sum(axis=0).tolist(),
                "misses": mis.sum(axis=0).tolist(),
            },
        }


def policy_for(schedule: Schedule, name: str, capacity: int, seed: int = 0, **params: object) -> Policy:
    """Build a policy for replaying ``schedule``: offline and profile inputs come from it."""
    cls = policy_class(name)
    ctx = PolicyContext(
        capacity=capacity,
        num_layers=schedule.num_layers,
        num_experts=schedule.num_experts,
        top_k=schedule.top_k,
        clock=Clock(),
        seed=seed,
        future=schedule.future if cls.offline else None,
        profile=schedule.profile if cls.needs_profile else None,
    )
    return make_policy(name, ctx, **params)


def schedule_capacities(schedule: Schedule, capacities) -> list[int]:
    """Capacities as whole experts, a share of all (``"25%"``) taken as ``simulate`` takes it; those beyond
    every expert said in a warning (they hold them all: their counts are all experts')."""
    total = schedule.num_layers * schedule.num_experts
    out = [one_capacity(c, total) if isinstance(c, str) else c for c in capacities]
    beyond = [c for c in out if isinstance(c, int) and not isinstance(c, bool) and c > total]
    if beyond:
        shown = ", ".join(map(str, beyond[:3])) + (", ..." if len(beyond) > 3 else "")
        one = len(beyond) == 1
        what = f"capacity {shown} is" if one else f"capacities {shown} are"
        warn_notes([f"{what} more than all {total} experts: {'it holds' if one else 'each holds'} them all"])
    return out


def check_schedule(schedule: object, who: str) -> None:
    """``who`` replays a ``Schedule`` (``build_schedule(trace, order)``), not a trace or its file."""
    if not isinstance(schedule, Schedule):
        raise ExpertcacheError(
            f"{who} takes a Schedule (build_schedule(trace, order)), got {type(schedule).__name__}"
        )


def replay(schedule: Schedule, name: str, capacity: int, seed: int = 0, **params: object) -> SimResult:
    """Serve every group of the schedule through a fresh cache of ``capacity`` experts (beyond every
    expert: capped at all of them, said in a warning, as ``simulate`` caps it; the result says the cap)."""
    check_schedule(schedule, "replay")
    total = schedule.num_layers * schedule.num_experts
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > total:
        warn_notes([f"a cache of {capacity} experts is more than all {total}; capped at {total}"])
        capacity = total
    return replay_as_given(schedule, name, capacity, seed, **params)


def replay_as_given(
    schedule: Schedule, name: str, capacity: int, seed: int = 0, **params: object
) -> SimResult:
    """``replay`` with a capacity beyond every expert kept as given (a curve's point: ``run_policy``'s rows
    keep the capacities asked for, said in one warning for all)."""
    check_schedule(schedule, "replay")
    name, params = spec_and_params(name, params)
    (capacity,) = schedule_capacities(schedule, [capacity])
    check_capacity(capacity, schedule.order, schedule.top_k)
    capacity = int(capacity)
    policy = policy_for(schedule, name, capacity, seed, **params)
    residency, clock = Residency(policy), policy.clock
    L, per_layer = schedule.num_layers, schedule.per_layer
    rooms = check_rooms(schedule, policy)
    admit, serve = residency.admit, residency.serve
    misses = [[0] * L, [0] * L]  # [phase][layer]; phase 1 = prefill
    slots = [(layer, sub) for layer in range(L) for sub in range(per_layer)]
    groups, g = iter(schedule.groups), 0
    tokens, seqs = schedule.round_token.tolist(), schedule.round_seq.tolist()
    scores = schedule.group_scores if policy.observes else None  # routing scores, for mrs
    weights = schedule.group_tokens if policy.weighs else None  # tokens per expert, for tlfu
    for r, prefill in enumerate(schedule.round_prefill.tolist()):
        clock.round = r
        clock.token = tokens[r]
        clock.seq = seqs[r]
        clock.prefill = bool(prefill)
        row = misses[prefill]
        for (layer, _), keys in zip(slots, groups, strict=False):  # per_layer groups per (round, layer) visit
            clock.layer = layer
            clock.group = g
            g += 1
            if keys and weights is not None:
                policy.on_use(keys, weights[g - 1])
            if keys and scores is not None:
                row[layer] += serve(layer, keys, scores[g - 1])
            elif keys:  # a group that fits is admitted at once (serve's own fast path, without the call)
                row[layer] += len(admit(keys)) if len(keys) <= rooms[layer] else serve(layer, keys)
    return SimResult(
        policy.name,
        capacity,
        schedule.order,
        layer_requests=schedule.layer_requests,
        layer_misses=np.asarray(misses, dtype=np.int64),
        params=dict(params),
        split_groups=bool((np.asarray(rooms) < schedule.max_group_by_layer).any()),
        seed=seed if policy_class(name).seeded else None,
    )


def check_rooms(schedule: Schedule, policy: Policy) -> list[int]:
    """Every layer's room must hold a token's experts of that layer (per-layer budgets included)."""
    rooms = [policy.room(layer) for layer in range(schedule.num_layers)]
    low = schedule.min_room
    short = [layer for layer, room in enumerate(rooms) if room < low]
    if short:
        raise ExpertcacheError(
            f"{policy.name}: layer {short[0]} gets {rooms[short[0]]} slot(s), below top-k {low}: in layer "
            f"order a token's experts of a layer must be resident together (uniform budgets need "
            f"capacity >= {schedule.num_layers * low})"
        )
    return rooms
