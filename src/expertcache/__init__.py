"""expertcache: expert caching for Mixture-of-Experts inference (policies, simulator, engine)."""

__version__ = "0.1.0"

from expertcache.errors import ExpertcacheError, PolicyError, TraceError  # noqa: E402
from expertcache.policy import POLICIES, PolicyContext, make_policy  # noqa: E402
from expertcache.sim import build_schedule, default_trace, replay, run_policy, simulate  # noqa: E402
from expertcache.trace import Trace, load_trace, synthesize  # noqa: E402


def __getattr__(name: str):
    """The engine (torch, transformers) is imported on first use, so the simulator stays light."""
    if name in ("load", "OffloadedModel"):
        from expertcache import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'expertcache' has no attribute {name!r}")


__all__ = [
    "OffloadedModel",
    "POLICIES",
    "ExpertcacheError",
    "PolicyContext",
    "PolicyError",
    "Trace",
    "TraceError",
    "__version__",
    "build_schedule",
    "default_trace",
    "load",
    "load_trace",
    "make_policy",
    "replay",
    "run_policy",
    "simulate",
    "synthesize",
]
