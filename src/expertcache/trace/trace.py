"""The routing trace: one in-memory type and one .npz file format.

Layout (see ../shared/traces/README.md): ``experts`` int16 [T, L, K] (expert ids, -1 = unknown),
``num_experts`` scalar, and optional ``weights`` float32 [T, L, K], ``seq_id`` int32 [T],
``is_prefill`` int8 [T] (1 prompt token, 0 generated, -1 unknown), ``token_id`` int32 [T]
(-1 unknown), ``step_id`` int32 [T] (the forward step that served the token, non-decreasing: an
engine's batched steps; without it, steps are derived from ``is_prefill`` and ``seq_id``),
``predicted`` int16 [T, L, K] (what the engine's predictor predicted for each step and layer: the
step's ranked list, read row after row over the step's tokens, -1 padding; meta ``predictor`` and
``window`` name it), and for a predictor that predicts a layer from several earlier ones (HOBBIT's
``adaptive``) ``predicted_from`` int16 [T, L, W, K] (entry ``d - 1`` of layer ``i``: what it predicted
for layer i at layer i - d, before the prefetch walked it; the same layout); a recorded run's wall clock
``step_start_s`` and ``step_end_s`` float64 [T]; ``padding`` int8 [T] (1: a row of a padded batch's left
padding, which the forward routed like a prompt token though no request wrote it). Other arrays and
scalars in a file are kept as metadata.
"""

from __future__ import annotations

import hashlib
import numbers
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from expertcache.errors import ExpertcacheError, TraceError
from expertcache.paths import output_file

# Optional per-token arrays: name -> (dtype kind check, canonical dtype, rank).
_OPTIONAL = {
    "weights": ("f", np.float32, 3),
    "seq_id": ("iu", np.int32, 1),
    "is_prefill": ("iu", np.int8, 1),
    "token_id": ("iu", np.int32, 1),
    "step_id": ("iu", np.int32, 1),
    "predicted": ("iu", np.int16, 3),
    "predicted_from": ("iu", np.int16, 4),
    "step_start_s": ("f", np.float64, 1),
    "step_end_s": ("f", np.float64, 1),
    "padding": ("iub", np.int8, 1),
}
_CORE = ("experts", "num_experts", *_OPTIONAL)


