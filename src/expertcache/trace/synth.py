"""Seeded synthetic routing traces.

- ``zipf``: each layer draws its K experts without replacement from p_j ~ 1/(j+b)^a (the LLRU paper,
  Sec. 5.1); the popularity ranking is shuffled per layer so that layers differ.
- ``uniform``: every expert equally likely (``zipf`` with a = 0).
- ``sticky``: Zipf draws with temporal locality: with probability ``stickiness`` a layer repeats the
  previous token's experts.
- ``cyclic``: the LLRU paper, Thm 3.3: round i uses expert i mod E in every layer (K = 1). With capacity
  L*E - 1 LRU misses every request while OPT misses about once per capacity.
- ``partition``: the LLRU paper, Thm 3.1: every layer uses expert 0 except layer ``layer``, which cycles
  through all E experts; a fixed per-layer split of a cache that holds E + L - 1 experts keeps missing,
  OPT does not.

Every generator can split its tokens into ``sequences`` requests, each starting with ``prompt_len``
prefill tokens, so that layer-order replay sees prefill steps.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable

import numpy as np

from expertcache.errors import ExpertcacheError, option
from expertcache.trace.trace import Trace


def zipf(
    tokens: int = 10_000,
    layers: int = 32,
    experts: int = 8,
    top_k: int = 2,
    a: float = 1.0,
    b: float = 0.0,
    seed: int = 0,
    sequences: int = 1,
    prompt_len: int = 0,
) -> Trace:
    """Independent per-layer Zipf(a, b) routing."""
    _, ex = _seeded_draws(seed, tokens, layers, experts, top_k, a, b)
    return _finish(ex, experts, sequences, prompt_len, {"generator": "zipf", "a": a, "b": b})


def uniform(
    tokens: int = 10_000,
    layers: int = 32,
    experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    sequences: int = 1,
    prompt_len: int = 0,
) -> Trace:
    """Every expert of a layer equally likely."""
    _, ex = _seeded_draws(seed, tokens, layers, experts, top_k, 0.0, 0.0)
    return _finish(ex, experts, sequences, prompt_len, {"generator": "uniform"})


def sticky(
    tokens: int = 10_000,
    layers: int = 32,
    experts: int = 8,
    top_k: int = 2,
    a: float = 1.0,
    b: float = 0.0,
    stickiness: float = 0.5,
    seed: int = 0,
    sequences: int = 1,
    prompt_len: int = 0,
) -> Trace:
    """Zipf routing where each layer repeats the previous token's experts with probability stickiness."""
    if not 0.0 <= stickiness <= 1.0:
        raise ExpertcacheError(f"{_p('stickiness')} must be in [0, 1], got {stickiness}")
    rng, fresh = _seeded_draws(seed, tokens, layers, experts, top_k, a, b)  # [T, L, K]
    keep = rng.random((tokens, layers)) < stickiness  # [T, L]
    keep[0] = False
    # Each (t, l) copies the most recent token at or before t that drew fresh experts.
    src = np.where(keep, 0, np.arange(tokens)[:, None])  # [T, L]
    src = np.maximum.accumulate(src, axis=0)
    ex = np.take_along_axis(fresh, src[:, :, None], axis=0)
    meta = {"generator": "sticky", "a": a, "b": b, "stickiness": stickiness}
    return _finish(ex, experts, sequences, prompt_len, meta)


def cyclic(tokens: int = 1_000, layers: int = 4, experts: int = 2) -> Trace:
    """The LLRU paper Thm 3.3: round i requests expert (i mod E) of every layer (K = 1)."""
    _check_shape(tokens, layers, experts, 1)
    ex = np.broadcast_to((np.arange(tokens) % experts)[:, None, None], (tokens, layers, 1))
    return _finish(ex.copy(), experts, 1, 0, {"generator": "cyclic"})


def partition(tokens: int = 1_000, layers: int = 4, experts: int = 4, layer: int = 0) -> Trace:
    """The LLRU paper Thm 3.1: one layer cycles through all its experts, every other layer uses expert 0."""
    _check_shape(tokens, layers, experts, 1)
    if not 0 <= layer < layers:
        raise ExpertcacheError(f"{_p('layer')} must be in 0..{layers - 1}, got {layer}")
    ex = np.zeros((tokens, layers, 1), dtype=np.int16)
    ex[:, layer, 0] = np.arange(tokens) % experts
    return _finish(ex, experts, 1, 0, {"generator": "partition", "layer": layer})


GENERATORS: dict[str, Callable[..., Trace]] = {
    "zipf": zipf,
    "uniform": uniform,
    "sticky": sticky,
    "cyclic": cyclic,
    "partition": partition,
}


def _p(name: str) -> str:
    """A parameter as the message's reader gave it: ``trace synth``'s flag, or the keyword."""
    return option(f"--{name.replace('_', '-')}", name)


