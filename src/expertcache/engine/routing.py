"""Routing replay: a model's routers pick the experts a recorded trace says, token after token.

For benchmarks of random-weight models with real routing: a checkpoint of real dimensions but random
weights routes almost uniformly, which says nothing about how a cache behaves on a real model. With
``replay_routing(model, trace)`` every MoE layer's router keeps computing its logits, but the top-k
experts (and their weights) it returns are taken from the trace: the tokens of each forward step get
the trace's next rows, in order (prefill steps take as many rows as they have tokens, flattened over
the batch), every layer advancing its own position so that all layers stay on the same rows.

The override is a PyTorch forward hook on each router module (``register_forward_hook``): every
supported family's router returns ``(router_logits, top_k_weights, top_k_index)`` (in an order that
depends on the transformers version: ``router_parts`` finds them) and the hook
replaces the last two. Weights are the trace's when it has them, else uniform ``1/K``. A row with an
unknown (-1) entry keeps the model's own routing for that (token, layer).

    model = expertcache.load(path, expert_memory="25%")
    with replay_routing(model.model, load_trace("trace.npz")) as replay:
        model.generate(input_ids, max_new_tokens=64)
    replay.position  # trace rows consumed
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from expertcache.engine.families import FAMILIES, Family
from expertcache.errors import ExpertcacheError
from expertcache.trace.trace import Trace, load_trace


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router module of every MoE layer of a transformers model, in layer order."""
    return [router for router, _ in _routers_and_inputs(model)]


def _routers_and_inputs(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Callable[[], tuple]]]:
    """Each MoE layer's router and a function giving the block's tensors it takes after the hidden
    states (the family's ``router_inputs``: AFMoE's router is passed the block's ``expert_bias``; read
    at each call, so they follow the model to its device), in layer order."""
    model = _unwrap(model)
    family = _family(model)
    model_type, attr = family.name, family.router
    routers = []
    for module in model.modules():
        router = getattr(module, attr, None)
        if isinstance(router, torch.nn.Module) and isinstance(
            getattr(module, "experts", None), torch.nn.Module
        ):
            routers.append((router, _inputs_of(module, family.router_inputs)))
    if not routers:
        raise ExpertcacheError(f"{model_type}: found no MoE block with a '{attr}' router and experts")
    return routers


