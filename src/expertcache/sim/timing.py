"""The simulator's timing model: a trace replayed in virtual time, prefetching and miss paths included.

``simulate_timing`` drives the engine's own step logic (``cache.step.StepDriver`` over an
``ExpertCache``: prefetch, early preemption, reordering, the miss path's routes) over a ``VirtualLink``
(``sim.vlink``) exactly as the engine drives it over its transfer worker, one forward step after another
in layer order. Compute is serial and follows a ``CostModel``: per step, each MoE layer's dense part
(attention, norms, router), then the layer's device units one after another (an expert: ``a + b *
tokens``; a segment of a split expert: its share of that; a low-precision copy: that plus the
dequantisation), and a fixed time per step (embeddings, LM head). Experts routed to the host run on a
second timeline beside the device's (``host_expert(tokens)`` each, one after another; the layer ends
when both have), or after the device's on the same clock when ``host_parallel`` is false (a CPU-only
engine). The link moves experts in the background, chunk by chunk; compute waits for an expert
still in transit (stall). See docs/TIMING.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np

from expertcache.cache.build import assemble, build_host_level, build_parts, part_capacities
from expertcache.cache.governor import describe
from expertcache.cache.schedule import (
    build_schedule,
    check_capacity,
    token_prefill,
    token_seq,
    usage_profile,
)
from expertcache.cache.step import InlinePredictor, StepDriver
from expertcache.cache.tiers import HOST_LEVEL_UNUSED, level_experts
from expertcache.config import AUTO as AUTO_PREFETCH
from expertcache.config import CacheConfig, HostConfig, MissConfig, PrefetchConfig, as_config
from expertcache.costs import AUTO, CostModel, as_cost, check_dense_layers, quantized_bytes
from expertcache.errors import ExpertcacheError, did_you_mean, option, warn_notes
from expertcache.miss.base import FULL, MissContext, MissPath, PartSpec
from expertcache.miss.registry import miss_class, parse_miss
from expertcache.policy.base import Clock, PolicyContext
from expertcache.predict.registry import trace_readers
from expertcache.sim.recorded import make_sim_predictor
from expertcache.sim.vlink import VirtualLink
from expertcache.trace.stats import clock_steps, phase_walls, whole_steps
from expertcache.trace.trace import Trace, as_trace
from expertcache.units import (
    capacity_for,
    capped_capacity,
    format_bytes,
    one_capacity,
    parse_share,
    parse_size,
)
from expertcache.workers import map_in_processes

# a replay's note where its host level is not the recorded run's kind (a plan, which runs both, drops it)
RECORDED_LEVEL = "the trace was recorded with"


def _summary(t: np.ndarray | None) -> dict[str, float] | None:
    """Per-request figures summed up: how many, mean, median, p99, most (None: none)."""
    if t is None or not len(t):
        return None
    return {
        "requests": len(t), "mean_s": float(t.mean()), "p50_s": float(np.percentile(t, 50)),
        "p99_s": float(np.percentile(t, 99)), "max_s": float(t.max()),
    }  # fmt: skip


@dataclass
class TimingResult:
    """Virtual times of one run; lists indexed [decode, prefill]."""

    policy: str
    capacity: int
    miss: str
    predictor: str | None
    window: int | None
    preemption: bool
    reorder: bool
    cost: CostModel
    tokens: int
    steps: list[int]  # forward steps
    step_time_s: list[float]  # summed step times
    stall_by_phase: list[float]  # compute waiting for transfers
    link_busy_s: float  # the link's transfers, the disk reads they wait on aside (``cache['link_read_s']``)
    bytes_moved: int
    transfers: int
    blocked_waits: int
    host_wait_by_phase: list[float]  # compute waiting for the host's experts (or computing them, inline)
    requests: int
    misses: int
    cache: dict[str, object] = field(default_factory=dict)  # the expert cache's counts (CacheStats)
    params: dict[str, object] = field(default_factory=dict)
    capacities: dict[str, int] = field(default_factory=dict)  # keys each cache part holds
    governor: dict[str, object] | None = None  # with prefetch_when "pays": what the governor decided
    notes: list[str] = field(default_factory=list)  # for the user: what was adjusted (a clipped window)
    host_busy_s: float = 0.0  # the host's time computing missed experts (busy, whether or not waited for)
    # a batched trace (``step_id``): each request's time from its first step's start to its first token
    # (the end of the step of its last prompt token), in the trace's request order; None otherwise
    request_ttft_s: np.ndarray | None = field(default=None, repr=False)
    # ... and each request's time per output token after its first (``request_tpots``)
    request_tpot_s: np.ndarray | None = field(default=None, repr=False)
    whole_transfers: bool = False  # the cost model's auto chunks dropped: no prefetch for a miss to pass
    deterministic: bool = False  # on a settled link (``PrefetchConfig(deterministic=True)``)
    # a trace the engine recorded with its wall clock: the run's own times (``recorded_times``), under its
    # own configuration, which this replay may not be; None otherwise
    recorded: dict[str, object] | None = None

    def __repr__(self) -> str:
        ms = lambda s: "-" if s is None else f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"  # noqa: E731
        pf = f", prefetch {self.predictor}" if self.predictor else ""
        return (
            f"<TimingResult {self.policy} at {self.capacity} experts, miss {self.miss}{pf}: TTFT "
            f"{ms(self.ttft_s)}, TPOT {ms(self.tpot_s)}, {self.misses} misses of {self.requests} requests, "
            f"{ms(self.stall_s)} stalled in all{f', {len(self.notes)} note(s)' if self.notes else ''}>"
        )

    @property
    def total_s(self) -> float:
        return sum(self.step_time_s)

    @property
    def ttft_s(self) -> float | None:
        """Mean prefill step time (one prefill step per request: the time to its first token)."""
        return self.step_time_s[1] / self.steps[1] if self.steps[1] else None

    @property
    def tokens_per_s(self) -> float | None:
        """Every token of the trace (prompts too) over the run's whole time."""
        return self.tokens / self.total_s if self.total_s else None

    @property
    def request_ttfts(self) -> dict[str, float] | None:
        """A batched trace's time to first token per request: mean, median, p99 and how many."""
        return _summary(self.request_ttft_s)

    @property
    def request_tpots(self) -> dict[str, float] | None:
        """A batched trace's time per output token per request (after its first): mean, median, p99, how
        many. TPOT is the mean pure-decode step; a request's tokens may come in steps that prefill others."""
        return _summary(self.request_tpot_s)

    @property
    def tpot_s(self) -> float | None:
        """Mean decode step time."""
        return self.step_time_s[0] / self.steps[0] if self.steps[0] else None

    @property
    def stall_s(self) -> float:
        return sum(self.stall_by_phase)

    @property
    def hits(self) -> int:
        return self.requests - self.misses

    @property
    def host_wait_s(self) -> float:
        return sum(self.host_wait_by_phase)

    def to_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "params": self.params,
            "capacity": self.capacity,
            "miss": self.miss,
            "capacities": self.capacities,
            "predictor": self.predictor,
            "window": self.window,
            "preemption": self.preemption,
            "reorder": self.reorder,
            "chunks_per_expert": len(self.cost.chunk_sizes()),
            "tokens": self.tokens,
            "ttft_requests": self.request_ttfts,
            "tpot_requests": self.request_tpots,
            "deterministic": self.deterministic,
            "prefill_steps": self.steps[1],
            "decode_steps": self.steps[0],
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "total_s": self.total_s,
            "tokens_per_s": self.tokens_per_s,
            "stall_s": self.stall_s,
            "prefill_stall_s": self.stall_by_phase[1],
            "decode_stall_s": self.stall_by_phase[0],
            "link_busy_s": self.link_busy_s,
            "bytes_moved": self.bytes_moved,
            "transfers": self.transfers,
            "blocked_waits": self.blocked_waits,
            "host_wait_s": self.host_wait_s,
            "host_busy_s": self.host_busy_s,
            "decode_host_wait_s": self.host_wait_by_phase[0],
            "prefill_host_wait_s": self.host_wait_by_phase[1],
            **self.cache,
            "prefetch_governor": self.governor,
            "cost": self.cost.to_dict(),
            "recorded": self.recorded,
        }


