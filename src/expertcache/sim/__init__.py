"""Trace-driven simulation: replay routing through any policy at any capacity, OPT as the bound."""

from expertcache.cache.schedule import ORDERS, Schedule, build_schedule
from expertcache.sim.bounds import StepBounds, step_bounds
from expertcache.sim.curves import all_capacities, run_policy, with_opt
from expertcache.sim.replay import SimResult, replay
from expertcache.sim.simulate import simulate
from expertcache.sim.timing import CostModel, TimingResult, plan_timing, recorded_step_s, simulate_timing
from expertcache.trace.default import default_trace

__all__ = [
    "ORDERS",
    "CostModel",
    "TimingResult",
    "Schedule",
    "SimResult",
    "StepBounds",
    "all_capacities",
    "build_schedule",
    "default_trace",
    "plan_timing",
    "recorded_step_s",
    "replay",
    "run_policy",
    "simulate",
    "simulate_timing",
    "step_bounds",
    "with_opt",
]
