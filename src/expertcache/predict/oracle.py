"""The oracle: predicts exactly the experts each layer will use (simulator only).

The timing simulator gives every step's true request groups (``future``, indexed by layer) to
``begin_step``; the oracle answers each target layer with that layer's group, in its first-use
order. It bounds what any predictor can gain from prefetching (ACCURACY = 1), leaving only the
transfer timing (FETCHRATE) to limit GOODPRED.
"""

from __future__ import annotations

from collections.abc import Sequence

from expertcache.predict.base import Predictor, PredictorError


class Oracle(Predictor):
    """The step's true experts of each target layer, read from the simulator's requests to come."""

    name = "oracle"
    sim_only = True

    _future: Sequence[Sequence[int]] = ()

    def _begin(self, token_ids, prefill, new_request, future) -> None:
        if future is None:
            raise PredictorError(
                "oracle is simulator-only: it reads each step's true experts, which only the simulator knows"
            )
        self._future = future

    def _predict(self, source: int, target: int, gate_input) -> list[int]:
        return [int(e) for e in self._future[target]] if target < len(self._future) else []