_RUNS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("expertcache_timing_runs", default=None)


@contextlib.contextmanager
def shared_runs() -> Iterator[None]:
    """Within it, ``run_timing`` called again with the same arguments returns the first call's result
    (the timing model is deterministic): ``doctor`` asks for the on-demand run, each host level's and
    the plan's candidates, and the plan's candidates include the first two. The results are shared, so a
    caller must not change one. Nested uses share the outermost one's runs."""
    token = _RUNS.set({}) if _RUNS.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _RUNS.reset(token)


def run_timing(
    trace: Trace | str,
    capacity: int | str,
    *,
    cache: CacheConfig | str | None = None,
    prefetch: PrefetchConfig | str | None = None,
    miss: MissConfig | str | None = None,
    cost: CostModel | dict | str | None = None,
    predictor_trace: Trace | None = None,
    capacities: dict[str, object] | None = None,
    host: HostConfig | str | None = None,
    host_capacity: int | None = None,
) -> TimingResult:
    """Replay ``trace`` (a ``Trace`` or its file) step by step in layer order through a cache of
    ``capacity`` experts' worth of memory (or "25%": a share of all experts' bytes; or bytes, "5MiB"),
    shared among the miss path's parts as the engine shares its expert memory, under ``cache`` (a
    policy spec or a ``CacheConfig``), prefetching as ``prefetch`` says (a predictor name or a
    ``PrefetchConfig``), serving misses by ``miss`` (a miss path spec or a
    ``MissConfig``), timed by ``cost`` (None: the costs an engine's recorded run decided by, where it
    recorded any (a cost-based miss path's), else the default model). Trace-based predictors learn from
    ``predictor_trace`` (``token`` requires one; it must be another run than the simulated one).
    ``capacities`` (keys per cache part) replaces the share of ``capacity`` the miss path would give
    each part: an engine's own (``trace.meta["capacities"]`` of a recorded trace) replays it exactly.
    ``host`` (a ``HostConfig``, or its memory as a spec) puts a host level between the link and the disk
    (``cache.tiers``), sized by its memory in the cost model's experts, or by ``host_capacity`` experts
    (an engine's own: ``trace.meta``) with a ``HostConfig`` that gives no memory (its policy and kind
    alone) or none; one or the other, not both. A host-level miss reads ``cost.disk_read_s`` first.
    What was adjusted (a capacity capped, a level no larger than the cache) is in the result's
    ``notes`` and comes as an ``ExpertcacheWarning``."""
    runs = _RUNS.get()
    args = _canonical(
        trace, capacity, cache, prefetch, miss, cost, predictor_trace, capacities, host, host_capacity
    )
    if runs is None:
        return _run_timing(*args)
    key, held = _key(args)
    if key not in runs:
        runs[key] = (held, _run_timing(*args))
    return runs[key][1]


def _canonical(
    trace, capacity, cache, prefetch, miss, cost, predictor_trace, capacities, host, host_capacity
):
    """``run_timing``'s arguments in one spelling each (its traces loaded, configs and costs made)."""
    trace = as_trace(trace, replay=True)
    predictor_trace = None if predictor_trace is None else as_trace(predictor_trace, "predictor trace")
    cache_cfg, pf = as_config(cache, CacheConfig), as_config(prefetch, PrefetchConfig)
    recorded = isinstance(capacity, str) and capacity == RECORDED
    if cost is None:  # a recorded run's own costs, where a cost-based miss path decided by them
        cost = recorded_costs(trace)
        moved = trace.meta.get("expert_bytes")
        if cost is None and isinstance(moved, int) and not isinstance(moved, bool) and moved > 0:
            # else the default's experts of 336 MiB: a byte budget held none of the run's (as the CLI)
            link = run_link(trace.meta)
            cost = CostModel(expert_bytes=moved, **link, **run_weight_bits(trace.meta))
            warn_notes([
                f"priced by the default costs (a Mixtral-8x7B expert's times, over PCIe 4 to a GPU) with the "
                f"run's experts of {moved / 2**10:.1f} KiB (the trace's expert_bytes){said_link(link)}: a "
                "profile of this machine and model (expertcache.profile, then cost=) prices the run"
            ])  # fmt: skip
    miss_cfg, cost = as_config(miss, MissConfig), as_cost(cost, trace)
    if recorded:
        if capacities is not None:
            raise ExpertcacheError(f"capacity {RECORDED!r} is the run's own capacities: leave out capacities")
        capacity, capacities = recorded_capacities(trace, miss_cfg, cost)
        capacity = max(trace.top_k, capacity)  # a run whose experts were all on the host held none
    capacity, memory = _memory(capacity, trace.num_layers * trace.num_experts, cost.expert_bytes)
    limit = trace.meta.get("prefetch_limit")  # an engine's --prefetch-limit (a whole number: else none)
    if pf.predictor == "recorded" and pf.limit is None and isinstance(limit, int) and limit >= 1:
        pf = replace(pf, limit=limit)  # as the run prefetched; said in its notes
    if predictor_trace is not None and not trace_readers([pf.predictor]):  # not taken in silence
        raise ExpertcacheError(
            f"predictor_trace: prefetch {pf.predictor} reads no recorded trace (token and eam do)"
        )
    args = (trace, capacity, cache_cfg, pf, miss_cfg, cost, predictor_trace, capacities, host, host_capacity)
    return *args, memory


def _memory(capacity: int | str, total: int, expert_bytes: int) -> tuple[int, int | None]:
    """The cache's whole experts, and for a capacity given as memory (a share of all experts, "30%", or
    bytes, "5MiB") its bytes: a path of several parts (``split``) splits those between them, as the engine
    splits its expert memory (28.8 experts' memory gave the engine's top part 86 slots where 28 whole
    experts' gave 83). None: whole experts, each ``expert_bytes``."""
    text = capacity.strip() if isinstance(capacity, str) else None
    if text is None or text.isdigit():
        return one_capacity(capacity, total), None
    if text.endswith("%"):
        experts = one_capacity(capacity, total)
        return experts, round(total * expert_bytes * parse_share(text, "capacity") / 100)
    if not re.fullmatch(r"[0-9.]+\s*[A-Za-z]+", text):  # a word, a range: refused as a capacity says
        return one_capacity(capacity, total), None
    size, experts = int(parse_size(text, "expert memory")), capacity_for(text, expert_bytes, total)
    if experts < 1:
        raise ExpertcacheError(
            f"expert memory {text} holds no expert of {format_bytes(expert_bytes)} (the cost model's size)"
        )
    return experts, min(size, total * expert_bytes)


def unsettled(meta: dict) -> str:
    """What a replay of a run that prefetched without ``--deterministic`` cannot know, and on a CPU (its
    copies land almost at once) the replay that comes nearest."""
    out = "the run was not deterministic: its counts followed when its transfers landed, which no replay"
    out += " knows"
    if meta.get("device") == "cpu":
        settled = option("--deterministic", "PrefetchConfig('recorded', deterministic=True)")
        out += f" (on a CPU, where copies land almost at once, adding {settled} comes nearest)"
    return out


def host_level_replay(meta: dict, top_k: int, prefetching: bool) -> tuple[str, str] | None:
    """The options that replay a recorded run's host level (``cache.tiers``), as the command line's flags
    and as ``simulate_timing``'s arguments, or None where the run had none. On the command line
    ``--host-capacity`` is the level's memory in experts (an exclusive one's reserve included), in Python
    ``host_capacity`` the experts it holds, as the run's stats give them; ``prefetching``: the replay
    prefetches already (a staging level needs predictions)."""
    recorded = meta.get("host_capacity")
    if recorded is None:
        return None
    from expertcache.cache.tiers import exclusive_reserve

    exclusive = bool(meta.get("host_exclusive"))  # its memory holds a reserve beside them
    given = int(recorded) + (exclusive_reserve(top_k) if exclusive else 0)
    policy, stage = meta.get("host_policy", "lru"), meta.get("host_stage") or 0
    flags = f"--host-capacity {given} --host-policy {policy}"
    flags += " --host-exclusive" if exclusive else ""
    flags += f" --host-stage {stage}" if stage else ""
    flags += " --prefetch recorded" if stage and not prefetching else ""  # stages need predictions
    host = f"HostConfig(None, {policy!r}" + (", exclusive=True" if exclusive else "")
    host += f", stage={stage})" if stage else ")"
    args = f"host={host}, host_capacity={int(recorded)}"
    args += ", prefetch='recorded'" if stage and not prefetching else ""
    return flags, args


