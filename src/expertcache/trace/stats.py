"""Descriptive statistics of a routing trace (what `expertcache trace info` prints)."""

from __future__ import annotations

import numpy as np

from expertcache.trace.trace import Trace, as_trace


def layer_entropy(trace: Trace) -> np.ndarray:
    """Entropy in bits of each layer's expert-usage distribution (NaN for a layer with no known
    entry). -> [L]"""
    L, E = trace.num_layers, trace.num_experts
    ex = trace.experts.transpose(1, 0, 2).reshape(L, -1)  # [L, T*K]
    out = np.full(L, np.nan)
    for layer in range(L):
        ids = ex[layer][ex[layer] >= 0]
        if ids.size:
            p = np.bincount(ids, minlength=E) / ids.size
            p = p[p > 0]
            out[layer] = float(-(p * np.log2(p)).sum())
    return out


def reuse_between_tokens(trace: Trace) -> np.ndarray:
    """Per layer: fraction of a token's experts the previous token of its sequence also used (NaN for a
    layer with no known entry after a token of its sequence). -> [L]"""
    ex = trace.experts.astype(np.int32)
    same_seq = np.ones(len(ex) - 1, dtype=bool)
    if trace.seq_id is not None:  # each request's tokens in order (a batched trace interleaves them)
        order = np.argsort(trace.seq_id, kind="stable")
        ex, seq = ex[order], trace.seq_id[order]
        same_seq = seq[1:] == seq[:-1]
    prev, cur = ex[:-1], ex[1:]  # [T-1, L, K]
    prev, cur = prev[same_seq], cur[same_seq]
    known = cur >= 0
    hit = (cur[:, :, :, None] == prev[:, :, None, :]).any(axis=3) & known  # [T', L, K]
    denom = known.sum(axis=(0, 2))
    return np.divide(hit.sum(axis=(0, 2)), denom, out=np.full(trace.num_layers, np.nan), where=denom > 0)


def step_shape(trace: Trace) -> dict[str, float | int] | None:
    """A batched trace's forward steps (``step_id``): how many, their tokens (mean, most), and the distinct
    experts a layer needs in a step (mean over steps and layers: what one step asks of a layer's
    cache), and with ``seq_id`` the requests a step serves together (mean, most); None for a trace
    without ``step_id``."""
    if trace.step_id is None:
        return None
    starts = np.flatnonzero(np.r_[True, trace.step_id[1:] != trace.step_id[:-1]])
    sizes = np.diff(np.r_[starts, trace.num_tokens])
    L, E = trace.num_layers, trace.num_experts
    seen = np.zeros((L, E + 1), dtype=bool)  # column E: unknown entries (-1)
    layers = np.arange(L)[None, :, None]
    distinct = 0
    for s, n in zip(starts.tolist(), sizes.tolist(), strict=True):
        seen[:] = False
        seen[np.broadcast_to(layers, (n, L, trace.top_k)), trace.experts[s : s + n]] = True
        distinct += int(seen[:, :E].sum())
    shape = {
        "steps": len(starts),
        "mean_step_tokens": float(sizes.mean()),
        "max_step_tokens": int(sizes.max()),
        "mean_step_experts": distinct / (len(starts) * L),
    }
    if trace.seq_id is not None:  # the requests a step served together: the concurrency achieved
        pairs = np.unique(np.stack((trace.step_id.astype(np.int64), trace.seq_id.astype(np.int64))), axis=1)
        per_step = np.bincount(np.searchsorted(np.unique(pairs[0]), pairs[0]))
        shape |= {"mean_step_requests": float(per_step.mean()), "max_step_requests": int(per_step.max())}
    return shape


