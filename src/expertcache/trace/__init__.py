"""Routing traces: which experts each token used in each layer (format, loading, generators, stats)."""

from expertcache.trace.batch import batch_requests
from expertcache.trace.default import default_trace
from expertcache.trace.stats import layer_entropy, reuse_between_tokens, step_shape, summary
from expertcache.trace.synth import GENERATORS, synthesize
from expertcache.trace.trace import Trace, as_trace, load_trace

__all__ = [
    "GENERATORS",
    "Trace",
    "as_trace",
    "batch_requests",
    "default_trace",
    "layer_entropy",
    "load_trace",
    "reuse_between_tokens",
    "step_shape",
    "summary",
    "synthesize",
]