RECORDED = "recorded"  # a capacity: the recorded run's own, each cache part as the engine held it


def run_link(meta: dict) -> dict[str, float]:
    """The emulated link an engine's run moved its experts over (``generate --link-bandwidth``,
    ``--link-latency``: ``meta["link_bandwidth"]``, ``meta["link_latency"]``), as the cost model's fields;
    empty for a run without one. A chunk takes ``latency + bytes / bandwidth`` on both."""
    if meta.get("link_bandwidth") is None:
        return {}
    latency = float(meta.get("link_latency") or 0.0)
    return {"link_bandwidth": float(meta["link_bandwidth"]), "link_latency": latency}


def run_weight_bits(meta: dict) -> dict[str, int]:
    """The bits of a weight of the run's experts (``meta["weight_bits"]``: 16 or 32, its dtype's), as the
    cost model's field; empty where not recorded. A replay sizes a low-precision copy by it: a float32
    run's int4 copies were priced as a 16-bit expert's, twice their size."""
    bits = meta.get("weight_bits")
    return {"weight_bits": int(bits)} if bits in (16, 32) and not isinstance(bits, bool) else {}


def said_link(link: dict[str, float]) -> str:
    """``run_link``'s link for a note (empty for none)."""
    if not link:
        return ""
    bandwidth = link["link_bandwidth"]
    rate = "unbounded" if math.isinf(bandwidth) else f"{bandwidth / 1e9:.3g} GB/s"
    return f" and its emulated link ({rate} + {link['link_latency'] * 1e6:.3g} us a transfer)"


def recorded_costs(trace: Trace) -> CostModel | None:
    """The costs a recorded run's cost-based miss path decided by (measured at its load, or given:
    ``trace.meta["costs"]``), or None."""
    try:
        return CostModel.from_dict(json.loads(trace.meta["costs"]))
    except (KeyError, TypeError, ValueError, ExpertcacheError):
        return None


def replay_differences(
    trace: Trace,
    cache: CacheConfig,
    pf: PrefetchConfig,
    miss: MissConfig,
    cost: CostModel,
) -> list[str]:
    """What a replay of an engine's recorded run (``trace``) leaves out of the run, each with what
    replays it: its miss path (``miss``, built with the replay's ``cost``), its policy, its static
    profile, its prefetching, and a deterministic run's instant transfers (its counts are an instant
    link's; a slower one's timing may cancel prefetches it did not). Empty for a trace no engine
    recorded."""
    meta = trace.meta
    if "capacities" not in meta:
        return []
    out = []
    ran = meta.get("miss")
    ctx = MissContext(trace.num_layers, trace.num_experts, trace.top_k, costs=cost)
    if ran is not None and _other_miss(str(ran), miss, miss_class(miss.name)(ctx, **miss.params)):
        out.append(
            f"it served its misses by miss path {ran} (" + option(f"--miss {ran}", f"miss={ran!r}") + ")"
        )
    policy = meta.get("policy")
    if policy is not None and policy != cache.policy:
        out.append(f"its policy was {policy} (" + option(f"--policy {policy}", f"cache={policy!r}") + ")")
    drew = meta.get("policy_seed")
    if drew is not None and policy == cache.policy and int(drew) != cache.seed:
        given = option(f"--seed {drew}", f"cache=CacheConfig({policy!r}, seed={drew})")
        out.append(f"its policy drew at random with seed {drew} ({given})")
    profile = meta.get("profile")
    if profile is not None and cache.profile is None and policy == cache.policy:
        out.append(f"it ranked by the use of {profile} (" + option(f"--profile {profile}", "profile=") + ")")
    if trace.predicted is not None and pf.predictor == "none":
        out.append(
            f"it prefetched ({meta.get('predictor', 'a predictor')}: "
            + option("--prefetch recorded", "prefetch='recorded'")
            + ")"
        )
    if meta.get("deterministic") and pf.predictor == "recorded" and not pf.deterministic:
        out.append(
            "it was deterministic, every transfer landing before the next decision ("
            + option("--deterministic", "PrefetchConfig('recorded', deterministic=True)")
            + " replays its counts on any link)"
        )
    said = [f"this replay is not the recorded run's: {'; '.join(out)}"] if out else []
    if meta.get("preloaded"):
        said.append(preloaded_note(meta))
    if meta.get("deterministic") is False and pf.predictor == "recorded" and not pf.deterministic:
        said.append(unsettled(meta))
    return said


def preloaded_note(meta: dict) -> str:
    """What a replay of a run that held every expert from its load (``meta["preloaded"]``, the engine's
    ``preloaded_experts``) counts otherwise: the run missed none of them, the replay starts empty."""
    return (
        f"this run read all {meta['preloaded']} experts at its load (its expert memory held them all) and "
        "missed none; a replay starts with an empty cache, so each expert's first use is a miss here and a "
        "hit in the run"
    )


def _other_miss(ran: str, miss: MissConfig, path: MissPath) -> bool:
    """Whether the replay's miss path (``miss``, built as ``path`` on the trace's shape with the replay's
    costs) is another than the run's ``ran`` (its spec as the engine recorded it): the two compared as the
    engine describes a path (``placement:first=2`` is ``placement:layers=0/1``; a parameter left out is its
    default). A parameter the path lays out by its own rule (``laid_out``: a stream buffer's slots) and
    the replay leaves out is the run's, not compared."""
    try:
        name, params = parse_miss(ran)
    except ExpertcacheError:  # a spec of a version that named it otherwise: its name alone
        return ran.partition(":")[0] != miss.name
    if name != miss.name:
        return True
    _, mine = parse_miss(path.describe())
    rule = {k for k in path.laid_out if k not in miss.params}
    return any(params.get(k) != mine.get(k) for k in (set(params) | set(mine)) - rule)


def recorded_capacities(trace: Trace, miss: MissConfig, cost: CostModel) -> tuple[int, dict[str, object]]:
    """The cache parts of the engine run ``trace`` recorded (``trace.meta``), as ``capacities`` takes
    them, and its primary part's capacity: a replay under the run's own miss path then holds what the
    run's held (a split path's segments, hobbit's low-precision copies), whatever the cost model's expert
    size. One clear error where the trace records no run, or another miss path than ``miss``."""
    meta = trace.meta
    try:
        parts, capacity = json.loads(meta["capacities"]), int(meta["capacity"])
    except (KeyError, TypeError, ValueError):
        raise ExpertcacheError(
            f"capacity {RECORDED!r}: {trace.source} records no engine run's cache (a trace of "
            + option("expertcache generate --record-trace", "model.save_trace")
            + ")"
        ) from None
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    path = miss_class(miss.name)(MissContext(L, E, K, costs=cost), **miss.params)
    if _other_miss(str(meta.get("miss", "fetch")), miss, path):
        memory = meta.get("memory")
        raise ExpertcacheError(
            f"capacity {RECORDED!r}: the run served its misses by miss path {meta.get('miss')}, not "
            f"{path.describe()}; give its expert memory in experts"
            + (f" ({memory})" if memory is not None else "")
            + " to replay it under another"
        )
    return capacity, parts


