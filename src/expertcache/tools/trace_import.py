"""Routing saved by torch as per-layer tensors, into a trace (torch-free formats: ``trace.importers``).

A ``.pt`` file of one of these shapes (``torch.save`` of plain tensors, lists and dicts):

- a list (or tuple) of per-layer tensors of top-k expert ids, ``[T, K]`` each;
- a dict of them by layer (``{0: ids, 1: ids}`` or ``{"layer_0": ids, ...}``, in the order of the layer
  numbers);
- either of those with weights: ``{"topk_ids": <list or dict>, "topk_weights": <the same>}``.

The file is read with ``torch.load(weights_only=True)``: a file that holds code or objects beyond
tensors and containers is refused rather than unpickled.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from expertcache.errors import TraceError
from expertcache.trace.trace import Trace


def _layers(obj, path: Path, what: str) -> list:
    if isinstance(obj, list | tuple):
        return list(obj)
    if isinstance(obj, dict):

        def number(key) -> int:
            m = re.search(r"\d+", str(key))
            if m is None:
                raise TraceError(f"{path}: {what}: key {key!r} names no layer number")
            return int(m.group())

        return [obj[k] for k in sorted(obj, key=number)]
    raise TraceError(
        f"{path}: {what}: expected a list or dict of per-layer tensors, got {type(obj).__name__}"
    )


def import_torch(path: str | Path, num_experts: int | None = None) -> Trace:
    import torch

    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError for code, RuntimeError for a corrupt file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(
            f"{path}: not read (only files of plain tensors are, with weights_only=True): {first[:160]}"
        ) from None
    weights = None
    if isinstance(obj, dict) and "topk_ids" in obj:
        ids, weights = obj["topk_ids"], obj.get("topk_weights")
    else:
        ids = obj
    layers = _layers(ids, path, "topk_ids")
    if not layers or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in layers):
        raise TraceError(f"{path}: every layer's expert ids must be a [tokens, top-k] tensor")
    shapes = {tuple(t.shape) for t in layers}
    if len(shapes) != 1:
        raise TraceError(f"{path}: the layers' tensors differ in shape: {sorted(shapes)}")
    if layers[0].dtype.is_floating_point:
        raise TraceError(f"{path}: expert ids must be integers, got {layers[0].dtype}")
    ex = np.stack([t.numpy() for t in layers], axis=1)  # [T, L, K]
    wt = None
    if weights is not None:
        wl = _layers(weights, path, "topk_weights")
        if len(wl) != len(layers) or any(tuple(w.shape) != tuple(layers[0].shape) for w in wl):
            raise TraceError(f"{path}: topk_weights must match topk_ids, layer for layer")
        wt = np.stack([w.float().numpy() for w in wl], axis=1)
    if ex.min() < -1 or ex.max() > np.iinfo(np.int16).max:
        raise TraceError(f"{path}: expert ids outside -1..32767")
    num_experts = num_experts or int(ex.max()) + 1
    return Trace(experts=ex.astype(np.int16), num_experts=num_experts, weights=wt, source=str(path),
                 meta={"imported_from": path.name})  # fmt: skip
