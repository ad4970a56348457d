"""The routing of every step as a trace (``--record-trace``): what the step driver saw, in order."""

from __future__ import annotations

import numpy as np

from expertcache.errors import ExpertcacheError
from expertcache.trace.trace import Trace


class Recorder:
    """Routing of every step (for ``--record-trace``): experts, weights, token ids, phase, sequence.

    Each step's routing goes into two arrays made when it begins (experts ``[L, T, K]`` int16, weights
    float32), not two per layer: recording a decode token of a 24-layer top-8 model holds about 2.2 KB
    (6.5 KB with an array per layer), which a long session or a server with ``--record-trace`` keeps
    until it ends."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.steps: list[dict[str, object]] = []
        self.predicted = False  # some step recorded predictions
        self.reach = 0  # the most layers ahead a prediction recorded by source reached (``predict_from``)

    def begin(
        self,
        token_ids: np.ndarray,
        prefill: bool,
        seq: np.ndarray,
        prompt: np.ndarray | None = None,
        padding: np.ndarray | None = None,
    ) -> None:
        """A step of ``token_ids`` (rows flattened); ``seq`` gives each token's sequence id, ``prompt``
        which tokens are prompt tokens (None: all of them if ``prefill``, else none), ``padding`` which
        rows are a padded batch's left padding (None: none)."""
        if prompt is None:
            phase = np.full(len(token_ids), 1 if prefill else 0, dtype=np.int8)
        else:
            phase = np.asarray(prompt, dtype=np.int8)
        t, L, K = len(token_ids), self.num_layers, self.top_k
        experts, weights = np.full((L, t, K), -1, dtype=np.int16), np.zeros((L, t, K), dtype=np.float32)
        self.steps.append(
            {"token_id": token_ids, "phase": phase, "seq": seq, "done": 0, "pred": {}, "from": {},
             "experts": experts, "weights": weights, "wall": None,
             "padding": None if padding is None or not np.any(padding) else np.asarray(padding, np.int8)}
        )  # fmt: skip

    def wall(self, start: float, end: float) -> None:
        """The step's forward ran from ``start`` to ``end`` on the engine's clock (``time.perf_counter``
        seconds): the recorded run's own times, which ``timing`` and ``trace info`` set beside a replay's."""
        if self.steps:
            self.steps[-1]["wall"] = (start, end)

    def predict(self, predictions: dict[int, list[int]]) -> None:
        """What the predictor said this step: target layer -> ranked experts."""
        if self.steps and predictions:
            self.steps[-1]["pred"].update(predictions)
            self.predicted = True

    def predict_from(self, source: int, predictions: dict[int, list[int]]) -> None:
        """What the predictor said at layer ``source`` this step, before the prefetch walked it, for a
        predictor that predicts a layer from several earlier ones (HOBBIT's ``adaptive``): replayed at
        the same layers, the simulator's walk then decides as the engine's did."""
        if self.steps and predictions:
            mine = self.steps[-1]["from"]
            for target, ranked in predictions.items():
                mine[target, target - source] = ranked
                self.reach = max(self.reach, target - source)

    def add(self, layer: int, index: np.ndarray, weights: np.ndarray | None) -> None:
        """Layer ``layer`` routed the step's tokens: experts [T, K] and their gate weights [T, K]."""
        step = self.steps[-1]
        step["experts"][layer] = index
        if weights is not None:
            step["weights"][layer] = weights
        step["done"] |= 1 << layer  # the layers routed, as bits

    def trace(self, meta: dict[str, object] | None = None) -> Trace:
        L, K = self.num_layers, self.top_k
        ex, wt, tok, pf, seq, step, pred, by_source = [], [], [], [], [], [], [], []
        # a step interrupted before its last layer (Ctrl-C, or a forward that raised: bad input to generate)
        # is dropped, wherever it is: the run went on without it (it left a request of unknown experts)
        steps = [s for s in self.steps if s["done"] == (1 << L) - 1]
        timed = bool(steps) and all(s["wall"] is not None for s in steps)  # every step's, or none
        origin = steps[0]["wall"][0] if timed else 0.0
        padded = any(s["padding"] is not None for s in steps)
        for i, s in enumerate(steps):
            t = len(s["token_id"])
            p = np.full((t, L, K), -1, dtype=np.int16)
            for layer, ranked in s["pred"].items():  # the step's ranked list, spread over its rows
                p[:, layer] = _rows(ranked, t, K)
            pred.append(p)
            if self.reach:
                f = np.full((t, L, self.reach, K), -1, dtype=np.int16)
                for (layer, d), ranked in s["from"].items():
                    f[:, layer, d - 1] = _rows(ranked, t, K)
                by_source.append(f)
            ex.append(s["experts"].transpose(1, 0, 2))
            wt.append(s["weights"].transpose(1, 0, 2))
            tok.append(s["token_id"])
            pf.append(s["phase"])
            seq.append(s["seq"])
            step.append(np.full(t, i, dtype=np.int32))
        if not ex:
            raise ExpertcacheError("nothing was generated yet: the trace is empty")
        return Trace(
            experts=np.concatenate(ex),
            num_experts=self.num_experts,
            weights=np.concatenate(wt),
            seq_id=np.concatenate(seq),
            is_prefill=np.concatenate(pf),
            token_id=np.concatenate(tok).astype(np.int32),
            step_id=np.concatenate(step),
            predicted=np.concatenate(pred) if self.predicted else None,
            predicted_from=np.concatenate(by_source) if self.reach else None,
            step_start_s=_walls(steps, 0, origin) if timed else None,
            step_end_s=_walls(steps, 1, origin) if timed else None,
            padding=_padding(steps) if padded else None,
            meta=dict(meta or {}),
        )


def _walls(steps: list[dict[str, object]], which: int, origin: float) -> np.ndarray:
    """Each token's step's start (``which`` 0) or end (1), seconds from ``origin``, float64 ``[T]``."""
    return np.concatenate(
        [np.full(len(s["token_id"]), s["wall"][which] - origin, dtype=np.float64) for s in steps]
    )


def _padding(steps: list[dict[str, object]]) -> np.ndarray:
    """Each token's padding flag (1: left padding), int8 ``[T]``."""
    return np.concatenate(
        [np.zeros(len(s["token_id"]), np.int8) if s["padding"] is None else s["padding"] for s in steps]
    )


def _rows(ranked: list[int], t: int, k: int) -> np.ndarray:
    """A step's ranked list spread row after row over its ``t`` rows of ``k`` (-1 padding), ``[t, k]``."""
    block = np.full(t * k, -1, dtype=np.int16)
    flat = ranked[: t * k]
    block[: len(flat)] = flat
    return block.reshape(t, k)
