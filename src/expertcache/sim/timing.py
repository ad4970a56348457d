"""The simulator's timing model: a trace replayed in virtual time, prefetching included.

``simulate_timing`` drives ``cache.proactive.Proactive`` (the engine's decisions: prefetch, early
preemption, reordering) over a ``VirtualLink`` (``sim.vlink``) exactly as the engine drives it over
its transfer worker, one forward step after another in layer order. Compute is serial and follows a
``CostModel``: per step, each MoE layer's dense part (attention, norms, router), then the layer's
experts one after another (``a + b * tokens`` each), and a fixed time per step (embeddings, LM head).
The link moves experts in the background, chunk by chunk; compute waits for an expert still in
transit (stall). See docs/TIMING.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from itertools import chain
from pathlib import Path

import numpy as np

from expertcache.cache.proactive import Proactive
from expertcache.cache.residency import Residency
from expertcache.errors import ExpertcacheError, first_line
from expertcache.policy.registry import parse_policy
from expertcache.predict.base import PredictContext, Predictor, PredictorError
from expertcache.sim.replay import check_rooms, policy_for
from expertcache.sim.schedule import Schedule, build_schedule, check_capacity
from expertcache.sim.vlink import VirtualLink
from expertcache.trace.trace import Trace

AUTO = "auto"  # chunk_bytes: an expert's three weight matrices, about a third of it each


@dataclass(frozen=True)
class CostModel:
    """Costs of one forward step, in seconds and bytes. The defaults: a Mixtral-8x7B expert in fp16
    (3 x 4096 x 14336 x 2 bytes) over PCIe 4.0 x16, with compute times of a recent GPU at batch 1."""

    dense_s: float | tuple[float, ...] = 0.25e-3  # per MoE layer: attention, norms, router (or one per layer)
    expert_s: float = 0.35e-3  # a: an expert's fixed time (reading its weights)
    expert_token_s: float = 2e-6  # b: its time per token routed to it
    step_s: float = 0.5e-3  # per forward step: embeddings and LM head
    link_bandwidth: float = 25e9  # bytes/s (inf: free transfers but for the latency)
    link_latency: float = 20e-6  # seconds per chunk
    expert_bytes: int = 352_321_536
    chunk_bytes: int | None | str = AUTO  # at most this per chunk; None: one chunk per expert
    wake_s: float = 0.0  # compute resumes this long after a transfer it waited for lands (thread wake-up)
    submit_s: float = 0.0  # compute time the engine spends issuing one transfer (bookkeeping, hand-off)

    def __post_init__(self) -> None:
        if isinstance(self.dense_s, list | tuple):
            object.__setattr__(self, "dense_s", tuple(float(d) for d in self.dense_s))
            if not self.dense_s:
                raise ExpertcacheError("cost: dense_s must be a time or a non-empty list of times")
        for name in ("expert_s", "expert_token_s", "step_s", "link_latency", "wake_s", "submit_s"):
            _check_time(name, getattr(self, name))
        for d in self.dense_s if isinstance(self.dense_s, tuple) else (self.dense_s,):
            _check_time("dense_s", d)
        if not self.link_bandwidth > 0:  # also refuses NaN
            raise ExpertcacheError(f"cost: link_bandwidth must be positive, got {self.link_bandwidth}")
        if not isinstance(self.expert_bytes, int) or self.expert_bytes < 1:
            raise ExpertcacheError(
                f"cost: expert_bytes must be a positive integer, got {self.expert_bytes!r}"
            )
        chunk = self.chunk_bytes
        if chunk not in (None, AUTO) and (not isinstance(chunk, int) or chunk < 1):
            raise ExpertcacheError(
                f"cost: chunk_bytes must be a positive integer, 'auto' or null, got {self.chunk_bytes!r}"
            )

    # -- what the simulator asks ----------------------------------------------------------------
    def dense(self, layer: int) -> float:
        return self.dense_s[layer] if isinstance(self.dense_s, tuple) else self.dense_s

    def expert(self, tokens: int) -> float:
        """Compute time of one expert given ``tokens`` tokens."""
        return self.expert_s + self.expert_token_s * tokens

    def chunk_sizes(self) -> list[int]:
        """Bytes of each chunk of one expert."""
        size = self.chunk_bytes or self.expert_bytes
        if size == AUTO:  # resolved here, so that a changed expert_bytes keeps its thirds
            size = -(-self.expert_bytes // 3)
        full, rest = divmod(self.expert_bytes, size)
        return [size] * full + ([rest] if rest else [])

    def chunk_times(self) -> list[float]:
        """Link seconds of each chunk of one expert: latency + bytes / bandwidth."""
        return [self.link_latency + b / self.link_bandwidth for b in self.chunk_sizes()]

    @property
    def transfer_s(self) -> float:
        """Link seconds of one whole expert, all its chunks."""
        return sum(self.chunk_times())

    # -- construction, files ---------------------------------------------------------------------
    @classmethod
    def from_measurements(
        cls,
        dense_s: float | Sequence[float],
        expert_samples: Sequence[tuple[int, float]],
        step_s: float,
        link_bandwidth: float,
        link_latency: float,
        expert_bytes: int,
        chunk_bytes: int | None | str = AUTO,
    ) -> CostModel:
        """A cost model from measured times; ``expert_samples`` are (tokens, seconds) of expert calls,
        fitted by least squares to ``a + b * tokens`` (b = 0 from one token count)."""
        tokens = np.asarray([s[0] for s in expert_samples], dtype=np.float64)
        secs = np.asarray([s[1] for s in expert_samples], dtype=np.float64)
        if len(secs) == 0:
            raise ExpertcacheError("cost: no expert timings to fit")
        if np.ptp(tokens) == 0:
            a, b = float(secs.mean()), 0.0
        else:
            b, a = (float(v) for v in np.polyfit(tokens, secs, 1))
        a, b = max(a, 0.0), max(b, 0.0)
        dense = dense_s if isinstance(dense_s, int | float) else tuple(dense_s)
        return cls(dense, a, b, step_s, link_bandwidth, link_latency, expert_bytes, chunk_bytes)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["dense_s"] = list(self.dense_s) if isinstance(self.dense_s, tuple) else self.dense_s
        return out

    def save(self, path: str | Path) -> None:
        """Write the model as JSON (an infinite bandwidth as the string "inf")."""
        data = self.to_dict()
        if math.isinf(self.link_bandwidth):
            data["link_bandwidth"] = "inf"
        try:
            Path(path).write_text(json.dumps(data, indent=2) + "\n")
        except OSError as e:
            raise ExpertcacheError(f"{path}: cannot write cost model ({e.strerror or e})") from None

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a JSON cost model: any subset of the fields, times as seconds or "1ms", rates as
        bytes/s or "16GB/s", sizes as bytes or "336MiB"; problems are one line naming the field."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise ExpertcacheError(f"{path}: cannot read cost model ({e.strerror or e})") from None
        except ValueError as e:
            raise ExpertcacheError(f"{path}: not JSON ({first_line(e)})") from None
        if not isinstance(data, dict):
            raise ExpertcacheError(f"{path}: a cost model is a JSON object of fields")
        try:
            return cls.from_dict(data)
        except ExpertcacheError as e:
            raise ExpertcacheError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, data: dict[str, object], base: CostModel | None = None) -> CostModel:
        """``base`` (default: the defaults) with the given fields, parsed as ``load`` does."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ExpertcacheError(f"cost: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
        parsed = {name: _parse_field(name, value) for name, value in data.items()}
        return replace(base or cls(), **parsed)

    def describe(self) -> str:
        """One line: every cost, and what one expert's transfer takes."""
        dense = (
            "/".join(f"{d * 1e3:g}" for d in self.dense_s) if isinstance(self.dense_s, tuple)
            else f"{self.dense_s * 1e3:g}"
        )  # fmt: skip
        chunks = len(self.chunk_sizes())
        return (
            f"dense {dense} ms/layer | expert {self.expert_s * 1e3:g} ms + {self.expert_token_s * 1e6:g} "
            f"us/token | step {self.step_s * 1e3:g} ms | link {self.link_bandwidth / 1e9:g} GB/s + "
            f"{self.link_latency * 1e6:g} us/chunk | expert {self.expert_bytes / 2**20:.1f} MiB in "
            f"{chunks} chunk{'s' if chunks > 1 else ''}: {self.transfer_s * 1e3:.3g} ms"
            + (f" | wake {self.wake_s * 1e6:g} us" if self.wake_s else "")
            + (f" | issue {self.submit_s * 1e6:g} us/transfer" if self.submit_s else "")
        )


