"""Golden miss counts on the real Qwen trace: every registered policy, every order, seed 0.

The numbers live in tests/golden/qwen_misses.json, written by ``python tests/golden/regenerate.py``;
this test recomputes them through the same plan() and compute() and compares. A difference means
results changed: if on purpose, regenerate and say why in the commit; if not, it is a regression.
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

from expertcache.cache.schedule import Schedule
from expertcache.policy import POLICIES
from expertcache.sim import ORDERS, build_schedule
from expertcache.trace import load_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "qwen15_moe_a27b_chat.npz"
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
GOLDEN = json.loads((GOLDEN_DIR / "qwen_misses.json").read_text())


def _load_regenerate() -> ModuleType:
    """tests/golden/regenerate.py as a module (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("golden_regenerate", GOLDEN_DIR / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


regen = _load_regenerate()
needs_trace = pytest.mark.skipif(
    not TRACE.is_file(),
    reason=f"real trace not found at {TRACE} (the shared/ directory beside the repository)",
)


@cache
def _schedule(order: str) -> Schedule:
    return build_schedule(load_trace(TRACE), order)


def test_golden_covers_every_policy_and_order() -> None:
    """A new policy or order needs new golden numbers (regenerate)."""
    assert sorted(GOLDEN["misses"]) == sorted(ORDERS)
    for order in ORDERS:
        assert sorted(GOLDEN["misses"][order]) == sorted(POLICIES), order
    header = GOLDEN["header"]
    assert header["seed"] == regen.SEED
    assert header["capacities"] == regen.CAPACITIES
    assert header["reduced_capacities"] == regen.REDUCED_CAPACITIES
    assert header["generated_by"] == "python tests/golden/regenerate.py"


@needs_trace
def test_golden_trace_is_the_recorded_one() -> None:
    header = GOLDEN["header"]
    assert regen.sha256(TRACE) == header["trace_sha256"], (
        "the shared trace changed: regenerate the golden file"
    )
    trace = load_trace(TRACE)
    shape = header["trace_shape"]
    assert (trace.num_tokens, trace.num_layers, trace.num_experts, trace.top_k) == (
        shape["tokens"],
        shape["layers"],
        shape["experts"],
        shape["top_k"],
    )


@needs_trace
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(POLICIES))
def test_golden_misses(order: str, name: str) -> None:
    schedule = _schedule(order)
    want = GOLDEN["misses"][order][name]
    assert [int(c) for c in want] == regen.plan(schedule, name), "capacity plan changed: regenerate"
    assert regen.compute(schedule, name) == want


@needs_trace
@pytest.mark.parametrize("order", ORDERS)
def test_golden_numbers_are_consistent(order: str) -> None:
    """Sanity of the recorded numbers themselves: compulsory misses at full capacity, OPT at or below
    every policy where groups are whole, misses non-increasing in capacity for lru and opt."""
    schedule = _schedule(order)
    table = GOLDEN["misses"][order]
    keys = schedule.num_layers * schedule.num_experts
    requests = schedule.num_requests
    for name, row in table.items():
        assert all(0 < m <= requests for m in row.values()), name
        if str(keys) in row:
            assert row[str(keys)] == keys, name  # every key resident: first uses only
    for name in ("lru", "opt", "lru-dist", "opt-dist"):
        misses = list(table[name].values())
        assert misses == sorted(misses, reverse=True), name
    for name, row in table.items():
        for cap, m in row.items():
            room = int(cap) // (schedule.num_layers if name.endswith("-dist") else 1)
            if room >= schedule.max_group and cap in table["opt"]:  # no group split into chunks
                assert m >= table["opt"][cap], (name, cap)
