"""Golden miss counts: every registered policy, every order, seed 0, on each golden set's trace.

Two golden sets (``GOLDEN_SETS`` in tests/golden/regenerate.py), both written by
``python tests/golden/regenerate.py``:

- ``embedded``: tests/golden/embedded_misses.json, on the checked-in trace of the embedded model
  (``expertcache.trace.default_trace()``, its first prompts); always runs, CI included.
- ``qwen``: tests/golden/qwen_misses.json, on the real Qwen trace in ``shared/`` beside the repository;
  its tests skip when that trace is absent.

This test recomputes each set through the same plan() and compute() and compares. A difference means
results changed: if on purpose, regenerate and say why in the commit; if not, it is a regression.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from expertcache.cache.schedule import Schedule
from expertcache.policy import POLICIES
from expertcache.sim import ORDERS, build_schedule

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


def _load_regenerate() -> ModuleType:
    """tests/golden/regenerate.py as a module (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("golden_regenerate", GOLDEN_DIR / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


regen = _load_regenerate()
SETS = list(regen.GOLDEN_SETS)


def _needing_trace(name: str) -> Any:
    """The set's name as a parameter, skipped when the set's trace file is absent."""
    golden = regen.GOLDEN_SETS[name]
    skip = pytest.mark.skipif(
        not golden.available(), reason=f"{name}: trace not found at {golden.trace_path}"
    )
    return pytest.param(name, marks=skip, id=name)


WITH_TRACE = [_needing_trace(name) for name in SETS]


@cache
def _golden(name: str) -> dict[str, Any]:
    return json.loads(regen.GOLDEN_SETS[name].output.read_text())


@cache
def _schedule(name: str, order: str) -> Schedule:
    return build_schedule(regen.GOLDEN_SETS[name].load(), order)


def test_embedded_set_always_runs() -> None:
    """The embedded set is what runs without shared/ (CI): its trace ships in the package, and its
    capacities reach every key, so the compulsory-miss check below applies to it."""
    golden = regen.GOLDEN_SETS["embedded"]
    assert golden.available(), golden.trace_path
    assert golden.load().num_keys in golden.capacities


@pytest.mark.parametrize("name", SETS)
def test_golden_covers_every_policy_and_order(name: str) -> None:
    """A new policy or order needs new golden numbers (regenerate)."""
    golden, doc = regen.GOLDEN_SETS[name], _golden(name)
    assert sorted(doc["misses"]) == sorted(ORDERS)
    for order in ORDERS:
        assert sorted(doc["misses"][order]) == sorted(POLICIES), order
    header = doc["header"]
    assert header["seed"] == regen.SEED
    assert header["capacities"] == golden.capacities
    assert header["full_capacity_policies"] == golden.full_policies()
    assert header["reduced_capacities"] == golden.reduced_capacities
    assert header["generated_by"] == "python tests/golden/regenerate.py"


@pytest.mark.parametrize("name", WITH_TRACE)
def test_golden_trace_is_the_recorded_one(name: str) -> None:
    golden, header = regen.GOLDEN_SETS[name], _golden(name)["header"]
    assert regen.sha256(golden.trace_path) == header["trace_sha256"], (
        f"{golden.trace_path} changed: regenerate the golden file"
    )
    trace = golden.load()
    shape = header["trace_shape"]
    assert (trace.num_tokens, trace.num_layers, trace.num_experts, trace.top_k) == (
        shape["tokens"],
        shape["layers"],
        shape["experts"],
        shape["top_k"],
    )


@pytest.mark.parametrize("name", WITH_TRACE)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_golden_misses(name: str, order: str, policy: str) -> None:
    golden, schedule = regen.GOLDEN_SETS[name], _schedule(name, order)
    want = _golden(name)["misses"][order][policy]
    assert [int(c) for c in want] == regen.plan(golden, schedule, policy), "capacity plan changed: regenerate"
    assert regen.compute(golden, schedule, policy) == want


@pytest.mark.parametrize("name", WITH_TRACE)
@pytest.mark.parametrize("order", ORDERS)
def test_golden_numbers_are_consistent(name: str, order: str) -> None:
    """Sanity of the recorded numbers themselves: compulsory misses at full capacity, OPT at or below
    every policy where groups are whole, misses non-increasing in capacity for lru and opt."""
    schedule = _schedule(name, order)
    table = _golden(name)["misses"][order]
    keys = schedule.num_layers * schedule.num_experts
    requests = schedule.num_requests
    for policy, row in table.items():
        assert all(0 < m <= requests for m in row.values()), policy
        if str(keys) in row:
            assert row[str(keys)] == keys, policy  # every key resident: first uses only
    for policy in ("lru", "opt", "lru-dist", "opt-dist"):
        misses = list(table[policy].values())
        assert misses == sorted(misses, reverse=True), policy
    for policy, row in table.items():
        for cap, m in row.items():
            room = int(cap) // (schedule.num_layers if policy.endswith("-dist") else 1)
            if room >= schedule.max_group and cap in table["opt"]:  # no group split into chunks
                assert m >= table["opt"][cap], (policy, cap)