def _check_time(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ExpertcacheError(f"cost: {name} must be a non-negative number of seconds, got {value!r}")


def _parse_field(name: str, value: object) -> object:
    """One JSON value of a cost field: numbers as they are, strings with units through the parsers."""
    from expertcache.engine.memory import parse_duration, parse_rate, parse_size  # imports torch

    what = f"cost field {name!r}"
    if isinstance(value, bool):
        raise ExpertcacheError(f"{what}: expected a number or a string with a unit, got {value}")
    if name == "dense_s" and isinstance(value, list):
        return tuple(_parse_field(name, v) for v in value)
    if name == "chunk_bytes" and (value is None or value == AUTO):
        return value
    if isinstance(value, str) and name == "link_bandwidth" and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if name in ("expert_bytes", "chunk_bytes"):
        size = parse_size(value, what) if isinstance(value, str | int | float) else None
        if size is None or size != int(size):
            raise ExpertcacheError(f"{what}: expected a whole number of bytes, got {value!r}")
        return int(size)
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise ExpertcacheError(f"{what}: expected a number or a string with a unit, got {value!r}")
    if name != "link_bandwidth":
        return parse_duration(value, what)
    try:
        return parse_rate(value, what)
    except ExpertcacheError:
        raise ExpertcacheError(f"{what}: {value!r} is not a rate (examples: 16GB/s, 500MiB/s, inf)") from None


# ------------------------------------------------------------------------------------------------
# Replaying recorded predictions
# ------------------------------------------------------------------------------------------------
class Recorded(Predictor):
    """The predictions an engine's predictor made, replayed from the trace's ``predicted`` array.

    For each step and layer the engine recorded its ranked list row after row over the step's rows
    (-1 padding). Each ``begin_step`` takes the next ``len(token_ids)`` rows of the trace, so the
    driver must run the trace's steps in order. Issued where the original issued them: for a
    gate-input predictor (``needs_model``) layers 1..k at layer 0 and layer i at layer i - k, for
    the others layers 0..k-1 at the step's start.
    """

    name = "recorded"
    needs_model = True

    def __init__(self, ctx: PredictContext, predicted: np.ndarray, needs_model: bool = True) -> None:
        super().__init__(ctx)
        self.predicted = predicted  # [T, L, K]
        self.needs_model = needs_model  # type: ignore[misc]  # as the recorded predictor
        self._rows = slice(0, 0)

    def _begin(self, token_ids, prefill, new_request, future) -> None:
        start = self._rows.stop
        self._rows = slice(start, start + len(token_ids))

    def _predict(self, source: int, target: int, gate_input) -> list[int]:
        flat = self.predicted[self._rows, target].reshape(-1).tolist()
        return list(dict.fromkeys(e for e in flat if e >= 0))


def make_sim_predictor(
    spec: str | Predictor | None,
    trace: Trace,
    window: int | None = None,
    seed: int = 0,
    data: Trace | None = None,
) -> Predictor | None:
    """A predictor the simulator can run. Trace-based ones by name, learning from ``data``, a recorded
    trace of other runs (``token`` requires one; ``eam`` without one starts cold and learns online; the
    simulated trace is never used silently, as it holds the future). Gate-input ones (``needs_model``)
    are replayed from the trace's recorded predictions; ``recorded`` replays whatever the trace holds."""
    if isinstance(spec, Predictor):
        return spec
    if spec is None or spec == "none":
        return None
    from expertcache.predict.registry import PREDICTORS, predictor_class  # gate predictors import torch

    if data is None and spec != Recorded.name and not predictor_class(spec).needs_model:
        if spec == "token":  # its table from the simulated trace itself would read the future
            raise PredictorError(
                "predictor 'token' needs a recorded trace to count from (--predictor TRACE.npz), another "
                "run than the one simulated; passing the simulated trace itself gives an in-sample bound"
            )
    elif data is None:
        data = trace
    if data is not None and (data.num_layers, data.num_experts) != (trace.num_layers, trace.num_experts):
        raise PredictorError(
            f"predictor trace {data.source} has {data.num_layers} layers x {data.num_experts} experts, "
            f"the simulated one {trace.num_layers} x {trace.num_experts}"
        )
    ctx = PredictContext(trace.num_layers, trace.num_experts, trace.top_k, window, trace=data, seed=seed)
    if spec != Recorded.name and not predictor_class(spec).needs_model:
        return predictor_class(spec)(ctx)
    recorded = trace.meta.get("predictor")
    if trace.predicted is None or (spec != Recorded.name and recorded != spec):
        has = f"those of {recorded!r}" if trace.predicted is not None else "none"
        raise PredictorError(
            f"{trace.source}: predictor {spec!r} needs the model's gate inputs, so the simulator replays "
            f"the predictions an engine recorded into the trace, and this trace has {has}"
        )
    rec_window = trace.meta.get("window")
    rec_window = int(rec_window) if rec_window is not None else None
    if window is not None and rec_window is not None and window != rec_window:
        raise PredictorError(
            f"{trace.source}: predictions were recorded with window {rec_window}, not {window}"
        )
    original = PREDICTORS.get(recorded) if isinstance(recorded, str) else None  # None: unknown here
    default = original.default_window if original is not None else 1
    ctx = replace(ctx, window=window or rec_window or default)
    return Recorded(ctx, trace.predicted, original.needs_model if original is not None else True)


# ------------------------------------------------------------------------------------------------
# The simulation
# ------------------------------------------------------------------------------------------------
@dataclass
class TimingResult:
    """Virtual times of one run; lists indexed [decode, prefill]."""

    policy: str
    capacity: int
    predictor: str | None
    window: int | None
    preemption: bool
    reorder: bool
    cost: CostModel
    tokens: int
    steps: list[int]  # forward steps
    step_time_s: list[float]  # summed step times
    stall_by_phase: list[float]  # compute waiting for transfers
    link_busy_s: float
    bytes_moved: int
    transfers: int
    blocked_waits: int
    requests: int
    misses: int
    proactive: dict[str, object] = field(default_factory=dict)
    params: dict[str, object] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.step_time_s)

    @property
    def ttft_s(self) -> float | None:
        """Mean prefill step time (one prefill step per request: the time to its first token)."""
        return self.step_time_s[1] / self.steps[1] if self.steps[1] else None

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

    def to_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "params": self.params,
            "capacity": self.capacity,
            "predictor": self.predictor,
            "window": self.window,
            "preemption": self.preemption,
            "reorder": self.reorder,
            "chunks_per_expert": len(self.cost.chunk_sizes()),
            "tokens": self.tokens,
            "prefill_steps": self.steps[1],
            "decode_steps": self.steps[0],
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "total_s": self.total_s,
            "tokens_per_s": self.tokens / self.total_s if self.total_s else None,
            "stall_s": self.stall_s,
            "prefill_stall_s": self.stall_by_phase[1],
            "decode_stall_s": self.stall_by_phase[0],
            "link_busy_s": self.link_busy_s,
            "bytes_moved": self.bytes_moved,
            "transfers": self.transfers,
            "blocked_waits": self.blocked_waits,
            "requests": self.requests,
            "hits": self.hits,
            "misses": self.misses,
            "miss_ratio": self.misses / self.requests if self.requests else 0.0,
            **self.proactive,
            "cost": self.cost.to_dict(),
        }


