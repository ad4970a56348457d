"""Routing traces: which experts each token used in each layer (format, loading, generators, stats)."""

from expertcache.trace.default import default_trace
from expertcache.trace.stats import layer_entropy, reuse_between_tokens, summary
from expertcache.trace.synth import GENERATORS, synthesize
from expertcache.trace.trace import Trace, load_trace

__all__ = [
    "GENERATORS",
    "Trace",
    "default_trace",
    "layer_entropy",
    "load_trace",
    "reuse_between_tokens",
    "summary",
    "synthesize",
]