def _key(args: tuple) -> tuple[tuple, tuple]:
    """A run's key in ``shared_runs``, and the objects it names by their ids (kept with the result, so
    that no other object takes an id meanwhile)."""
    (
        trace,
        capacity,
        cache_cfg,
        pf,
        miss_cfg,
        cost,
        predictor_trace,
        capacities,
        host,
        host_capacity,
        memory,
    ) = args
    held = (trace, predictor_trace, pf.predictor_object)
    return (
        *map(id, held),
        capacity,
        repr((cache_cfg, pf, miss_cfg, cost, capacities, host, host_capacity, memory)),
    ), held


def warm_runs(calls: Sequence[dict[str, object]], jobs: int) -> None:
    """Run ``run_timing(**call)`` for each call on up to ``jobs`` worker processes and keep the results
    in the current ``shared_runs``, where the caller's own ``run_timing`` calls then find them: the
    planner's candidates and the doctor's runs, which do not depend on each other, side by side. A call
    the model refuses is left for the caller's own call to raise. Nothing is run outside ``shared_runs``,
    with fewer than two jobs or fewer than two runs to make, for a predictor given as an object, or where
    the worker processes cannot (none can start, an argument does not pickle, a run fails): the caller's
    calls then run them one after another, with the same results, and raise what fails."""
    runs = _RUNS.get()
    if runs is None or jobs < 2:
        return
    todo: dict[tuple, tuple[tuple, dict]] = {}
    for call in calls:
        c = dict(call)
        try:
            args = _canonical(
                c.pop("trace"), c.pop("capacity"), c.pop("cache", None), c.pop("prefetch", None),
                c.pop("miss", None), c.pop("cost", None), c.pop("predictor_trace", None),
                c.pop("capacities", None), c.pop("host", None), c.pop("host_capacity", None),
            )  # fmt: skip
        except ExpertcacheError:  # the caller's own call says what is wrong
            continue
        if c:
            raise TypeError(f"warm_runs: not arguments of run_timing: {', '.join(c)}")
        key, held = _key(args)
        if key not in runs and key not in todo and args[3].predictor_object is None:
            todo[key] = (held, args)
    if len(todo) < 2:
        return
    try:
        results = map_in_processes(_timing_or_none, [a for _, a in todo.values()], jobs)
    except Exception:  # best effort: the caller's own calls run them, and raise what fails
        return
    for (key, (held, _)), result in zip(todo.items(), results, strict=True):
        if result is not None:
            runs[key] = (held, result)


def _timing_or_none(args: tuple) -> TimingResult | None:
    """A worker's run (``warm_runs``): its result, or None where the model refuses it."""
    try:
        return _run_timing(*args)
    except ExpertcacheError:
        return None