@dataclass(frozen=True, eq=False)
class Trace:
    """Expert routing of T tokens through L MoE layers, K experts each (shapes checked on creation)."""

    experts: np.ndarray  # int16 [T, L, K], -1 = unknown
    num_experts: int
    weights: np.ndarray | None = None  # float32 [T, L, K]
    seq_id: np.ndarray | None = None  # int32 [T]
    is_prefill: np.ndarray | None = None  # int8 [T]
    token_id: np.ndarray | None = None  # int32 [T]
    step_id: np.ndarray | None = None  # int32 [T], non-decreasing
    predicted: np.ndarray | None = None  # int16 [T, L, K]: the engine predictor's experts, -1 none
    predicted_from: np.ndarray | None = None  # int16 [T, L, W, K]: layer i's predicted at layer i - d - 1
    # a recorded run's wall clock: when the forward of each token's step began and ended, seconds from the
    # recording's first step (float64 [T]; both or neither). The next step's start bounds a step's whole
    # time (a server's sampling and scheduling come after its forward); on a GPU the end is the host's,
    # which may run ahead of the device's kernels
    step_start_s: np.ndarray | None = None
    step_end_s: np.ndarray | None = None
    # 1 where the row is a padded batch's left padding (routed, computed and cached like a prompt token, so
    # a replay keeps it; no request's token): int8 [T]
    padding: np.ndarray | None = None
    meta: dict[str, object] = field(default_factory=dict)
    source: str = "<memory>"

    def __post_init__(self) -> None:
        object.__setattr__(self, "experts", _as_experts(self.experts, self.source))
        n = self.num_experts  # not "4", not 4.5 (a trace of 4.5 experts failed later, in a replay)
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TraceError(f"{self.source}: num_experts must be a whole number, got {n!r}")
        object.__setattr__(self, "num_experts", int(n))
        most = np.iinfo(np.int16).max + 1  # expert ids are int16: (layer, expert) keys beyond wrap
        if not 1 <= self.num_experts <= most:
            raise TraceError(f"{self.source}: num_experts must be in 1 .. {most}, got {self.num_experts}")
        if not isinstance(self.meta, dict):
            raise TraceError(f"{self.source}: meta must be a dict, got {type(self.meta).__name__}")
        for name, (kinds, dtype, _) in _OPTIONAL.items():
            value = getattr(self, name)
            if value is None:
                continue
            value = np.asarray(value)
            if value.dtype.kind not in kinds:
                raise TraceError(
                    f"{self.source}: '{name}' has dtype {value.dtype}, expected {dtype.__name__}"
                )
            if value.dtype.kind in "iu" and value.size and np.iinfo(dtype).max < value.max():  # not wrapped
                most = f"more than {dtype.__name__} holds"
                raise TraceError(f"{self.source}: '{name}' holds {value.max()}, {most}")
            object.__setattr__(self, name, value.astype(dtype, copy=False))
        _validate(self)
        w = self.weights
        if w is not None and not np.isfinite(w).all():  # only at unknown entries (validated): read as 0
            object.__setattr__(self, "weights", np.where(np.isfinite(w), w, np.float32(0)))

    def __repr__(self) -> str:
        n = None if self.seq_id is None else len(np.unique(self.seq_id))
        seqs = "" if n is None else f", {n} sequence{'' if n == 1 else 's'}"
        return (
            f"<Trace {self.source}: {self.num_tokens} tokens{seqs}, {self.num_layers} layers x "
            f"{self.num_experts} experts, top-{self.top_k}>"
        )

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    def digest(self) -> str:
        """A fingerprint of the routing (its shape, experts, phases and steps): two traces of equal
        digests replay alike, whatever their files are called (a plan holds its trace's)."""
        h = hashlib.sha256(repr((self.num_tokens, self.num_layers, self.num_experts, self.top_k)).encode())
        for a in (self.experts, self.is_prefill, self.step_id, self.seq_id):
            h.update(b"-" if a is None else np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def select(self, tokens) -> Trace:
        """The trace of some of its tokens, in time order: a boolean mask of every token
        (``trace.seq_id < 8``: a training half, the other half to test on) or increasing token indices.
        Every per-token array comes along, and the metadata (a recorded run's: the selection is part of
        that run)."""
        index = np.asarray(tokens)
        if index.dtype == bool:
            if index.shape != (self.num_tokens,):
                raise TraceError(
                    f"select: a mask of every token ({self.num_tokens}), got shape {index.shape}"
                )
            index = np.flatnonzero(index)
        elif index.dtype.kind not in "iu" or index.ndim != 1:
            raise TraceError("select: a boolean mask of the tokens or a list of token indices")
        elif index.size and (
            index.min() < 0 or index.max() >= self.num_tokens or (np.diff(index) <= 0).any()
        ):
            raise TraceError(f"select: token indices increasing, in 0 .. {self.num_tokens - 1}")
        arrays = {
            name: None if getattr(self, name) is None else getattr(self, name)[index] for name in _OPTIONAL
        }
        return Trace(
            self.experts[index],
            self.num_experts,
            **arrays,
            meta=dict(self.meta),
            source=f"{self.source} (selected)",
        )

    @property
    def num_keys(self) -> int:
        """How many distinct (layer, expert) pages the model has: L * E."""
        return self.num_layers * self.num_experts

    def save(self, path: str | Path) -> None:
        """Write the trace as .npz in the shared layout (meta scalars included)."""
        check_save_path(path)
        arrays: dict[str, object] = {
            "experts": self.experts,
            "num_experts": np.int32(self.num_experts),
            "num_layers": np.int32(self.num_layers),
            "top_k": np.int32(self.top_k),
        }
        for name in _OPTIONAL:
            if getattr(self, name) is not None:
                arrays[name] = getattr(self, name)
        for key, value in self.meta.items():
            if value is None:
                continue  # absent metadata stays absent
            arr = np.asarray(value)
            arrays.setdefault(key, arr.astype(str) if arr.dtype == object else arr)
        try:
            with output_file(path, "trace") as target, open(target, "wb") as f:
                np.savez_compressed(f, **arrays)
        except ExpertcacheError as e:
            raise TraceError(str(e)) from None


def check_save_path(path: object) -> None:
    """A trace is saved to a path: an int would be taken as a file descriptor."""
    if not isinstance(path, str | os.PathLike):
        raise TraceError(f"a trace is saved to a path (.npz), got {type(path).__name__} {path!r}")


def as_trace(trace: Trace | str | Path, what: str = "trace", replay: bool = False) -> Trace:
    """``trace`` itself, or the trace file it names (``load_trace``), or ``"default"``: the embedded model's
    (as the command line names it): what the API's functions take. ``replay``: a trace to replay, which
    must hold a known expert (``check_replayable``)."""
    if isinstance(trace, Trace):
        got = trace
    elif isinstance(trace, str) and trace == "default":
        from expertcache.trace.default import default_trace

        got = default_trace()
    elif isinstance(trace, str | os.PathLike):
        got = load_trace(trace)
    else:
        raise TraceError(f"{what}: a Trace or a trace file's path (.npz), got {type(trace).__name__}")
    return check_replayable(got) if replay else got


def check_replayable(trace: Trace) -> Trace:
    """A trace whose every entry is unknown (-1) has nothing to replay: its zero misses are no result."""
    if not (trace.experts >= 0).any():
        raise TraceError(f"{trace.source}: every entry is unknown (-1): no expert to replay")
    return trace


def load_trace(path: str | Path) -> Trace:
    """Load and validate a .npz routing trace; every problem is a TraceError naming the file."""
    if not isinstance(path, str | os.PathLike):
        raise TraceError(f"a trace file's path, got {type(path).__name__}")
    path = Path(path)
    if path.is_dir():
        raise TraceError(f"{path}: a directory, not a trace file (.npz)")
    if not path.is_file():
        what = (
            "not a regular file (a device, a pipe), not a trace file (.npz)"
            if path.exists()
            else "no such trace file"
        )
        raise TraceError(f"{path}: {what}")
    if not zipfile.is_zipfile(path):
        raise TraceError(f"{path}: not a readable .npz trace (not a zip archive)")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as e:
        raise TraceError(f"{path}: not a readable .npz trace ({e})") from None
    except ValueError as e:
        raise TraceError(f"{path}: unsupported array in trace ({str(e).split('.')[0]})") from None
    if "experts" not in arrays:
        raise TraceError(f"{path}: missing array 'experts' (int16 [T, L, K])")
    if "num_experts" not in arrays:
        raise TraceError(f"{path}: missing scalar 'num_experts'")
    num_experts = arrays["num_experts"]
    if num_experts.ndim != 0 or num_experts.dtype.kind not in "iu":
        raise TraceError(f"{path}: 'num_experts' must be an integer scalar")
    meta = {k: v.item() if v.ndim == 0 else v for k, v in arrays.items() if k not in _CORE}
    return Trace(
        experts=arrays["experts"],
        num_experts=int(num_experts),
        **{name: arrays.get(name) for name in _OPTIONAL},
        meta=meta,
        source=str(path),
    )


def _as_experts(experts: object, source: str) -> np.ndarray:
    arr = np.asarray(experts)
    if arr.ndim != 3:
        raise TraceError(f"{source}: 'experts' must have 3 dimensions [T, L, K], got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TraceError(f"{source}: 'experts' must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < -1 or arr.max() > np.iinfo(np.int16).max):
        raise TraceError(f"{source}: 'experts' has ids outside -1..32767")
    return arr.astype(np.int16, copy=False)


def repeated_expert(experts: np.ndarray) -> tuple[int, int, int, int] | None:
    """(token, layer, first slot, second slot) of the first top-k in ``experts`` ``[T, L, K]`` that names
    an expert twice (unknown slots, -1, aside), or None: a router picks an expert at most once per token."""
    if experts.shape[-1] < 2:
        return None
    ordered = np.sort(experts, axis=-1)
    twice = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(axis=-1)
    if not twice.any():
        return None
    tok, layer = (int(i) for i in np.argwhere(twice)[0])
    row = [int(e) for e in experts[tok, layer]]
    slot = next(s for s, e in enumerate(row) if e >= 0 and e in row[:s])
    return tok, layer, row.index(row[slot]), slot


def _validate(trace: Trace) -> None:
    src, ex = trace.source, trace.experts
    t, layers, k = ex.shape
    if t == 0 or layers == 0 or k == 0:
        raise TraceError(f"{src}: 'experts' is empty (shape {ex.shape})")
    if trace.num_experts < 1:
        raise TraceError(f"{src}: 'num_experts' must be at least 1, got {trace.num_experts}")
    if ex.max() >= trace.num_experts:
        raise TraceError(f"{src}: expert id {int(ex.max())} out of range for num_experts={trace.num_experts}")
    if k > trace.num_experts:
        raise TraceError(f"{src}: top-k {k} exceeds num_experts {trace.num_experts}")
    twice = repeated_expert(ex)
    if twice is not None:
        tok, layer, first, slot = twice
        raise TraceError(
            f"{src}: expert {int(ex[tok, layer, slot])} appears twice in the top-k of token {tok}, layer "
            f"{layer} (slots {first} and {slot}; a router picks an expert at most once per token)"
        )
    for name, (_, _, rank) in _OPTIONAL.items():
        value = getattr(trace, name)
        if value is None:
            continue
        if rank == 4:  # [T, L, W, K], any W of at least 1
            ok = value.ndim == 4 and value.shape[:2] == (t, layers) and value.shape[3] == k and value.shape[2]
            want = f"({t}, {layers}, W, {k}), W at least 1"
        else:
            ok = value.shape == (ex.shape if rank == 3 else (t,))
            want = str(ex.shape if rank == 3 else (t,))
        if not ok:
            raise TraceError(f"{src}: '{name}' has shape {value.shape}, expected {want}")
    for name in ("predicted", "predicted_from"):
        value = getattr(trace, name)
        if value is not None and value.size and (value.min() < -1 or value.max() >= trace.num_experts):
            raise TraceError(f"{src}: '{name}' has expert ids outside -1..{trace.num_experts - 1}")
    starts, ends = trace.step_start_s, trace.step_end_s
    if (starts is None) != (ends is None):
        given = "step_start_s" if ends is None else "step_end_s"
        raise TraceError(f"{src}: '{given}' without its pair (a step's wall clock is its start and its end)")
    if starts is not None and not (np.isfinite(starts).all() and np.isfinite(ends).all()):
        raise TraceError(f"{src}: 'step_start_s' and 'step_end_s' must be finite")
    if starts is not None and (ends < starts).any():
        tok = int(np.argmax(ends < starts))
        raise TraceError(f"{src}: token {tok}'s step ends ({ends[tok]} s) before it starts ({starts[tok]} s)")
    if trace.is_prefill is not None and not np.isin(trace.is_prefill, (-1, 0, 1)).all():
        raise TraceError(f"{src}: 'is_prefill' must hold only -1, 0 or 1")
    if trace.padding is not None and not np.isin(trace.padding, (0, 1)).all():
        raise TraceError(f"{src}: 'padding' must hold only 0 or 1")
    if trace.seq_id is not None and (trace.seq_id < 0).any():
        raise TraceError(f"{src}: 'seq_id' must be non-negative")
    if trace.step_id is not None and ((trace.step_id < 0).any() or (np.diff(trace.step_id) < 0).any()):
        raise TraceError(f"{src}: 'step_id' must be non-negative and non-decreasing")
    if trace.weights is not None:
        bad = ~np.isfinite(trace.weights) & (ex >= 0)  # an unknown entry (-1) may carry any weight
        if bad.any():
            tok, layer, slot = (int(i) for i in np.argwhere(bad)[0])
            raise TraceError(
                f"{src}: 'weights' has NaN or infinite values where the expert is known (token {tok}, "
                f"layer {layer}, slot {slot})"
            )