def synthesize(kind: str, **params: object) -> Trace:
    """Build a synthetic trace by generator name; unknown names or parameters are errors."""
    if kind not in GENERATORS:
        raise ExpertcacheError(f"unknown trace kind {kind!r}; choose from {', '.join(GENERATORS)}")
    gen = GENERATORS[kind]
    accepted = inspect.signature(gen).parameters
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ExpertcacheError(
            f"trace kind {kind!r} does not take {', '.join(map(_p, unknown))}; it takes "
            f"{', '.join(map(_p, accepted))}"
        )
    for key, value in params.items():  # by the default's type: a whole number, or any real one
        whole = isinstance(accepted[key].default, int)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if whole else numbers.Real):
            raise ExpertcacheError(
                f"trace kind {kind!r}: {key} must be a {'whole' if whole else 'real'} number, got {value!r}"
            )
    if params.get("seed", 0) < 0:  # numpy's own error named nothing
        raise ExpertcacheError(f"trace kind {kind!r}: seed must be at least 0, got {params['seed']}")
    return gen(**params)


def zipf_probs(experts: int, a: float, b: float) -> np.ndarray:
    """p_j ~ 1/(j+b)^a for ranks j = 1..E, normalised."""
    w = 1.0 / np.power(np.arange(1, experts + 1, dtype=np.float64) + b, a)
    return w / w.sum()


def _seeded_draws(
    seed: int, t: int, layers: int, experts: int, k: int, a: float, b: float
) -> tuple[np.random.Generator, np.ndarray]:
    """Check the parameters, then draw Zipf routing from a fresh seeded generator. -> (rng, [T, L, K])"""
    _check_shape(t, layers, experts, k)
    if not (math.isfinite(a) and math.isfinite(b)) or a < 0 or b <= -1:
        raise ExpertcacheError(
            f"zipf routing needs finite {_p('a')} >= 0 and {_p('b')} > -1, got a={a}, b={b}"
        )
    rng = np.random.default_rng(seed)
    return rng, _zipf_draws(rng, t, layers, experts, k, a, b)


def _zipf_draws(
    rng: np.random.Generator, t: int, layers: int, experts: int, k: int, a: float, b: float
) -> np.ndarray:
    """K distinct experts per (token, layer) drawn without replacement (Gumbel top-k). -> [T, L, K]"""
    logp = np.log(zipf_probs(experts, a, b))
    ranks = np.argsort(rng.random((layers, experts)), axis=1)  # per-layer popularity order
    logits = np.empty((layers, experts))
    np.put_along_axis(logits, ranks, np.broadcast_to(logp, (layers, experts)), axis=1)
    out = np.empty((t, layers, k), dtype=np.int16)
    block = max(1, 2_000_000 // (layers * experts))
    for s in range(0, t, block):
        n = min(block, t - s)
        g = logits + rng.gumbel(size=(n, layers, experts))  # [n, L, E]
        out[s : s + n] = np.argsort(-g, axis=2)[:, :, :k]
    return out


MAX_TRACE_BYTES = 4 * 2**30  # a synthetic trace's expert ids (its generator needs a few times more)


def _check_shape(tokens: int, layers: int, experts: int, top_k: int) -> None:
    for name, value in (("tokens", tokens), ("layers", layers), ("experts", experts)):
        if value < 1:
            raise ExpertcacheError(f"{_p(name)} must be at least 1, got {value}")
    if not 1 <= top_k <= experts:
        raise ExpertcacheError(f"{_p('top_k')} must be in 1..{experts} (the experts), got {top_k}")
    if experts > np.iinfo(np.int16).max:
        raise ExpertcacheError(f"{_p('experts')} must be at most 32767, got {experts}")
    need = tokens * layers * top_k * 2  # the int16 expert ids alone, before weights and working arrays
    if need > MAX_TRACE_BYTES:
        raise ExpertcacheError(
            f"{tokens} tokens x {layers} layers x top-{top_k} is {need / 2**30:.1f} GiB of expert ids; a "
            f"synthetic trace is at most {MAX_TRACE_BYTES / 2**30:.0f} GiB (fewer tokens, or several traces)"
        )


def _finish(ex: np.ndarray, experts: int, sequences: int, prompt_len: int, meta: dict[str, object]) -> Trace:
    t = ex.shape[0]
    if not 1 <= sequences <= t:
        raise ExpertcacheError(f"{_p('sequences')} must be in 1..{t} (the tokens), got {sequences}")
    if prompt_len < 0:
        raise ExpertcacheError(f"{_p('prompt_len')} must be >= 0, got {prompt_len}")
    seq_id = (np.arange(t) * sequences // t).astype(np.int32)  # contiguous, near-equal sequences
    shortest = int(np.bincount(seq_id).min())
    if prompt_len >= shortest:
        raise ExpertcacheError(
            f"a prompt length of {prompt_len} leaves no generated token in a sequence of {shortest} tokens "
            f"({t} tokens in {sequences} sequence(s)): give a prompt length below {shortest}, or more tokens"
        )
    starts = np.searchsorted(seq_id, seq_id)  # first token of each token's sequence
    is_prefill = ((np.arange(t) - starts) < prompt_len).astype(np.int8)
    return Trace(ex.astype(np.int16), experts, seq_id=seq_id, is_prefill=is_prefill, meta=meta)