def simulate_timing(
    trace: Trace,
    policy: str = "lru",
    *,
    capacity: int,
    predictor: str | Predictor | None = None,
    window: int | None = None,
    cost: CostModel | None = None,
    preemption: bool = True,
    reorder: bool = True,
    seed: int = 0,
    predictor_trace: Trace | None = None,
    prefetch_limit: int | None = None,
    **policy_params: object,
) -> TimingResult:
    """Replay ``trace`` step by step in layer order through a cache of ``capacity`` experts under
    ``policy`` ('name' or 'name:k=v,...'), prefetching with ``predictor``, timed by ``cost``.
    Trace-based predictors learn from ``predictor_trace`` (default: ``trace`` itself, which has seen
    the very routing it predicts: an optimistic bound)."""
    cost = cost or CostModel()
    name, params = parse_policy(policy)
    params.update(policy_params)
    L, K = trace.num_layers, trace.top_k
    if isinstance(cost.dense_s, tuple) and len(cost.dense_s) != L:
        raise ExpertcacheError(f"cost: dense_s has {len(cost.dense_s)} times for a model of {L} layers")
    check_capacity(capacity, "layer", K)
    schedule = build_schedule(trace, "layer")
    pol = policy_for(schedule, name, capacity, seed, **params)
    check_rooms(schedule, pol)
    pred = make_sim_predictor(predictor, trace, window, seed, predictor_trace)
    link = VirtualLink(cost.chunk_times(), cost.chunk_sizes(), wake_s=cost.wake_s, submit_s=cost.submit_s)
    if prefetch_limit is not None and prefetch_limit < 1:
        raise ExpertcacheError(f"prefetch limit must be at least 1 expert per layer, got {prefetch_limit}")
    limit = K if prefetch_limit is None else int(prefetch_limit)  # as the engine: top-k by default
    pro = Proactive(Residency(pol), link, L, limit, preemption, reorder)
    run = _Run(trace, schedule, cost, pro, pred)
    steps, times, stalls = [0, 0], [0.0, 0.0], [0.0, 0.0]
    for r, prefill in enumerate(schedule.round_prefill.tolist()):
        t0, s0 = link.now, link.stall_s
        run.step(r, prefill)
        steps[prefill] += 1
        times[prefill] += link.now - t0
        stalls[prefill] += link.stall_s - s0
    st = pro.stats
    return TimingResult(
        policy=pol.name,
        capacity=capacity,
        predictor=None if pred is None else predictor if isinstance(predictor, str) else pred.name,
        window=pred.window if pred is not None else None,
        preemption=preemption,
        reorder=reorder,
        cost=cost,
        tokens=trace.num_tokens,
        steps=steps,
        step_time_s=times,
        stall_by_phase=stalls,
        link_busy_s=link.busy_s,
        bytes_moved=link.bytes_moved,
        transfers=link.transfers,
        blocked_waits=link.blocked,
        requests=int(st.requests.sum()),
        misses=int(st.misses.sum()),
        proactive=st.to_dict(),
        params=params,
    )


