"""Descriptive statistics of a routing trace (what `expertcache trace info` prints)."""

from __future__ import annotations

import numpy as np

from expertcache.trace.trace import Trace


def layer_entropy(trace: Trace) -> np.ndarray:
    """Entropy in bits of each layer's expert-usage distribution. -> [L]"""
    L, E = trace.num_layers, trace.num_experts
    ex = trace.experts.transpose(1, 0, 2).reshape(L, -1)  # [L, T*K]
    out = np.zeros(L)
    for layer in range(L):
        ids = ex[layer][ex[layer] >= 0]
        if ids.size:
            p = np.bincount(ids, minlength=E) / ids.size
            p = p[p > 0]
            out[layer] = float(-(p * np.log2(p)).sum())
    return out


def reuse_between_tokens(trace: Trace) -> np.ndarray:
    """Per layer: fraction of a token's experts the previous token of its sequence also used. -> [L]"""
    ex = trace.experts.astype(np.int32)
    prev, cur = ex[:-1], ex[1:]  # [T-1, L, K]
    same_seq = np.ones(len(cur), dtype=bool)
    if trace.seq_id is not None:
        same_seq = trace.seq_id[1:] == trace.seq_id[:-1]
    prev, cur = prev[same_seq], cur[same_seq]
    known = cur >= 0
    hit = (cur[:, :, :, None] == prev[:, :, None, :]).any(axis=3) & known  # [T', L, K]
    denom = known.sum(axis=(0, 2))
    return np.divide(hit.sum(axis=(0, 2)), denom, out=np.zeros(trace.num_layers), where=denom > 0)


def summary(trace: Trace) -> dict[str, object]:
    """Shape, sequence structure, per-layer entropy and reuse as a JSON-ready dict."""
    ent = layer_entropy(trace)
    reuse = reuse_between_tokens(trace)
    prefill = int((trace.is_prefill == 1).sum()) if trace.is_prefill is not None else None
    return {
        "source": trace.source,
        "tokens": trace.num_tokens,
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "top_k": trace.top_k,
        "sequences": int(np.unique(trace.seq_id).size) if trace.seq_id is not None else None,
        "prefill_tokens": prefill,
        "unknown_entries": int((trace.experts < 0).sum()),
        "max_entropy_bits": float(np.log2(trace.num_experts)),
        "entropy_bits": ent.round(4).tolist(),
        "mean_entropy_bits": float(ent.mean()),
        "reuse": reuse.round(4).tolist(),
        "mean_reuse": float(reuse.mean()),
    }