def _run_timing(
    trace: Trace,
    capacity: int,
    cache_cfg: CacheConfig,
    pf: PrefetchConfig,
    miss_cfg: MissConfig,
    cost: CostModel,
    predictor_trace: Trace | None,
    capacities: dict[str, object] | None,
    host: HostConfig | str | None,
    host_capacity: int | None,
    memory: int | None = None,
) -> TimingResult:
    if pf.predictor == AUTO_PREFETCH:
        raise ExpertcacheError(
            "prefetch 'auto' is the engine's choice of predictor; here name one, with "
            + option("--prefetch-when pays", "PrefetchConfig(NAME, when='pays')")
            + " for the governor, or replay what an engine predicted with "
            + option("--prefetch recorded", "prefetch='recorded'")
        )
    # the engine's rule: nothing speculative for a demand miss to pass, no chunks (auto's, or a size given,
    # which the note says changes nothing); the cost line says every transfer moves whole
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    path = miss_class(miss_cfg.name)(MissContext(L, E, K, costs=cost), **miss_cfg.params)
    background = path.fills()
    idle_chunks = pf.idle_chunking_note(background=background)
    unchunked = (cost.chunk_bytes == AUTO and not pf.chunked(background=background)) or (
        idle_chunks is not None and cost.chunk_bytes is not None
    )
    if unchunked:
        cost = CostModel.from_dict({"chunk_bytes": None}, cost)
        path.ctx = replace(path.ctx, costs=cost)
    check_dense_layers(cost, L)
    check_capacity(capacity, "layer", K)
    capped = []
    if not capacities:  # as the engine caps an expert memory beyond every expert
        capacity, capped = capped_capacity(capacity, L * E)
    schedule = build_schedule(trace, "layer")
    part_bytes = {spec.name: sim_part_bytes(spec, cost, L) for spec in path.parts()}
    part_bytes.update(recorded_part_bytes(trace, cost, part_bytes))
    if capacities is not None:
        capacities = _given_capacities(capacities, path, L)
    budget = capacity * cost.expert_bytes if memory is None or capped else memory  # bytes, as the engine's
    caps = capacities or part_capacities(path, budget, part_bytes, K)
    clock = Clock()
    ctx = PolicyContext(
        capacity=max(1, capacity), num_layers=L, num_experts=E, top_k=K, clock=clock, seed=cache_cfg.seed,
        future=schedule.future if cache_cfg.offline else None,
        profile=_profile(cache_cfg, schedule, trace),
    )  # fmt: skip
    parts = build_parts(path, caps, cache_cfg.policy, ctx)
    level, notes = None, capped + ([] if capacities else path.capacity_notes(caps))
    notes += path.policy_notes(next(iter(parts.values())).policy, caps)
    if idle_chunks is not None:
        notes.append(idle_chunks)
    if pf.predictor == "recorded" and pf.limit is not None and pf.limit == trace.meta.get("prefetch_limit"):
        notes.append(f"prefetch limit {pf.limit} a layer: the recorded run's")
    host_level = host_level_of(host, host_capacity, L * E, cost.expert_bytes, K, capacity)
    if host_level is not None and capacity >= L * E and not capacities:  # as the engine does
        notes += host_level[2] + [HOST_LEVEL_UNUSED]
        host_level = None
    if host_level is not None:
        host_cfg, host_capacity, level_notes = host_level
        notes += level_notes
        recorded = trace.meta.get("host_exclusive")
        if recorded is not None and bool(recorded) != host_cfg.exclusive:  # a replay of a run, not its level
            kind = {True: "an exclusive", False: "an inclusive"}
            notes.append(
                f"{RECORDED_LEVEL} {kind[bool(recorded)]} host level; this replay's is "
                f"{kind[host_cfg.exclusive].split()[1]}"
            )
        if miss_cfg.name != "fetch":
            raise ExpertcacheError(
                f"a host level serves the fetch miss path, as the engine's does; miss path {miss_cfg.name} "
                "reads experts its own way"
            )
        if not cost.disk_read_s:
            notes.append(
                "the cost model's disk_read_s is 0 (give "
                + option("--disk-time", "CostModel(disk_read_s=...)")
                + ", or a profile of the disk tier): the host level's misses cost no time"
            )
        level = build_host_level(host_cfg, host_capacity, ctx)
    one = CostModel.from_dict({"chunk_bytes": None}, cost)  # demand transfers move whole (the engine's rule)
    plans, whole = {}, {FULL: (one.chunk_times(), one.chunk_sizes())}  # the parts' own replace FULL's
    for part, nbytes in part_bytes.items():
        for where, n in enumerate(nbytes) if isinstance(nbytes, list) else [(None, nbytes)]:
            plans[part if where is None else (part, where)] = (cost.chunk_times(n), cost.chunk_sizes(n))
            whole[part if where is None else (part, where)] = (one.chunk_times(n), one.chunk_sizes(n))
    link = VirtualLink(
        cost.chunk_times(), cost.chunk_sizes(), wake_s=cost.wake_s, submit_s=cost.submit_s, parts=plans,
        whole=whole, read_s=cost.disk_read_s if level is not None else None, demote_s=cost.demote_s,
        settle=pf.deterministic,
    )  # fmt: skip
    spec = pf.predictor_object or pf.predictor
    pred = make_sim_predictor(spec, trace, pf.window, cache_cfg.seed, predictor_trace)
    if level is not None and level.stage_limit and pred is None:
        raise ExpertcacheError(
            f"host stage {level.stage_limit} reads predicted experts early: give a predictor "
            f"({option('--prefetch NAME', 'prefetch=NAME')})"
        )
    driver = assemble(
        parts, link, path, ctx, limit=pf.limit, preemption=pf.preemption, reorder=pf.reorder,
        predictor=InlinePredictor(pred) if pred is not None else None,
        governor_clock=(lambda: link.now) if pf.governed else None, host_level=level,
    )  # fmt: skip
    xcache, governor = driver.cache, driver.governor
    run = _Run(trace, schedule, cost, driver, link, {s.name: s for s in path.parts()}, pred)
    steps, times, stalls, host = [0, 0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    bounds = np.empty(schedule.num_rounds + 1)  # each step's start, and the last one's end
    for r, prefill in enumerate(schedule.round_prefill.tolist()):
        t0, s0, h0 = link.now, link.stall_s, link.host_wait_s
        bounds[r] = t0
        run.step(r, prefill)
        steps[prefill] += 1
        times[prefill] += link.now - t0
        stalls[prefill] += link.stall_s - s0
        host[prefill] += link.host_wait_s - h0
    bounds[-1] = link.now
    st = xcache.stats
    return TimingResult(
        policy=xcache.policy.name,
        capacity=capacity,
        miss=path.describe(),
        predictor=None if pred is None else pf.predictor if pf.predictor_object is None else pred.name,
        window=pred.window if pred is not None else None,
        preemption=pf.preemption,
        reorder=pf.reorder,
        cost=cost,
        tokens=trace.num_tokens,
        steps=steps,
        step_time_s=times,
        stall_by_phase=stalls,
        link_busy_s=link.busy_s - link.link_read_s,
        bytes_moved=link.bytes_moved,
        transfers=link.transfers,
        blocked_waits=link.blocked,
        host_wait_by_phase=host,
        requests=int(st.requests.sum()),
        misses=int(st.misses.sum()),
        cache={**st.to_dict(), **_level_counts(level, link, host_level)},
        params=cache_cfg.params,
        capacities=caps,
        governor=None if governor is None else governor.summary(),
        notes=([pred.note] if pred is not None and pred.note else []) + notes,
        host_busy_s=link.host_busy_s,
        request_ttft_s=request_ttfts(trace, schedule.round_token, bounds),
        request_tpot_s=request_tpots(trace, schedule.round_token, bounds),
        whole_transfers=unchunked,
        deterministic=pf.deterministic,
        recorded=recorded_times(trace, schedule.round_token),
    )


@functools.wraps(run_timing)
def simulate_timing(*args, **kwargs) -> TimingResult:
    if len(args) > 2:  # run_timing's own TypeError named run_timing
        raise ExpertcacheError(
            "simulate_timing takes the trace and the capacity by position and the rest by name "
            "(cache=..., prefetch=..., miss=..., cost=...)"
        )
    takes = inspect.signature(run_timing).parameters
    unknown = [k for k in kwargs if k not in takes]
    if unknown:  # run_timing's own TypeError named run_timing
        hint = did_you_mean(unknown[0], takes)
        for arg, config in (("prefetch", PrefetchConfig), ("cache", CacheConfig), ("miss", MissConfig)):
            name = config.__name__
            if unknown[0] in {f.name for f in fields(config)}:  # a field of a config it takes
                hint = f" ({unknown[0]} is {name}'s: {arg}={name}(..., {unknown[0]}=...))"
        raise ExpertcacheError(f"simulate_timing got an unknown argument {unknown[0]!r}{hint}")
    given = inspect.signature(run_timing).bind(*args, **kwargs).arguments
    trace = given["trace"] = as_trace(given["trace"], replay=True)  # loaded once, for the notes too
    result = run_timing(**given)
    # the costs' own gap, for a replay asked for (plan and doctor, which run many, say it once themselves)
    unpriced = result.cost.unpriced_work(result.transfers > 0, bool(result.cache["host_computed"]))
    result.notes += [unpriced] if unpriced else []
    warn_notes(result.notes)  # the API's caller hears what was adjusted; the command line prints them
    # and what of a recorded run this replay leaves out, as `timing` notes it (its own seed, prefetching)
    cache, pf = as_config(given.get("cache"), CacheConfig), as_config(given.get("prefetch"), PrefetchConfig)
    miss = as_config(given.get("miss"), MissConfig)
    warn_notes(replay_differences(trace, cache, pf, miss, result.cost))
    level = host_level_replay(trace.meta, trace.top_k, pf.predictor != "none")
    if level is not None and given.get("host") is None and given.get("host_capacity") is None:
        warn_notes([
            f"the run had a host level of {trace.meta['host_capacity']} experts, which this replay leaves "
            f"out: {level[1]} replays it"
        ])  # fmt: skip
    return result


def plan_timing(
    plan, trace: Trace | str | os.PathLike | None = None, *, cost=None, profile=None, seed: int = 0
) -> TimingResult:
    """``expertcache timing --plan PLAN.json`` in one call: ``plan`` (a ``Plan``, ``make_plan``'s, or its
    file) replayed as planned: its policy and budgets, miss path, predictor (learning from the trace it was
    planned with), capacity and host level, priced by the costs it was made with (``cost`` gives others:
    a cost model, its dict, or a profile's file). ``trace`` defaults to the plan's own: the file it was
    made on, or its requests served N at a time made again (``plan --concurrency``); the embedded trace
    where neither is there (a note says so). A replay of another workload than the plan's says that its
    figures are not the plan's prediction. ``profile``: the usage profile a ``static`` plan ranks its experts
    by (``timing --profile``; without it, the replayed trace's own use). Notes come as
    ``ExpertcacheWarning``s, as ``simulate_timing``'s."""
    from expertcache.plan import Plan, as_plan
    from expertcache.trace.trace import load_trace

    if not isinstance(plan, Plan | str | os.PathLike):
        raise ExpertcacheError(
            f"plan_timing takes a plan (make_plan's, or its file), not {type(plan).__name__}"
        )
    plan = as_plan(os.fspath(plan) if isinstance(plan, os.PathLike) else plan)
    notes: list[str] = []
    if trace is None:
        made_on = plan.trace_file()
        served = plan.served_trace() if made_on is None else None
        if served is not None:
            trace = served
        elif made_on is not None:
            trace = made_on
        else:
            if plan.source.get("trace"):
                notes.append(
                    f"the plan's trace {plan.source['trace']} is not there: replaying the embedded one"
                )
            trace = "default"
    trace = as_trace(trace, replay=True)
    plan.check_model(trace.num_layers, trace.num_experts, trace.top_k, f"trace {trace.source}")
    digest = plan.source.get("digest")
    if digest is not None and digest != trace.digest():
        notes.append(
            f"the plan was made on {plan.source.get('trace')}; this replays {trace.source}, so these figures "
            "are not the plan's prediction"
        )
    learned = plan.predictor_trace()
    if learned is not None and not os.path.isfile(learned):
        raise ExpertcacheError(
            f"the plan's predictor {plan.prefetch} was planned learning from {learned}, which is not there"
        )
    changed = plan.predictor_trace_changed()
    if changed is not None:
        notes.append(f"{changed}, so these figures are not the plan's prediction")
    planned = plan.source.get("cost")
    if cost is None and planned:
        cost = CostModel.from_dict(planned)
    host = None
    if plan.host_capacity is not None:
        host = HostConfig(None, plan.host_policy, exclusive=plan.host_exclusive)
    warn_notes(notes)
    learned_trace = None if learned is None else load_trace(learned)
    return simulate_timing(
        trace, plan.capacity, cache=plan.cache_config(seed=seed, profile=profile),
        prefetch=plan.prefetch_config(), miss=plan.miss_config(), cost=cost, predictor_trace=learned_trace,
        host=host, host_capacity=plan.host_capacity,
    )  # fmt: skip


def recorded_times(trace: Trace, round_token: np.ndarray) -> dict[str, object] | None:
    """A recorded run's own times, from its wall clock (``step_start_s``/``step_end_s``), as a replay of it
    states its own: the mean decode and prefill step (``trace.stats.whole_steps``: its start to the next
    step's, so a server's work around the forward counts, as the replay's ``step_s`` would, idle pauses
    left out) and its forward alone (``trace.stats.step_walls``: medians too), and where the replay's steps
    are the run's (``round_token``), each request's TTFT and TPOT timed as ``request_ttfts`` and
    ``request_tpots`` time a replay's. None for a trace without the clock."""
    bounds = clock_steps(trace)
    if bounds is None:
        return None
    first, starts, ends = bounds
    whole = whole_steps(starts, ends)
    walls = phase_walls(trace, first, starts, ends, whole)  # the clock's steps read once, for both
    out: dict[str, object] = {"steps": walls["steps"], "seconds": walls["seconds"]}
    edges = np.r_[0.0, np.cumsum(whole)]  # step r from edges[r] to edges[r + 1], no idle
    for name in ("decode", "prefill"):
        out[f"{name}_step_s"] = walls[name]["whole_mean_s"]
        out[f"{name}_forward_s"] = walls[name]["forward_mean_s"]
        out[name] = walls[name]
    same = len(round_token) == len(first) and np.array_equal(np.asarray(round_token), first)
    batched = trace.step_id is not None and trace.seq_id is not None
    out["requests_timed"] = bool(same and batched)
    if out["requests_timed"]:
        out["ttft_requests"] = _summary(request_ttfts(trace, first, edges))
        out["tpot_requests"] = _summary(request_tpots(trace, first, edges))
    return out


def recorded_step_s(
    trace: Trace | str | os.PathLike, cost: CostModel | dict | str | os.PathLike | None = None
) -> tuple[float, dict[str, object]]:
    """The time a recorded run spent a step beyond what the timing model prices, from the run's own clock:
    the mean of its decode steps (each from its start to the next step's, ``recorded_times``) less the mean
    decode step of the model's replay of that run, under its own configuration (its policy, miss path,
    cache parts, recorded predictions) and ``cost`` with no ``step_s``; at least 0. On a server this is
    its work around each forward (sampling, scheduling, streaming) and what the forward costs there beyond
    the profile's (continuous batching's attention over its paged cache): on the 2-core CPU with the
    embedded model and 4 clients, 5.4 ms a step, where a profile priced the whole step at 3.8 ms. Returns it
    and the figures it comes from (JSON-ready). One clear error where the trace has no clock, records no
    run, or a run the replay cannot repeat (a usage profile, a host level). ``trace``: a ``Trace`` or its
    file; ``cost``: a ``CostModel``, its file or fields (None: the timing model's defaults)."""
    trace = as_trace(trace)
    times = check_clock(trace)
    meta = trace.meta
    cache = CacheConfig(str(meta["policy"]), seed=int(meta.get("policy_seed") or 0))
    predicted = trace.predicted is not None
    pf = PrefetchConfig("recorded" if predicted else "none", deterministic=bool(meta.get("deterministic")))
    replay = run_timing(trace, RECORDED, cache=cache, prefetch=pf, miss=str(meta["miss"]),
                        cost=replace(as_cost(cost, trace), step_s=0.0))  # fmt: skip
    replayed = replay.tpot_s or 0.0
    step = round(max(0.0, times["decode_step_s"] - replayed), 7)  # to 0.1 us, not a remainder's digits
    ms = lambda v: f"{v * 1e3:.3g} ms"  # noqa: E731
    note = (
        f"step time {ms(step)}, from the recorded run's own clock: its decode steps took "
        f"{ms(times['decode_step_s'])} on average ({ms(times['decode_forward_s'])} in the forward), the "
        f"model's replay of the run under these costs {ms(replayed)} without a step time; the rest is priced "
        "a step"
    )
    if replayed > times["decode_step_s"]:
        note += (
            f" (none: the replay is {replayed / times['decode_step_s']:.2g}x slower than the run, so these "
            "costs are not the machine's that ran it: a profile of it prices the run)"
        )
    return step, {
        "step_s": step, "recorded_decode_step_s": times["decode_step_s"],
        "recorded_decode_forward_s": times["decode_forward_s"], "replayed_decode_step_s": replay.tpot_s,
        "decode_steps": times["decode"]["steps"], "note": note,
    }  # fmt: skip


def check_clock(trace: Trace) -> dict[str, object]:
    """What ``recorded_step_s`` needs of ``trace``, each lack one clear error: a clock of its run (the
    run's own times, ``recorded_times``, returned), a decode step, and an engine run the replay repeats."""
    from expertcache.trace.default import DEFAULT_TRACE

    name = "the embedded trace" if trace.source == str(DEFAULT_TRACE) else trace.source
    times = recorded_times(trace, np.zeros(0, dtype=np.int64))
    if times is None:
        raise ExpertcacheError(
            f"{name} has no clock of its run (step_start_s, step_end_s): the engine records one with every "
            "trace since 2026-11-29 (" + option("--record-trace", "model.save_trace") + "); a trace made "
            "from another (trace batch, trace import, synthesized) has none: its steps are not a run's"
        )
    if times["decode_step_s"] is None:
        raise ExpertcacheError(f"{name}: its run has no decode step to time")
    meta = trace.meta
    if "capacities" not in meta or "policy" not in meta or "miss" not in meta:
        raise ExpertcacheError(f"{name} records no engine run to replay (its policy and miss path)")
    for key, what in (("profile", "a usage profile"), ("host_capacity", "a host level")):
        if meta.get(key) is not None:
            raise ExpertcacheError(
                f"{name}: its run had {what}, which the step time's replay does not repeat: give "
                + option("--step-time TIME", "step_s")
            )
    return times


def request_ttfts(trace: Trace, round_token: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Each request's time to first token in a replay whose step ``r`` began at ``bounds[r]`` (and the
    last ended at ``bounds[-1]``), steps starting at tokens ``round_token``: from the start of its first
    step to the end of the step that holds its last prompt token, where its first token is sampled (a
    prompt chunked over several steps, or waiting behind others, counts whole). Requests without a
    prompt token in the trace are left out."""
    tokens = np.arange(trace.num_tokens)
    step = np.searchsorted(round_token, tokens, side="right") - 1
    seq, prompt = token_seq(trace), token_prefill(trace)
    ids, first = np.unique(seq, return_index=True)  # each request's first token, in id order
    last = np.full(len(ids), -1)
    np.maximum.at(last, np.searchsorted(ids, seq[prompt]), tokens[prompt])  # its last prompt token
    has = last >= 0
    order = np.argsort(first[has], kind="stable")  # in the order the requests began
    return (bounds[step[last[has]] + 1] - bounds[step[first[has]]])[order]


def request_tpots(trace: Trace, round_token: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Each request's time per output token after its first, in a replay timed as ``request_ttfts``'s:
    from the end of the step of its last prompt token (its first token) to the end of the step of its last
    generated token, over its generated tokens in the trace (a request generates one more than the trace
    holds: the last is not fed back). Requests without a prompt token or a generated one are left out."""
    tokens = np.arange(trace.num_tokens)
    step = np.searchsorted(round_token, tokens, side="right") - 1
    seq, prompt = token_seq(trace), token_prefill(trace)
    decode = trace.is_prefill == 0 if trace.is_prefill is not None else np.zeros(trace.num_tokens, bool)
    ids, first = np.unique(seq, return_index=True)
    last_prompt, last_decode = np.full(len(ids), -1), np.full(len(ids), -1)
    np.maximum.at(last_prompt, np.searchsorted(ids, seq[prompt]), tokens[prompt])
    where = np.searchsorted(ids, seq[decode])
    np.maximum.at(last_decode, where, tokens[decode])
    count = np.bincount(where, minlength=len(ids))
    has = (last_prompt >= 0) & (last_decode >= 0)
    order = np.argsort(first[has], kind="stable")
    span = bounds[step[last_decode[has]] + 1] - bounds[step[last_prompt[has]] + 1]
    return (span / count[has])[order]


def _given_capacities(given: object, path: MissPath, num_layers: int) -> dict[str, object]:
    """``simulate_timing``'s ``capacities``: the keys of each of the miss path's parts, a whole number
    (or one per layer), as a recorded trace's ``meta["capacities"]`` gives them; else one clear error."""
    names = [spec.name for spec in path.parts()]
    if not isinstance(given, dict) or set(given) != set(names):
        got = sorted(map(str, given)) if isinstance(given, dict) else given
        raise ExpertcacheError(
            f"capacities: a dict of each part of miss path {path.describe()} ({', '.join(names)}) to the "
            f"experts it holds, got {got!r}"
        )
    for name, n in given.items():
        values = n if isinstance(n, list) and len(n) == num_layers else [n]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise ExpertcacheError(
                f"capacities[{name!r}]: a whole number of experts, or a list of {num_layers} (one a layer), "
                f"got {n!r}"
            )
    return given


def host_level_of(
    host: HostConfig | str | None,
    host_capacity: int | None,
    total: int,
    expert_bytes: int,
    top_k: int = 1,
    capacity: int | None = None,
) -> tuple[HostConfig, int, list[str]] | None:
    """The host level asked for, as (its config, its experts, notes), or None: ``host`` (a ``HostConfig``
    or its memory) sized by its memory in experts of ``expert_bytes`` (less an exclusive level's reserve
    for its hits in flight, as the engine sizes it: ``cache.tiers.exclusive_reserve``), or
    ``host_capacity`` experts (one or the other; ``host_capacity`` alone: an LRU host level). One clear
    error for a size that cannot be a host level; more than all ``total`` experts is capped, with a
    note, and an inclusive level no larger than the cache's ``capacity`` is noted (timing, plan and
    doctor say the same)."""
    if host is None and host_capacity is None:
        return None
    try:
        cfg = as_config(host, HostConfig)
    except ExpertcacheError as e:  # a spec is the level's memory; its policy is the config's
        if not isinstance(host, str) or "is not a" not in str(e):
            raise
        raise ExpertcacheError(
            f"{option('--host-memory', 'host')} {host!r} is not the host level's memory (bytes, '8GiB', or "
            f"a share of all experts, '30%')"
            + option("", "; its policy and kind: HostConfig(memory, policy=..., exclusive=...)")
        ) from None
    notes: list[str] = []
    if host_capacity is not None:
        if not isinstance(host_capacity, int) or isinstance(host_capacity, bool) or host_capacity < 1:
            raise ExpertcacheError(
                f"{option('--host-capacity', 'host_capacity')}: a whole number of experts, 1 or more, got "
                f"{host_capacity!r}"
            )
        if cfg.enabled:
            raise ExpertcacheError(
                f"give the host level's memory ({cfg.memory}) or its capacity in experts ({host_capacity}), "
                "not both"
            )
        experts = host_capacity
    elif not cfg.enabled:
        raise ExpertcacheError("a host level needs its memory (HostConfig(memory=...)) or host_capacity")
    else:
        memory = cfg.bytes_of(total * expert_bytes) // expert_bytes
        if cfg.exceeds(total * expert_bytes):  # as the engine notes it
            notes.append(
                f"a host level of {cfg.memory} is more than all {total} experts take "
                f"({format_bytes(total * expert_bytes)}); capped at {total}"
            )
        if memory < 1:
            raise ExpertcacheError(
                f"host memory {cfg.memory} holds no expert of {format_bytes(expert_bytes)} (the cost "
                "model's expert_bytes)"
            )
        experts = level_experts(memory, cfg.exclusive, top_k)
        if experts < 1:
            raise ExpertcacheError(
                f"host memory {cfg.memory} holds {memory} expert(s) of {format_bytes(expert_bytes)}, all of "
                f"them the reserve an exclusive host level keeps for its hits in flight (a layer's top-k): "
                f"give at least {top_k + memory - experts} experts' memory"
            )
    if experts > total:
        notes.append(f"a host level of {experts} experts is more than all {total}; capped at {total}")
        experts = total
    if capacity is not None and capacity < total and not cfg.exclusive and experts <= capacity:
        notes.append(
            f"the host level ({experts} experts) holds no more than the cache ({capacity}): "
            "inclusive, it hits only experts the cache let go recently; give it more memory"
        )
    return cfg, experts, notes


def _level_counts(level, link: VirtualLink, host_level) -> dict[str, object]:
    """The host level's counts and the disk's reads (``cache.tiers``), where there is one."""
    if level is None:
        return {}
    return {
        **level.stats.to_dict(),
        "host_capacity": level.policy.capacity,
        "host_policy": host_level[0].policy,  # the spec as given, its parameters too
        "host_exclusive": level.exclusive,
        "host_stage": level.stage_limit,
        "disk_reads": link.disk_reads,
        "disk_read_s": link.disk_busy_s,
        "link_read_s": link.link_read_s,  # of those, the reads in transfers (``link_busy_s`` leaves them out)
    }


def _profile(cfg: CacheConfig, schedule, trace: Trace) -> dict | None:
    """A static policy's ranking: the usage profile given (``cfg.profile``: what the engine ranked by),
    else the replayed trace's own (an oracle's); None for a policy that ranks by none."""
    if not _needs_profile(cfg):
        return None
    return schedule.profile if cfg.profile is None else usage_profile(cfg.profile, trace)


def _needs_profile(cfg: CacheConfig) -> bool:
    from expertcache.policy.registry import policy_class

    return policy_class(cfg.name).needs_profile


def sim_part_bytes(spec: PartSpec, cost: CostModel, num_layers: int) -> int | list[int]:
    """Bytes one key of a cache part moves, from the cost model's expert bytes (and its bits per weight,
    for low-precision copies); one figure per layer for a segment whose bounds differ by layer."""
    if spec.kind == "segment":
        sizes = [
            max(1, round((hi - lo) * cost.expert_bytes)) for lo, hi in map(spec.bounds, range(num_layers))
        ]
        return sizes if len(set(sizes)) > 1 else sizes[0]
    if spec.kind == "quantized":
        return quantized_bytes(cost.expert_bytes, int(spec.bits), cost.weight_bits, int(spec.group or 64))
    return cost.expert_bytes


def recorded_part_bytes(trace: Trace, cost: CostModel, parts: dict) -> dict:
    """What each of ``parts`` moved a transfer in the engine run that recorded ``trace``
    (``trace.meta["part_bytes"]``), where the replay is priced for the run's own experts (``expert_bytes``):
    the engine cuts a segment at whole neurons (``split:theta=0.3`` of 96 neurons moves 29 of them, where
    0.3 of the expert's bytes is less), which the cost model's share of its expert bytes rounds otherwise.
    Empty otherwise (a part the replay does not have, or experts of another size)."""
    meta = trace.meta
    if "part_bytes" not in meta or meta.get("expert_bytes") is None:
        return {}
    if int(meta["expert_bytes"]) != cost.expert_bytes:
        return {}
    try:
        recorded = json.loads(meta["part_bytes"])
    except (TypeError, ValueError):
        return {}
    return {name: recorded[name] for name in parts if name in recorded}


def unit_time(spec: PartSpec, cost: CostModel, layer: int, tokens: int) -> float:
    """Device time of one unit: an expert, a segment of one (its share), a low-precision copy (plus its
    expansion)."""
    if spec.kind == "segment":
        lo, hi = spec.bounds(layer)
        return (hi - lo) * cost.expert(tokens)
    if spec.kind == "quantized":
        return cost.expert(tokens) + cost.dequant_s
    return cost.expert(tokens)


class _Run:
    """One forward step after another, as the engine drives its cache."""

    def __init__(self, trace, schedule, cost, driver: StepDriver, link: VirtualLink, specs, pred) -> None:
        self.trace, self.groups, self.cost = trace, schedule.groups, cost
        self.driver, self.link = driver, link
        self.specs, self.oracle = specs, pred is not None  # predictors may read the future (oracle)
        self.starts = schedule.round_token.tolist()  # each step's first token
        self.ends = [*self.starts[1:], trace.num_tokens]
        self.seq = schedule.round_seq.tolist()
        self.token_id = trace.token_id if trace.token_id is not None else np.full(trace.num_tokens, -1)

    def step(self, r: int, prefill: bool) -> None:
        s, e, L = self.starts[r], self.ends[r], self.trace.num_layers
        driver, link, cost, specs = self.driver, self.link, self.cost, self.specs
        future = [[ex for _, ex in g] for g in self.groups[r * L : (r + 1) * L]] if self.oracle else None
        driver.begin_step(self.token_id[s:e], prefill, self.seq[r], future)
        block = self.trace.experts[s:e]  # [n, L, K]
        weights = self.trace.weights[s:e] if self.trace.weights is not None else None
        for layer in range(L):
            link.advance(cost.dense(layer))
            work = driver.layer(layer, block[:, layer, :], None if weights is None else weights[:, layer, :])
            host_s = sum(cost.host_expert(need.tokens) for need in work.host)  # one after another
            link.host_busy_s += host_s
            if work.host and cost.host_submit_s:  # the compute thread hands over tokens, places outputs
                link.advance(cost.host_submit_s * len(work.host))
            host_end = link.now + host_s  # beside the device, from when the router has chosen
            if e - s == 1:  # one token (its experts distinct: ``Trace`` checks it): each computes it once
                for _, part in work.units():  # lazily: wait, compute, ...
                    link.advance(unit_time(specs[part], cost, layer, 1))
            else:
                tokens = {n.key: n.tokens for n in work.needs}
                for key, part in work.units():
                    link.advance(unit_time(specs[part], cost, layer, tokens[key]))
            driver.end_layer(layer)
            # host and device are one processor when not host_parallel: the host's experts run after
            link.join(host_end if cost.host_parallel else link.now + host_s)
        link.advance(cost.step_s)


def _describe_recorded_times(r: TimingResult) -> str:
    """The recorded run's own times beside this replay's (``TimingResult.recorded``)."""
    rec = r.recorded
    ms = lambda s: "-" if s is None else f"{s * 1e3:.3g} ms"  # noqa: E731
    said = []
    for phase, mine in (("decode", r.tpot_s), ("prefill", r.ttft_s)):
        step = rec[f"{phase}_step_s"]
        if step is None:
            continue
        ratio = f", this replay's {mine / step:.2f}x" if mine and step else ""
        said.append(f"a {phase} step {ms(step)} (its forward {ms(rec[f'{phase}_forward_s'])}){ratio}")
    for what, key in (("TTFT (from its first step to its first token)", "ttft_requests"),
                      ("TPOT (between its tokens)", "tpot_requests")):  # fmt: skip
        q = rec.get(key)
        if q:
            said.append(f"a request's {what} mean {ms(q['mean_s'])}, p99 {ms(q['p99_s'])}")
    return "the run's own clock, under its own configuration: " + "; ".join(said)


def format_timing(result: TimingResult) -> str:
    """The result as a few aligned lines (what ``expertcache timing`` prints)."""
    r, pf = result, result.cache

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"

    def own(q: dict | None, step_s: float | None, what: str) -> str:
        """A request's own figure beside the step's, where the trace holds several requests or it differs
        (one request whose prompt takes one step: that step is its time to first token, its decode steps
        its tokens)."""
        if not q or (q["requests"] == 1 and math.isclose(q["mean_s"], step_s or 0.0, rel_tol=0.01)):
            return ""
        n = q["requests"]
        return f"; a request's, {what}: mean {ms(q['mean_s'])}, p99 {ms(q['p99_s'])} over {n} requests"

    spell = lambda v: "/".join(map(str, v)) if isinstance(v, list) else v  # noqa: E731  as --policy takes it
    params = ":" + ",".join(f"{k}={spell(v)}" for k, v in r.params.items()) if r.params else ""
    prefetch = "none" if r.predictor is None else f"{r.predictor} (window {r.window})"
    if r.governor is not None:
        prefetch += f", {describe(r.governor)}"
    onoff = {True: "on", False: "off"}
    rate = "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f} tok/s"
    # a cache of several parts by its parts' keys (its capacity is its memory or its first part's, as given)
    parts = ", ".join(f"{k} {v}" for k, v in r.capacities.items()) if len(r.capacities) > 1 else None
    held = f"{r.capacity} experts" if parts is None else f"slots: {parts}"
    if list(r.capacities.values()) == [0] and r.capacity:  # every layer on the host: no slot is allocated
        held = f"no slot (the expert memory of {r.capacity} experts goes unused: miss {r.miss} caches none)"
    lines = [
        f"cache      {r.policy}{params}, {held} | miss {r.miss} | prefetch {prefetch} | "
        f"preemption {onoff[r.preemption]} | reorder {onoff[r.reorder]}"
        + (" | deterministic (each transfer landed before the next decision)" if r.deterministic else ""),
        "cost       "
        + r.cost.describe().replace(  # said where the chunks are, since doctor and plan show the model's
            " in 1 chunk:",
            " in 1 chunk (nothing prefetched to pass):" if r.whole_transfers else " in 1 chunk:",
        ),
        f"TTFT       {ms(r.ttft_s)} (mean of {r.steps[1]} prefill steps)"
        + own(r.request_ttfts, r.ttft_s, "from its first step to its first token"),
        f"TPOT       {ms(r.tpot_s)} (mean of {r.steps[0]} decode steps)"
        + own(r.request_tpots, r.tpot_s, "between its tokens"),
        *([f"recorded   {_describe_recorded_times(r)}"] if r.recorded is not None else []),
        f"total      {r.total_s:.3f} s for {r.tokens} tokens, {rate}",
        f"stall      {r.stall_s:.3f} s (prefill {r.stall_by_phase[1]:.3f} s, decode "
        f"{r.stall_by_phase[0]:.3f} s) | link busy {r.link_busy_s:.3f} s, "
        f"{r.transfers} transfers",
        f"cache      {r.requests} requests | {r.hits} hits | {r.misses} misses "
        f"({r.misses / r.requests if r.requests else 0:.1%})",
    ]
    if "host_requests" in pf:
        req = pf["host_requests"]
        more = "".join(
            f" | {word} {pf[key]}"
            for word, key in (("evicted", "host_evicted"), ("bypassed", "host_bypassed"),
                              ("demoted", "host_demoted"), ("dropped", "host_dropped"),
                              ("returned", "host_returned"), ("staged", "host_staged"))
            if pf[key]
        )  # fmt: skip
        lines.append(
            f"host level {pf['host_policy']}, {pf['host_capacity']} experts"
            f"{', exclusive' if pf['host_exclusive'] else ''} | {req} requests | {pf['host_hits']} hits | "
            f"{pf['host_misses']} misses ({pf['host_miss_ratio']:.1%}){more} | disk reads "
            f"{pf['disk_reads']}, {pf['disk_read_s']:.3f} s"
        )
    if r.miss != "fetch":
        # a part's slots (its capacity), its demand transfers, fills (moved in after host compute), and
        # misses found in it already (moved nothing)
        moved, fills, reused = (pf.get(k, {}) for k in ("part_misses", "part_fills", "part_reused"))

        def part(p: str, n) -> str:
            extra = "".join(f", {c[p]} {w}" for c, w in ((fills, "filled"), (reused, "reused")) if c.get(p))
            return f"{p} {n} slots, {moved.get(p, 0)} moved{extra}"

        parts = ", ".join(part(p, n) for p, n in r.capacities.items())
        lines.append(
            f"misses     host {pf['host_computed']} | low precision {pf['low_precision']} | skipped "
            f"{pf['skipped']} | host wait {r.host_wait_s:.3f} s | parts {parts}"
        )
    if r.predictor is not None:
        lines += [
            f"prefetch   issued {pf['prefetch_issued']} | used {pf['prefetch_used']} | late "
            f"{pf['prefetch_late']} | evicted {pf['prefetch_evicted']} | cancelled "
            f"{pf['prefetch_cancelled']} | skipped {pf['prefetch_skipped']}",
            "quality    "
            + " | ".join(
                f"{k} {'-' if pf[k] is None else format(pf[k], '.3f')}"
                for k in ("accuracy", "fetchrate", "goodpred")
            ),
        ]
    return "\n".join(lines)
