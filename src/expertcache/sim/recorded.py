"""Predictions the simulator can make: trace-based predictors by name, gate-input ones replayed.

Gate-input predictors (``next-gate``, ``window``, ``learned``) need the model's hidden states, which a
trace does not hold; the engine records what they predicted into the trace (``predicted``), and
``Recorded`` replays it where the original issued it (an adaptive predictor's at each layer it predicted
from, ``predicted_from``). Trace-based predictors (``token``, ``eam``) and ``oracle`` run directly.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from expertcache.errors import option
from expertcache.predict.base import PredictContext, Predictor, PredictorError
from expertcache.predict.registry import PREDICTORS, predictor_class
from expertcache.trace.trace import Trace


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

    def __init__(
        self,
        ctx: PredictContext,
        predicted: np.ndarray,
        needs_model: bool = True,
        predicted_from: np.ndarray | None = None,
    ) -> None:
        super().__init__(ctx)
        self.predicted = predicted  # [T, L, K]
        self.needs_model = needs_model  # type: ignore[misc]  # as the recorded predictor
        # [T, L, W, K]: what an adaptive predictor said of each layer at each of the W before it; replayed
        # at the same layers and walked by the driver as the engine's were (HOBBIT's ``adaptive``)
        self.predicted_from = predicted_from
        if predicted_from is not None:
            self.adaptive = True  # type: ignore[misc]
            self.window = predicted_from.shape[2]
        self._rows = slice(0, 0)

    def _begin(self, token_ids, prefill, new_request, future) -> None:
        start = self._rows.stop
        self._rows = slice(start, start + len(token_ids))

    def after_router(self, layer: int, experts: np.ndarray, gate_input=None):
        if self.predicted_from is None:
            return super().after_router(layer, experts, gate_input)
        targets = range(layer + 1, min(layer + self.window, self.num_layers - 1) + 1)
        return self._targets(layer, targets, gate_input)

    def _predict(self, source: int, target: int, gate_input) -> list[int]:
        if self.predicted_from is not None:
            flat = self.predicted_from[self._rows, target, target - source - 1].reshape(-1).tolist()
        else:
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
    if data is None and spec != Recorded.name and not predictor_class(spec).needs_model:
        if spec == "token":  # its table from the simulated trace itself would read the future
            raise PredictorError(
                "predictor 'token' needs a recorded trace to count from "
                f"({option('--predictor TRACE.npz', 'predictor_trace=TRACE')}), another run than the one "
                "simulated; passing the simulated trace itself gives an in-sample bound"
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
        if spec == Recorded.name:  # nothing to replay: the run did not prefetch
            why = (
                "a batched trace (trace batch) holds none: the steps it lays out are not the ones its run "
                "predicted in; replay it without prefetching, or with a predictor the simulator runs"
                if "batched_from" in trace.meta
                else "its run did not prefetch: replay it without prefetching"
            )
            raise PredictorError(
                f"{trace.source}: prefetch 'recorded' replays the predictions an engine recorded into the "
                f"trace, and this trace has none ({why})"
            )
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
    # where its predictions were made: the start of each step (trace-based ones), or after a router (those
    # of the model's gate inputs); a predictor unknown here (the user's own) as the run recorded it
    needs_model = original.needs_model if original is not None else trace.meta.get("predictor_needs_model")
    replayed = Recorded(ctx, trace.predicted, bool(needs_model) if needs_model is not None else True,
                        trace.predicted_from)  # fmt: skip
    notes = []
    if spec != Recorded.name:  # asked by name: where the run predicted in some steps only, said
        steps = trace.step_id if trace.step_id is not None else np.arange(trace.num_tokens)
        made = (trace.predicted >= 0).reshape(trace.num_tokens, -1).any(axis=1)
        some, every = len(np.unique(steps[made])), len(np.unique(steps))
        if some < every:
            notes.append(
                f"{trace.source} holds {recorded}'s predictions for {some} of {every} steps (its run "
                f"predicted in those alone: the prefetch governor's, or a predictor that came late): the "
                f"replay prefetches in those steps alone, not in every one"
            )
    if original is not None and original.adaptive and trace.predicted_from is None:
        notes.append(
            f"{trace.source} holds {recorded}'s predictions without the layers it made them at (its "
            "predictor ran on a thread of its own, or an older expertcache recorded it): replayed as a "
            "window predictor's, so the counts approximate the run's"
        )
    replayed.note = "; ".join(notes) or replayed.note
    return replayed