class _Run:
    """One forward step after another, as the engine drives its cache."""

    def __init__(self, trace: Trace, schedule: Schedule, cost: CostModel, pro: Proactive, pred) -> None:
        self.trace, self.groups, self.cost, self.pro, self.pred = trace, schedule.groups, cost, pro, pred
        self.link: VirtualLink = pro.transport  # type: ignore[assignment]
        self.clock = pro.policy.clock
        self.starts = schedule.round_token.tolist()  # each step's first token
        self.ends = [*self.starts[1:], trace.num_tokens]
        self.seq = schedule.round_seq.tolist()
        self.token_id = trace.token_id if trace.token_id is not None else np.full(trace.num_tokens, -1)

    def step(self, r: int, prefill: bool) -> None:
        s, e, L = self.starts[r], self.ends[r], self.trace.num_layers
        clock, pro, pred, link, cost = self.clock, self.pro, self.pred, self.link, self.cost
        clock.round, clock.token, clock.seq, clock.layer = r, s, self.seq[r], 0
        block = self.trace.experts[s:e]  # [n, L, K]
        groups = self.groups[r * L : (r + 1) * L]
        pro.begin_step()
        if pred is not None:
            new = prefill or r == 0 or self.seq[r] != self.seq[r - 1]
            future = [[ex for _, ex in g] for g in groups]
            pro.prefetch(pred.begin_step(self.token_id[s:e], prefill, new, future))
        for layer, keys in enumerate(groups):
            clock.layer, clock.group = layer, r * L + layer
            link.advance(cost.dense(layer))
            rows = block[:, layer, :]  # [n, K]
            tokens = np.bincount(rows[rows >= 0], minlength=self.trace.num_experts) if e - s > 1 else None
            served = pro.serve(layer, [ex for _, ex in keys])
            first = next(served, None)  # the router has chosen: preemption and demand misses happen
            if pred is not None:
                pro.prefetch(pred.after_router(layer, rows, None), current=keys)
            for key in chain((first,), served) if first is not None else ():  # lazily: wait, compute, ...
                link.advance(cost.expert(1 if tokens is None else int(tokens[key[1]])))
        link.advance(cost.step_s)


