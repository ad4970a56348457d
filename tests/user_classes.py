"""A policy and a predictor written as a user would write theirs, outside the package (no registration
here: tests/test_plugins.py registers them, tests/test_replay_run.py passes the predictor as an object)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from expertcache.policy.base import Policy
from expertcache.predict.base import Predictor


class MRU(Policy):
    """A most-recently-used eviction policy, the user's own."""

    name = "users-mru"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.keys = OrderedDict()

    def __len__(self):
        return len(self.keys)

    def __contains__(self, key):
        return key in self.keys

    def on_hit(self, key):
        self.keys.move_to_end(key)

    def on_insert(self, key):
        self.keys[key] = None

    def on_evict(self, key):
        del self.keys[key]

    def victim(self, incoming, pinned):
        if len(self.keys) < self.capacity:
            return None
        return next((k for k in reversed(self.keys) if k not in pinned), None)


class LastStep(Predictor):
    """Each layer routes as it did in the step before (at each step's start: no gate input)."""

    name = "users-last-step"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.last, self.now = {}, {}

    def _begin(self, token_ids, prefill, new_request, future):
        self.last, self.now = ({} if new_request else {**self.last, **self.now}), {}

    def _observe(self, layer, experts):
        self.now[layer] = [int(x) for x in np.asarray(experts)[-1] if x >= 0]

    def _predict(self, source, target, gate_input):
        return list(self.last.get(target, []))
