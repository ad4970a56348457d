"""expertcache: expert caching for Mixture-of-Experts inference (policies, simulator, engine)."""

__version__ = "0.1.0"

from expertcache.config import (  # noqa: E402
    CacheConfig,
    HostConfig,
    LinkConfig,
    MissConfig,
    PrefetchConfig,
    SamplingConfig,
    ServeConfig,
)
from expertcache.errors import ExpertcacheError, ExpertcacheWarning, PolicyError, TraceError  # noqa: E402
from expertcache.plan import Plan  # noqa: E402
from expertcache.plugins import load_plugins, register_miss, register_policy, register_predictor  # noqa: E402
from expertcache.policy import POLICIES, PolicyContext, make_policy  # noqa: E402
from expertcache.predict import PREDICTORS, PredictContext, make_predictor  # noqa: E402
from expertcache.sim import (  # noqa: E402
    CostModel,
    build_schedule,
    default_trace,
    plan_timing,
    recorded_step_s,
    replay,
    run_policy,
    simulate,
    simulate_timing,
    step_bounds,
)
from expertcache.sim.doctor import diagnose  # noqa: E402
from expertcache.sim.planner import make_plan  # noqa: E402
from expertcache.trace import Trace, batch_requests, load_trace, synthesize  # noqa: E402


def __getattr__(name: str):
    """The engine (torch, transformers) is imported on first use, so the simulator stays light."""
    if name in ("load", "OffloadedModel"):
        from expertcache import engine

        return getattr(engine, name)
    if name == "selftest":
        from expertcache.tools.selftest import selftest

        return selftest
    if name == "profile":
        from expertcache.tools.profile import profile

        return profile
    if name == "sweep":  # the table, plots and backends load what they need when used
        from expertcache.tools.sweep import sweep

        return sweep
    raise AttributeError(f"module 'expertcache' has no attribute {name!r}")


__all__ = [
    "CacheConfig",
    "CostModel",
    "OffloadedModel",
    "POLICIES",
    "PREDICTORS",
    "Plan",
    "PredictContext",
    "PrefetchConfig",
    "ExpertcacheError",
    "ExpertcacheWarning",
    "HostConfig",
    "LinkConfig",
    "MissConfig",
    "PolicyContext",
    "PolicyError",
    "Trace",
    "SamplingConfig",
    "ServeConfig",
    "TraceError",
    "__version__",
    "batch_requests",
    "build_schedule",
    "default_trace",
    "diagnose",
    "load",
    "load_plugins",
    "load_trace",
    "make_plan",
    "make_policy",
    "make_predictor",
    "plan_timing",
    "profile",
    "register_miss",
    "register_policy",
    "recorded_step_s",
    "register_predictor",
    "replay",
    "run_policy",
    "selftest",
    "simulate",
    "simulate_timing",
    "step_bounds",
    "sweep",
    "synthesize",
]
