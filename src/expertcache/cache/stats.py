"""What the expert cache did, counted by the cache itself (the engine adds bytes and stall times).

Per phase and layer (arrays [2, L], row 1 = prefill): ``requests`` (experts the steps needed), ``misses``
(needed but not present in the primary part: not resident and not moving in), and how the misses were
served: ``host`` (computed on the host), ``low_precision`` (from a low-precision copy), ``skipped``
(not computed: lossy). Per part: demand transfers, speculative ones (prefetches; ``part_cancelled`` those
dropped before they moved) and fills, and ``part_reused``: missed experts whose part was there already
(``batch``'s stream buffer, MoEpic's buffer of bottom segments), which moved nothing. Per layer: ``filled``,
experts computed on the host and moved into the cache in the background for later steps. Per layer
(ProMoE's accounting of prefetching):
speculative transfers ``issued``, ``used`` (their layer then asked for them, and they were still there),
``late`` (still moving then), ``evicted`` (their layer asked for them, but a demand transfer of a layer in
between had taken their place: moved for nothing, then fetched again), ``cancelled``,
``skipped_prefetches`` (no evictable slot), and the prediction quality: ``actual`` experts of predicted
layer visits, ``correct`` (predicted), ``in_time`` (predicted and resident when
needed): ACCURACY = correct / actual, FETCHRATE = in_time / correct, GOODPRED = in_time / actual. In the
prefetch governor's warm-up the predictor runs in shadow (``ExpertCache.shadow``): ``shadow_guesses``,
predicted experts not present that prefetching would have moved, ``shadow_hits``, those of them the
router then chose (a demand transfer saved); the others would have been moved for nothing.
"""

from __future__ import annotations

import numpy as np

_PHASED = ("requests", "misses", "host", "low_precision", "skipped")
_LAYERED = (
    "issued", "used", "late", "evicted", "cancelled", "skipped_prefetches", "actual", "correct", "in_time",
    "filled",
)  # fmt: skip


class CacheStats:
    """Counters since the start; see the module docstring."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        for name in _PHASED:
            setattr(self, name, np.zeros((2, num_layers), dtype=np.int64))
        for name in _LAYERED:
            setattr(self, name, np.zeros(num_layers, dtype=np.int64))
        self.part_misses: dict[str, int] = {}  # demand transfers of each part
        self.part_prefetches: dict[str, int] = {}  # speculative transfers of each part queued (prefetches)
        self.part_cancelled: dict[str, int] = {}  # of those, dropped before they moved (``cancelled``)
        self.part_fills: dict[str, int] = {}  # host-computed experts moved into each part in the background
        self.part_reused: dict[str, int] = {}  # missed experts found in a part other than the primary one
        self.shadow_guesses = 0  # predicted in shadow, not present: what prefetching would have moved
        self.shadow_hits = 0  # of those, chosen by the router (and still missing then)

    @property
    def hits(self) -> int:
        return int(self.requests.sum() - self.misses.sum())

    def to_dict(self) -> dict[str, object]:
        req, miss = int(self.requests.sum()), int(self.misses.sum())
        return {
            "requests": req,
            "hits": req - miss,
            "misses": miss,
            "miss_ratio": miss / req if req else 0.0,
            "misses_by_layer": self.misses.sum(axis=0).tolist(),
            "prefill_misses": int(self.misses[1].sum()),
            "decode_misses": int(self.misses[0].sum()),
            "phases": _phases(self),
            "host_computed": int(self.host.sum()),
            "low_precision": int(self.low_precision.sum()),
            "skipped": int(self.skipped.sum()),
            "filled": int(self.filled.sum()),
            "part_misses": dict(self.part_misses),
            "part_prefetches": dict(self.part_prefetches),
            "part_cancelled": dict(self.part_cancelled),
            "part_fills": dict(self.part_fills),
            "part_reused": dict(self.part_reused),
            "prefetch_issued": int(self.issued.sum()),
            "prefetch_used": int(self.used.sum()),
            "prefetch_late": int(self.late.sum()),
            "prefetch_evicted": int(self.evicted.sum()),
            "prefetch_cancelled": int(self.cancelled.sum()),
            # landed and not used by the layer they were for: not chosen (a later step may still hit them),
            # or evicted before it (``prefetch_evicted``)
            "prefetch_unused": int(self.issued.sum() - self.used.sum() - self.cancelled.sum()),
            "prefetch_skipped": int(self.skipped_prefetches.sum()),
            "shadow_guesses": self.shadow_guesses,
            "shadow_hits": self.shadow_hits,
            **prediction_quality(self.correct, self.actual, self.in_time),
        }

    def prediction_counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of ``correct``, ``actual`` and ``in_time`` per layer: two of them taken around a run give
        its own quality (``prediction_quality`` of their differences)."""
        return self.correct.copy(), self.actual.copy(), self.in_time.copy()


def prediction_quality(correct: np.ndarray, actual: np.ndarray, in_time: np.ndarray) -> dict[str, object]:
    """ProMoE's accuracy, fetch rate and good prediction rate, overall and per layer, from the counts
    per layer (the module docstring)."""

    def ratio(a: np.ndarray, b: np.ndarray) -> float | None:  # None: nothing to measure (as per layer)
        return float(a.sum() / b.sum()) if b.sum() else None

    return {
        "accuracy": ratio(correct, actual),
        "fetchrate": ratio(in_time, correct),
        "goodpred": ratio(in_time, actual),
        "accuracy_by_layer": _per_layer(correct, actual),
        "fetchrate_by_layer": _per_layer(in_time, correct),
        "goodpred_by_layer": _per_layer(in_time, actual),
    }


def _phases(stats: CacheStats) -> dict[str, dict[str, int]]:
    """The counts per phase: ``decode`` (steps of generated tokens only) and ``prefill`` (steps holding a
    prompt token: a prompt alone, or, under continuous batching, prompt chunks beside other requests'
    generated tokens)."""
    out = {}
    for row, phase in ((0, "decode"), (1, "prefill")):
        req, miss = int(stats.requests[row].sum()), int(stats.misses[row].sum())
        out[phase] = {
            "requests": req, "hits": req - miss, "misses": miss, "host_computed": int(stats.host[row].sum()),
            "low_precision": int(stats.low_precision[row].sum()), "skipped": int(stats.skipped[row].sum()),
        }  # fmt: skip
    return out


def _per_layer(num: np.ndarray, den: np.ndarray) -> list[float | None]:
    """num / den per layer; None where a layer was never predicted (layer 0 of gate predictors)."""
    return [float(n / d) if d else None for n, d in zip(num.tolist(), den.tolist(), strict=True)]
