"""Regenerate tests/golden/qwen_misses.json: misses of every registered policy on the real Qwen trace.

    python tests/golden/regenerate.py

For every policy in ``expertcache.policy.POLICIES`` (online and offline, -dist included) and every order
(layer, flat, rounds), the misses at a set of capacities with seed 0, computed with
``expertcache.sim.run_policy`` on ``shared/traces/qwen15_moe_a27b_chat.npz`` (the ``shared/`` directory
beside the repository root). tests/test_golden.py recomputes the same matrix through ``plan()`` and
``compute()`` below and compares. Regenerate only after a deliberate change of results, and say why in
the commit.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from expertcache.cache.schedule import Schedule
from expertcache.policy import POLICIES
from expertcache.sim import ORDERS, build_schedule, run_policy
from expertcache.trace import Trace, load_trace

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TRACE = REPO.parent / "shared" / "traces" / "qwen15_moe_a27b_chat.npz"
GOLDEN = HERE / "qwen_misses.json"

SEED = 0
CAPACITIES = [4, 24, 60, 120, 240, 480, 960, 1440]
# The slow replayed policies get fewer capacities, so that the whole matrix (and the test) stays near
# 30 s on one core: lru and opt take one stack pass for all capacities, fifo and the lru, fifo and opt
# -dist policies replay quickly.
FULL = ("lru", "fifo", "opt", "lru-dist", "fifo-dist", "opt-dist")
REDUCED_CAPACITIES = [24, 240, 960]


def min_capacity(schedule: Schedule, name: str) -> int:
    """A layer's room must hold one token's experts of that layer (top-k in layer order, 1 otherwise);
    a -dist policy splits the capacity into per-layer budgets, so it needs L times that."""
    room = schedule.top_k if schedule.order == "layer" else 1
    return room * (schedule.num_layers if name.endswith("-dist") else 1)


def plan(schedule: Schedule, name: str) -> list[int]:
    """The capacities recorded for one policy in one order."""
    caps = CAPACITIES if name in FULL else REDUCED_CAPACITIES
    return [c for c in caps if c >= min_capacity(schedule, name)]


def compute(schedule: Schedule, name: str) -> dict[str, int]:
    """{capacity: misses} for one policy over plan(schedule, name)."""
    results = run_policy(schedule, name, plan(schedule, name), SEED)
    return {str(r.capacity): r.misses for r in results}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "src"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() + (" (src/ modified)" if dirty.stdout.strip() else "")


def header(trace: Trace) -> dict[str, object]:
    from importlib.metadata import version

    return {
        "description": "Misses of every registered policy on the real Qwen1.5-MoE trace, per order and "
        "capacity (capacity in experts), from expertcache.sim.run_policy with the given seed.",
        "generated_by": "python tests/golden/regenerate.py",
        "compared_by": "tests/test_golden.py",
        "trace": "shared/traces/qwen15_moe_a27b_chat.npz (beside the repository root)",
        "trace_sha256": sha256(TRACE),
        "trace_shape": {
            "tokens": trace.num_tokens,
            "layers": trace.num_layers,
            "experts": trace.num_experts,
            "top_k": trace.top_k,
        },
        "seed": SEED,
        "orders": list(ORDERS),
        "policies": list(POLICIES),
        "capacities": CAPACITIES,
        "full_capacity_policies": list(FULL),
        "reduced_capacities": REDUCED_CAPACITIES,
        "notes": [
            f"policies other than {', '.join(FULL)} are recorded at capacities {REDUCED_CAPACITIES} only, "
            "to keep the computation (and tests/test_golden.py) near 30 s",
            "capacities below a policy's minimum are left out: top-k (4) in layer order; for -dist "
            "policies one room per layer, i.e. capacity >= L = 24 in flat and rounds order and "
            ">= L * top-k = 96 in layer order",
            "lru and opt come from one stack-distance pass for capacities >= the largest group, "
            "replays below it (run_policy)",
        ],
        "expertcache_version": version("expertcache"),
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def dumps(obj: object, indent: int = 0) -> str:
    """JSON that keeps every list or object fitting in 120 characters on one line."""
    flat = json.dumps(obj)
    if indent + len(flat) <= 120 or not isinstance(obj, dict | list):
        return flat
    pad = " " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + dumps(v, indent + 1) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def main() -> int:
    if not TRACE.is_file():
        print(f"real trace not found at {TRACE}", file=sys.stderr)
        return 1
    trace = load_trace(TRACE)
    start = time.perf_counter()
    misses: dict[str, dict[str, dict[str, int]]] = {}
    for order in ORDERS:
        schedule = build_schedule(trace, order)
        misses[order] = {name: compute(schedule, name) for name in POLICIES}
    elapsed = time.perf_counter() - start
    doc = {"header": header(trace), "misses": misses}
    GOLDEN.write_text(dumps(doc) + "\n")
    print(f"wrote {GOLDEN.relative_to(REPO)} ({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
