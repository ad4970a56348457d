"""Skip-based prediction: a layer's gate input through a later layer's router.

``next-gate`` feeds layer i's gate input to layer i+1's router (Mixtral-offloading, MoEpic, Fate);
``window`` feeds it to layer i+k's (ProMoE's sliding-window skip, Sec. 4); ``adaptive`` to each of the
next p layers' routers, and the prefetch walks them forward while their experts are cached, stopping at
the first layer with a miss (HOBBIT's layer-adaptive prefetch). The routers are the
model's own, called without hooks, so the predicted experts are what layer i+k would choose if its
input were layer i's. Engine only: the simulator replays predictions recorded by the engine.
"""

from __future__ import annotations

import numpy as np

from expertcache.predict.base import PredictContext, Predictor, PredictorError, rank_union


class NextGate(Predictor):
    """Layer i-k's gate input through layer i's router (k = the window, 1 by default)."""

    name = "next-gate"
    needs_model = True
    default_window = 1

    def __init__(self, ctx: PredictContext) -> None:
        super().__init__(ctx)
        if ctx.routers is None or len(ctx.routers) != ctx.num_layers:
            raise PredictorError(f"predictor {self.name!r} needs the model's routers (engine only)")
        self.routers = ctx.routers

    def _predict(self, source: int, target: int, gate_input) -> list[int]:
        if gate_input is None:
            return []
        import torch  # the engine's predictor: the simulator imports this module without torch

        with torch.no_grad():
            index = self.routers[target](gate_input)
        return rank_union(np.asarray(index.detach().to("cpu").numpy()))


class Window(NextGate):
    """The same, k layers ahead: ProMoE's sliding-window skip prediction (default k = 2)."""

    name = "window"
    default_window = 2


class Adaptive(NextGate):
    """HOBBIT's layer-adaptive prefetch: the next p layers' routers on this gate input (default p = 3).

    Their predictions are walked forward while their experts are already cached, up to the first layer
    with a miss."""

    name = "adaptive"
    default_window = 3
    adaptive = True  # the step driver keeps the targets up to the first one with a missing expert

    def after_router(self, layer: int, experts, gate_input=None):
        self._observe(layer, experts)
        targets = [t for t in range(layer + 1, layer + self.window + 1) if t < self.num_layers]
        return self._targets(layer, targets, gate_input)
