"""Regenerate the golden miss counts in tests/golden/: misses of every registered policy, per trace.

    python tests/golden/regenerate.py              # every golden set whose trace is present
    python tests/golden/regenerate.py embedded     # only the named set(s)

Each golden set (``GOLDEN_SETS`` below) names a trace, its capacities and its output file:

- ``embedded`` -> embedded_misses.json: the routing recorded from the embedded model, checked in as
  ``src/expertcache/data/default_trace.npz`` (``expertcache.trace.default_trace()``), its first
  ``EMBEDDED_PROMPTS`` prompts; always available, so these numbers are checked everywhere (CI included).
- ``qwen`` -> qwen_misses.json: the real Qwen1.5-MoE trace ``shared/traces/qwen15_moe_a27b_chat.npz``
  (the ``shared/`` directory beside the repository root); skipped, with a line on stderr, without it.

For every policy in ``expertcache.policy.POLICIES`` (online and offline, -dist included) and every order
(layer, flat, rounds), the misses at the set's capacities with seed 0, computed with
``expertcache.sim.run_policy``. tests/test_golden.py recomputes the same matrices through ``plan()`` and
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
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from expertcache.cache.schedule import Schedule
from expertcache.policy import POLICIES
from expertcache.sim import ORDERS, build_schedule, run_policy
from expertcache.trace import Trace, default_trace, load_trace
from expertcache.trace.default import DEFAULT_TRACE

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SEED = 0


@dataclass(frozen=True)
class GoldenSet:
    """One golden file: which trace, which capacities, where the numbers go."""

    name: str
    trace_path: Path  # the file whose sha256 the header records
    trace_label: str  # how the header names the trace
    load: Callable[[], Trace]  # the trace the numbers are computed on
    capacities: list[int]
    # Policies recorded at every capacity (None: all of them); the others at reduced_capacities only.
    full: tuple[str, ...] | None
    reduced_capacities: list[int]
    output: Path
    description: str
    budget_note: str  # why the matrix has the size it has

    def available(self) -> bool:
        return self.trace_path.is_file()

    def full_policies(self) -> list[str]:
        return list(POLICIES) if self.full is None else list(self.full)


def first_prompts(trace: Trace, n: int) -> Trace:
    """The tokens of the first ``n`` sequences (prompts) of a trace whose sequences follow each other."""
    if trace.seq_id is None or not bool(np.all(np.diff(trace.seq_id) >= 0)):
        raise ValueError(f"{trace.source}: no seq_id, or sequences interleave")
    end = int(np.searchsorted(trace.seq_id, n))
    kwargs = {f.name: getattr(trace, f.name) for f in fields(trace)}
    for key, value in kwargs.items():
        if isinstance(value, np.ndarray) and value.ndim >= 1 and len(value) == trace.num_tokens:
            kwargs[key] = value[:end]
    return Trace(**kwargs)


QWEN_TRACE = REPO.parent / "shared" / "traces" / "qwen15_moe_a27b_chat.npz"
# The slow replayed policies get fewer capacities, so that the whole matrix (and the test) stays near
# 30 s on one core: lru and opt take one stack pass for all capacities, fifo and the lru, fifo and opt
# -dist policies replay quickly.
QWEN = GoldenSet(
    name="qwen",
    trace_path=QWEN_TRACE,
    trace_label="shared/traces/qwen15_moe_a27b_chat.npz (beside the repository root)",
    load=lambda: load_trace(QWEN_TRACE),
    capacities=[4, 24, 60, 120, 240, 480, 960, 1440],
    full=("lru", "fifo", "opt", "lru-dist", "fifo-dist", "opt-dist"),
    reduced_capacities=[24, 240, 960],
    output=HERE / "qwen_misses.json",
    description="Misses of every registered policy on the real Qwen1.5-MoE trace, per order and "
    "capacity (capacity in experts), from expertcache.sim.run_policy with the given seed.",
    budget_note="to keep the computation (and tests/test_golden.py) near 30 s",
)

# The whole embedded trace (16 prompts, 5192 tokens) takes close to a minute for this matrix (eam and
# hobbit replay slowly, and no capacity plan brings it near 10 s); its first 2 prompts (640 tokens, 7680
# requests per order) take about 6 s for every policy at every capacity.
EMBEDDED_PROMPTS = 2
EMBEDDED = GoldenSet(
    name="embedded",
    trace_path=DEFAULT_TRACE,
    trace_label=f"src/expertcache/data/default_trace.npz (expertcache.trace.default_trace()), "
    f"its first {EMBEDDED_PROMPTS} prompts",
    load=lambda: first_prompts(default_trace(), EMBEDDED_PROMPTS),
    capacities=[2, 4, 8, 12, 24, 48, 72, 96],
    full=None,
    reduced_capacities=[],
    output=HERE / "embedded_misses.json",
    description="Misses of every registered policy on the embedded model's recorded routing (the "
    "checked-in default trace, its first prompts), per order and capacity (capacity in experts), from "
    "expertcache.sim.run_policy with the given seed.",
    budget_note=f"only the trace's first {EMBEDDED_PROMPTS} prompts are replayed, to keep the "
    "computation (and tests/test_golden.py) near 6 s",
)

GOLDEN_SETS = {g.name: g for g in (EMBEDDED, QWEN)}


def min_capacity(schedule: Schedule, name: str) -> int:
    """A layer's room must hold one token's experts of that layer (top-k in layer order, 1 otherwise);
    a -dist policy splits the capacity into per-layer budgets, so it needs L times that."""
    room = schedule.top_k if schedule.order == "layer" else 1
    return room * (schedule.num_layers if name.endswith("-dist") else 1)


def plan(golden: GoldenSet, schedule: Schedule, name: str) -> list[int]:
    """The capacities recorded for one policy in one order."""
    caps = golden.capacities if name in golden.full_policies() else golden.reduced_capacities
    return [c for c in caps if c >= min_capacity(schedule, name)]


def compute(golden: GoldenSet, schedule: Schedule, name: str) -> dict[str, int]:
    """{capacity: misses} for one policy over plan(golden, schedule, name)."""
    results = run_policy(schedule, name, plan(golden, schedule, name), SEED)
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


def notes(golden: GoldenSet, trace: Trace) -> list[str]:
    full = golden.full_policies()
    L, K = trace.num_layers, trace.top_k
    first = (
        f"policies other than {', '.join(full)} are recorded at capacities {golden.reduced_capacities} "
        f"only, {golden.budget_note}"
        if len(full) < len(POLICIES)
        else f"every policy is recorded at every capacity; {golden.budget_note}"
    )
    return [
        first,
        f"capacities below a policy's minimum are left out: top-k ({K}) in layer order; for -dist "
        f"policies one room per layer, i.e. capacity >= L = {L} in flat and rounds order and "
        f">= L * top-k = {L * K} in layer order",
        "lru and opt come from one stack-distance pass for capacities >= the largest group, "
        "replays below it (run_policy)",
    ]


def header(golden: GoldenSet, trace: Trace) -> dict[str, object]:
    from importlib.metadata import version

    return {
        "description": golden.description,
        "generated_by": "python tests/golden/regenerate.py",
        "compared_by": "tests/test_golden.py",
        "trace": golden.trace_label,
        "trace_sha256": sha256(golden.trace_path),
        "trace_shape": {
            "tokens": trace.num_tokens,
            "layers": trace.num_layers,
            "experts": trace.num_experts,
            "top_k": trace.top_k,
        },
        "seed": SEED,
        "orders": list(ORDERS),
        "policies": list(POLICIES),
        "capacities": golden.capacities,
        "full_capacity_policies": golden.full_policies(),
        "reduced_capacities": golden.reduced_capacities,
        "notes": notes(golden, trace),
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


def regenerate(golden: GoldenSet) -> float:
    """Compute one golden set and write its file; returns the seconds the matrix took."""
    trace = golden.load()
    start = time.perf_counter()
    misses: dict[str, dict[str, dict[str, int]]] = {}
    for order in ORDERS:
        schedule = build_schedule(trace, order)
        misses[order] = {name: compute(golden, schedule, name) for name in POLICIES}
    elapsed = time.perf_counter() - start
    doc = {"header": header(golden, trace), "misses": misses}
    golden.output.write_text(dumps(doc) + "\n")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    unknown = [n for n in names if n not in GOLDEN_SETS]
    if unknown:
        print(
            f"unknown golden set(s) {', '.join(unknown)}; choose from {', '.join(GOLDEN_SETS)}",
            file=sys.stderr,
        )
        return 2
    for golden in [GOLDEN_SETS[n] for n in names] or GOLDEN_SETS.values():
        if not golden.available():
            print(f"{golden.name}: trace not found at {golden.trace_path}, not regenerated", file=sys.stderr)
            if names:
                return 1
            continue
        elapsed = regenerate(golden)
        print(f"wrote {golden.output.relative_to(REPO)} ({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
