"""The simulator's entry point: trace x policies x capacities x order -> results, OPT included."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from expertcache.policy.registry import min_capacity, parse_policy
from expertcache.sim.curves import all_capacities, run_policy, with_opt
from expertcache.sim.replay import SimResult
from expertcache.sim.schedule import build_schedule
from expertcache.trace.synth import sticky
from expertcache.trace.trace import Trace, load_trace

DEFAULT_POLICIES = ("opt", "lru", "lru-dist", "llru", "lcp", "lfu", "marking", "fifo", "static")


DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "data" / "default_trace.npz"


def default_trace() -> Trace:
    """The embedded default: the routing of the embedded model (6 layers, 16 experts, top-2) on 16
    prompts from held-out standard-library files, recorded by ``tools/record_default_trace.py``."""
    return load_trace(DEFAULT_TRACE)


def synthetic_trace() -> Trace:
    """A seeded sticky-Zipf trace of Mixtral's shape (L=32, E=8, K=2): 8 requests of 32 prompt and
    224 generated tokens (the default of earlier versions)."""
    return sticky(
        tokens=2048,
        layers=32,
        experts=8,
        top_k=2,
        a=1.0,
        stickiness=0.3,
        seed=0,
        sequences=8,
        prompt_len=32,
    )


def simulate(
    trace: Trace,
    policies: Sequence[str] = DEFAULT_POLICIES,
    capacities: Sequence[int] | str = "all",
    order: str = "layer",
    seed: int = 0,
    skip_infeasible: bool = False,
    jobs: int = 1,
) -> list[SimResult]:
    """Replay ``trace`` through every policy ('name' or 'name:k=v,...') at every capacity ('all' =
    1..L*E); each result carries OPT's misses at its capacity. With ``skip_infeasible``, capacities a
    policy cannot run with (below one slot per layer for -dist) are left out instead of raising.
    ``jobs`` > 1 replays capacities on that many processes."""
    schedule = build_schedule(trace, order)
    caps = all_capacities(schedule) if capacities == "all" else [int(c) for c in capacities]
    results: list[SimResult] = []
    for spec in policies:
        name, params = parse_policy(spec)
        low = min_capacity(name, trace.num_layers, params, schedule.min_room)
        mine = [c for c in caps if c >= low] if skip_infeasible else caps
        results += run_policy(schedule, name, mine, seed, params, jobs) if mine else []
    return with_opt(schedule, results)
