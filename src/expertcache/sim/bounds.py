"""Two reference strategies for a batched trace, step by step: what a step's misses would cost without a
cache policy's cleverness, for comparing one against (issue "many users, one expert cache").

- **stream**: every expert a step needs is moved once (MoE-Lightning's layer streaming, no reuse across
  steps): per step, ``sum over layers of |experts the layer needs| * transfer time``;
- **static split**: a fixed set of experts is resident (the most used, by tokens routed to them over the
  whole trace, ``capacity // L`` a layer as a uniform budget gives), and every other expert a step needs
  is computed on the host (its tokens at ``host_expert``'s cost, one expert after another), none moved.

``best`` is the better of the two in each step. These are the per-step references the simulator's miss
time is held against (the timing model's ``stall + host wait``: what compute waited for experts); they
are not lower bounds of every strategy (a prefetcher overlaps moves with compute, a mixed split can beat
both), but a batch-aware cache should come close to the better of them in each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from expertcache.cache.schedule import step_starts
from expertcache.costs import CostModel, as_cost
from expertcache.errors import ExpertcacheError, warn_notes
from expertcache.trace.trace import Trace, as_trace
from expertcache.units import capped_capacity, one_capacity


@dataclass(frozen=True)
class StepBounds:
    """Per forward step of a trace: the two reference strategies' miss time, seconds. [S] each."""

    stream_s: np.ndarray
    static_s: np.ndarray
    prefill: np.ndarray  # bool [S]: the step holds a prompt token

    @property
    def best_s(self) -> np.ndarray:
        return np.minimum(self.stream_s, self.static_s)

    def to_dict(self) -> dict[str, float | int]:
        return {
            "steps": len(self.stream_s),
            "stream_s": float(self.stream_s.sum()),
            "static_s": float(self.static_s.sum()),
            "best_s": float(self.best_s.sum()),
            "stream_better_steps": int((self.stream_s < self.static_s).sum()),
        }


def step_bounds(
    trace: Trace | str, capacity: int | str, cost: CostModel | dict | str | None = None
) -> StepBounds:
    """The stream and static-split miss times of each step of ``trace`` (a ``Trace`` or its file; see the
    module docstring), at a cache of ``capacity`` experts (or a share of all, "25%"; ``capacity // L`` a
    layer for the static set; 0: no cache, every needed expert streamed or computed on the host; more than
    all experts: capped, and said), under ``cost`` (a ``CostModel``, a dict or file of one, None: the
    defaults), as ``simulate_timing`` takes them."""
    trace = as_trace(trace)
    cost = as_cost(cost, trace)
    L, E = trace.num_layers, trace.num_experts
    if not isinstance(capacity, bool) and isinstance(capacity, int) and capacity <= 0:  # 0: no cache
        if capacity < 0:
            raise ExpertcacheError(f"capacity must be at least 0 experts, got {capacity}")
    else:
        capacity = one_capacity(capacity, L * E)
    capacity, capped = capped_capacity(capacity, L * E)  # said, as the simulator says it (a trial)
    warn_notes(capped)
    room = min(capacity // L, E)
    ex = trace.experts
    layer_of = np.broadcast_to(np.arange(L)[None, :, None], ex.shape)
    known = ex >= 0
    uses = np.zeros((L, E), dtype=np.int64)  # tokens routed to each expert over the trace
    np.add.at(uses, (layer_of[known], ex[known]), 1)
    resident = np.zeros((L, E), dtype=bool)
    if room:
        top = np.argsort(-uses, axis=1, kind="stable")[:, :room]
        resident[np.arange(L)[:, None], top] = True
    transfer = cost.demand_transfer_time()  # each needed expert moved once, whole
    starts = step_starts(trace)
    ends = np.r_[starts[1:], trace.num_tokens]
    stream, static = np.zeros(len(starts)), np.zeros(len(starts))
    prompt = trace.is_prefill == 1 if trace.is_prefill is not None else np.zeros(trace.num_tokens, bool)
    prefill = np.logical_or.reduceat(prompt, starts)  # a step holding a prompt token, as the schedule
    counts = np.zeros((L, E), dtype=np.int64)
    for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        counts[:] = 0
        block, ok = ex[s:e], known[s:e]
        np.add.at(counts, (layer_of[s:e][ok], block[ok]), 1)  # tokens of the step per (layer, expert)
        needed = counts > 0
        stream[i] = needed.sum() * transfer
        static[i] = sum(cost.host_expert(int(n)) for n in counts[needed & ~resident].tolist())
    return StepBounds(stream, static, prefill)
