"""The compiled stack passes (numba) equal the reference ones request for request: LRU's and OPT's
depths, on every order, on synthetic traces and the real one, with prefill groups larger than any
capacity; and the curves ``run_policy`` builds with them equal per-capacity replays."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache.cache.schedule import ORDERS, build_schedule
from expertcache.sim import fast, stack
from expertcache.sim.curves import misses_by_layer
from expertcache.sim.replay import replay
from expertcache.trace import synthesize
from expertcache.trace.default import default_trace

pytestmark = pytest.mark.skipif(not fast.available(), reason="numba is not installed")

TRACES = {
    "sticky": lambda: synthesize(
        "sticky", tokens=1500, layers=4, experts=8, top_k=2, seed=2, sequences=3, prompt_len=40
    ),
    "zipf": lambda: synthesize("zipf", tokens=1000, layers=3, experts=16, top_k=4, seed=5),
    "embedded": default_trace,
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(TRACES))
def test_compiled_depths_equal_the_reference(name, order):
    s = build_schedule(TRACES[name](), order)
    assert np.array_equal(fast.lru_depths(s), stack.lru_depths(s))
    assert np.array_equal(fast.opt_depths(s), stack.opt_depths(s))


def test_compiled_curves_equal_replays():
    s = build_schedule(TRACES["sticky"](), "layer")
    caps = [s.max_group, s.max_group + 3, 20, 32]
    for name, depths in (("lru", fast.lru_depths(s)), ("opt", fast.opt_depths(s))):
        curve = misses_by_layer(s, depths, caps)
        for c, per in zip(caps, curve, strict=True):
            assert per.tolist() == replay(s, name, c).layer_misses.tolist()