def _family(model: torch.nn.Module) -> Family:
    model = _unwrap(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(str(model_type))
    if family is None and hasattr(config, "get_text_config"):  # an image-text model: its text model's
        family = FAMILIES.get(str(getattr(config.get_text_config(), "model_type", None)))
    if family is None:
        raise ExpertcacheError(
            f"routing replay does not support architecture {model_type!r}; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return family


def _inputs_of(block: torch.nn.Module, names: tuple[str, ...]) -> Callable[[], tuple]:
    return lambda: tuple(getattr(block, name) for name in names)


def router_fns(model: torch.nn.Module) -> list:
    """Each MoE layer's router as ``gate input [T, H] -> top-k index [T, K]``, called without its hooks
    (a routing replay is not disturbed): what the gate-based predictors feed."""

    batched = _family(model).router_batched

    def call(router: torch.nn.Module, inputs: Callable[[], tuple]):
        p = next(router.parameters())

        def route(x: torch.Tensor) -> torch.Tensor:
            x = x.to(p.device, p.dtype)
            extra = inputs()
            # [1, T, H] as its block passes (AFMoE's); LFM2-MoE's takes [T, H] with its expert_bias
            out = router.forward(x[None] if extra and batched else x, *extra)
            return out[router_parts(out, router)[2]]

        return route

    return [call(r, inputs) for r, inputs in _routers_and_inputs(model)]


class RoutingReplay:
    """Forward hooks that make every router return the trace's experts; ``remove()`` restores them."""

    def __init__(self, model: torch.nn.Module, trace: Trace, start: int = 0, wrap: bool = False) -> None:
        routers = moe_routers(model)
        L, E, K, T = trace.num_layers, trace.num_experts, trace.top_k, trace.num_tokens
        if len(routers) != L:
            raise ExpertcacheError(f"trace has {L} MoE layers, the model {len(routers)}")
        model_e = {int(getattr(r, "num_experts", E)) for r in routers}
        if model_e != {E}:
            raise ExpertcacheError(f"trace has {E} experts per layer, the model {sorted(model_e)}")
        model_k = {int(getattr(r, "top_k", K)) for r in routers}
        if model_k != {K}:
            raise ExpertcacheError(f"trace has top-{K} routing, the model top-{sorted(model_k)}")
        if not 0 <= start < T:
            raise ExpertcacheError(f"start {start} is outside the trace's {T} tokens")
        experts = np.asarray(trace.experts, dtype=np.int64)
        unknown = (experts < 0).any(axis=2)  # [T, L]
        if trace.weights is not None:
            weights = np.asarray(trace.weights, dtype=np.float32)
        else:
            weights = np.full(experts.shape, 1.0 / K, dtype=np.float32)
        self.trace, self.num_tokens, self.wrap = trace, T, wrap
        self._experts = torch.from_numpy(np.where(experts < 0, 0, experts))
        self._weights = torch.from_numpy(weights)
        self._unknown = torch.from_numpy(unknown) if unknown.any() else None
        self._on: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self.positions = [start] * L
        self._handles = [
            router.register_forward_hook(self._hook_for(layer)) for layer, router in enumerate(routers)
        ]

    @property
    def position(self) -> int:
        """Trace rows consumed so far (by the layer furthest behind)."""
        return min(self.positions)

    def reset(self, start: int = 0) -> None:
        """Start again at trace row ``start`` (e.g. before each measured run)."""
        if not 0 <= start < self.num_tokens:
            raise ExpertcacheError(f"start {start} is outside the trace's {self.num_tokens} tokens")
        self.positions = [start] * len(self.positions)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> RoutingReplay:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        key = (device, dtype)
        if key not in self._on:
            unknown = None if self._unknown is None else self._unknown.to(device)
            self._on[key] = (self._experts.to(device), self._weights.to(device, dtype), unknown)
        return self._on[key]

    def _rows(self, layer: int, n: int, device: torch.device) -> slice | torch.Tensor:
        """The trace rows for the next ``n`` tokens of ``layer``: a slice, or indices when wrapping."""
        start, T = self.positions[layer], self.num_tokens
        if start + n <= T:
            self.positions[layer] = start + n
            return slice(start, start + n)
        if not self.wrap:
            raise ExpertcacheError(
                f"routing trace exhausted: layer {layer} needs rows {start}..{start + n - 1} "
                f"of a trace of {T} tokens (pass wrap=True to start over)"
            )
        self.positions[layer] = (start + n) % T
        return (torch.arange(start, start + n) % T).to(device)

    def _hook_for(self, layer: int):
        def hook(module, args, output):
            at = router_parts(output, module, layer)
            logits, weights, index = (output[i] for i in at)
            rows = self._rows(layer, index.shape[0], index.device)
            experts, wts, unknown = self._tables(index.device, weights.dtype)
            new_index = experts[rows, layer].to(index.dtype).contiguous()
            new_weights = wts[rows, layer].contiguous()
            if unknown is not None:
                keep = unknown[rows, layer][:, None]
                new_index = torch.where(keep, index, new_index)
                new_weights = torch.where(keep, weights, new_weights)
            out = list(output)
            out[at[1]], out[at[2]] = new_weights, new_index
            return tuple(out)

        return hook


def router_parts(output: object, module: torch.nn.Module, layer: int | None = None) -> tuple[int, int, int]:
    """Where a router's output tuple holds (router_logits, top_k_weights, top_k_index): the order differs
    between transformers versions (5.17's Granite-MoE returns the index first), so they are told apart by
    type and shape: the index is the integer tensor, the weights the float tensor of the index's shape,
    the logits the first other float tensor. Outputs after the first three (Inkling's shared experts'
    weights) are the router's own and pass through."""
    where = f"router of MoE layer {layer} ({type(module).__name__})" if layer is not None else "router"
    ok = isinstance(output, tuple) and len(output) >= 3 and all(isinstance(t, torch.Tensor) for t in output)
    ints = [i for i, t in enumerate(output[:3]) if not t.is_floating_point()] if ok else []
    if len(ints) != 1:
        raise ExpertcacheError(f"{where} did not return (router_logits, top_k_weights, top_k_index)")
    index = ints[0]
    floats = [i for i in range(3) if i != index]
    same = [i for i in floats if output[i].shape == output[index].shape]
    weights = same[-1] if same else None  # both match only when top-k is every expert: weights come later
    if weights is None:
        raise ExpertcacheError(f"{where}: no top-k weights of the index's shape {tuple(output[index].shape)}")
    return next(i for i in floats if i != weights), weights, index


def replay_routing(
    model: torch.nn.Module, trace: Trace | str | Path, start: int = 0, wrap: bool = False
) -> RoutingReplay:
    """Make ``model``'s routers follow ``trace`` from row ``start``; returns a handle with ``.remove()``.

    ``model`` is a transformers model (``OffloadedModel.model`` or a reference model; an
    ``OffloadedModel`` is unwrapped). The trace's layers, experts and top-k must match the model's.
    Running past the trace's end raises an ``ExpertcacheError`` unless ``wrap`` (then it starts over).
    """
    tr = trace if isinstance(trace, Trace) else load_trace(trace)
    return RoutingReplay(model, tr, start=start, wrap=wrap)


def _unwrap(model) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module) and isinstance(getattr(model, "model", None), torch.nn.Module):
        model = model.model
    if not isinstance(model, torch.nn.Module):
        raise ExpertcacheError(f"routing replay needs a torch model, got {type(model).__name__}")
    return model