def clock_steps(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A recorded run's steps on its wall clock (``step_start_s``, ``step_end_s``): each step's first token
    (by ``step_id``, else by its start), the steps' starts and the ends of their forwards, seconds from the
    first; None for a trace without them."""
    if trace.step_start_s is None or trace.step_end_s is None:
        return None
    ids = trace.step_id if trace.step_id is not None else trace.step_start_s
    first = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    return first, trace.step_start_s[first], trace.step_end_s[first]


IDLE_GAP = 10  # a pause between steps this many times the median one: the run was idle (no request to run)


def whole_steps(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Each step's whole time on a run's clock: from its start to the next step's (its forward, then what
    the run did before the next: a server's sampling, scheduling and streaming), the last step its forward
    alone. A pause more than ``IDLE_GAP`` times the median pause (a server with no request to run) counts
    as the median pause: idle time is no step's."""
    gaps = np.maximum(starts[1:] - ends[:-1], 0.0)
    usual = float(np.median(gaps)) if gaps.size else 0.0
    if usual > 0:
        gaps = np.where(gaps > IDLE_GAP * usual, usual, gaps)
    return (ends - starts) + np.r_[gaps, 0.0]


def step_walls(trace: Trace) -> dict[str, object] | None:
    """A recorded run's own step times (``clock_steps``), by phase (a step with any prompt token is a
    prefill step): each step's forward (its start to its end) and its whole time (``whole_steps``), in
    seconds: median and mean; None without them."""
    bounds = clock_steps(trace)
    if bounds is None:
        return None
    first, starts, ends = bounds
    return phase_walls(trace, first, starts, ends, whole_steps(starts, ends))


def phase_walls(
    trace: Trace, first: np.ndarray, starts: np.ndarray, ends: np.ndarray, whole: np.ndarray
) -> dict[str, object]:
    """``step_walls`` of the steps ``clock_steps`` gave and their ``whole_steps``, for a caller that has
    them already (``sim.timing.recorded_times``)."""
    prompt = trace.is_prefill == 1 if trace.is_prefill is not None else np.zeros(trace.num_tokens, bool)
    prefill = np.logical_or.reduceat(prompt, first)
    forward = ends - starts
    out: dict[str, object] = {"steps": len(first), "seconds": float(ends.max())}
    for name, phase in (("decode", ~prefill), ("prefill", prefill)):
        n = int(phase.sum())
        out[name] = {
            "steps": n,
            "forward_median_s": float(np.median(forward[phase])) if n else None,
            "forward_mean_s": float(forward[phase].mean()) if n else None,
            "whole_median_s": float(np.median(whole[phase])) if n else None,
            "whole_mean_s": float(whole[phase].mean()) if n else None,
        }
    return out


def summary(trace: Trace) -> dict[str, object]:
    """Shape, sequence structure, per-layer entropy and reuse as a JSON-ready dict (``trace``: a
    ``Trace`` or its file)."""
    trace = as_trace(trace)
    ent = layer_entropy(trace)
    reuse = reuse_between_tokens(trace)
    pad = trace.padding == 1 if trace.padding is not None else np.zeros(trace.num_tokens, bool)
    prefill = int(((trace.is_prefill == 1) & ~pad).sum()) if trace.is_prefill is not None else None
    return {
        "source": trace.source,
        "tokens": trace.num_tokens,
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "top_k": trace.top_k,
        "sequences": int(np.unique(trace.seq_id).size) if trace.seq_id is not None else None,
        "prefill_tokens": prefill,  # the prompts' own tokens: a padded batch's left padding apart
        "padding_tokens": int(pad.sum()),
        "unknown_entries": int((trace.experts < 0).sum()),
        "step_shape": step_shape(trace),
        "step_walls": step_walls(trace),
        "max_entropy_bits": float(np.log2(trace.num_experts)),
        "entropy_bits": _or_none(ent.round(4)),
        "mean_entropy_bits": _mean_or_none(ent),
        "reuse": _or_none(reuse.round(4)),
        "mean_reuse": _mean_or_none(reuse),
    }


def _or_none(values: np.ndarray) -> list[float | None]:
    """A layer without the data (NaN) as None: JSON's null, printed "-"."""
    return [None if np.isnan(v) else float(v) for v in values]


def _mean_or_none(values: np.ndarray) -> float | None:
    """The mean over the layers that have the data; None where none has."""
    known = values[~np.isnan(values)]
    return float(known.mean()) if known.size else None
