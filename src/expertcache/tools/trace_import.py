"""Routing saved by torch as tensors, into a trace (torch-free formats: ``trace.importers``).

A ``.pt`` file that ``torch.save`` wrote of plain tensors, lists and dicts, in one of these forms (``T``
tokens, ``L`` layers, top-``K`` expert ids per token, ``-1`` for an unknown one):

- one ``[T, L, K]`` tensor of expert ids;
- a list (or tuple) of per-layer ``[T, K]`` tensors of expert ids;
- a dict of them by layer (``{0: ids, 1: ids}`` or ``{"layer_0": ids, ...}``, in the order of the layer
  numbers);
- ``{"topk_ids": ids, "topk_weights": weights}``, each in any of the forms above (weights optional).

The file is read with ``torch.load(weights_only=True)``: a file that holds code or objects beyond
tensors and containers is refused rather than unpickled. An expert named twice in one token's top-k is
refused: a router picks an expert at most once per token.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np

from expertcache.errors import TraceError
from expertcache.trace.trace import Trace

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # terminal escapes (torch puts bold text in its messages)
# what weights_only=True refuses: a global (a class or function) or an object it would build
_OBJECTS = re.compile(
    r"unsupported global|can only (create|build)|call reduce|must be imported to load", re.I
)


def _load_error(path: Path, exc: Exception) -> TraceError:
    """torch.load's long, multi-line, terminal-styled message as one clean line."""
    text = " ".join(ANSI.sub("", str(exc)).split())
    inner = text.split("WeightsUnpickler error:", 1)[-1].split(" Check the documentation of torch.load")[0]
    inner = inner.strip()
    if isinstance(exc, pickle.UnpicklingError) and _OBJECTS.search(inner):
        named = re.search(r"GLOBAL (\S+)", inner)
        what = f"it names {named.group(1)}; " if named else ""
        hint = ": save torch tensors (torch.from_numpy), not numpy arrays" if "numpy" in inner else ""
        return TraceError(
            f"{path}: refused: the file holds Python objects, not only tensors ({what}read with "
            f"weights_only=True, so code in it is never run){hint}"
        )
    why = inner.split(". ")[0].rstrip(".")
    if not isinstance(exc, pickle.UnpicklingError | RuntimeError):  # KeyError '101' says little alone
        why = f"{type(exc).__name__} {why}".strip()
    return TraceError(f"{path}: not a file torch.save wrote of tensors (torch.load: {why[:160]})")


def _array(t, path: Path, what: str, torch) -> np.ndarray:
    """A tensor as an array: integers for ``topk_ids``, float32 for ``topk_weights``."""
    if what == "topk_ids" and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise TraceError(f"{path}: expert ids must be integers, got {t.dtype}")
    if what == "topk_weights" and t.dtype.is_complex:
        raise TraceError(f"{path}: topk_weights must be real numbers, got {t.dtype}")
    try:
        t = t.detach().to_dense() if t.layout != torch.strided else t.detach()
        return t.float().numpy() if what == "topk_weights" else t.numpy()
    except (RuntimeError, TypeError) as exc:  # a quantized or otherwise unusual tensor
        raise TraceError(f"{path}: {what}: a {t.dtype} tensor numpy cannot hold ({exc})") from None


def _stack(obj, path: Path, what: str, torch) -> np.ndarray:
    """One of the accepted forms as an array [T, L, K]."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() != 3:
            raise TraceError(
                f"{path}: {what}: a tensor of shape {list(obj.shape)}; expected [tokens, layers, top-k], or "
                "a list or dict of per-layer [tokens, top-k] tensors"
            )
        return _array(obj, path, what, torch)
    if isinstance(obj, list | tuple):
        layers = list(obj)
    elif isinstance(obj, dict):

        def number(key) -> int:
            m = re.search(r"\d+", str(key))
            if m is None:
                raise TraceError(f"{path}: {what}: key {key!r} names no layer number")
            return int(m.group())

        numbers = [number(k) for k in obj]
        if len(set(numbers)) != len(numbers):
            raise TraceError(f"{path}: {what}: two keys name the same layer number ({sorted(obj, key=str)})")
        layers = [obj[k] for k in sorted(obj, key=number)]
    else:
        raise TraceError(
            f"{path}: {what}: expected a [tokens, layers, top-k] tensor, or a list or dict of per-layer "
            f"[tokens, top-k] tensors, got {type(obj).__name__}"
        )
    if not layers or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in layers):
        raise TraceError(f"{path}: {what}: every layer must be a [tokens, top-k] tensor")
    shapes = {tuple(t.shape) for t in layers}
    if len(shapes) != 1:
        raise TraceError(f"{path}: {what}: the layers' tensors differ in shape: {sorted(shapes)}")
    return np.stack([_array(t, path, what, torch) for t in layers], axis=1)


def import_torch(path: str | Path, num_experts: int | None = None) -> Trace:
    import torch

    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise TraceError(f"{path}: empty file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError for code or objects, RuntimeError for a corrupt file
        raise _load_error(path, exc) from None
    weights = None
    if isinstance(obj, dict) and "topk_ids" in obj:
        ids, weights = obj["topk_ids"], obj.get("topk_weights")
    else:
        ids = obj
    ex = _stack(ids, path, "topk_ids", torch)  # [T, L, K]
    if ex.size == 0:
        raise TraceError(f"{path}: no routing (topk_ids has shape {list(ex.shape)})")
    wt = None
    if weights is not None:
        wt = _stack(weights, path, "topk_weights", torch)
        if wt.shape != ex.shape:
            raise TraceError(
                f"{path}: topk_weights has shape {list(wt.shape)} as [tokens, layers, top-k], topk_ids "
                f"{list(ex.shape)}: they must match"
            )
    if ex.min() < -1 or ex.max() > np.iinfo(np.int16).max:
        raise TraceError(f"{path}: expert ids outside -1..32767")
    num_experts = num_experts or int(ex.max()) + 1
    return Trace(experts=ex.astype(np.int16), num_experts=num_experts, weights=wt, source=str(path),
                 meta={"imported_from": path.name})  # fmt: skip