def format_timing(result: TimingResult) -> str:
    """The result as a few aligned lines (what ``expertcache timing`` prints)."""
    r, pf = result, result.proactive

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"

    params = ":" + ",".join(f"{k}={v}" for k, v in r.params.items()) if r.params else ""
    prefetch = "none" if r.predictor is None else f"{r.predictor} (window {r.window})"
    onoff = {True: "on", False: "off"}
    rate = f"{r.tokens / r.total_s:.1f} tok/s" if r.total_s else "-"
    lines = [
        f"cache      {r.policy}{params}, {r.capacity} experts | prefetch {prefetch} | "
        f"preemption {onoff[r.preemption]} | reorder {onoff[r.reorder]}",
        f"cost       {r.cost.describe()}",
        f"TTFT       {ms(r.ttft_s)} (mean of {r.steps[1]} prefill steps)",
        f"TPOT       {ms(r.tpot_s)} (mean of {r.steps[0]} decode steps)",
        f"total      {r.total_s:.3f} s for {r.tokens} tokens, {rate}",
        f"stall      {r.stall_s:.3f} s (prefill {r.stall_by_phase[1]:.3f} s, decode "
        f"{r.stall_by_phase[0]:.3f} s) | link busy {r.link_busy_s:.3f} s, {r.transfers} transfers",
        f"cache      {r.requests} requests | {r.hits} hits | {r.misses} misses "
        f"({r.misses / r.requests if r.requests else 0:.1%})",
    ]
    if r.predictor is not None:
        lines += [
            f"prefetch   issued {pf['prefetch_issued']} | used {pf['prefetch_used']} | late "
            f"{pf['prefetch_late']} | cancelled {pf['prefetch_cancelled']} | skipped "
            f"{pf['prefetch_skipped']}",
            f"quality    accuracy {pf['accuracy']:.3f} | fetchrate {pf['fetchrate']:.3f} | "
            f"goodpred {pf['goodpred']:.3f}",
        ]
    return "\n".join(lines)
