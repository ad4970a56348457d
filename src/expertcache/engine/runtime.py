"""The engine at run time: the registered experts forward, and step tracking.

``expertcache_experts_forward`` is registered in transformers' ``ExpertsInterface`` under the name
``"expertcache"``; every ``...Experts`` module of a model built with that implementation calls it
with ``(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``. The shared step driver
(``cache.step.StepDriver``) takes the layer's routing: its distinct experts in first-use order (the
rule the simulator applies to a trace), the miss path's route for each, the transfers, the
predictor's prefetches. The engine then computes what the driver hands it: device units (an expert, or
a part of one) once each is resident, host experts on the host, and adds the contributions in
ascending expert order, as transformers' eager loop does, so the output does not depend on the order
experts became resident or were computed: the full-precision device path is the reference bit for bit.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from transformers.integrations.moe import ExpertsInterface

from expertcache.cache.step import StepDriver, StepSource
from expertcache.engine.host import HostExperts
from expertcache.engine.kernels import (
    KERNELS,
    Kernel,
    StackedPool,
    cast,
    combine,
    compiled_rows,
    decode_rows,
    follow_torch_threads,
    grouped_rows,
    order_from_ranks,
    pair_ranks,
    reference_order,
)
from expertcache.engine.kv import grow
from expertcache.engine.packed import packed_decode_rows, packed_grouped_rows
from expertcache.engine.parts import EnginePart
from expertcache.engine.routing import moe_routers
from expertcache.engine.slots import SlotTable, SlotTransport
from expertcache.errors import ExpertcacheError
from expertcache.miss.base import FULL

IMPLEMENTATION = "expertcache"


def expertcache_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    engine = getattr(module, "_expertcache_engine", None)
    if engine is None:
        raise ExpertcacheError(
            "experts module is not attached to an expertcache engine (use expertcache.load)"
        )
    return engine.run_experts(module, module._expertcache_layer, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, expertcache_experts_forward)


class PredictorThread:
    """A predictor run beside inference, on a thread of its own (ProMoE runs its MLPs on the CPU beside
    the GPU): the compute thread queues each call and goes on; one thread runs them in order, so a
    predictor with state (``eam``, ``token``) sees its calls as it would inline. ``ready()`` hands back,
    without waiting, the finished predictions of the current step in call order; those of an earlier
    step are dropped (their layers have been computed). The step driver calls it as any
    ``cache.step.PredictorRunner``: every call returns what is ready now."""

    def __init__(self, predictor) -> None:
        self.predictor = predictor
        self.window = predictor.window
        self.adaptive = getattr(predictor, "adaptive", False)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="expertcache-predict")
        self._pending: deque[tuple[int, Future]] = deque()
        self.step = 0
        self.calls = 0  # queued
        self.collected = 0  # handed back within their step
        self.stale = 0  # handed back after their step was over (dropped)

    def begin_step(self, *args) -> list[dict[int, list[int]]]:
        self.step += 1
        self._submit(self.predictor.begin_step, args)
        return []

    def after_router(self, *args) -> list[dict[int, list[int]]]:
        self._submit(self.predictor.after_router, args)
        return []

    def collect(self, layer: int) -> list[dict[int, list[int]]]:
        return self.ready()

    def ready(self) -> list[dict[int, list[int]]]:
        out = []
        while self._pending and self._pending[0][1].done():
            step, future = self._pending.popleft()
            result = future.result()  # a predictor's error surfaces on the compute thread
            if step == self.step:
                self.collected += 1
                out.append(result)
            else:
                self.stale += 1
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _submit(self, fn, args) -> None:
        self.calls += 1
        self._pending.append((self.step, self._pool.submit(_inference, fn, args)))


def _narrowed(experts: torch.nn.Module, router: torch.nn.Module) -> bool:
    """Whether the experts take hidden states of another width than their router (Muse Spark's)."""
    width = getattr(experts, "hidden_dim", None)
    weight = getattr(router, "weight", None)
    return width is not None and isinstance(weight, torch.Tensor) and weight.shape[-1] != width


def routing_on_host(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, packed: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The layer's routing on the host: expert ids ``[T, K]`` (int64) and weights (float32). From a GPU
    (``packed``, by default off a CPU) in one device-to-host copy, ids beside weights as float32 (ids are
    exact there below 2**24), so a layer waits for one copy, not two; on a CPU the tensors' own memory."""
    if packed is None:
        packed = top_k_index.device.type != "cpu"
    if not packed:
        index, weights = top_k_index.detach(), top_k_weights.detach()
        if index.device.type != "cpu":
            index, weights = index.cpu(), weights.cpu()
        return index.numpy(), cast(weights, torch.float32).numpy()
    K = top_k_index.shape[-1]
    both = torch.cat((top_k_index.detach().to(torch.float32), top_k_weights.detach().to(torch.float32)), -1)
    both = both.cpu().numpy()
    return both[:, :K].astype(np.int64), np.ascontiguousarray(both[:, K:])


class RowsByExpert:
    """Each expert's rows of a layer's routing ``[T, K]`` (host ids), as eager's ``torch.where(expert ==
    top_k_index.T)`` gives them (top-k position, then token), for all experts at once: one stable sort on
    the host and one copy to the device (pinned, asynchronous), where each expert's rows are views.
    eager's loop synchronises with the GPU once an expert; on a CPU, where nothing waits, the engine's
    ``np.nonzero`` per expert is faster for a few tokens."""

    def __init__(self, index: np.ndarray, device: torch.device) -> None:
        T = index.shape[0]
        flat = np.ascontiguousarray(index.T).ravel()  # position p = top_k_pos * T + token
        order = np.argsort(flat, kind="stable")
        ids = flat[order]
        bounds = np.concatenate(([0], np.flatnonzero(ids[1:] != ids[:-1]) + 1, [ids.size])).tolist()
        self._where = (
            dict(zip(ids[bounds[:-1]].tolist(), itertools.pairwise(bounds), strict=True)) if ids.size else {}
        )
        pairs = torch.from_numpy(np.stack((order % T, order // T)))  # token_idx, top_k_pos (int64)
        if device.type != "cpu":
            pairs = pairs.pin_memory().to(device, non_blocking=True)
        self._pairs = pairs

    def __getitem__(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self._where.get(expert, (0, 0))
        return self._pairs[0, a:b], self._pairs[1, a:b]


def _inference(fn, args):
    with torch.inference_mode():  # inference mode is per thread
        return fn(*args)


class Engine:
    """Runs a model's experts through the step driver; tracks forward steps with a pre-hook."""

    def __init__(
        self,
        model: torch.nn.Module,
        experts: list[torch.nn.Module],
        driver: StepDriver,
        transport: SlotTransport,
        parts: dict[str, EnginePart],
        host: HostExperts,
        kernel: Kernel = KERNELS["eager"],
        pools: dict[str, tuple[StackedPool, SlotTable]] | None = None,
    ):
        self.model, self.driver, self.transport, self.parts, self.host = model, driver, transport, parts, host
        self._one_part = next(iter(parts.values())) if len(parts) == 1 else None
        self.kernel = kernel
        self.grouped = kernel.stacked  # grouped or compiled: over the stacked slot pool
        self.compiled = kernel.name == "compiled"  # a one-token step's experts in the compiled loops
        # the pools of whole experts stacked, with their slot tables, by part (the cache's, ``full``, and
        # any other of its layout: a stream buffer); ``stacked``, ``table``: the cache's (None without one)
        self.pools = dict(pools or {})
        self.stacked, self.table = self.pools.get(FULL, (None, None))
        stacked = self.stacked
        self._on_cpu = stacked is not None and stacked.device.type == "cpu"
        packed = getattr(stacked, "packed", False)  # a packed checkpoint's pool (``engine.packed``)
        # a one-token step on a CPU with every expert resident, and any other batch of whole experts
        self._one_token = packed_decode_rows if packed else compiled_rows if self.compiled else decode_rows
        self._rows = packed_grouped_rows if packed else grouped_rows
        self._loops = self.compiled or packed  # a one-token batch of ready experts in compiled loops
        self._only_full = set(parts) == {FULL}  # every device unit is a whole expert in the stacked pool
        # pools that are regions of one buffer (the cache's slots, then a stream buffer's: ``SlotPool.
        # regions``): computed together, one grouped call for the experts of all of them; each part's
        # first slot in it (None: each pool alone)
        self._joint: StackedPool | None = None
        self._offsets: dict[str, int] = {}
        whole = {id(getattr(pool, "joint", pool)) for pool, _ in self.pools.values()}
        if len(self.pools) > 1 and len(whole) == 1 and not packed:
            first = next(iter(self.pools.values()))[0]
            self._joint = StackedPool(first.joint)
            self._offsets = {part: pool.offset for part, (pool, _) in self.pools.items()}
        self.num_layers = len(experts)
        self._experts = list(experts)
        for layer, module in enumerate(experts):
            module._expertcache_engine = self
            module._expertcache_layer = layer
        # each expert's output normalised before its routing weight (Muse Spark's ``post_expert_norm``),
        # once the expert's parts are summed, whatever path computed it (only the eager loop runs these)
        self._post_norm = [
            module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
            for module in experts
        ]
        if self.grouped and any(n is not None for n in self._post_norm):
            raise ExpertcacheError(f"experts kernel {kernel.name} cannot normalise each expert's output")
        # a router that does not take its experts' input (Muse Spark narrows the hidden states for its
        # experts): a pre-hook keeps the router's own input for the gate-based predictors
        self._gate_inputs: dict[int, torch.Tensor] = {}
        self._router_hooks = [
            router.register_forward_pre_hook(self._keeper(layer))
            for layer, (module, router) in enumerate(zip(experts, moe_routers(model), strict=True))
            if _narrowed(module, router)
        ]
        self._seq = 0  # sequences started so far (one per row of each prefill)
        # who each token of a step is (continuous batching, where the KV cache cannot tell): a callable
        # returning (request id [T], prompt token [T]) for the step about to run, or None (``StepSource``)
        self.step_source: StepSource | None = None
        self._hook = model.register_forward_pre_hook(self._begin_step, with_kwargs=True)
        self._out_hook = model.register_forward_hook(self._end_step)
        self._step_start = 0.0  # the wall clock at the step's start (``time.perf_counter``)

    def _end_step(self, module, args, output) -> None:
        self.driver.step_wall(self._step_start, time.perf_counter())  # recorded with the step's routing
        self._finite_logits(output)

    def _finite_logits(self, output) -> None:
        """A forward whose logits are NaN or infinite (a checkpoint's NaN weights, or a config's NaN
        epsilon) decodes token 0 for ever: an empty text, exit 0. It is one error instead, at the step it
        happens. Not under the server's continuous batching, whose steps may hold padding rows that attend
        to nothing (NaN by construction, never sampled): there the server checks each request's own rows
        and ends a request whose scores are NaN with an error (``serve.batcher.SeededSampler``)."""
        if self.step_source is not None:
            return
        logits = getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            return
        # a finite sum has no NaN or infinity in it (one reduction: 6-8 us against isfinite's 44-72 us over
        # Granite's 49,155 scores on a CPU); a sum that overflowed is checked value by value
        if not torch.isfinite(logits.sum()) and not torch.isfinite(logits).all():
            raise ExpertcacheError(
                "the model's outputs are not finite (NaN or infinite logits): the checkpoint's weights or "
                "config.json (rms_norm_eps, ...) hold a NaN or an infinity, or the dtype overflows (try "
                "--dtype float32)"
            )

    def _keeper(self, layer: int):
        def keep(router, args):
            x = args[0]
            self._gate_inputs[layer] = x.reshape(-1, x.shape[-1])

        return keep

    def _begin_step(self, module, args, kwargs):
        self._step_start = time.perf_counter()
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ExpertcacheError("the engine needs input_ids (inputs_embeds alone is not supported)")
        past = kwargs.get("cache")  # transformers >= 5.24 names the KV cache ``cache``
        if past is None:
            past = kwargs.get("past_key_values")
        if ids.device.type == "cpu" and "expertcache.jit" in sys.modules:
            follow_torch_threads()  # numba's loops on this thread's count (it is per thread)
        if past is not None and ids.device.type == "cpu":
            grow(past)  # the cache's keys and values written in place, not concatenated (``engine.kv``)
        # a paged cache (continuous batching: requests in prefill and decode share a step) has no length:
        # the step source (the server's batcher) says whose each token is; without one each such step
        # counts as a prefill step of its own
        flat = ids.detach().reshape(-1).to("cpu").numpy().astype(np.int32)
        length = getattr(past, "get_seq_length", None)
        paged = past is not None and length is None  # continuous batching's cache
        told = self.step_source() if paged and self.step_source is not None else None
        padding = None
        if told is not None and len(told[0]) == len(flat):
            seq, prompt = told
            prefill = bool(prompt.any())  # a step holding any prompt token is a prefill step
            first = int(seq[0])
        else:
            prefill = past is None or length is None or length() == 0
            rows, cols = ids.shape if ids.dim() == 2 else (1, ids.numel())
            if prefill:
                self._seq += rows
            seq = np.repeat(np.arange(self._seq - rows, self._seq, dtype=np.int32), cols)
            prompt, first = None, self._seq - rows
            if prefill and self.driver.recorder is not None:  # a padded batch's left padding, for the trace
                mask = kwargs.get("attention_mask")
                if isinstance(mask, torch.Tensor) and mask.shape == ids.shape and mask.dim() == 2:
                    padding = (mask == 0).reshape(-1).to("cpu").numpy()
        self.transport.phase = int(prefill)
        self.driver.begin_step(flat, prefill, first, seq_ids=seq, prompt=prompt, padding=padding)
        # a forward that raises never reaches ``_end_step``: its step keeps a forward of no length (the next
        # step's start bounds it), and the run's clock its other steps
        self.driver.step_wall(self._step_start, self._step_start)
        return None

    def run_experts(self, module, layer, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        index, weights = routing_on_host(top_k_index, top_k_weights)  # grouping, routes, recording
        work = self.driver.layer(layer, index, weights, self._gate_inputs.pop(layer, hidden))
        if self.grouped:
            return self._grouped(module, layer, hidden, top_k_index, top_k_weights, index, work)
        on_cpu = hidden.device.type == "cpu"
        rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # expert -> (token_idx, top_k_pos)
        on_device = None  # off a CPU: every expert's rows, copied at the first need

        def tokens_of(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal on_device
            if not on_cpu:
                if on_device is None:
                    on_device = RowsByExpert(index, hidden.device)
                return on_device[expert]
            got = rows.get(expert)
            if got is None:  # from the host copy: the same indices, in the same order, as torch.where's
                top_k_pos, token_idx = np.nonzero(expert == index.T)
                got = rows[expert] = (torch.from_numpy(token_idx), torch.from_numpy(top_k_pos))
            return got

        # one token on a CPU (a decode step of one sequence): every expert computes all of ``hidden``,
        # which is then its own input, as eager's gathered copy would be (the same bytes, shape and
        # 64-byte alignment; a GPU keeps the gathered copy, its kernels never having been tried on this)
        whole = on_cpu and hidden.shape[0] == 1 and hidden.is_contiguous() and hidden.data_ptr() % 64 == 0

        def inputs(expert: int) -> torch.Tensor:
            return hidden if whole else hidden[tokens_of(expert)[0]]

        outputs: dict[int, torch.Tensor] = {}
        views = self.transport.views
        if not work.host and self._one_part is not None:  # each unit is a whole expert
            compute = self._one_part.compute
            for key, part in work.units():
                expert = key[1]
                outputs[expert] = compute(module, views(key, part), inputs(expert))
            self.driver.end_layer(layer)
        else:
            on_host = {}
            for need in work.host:
                expert = need.key[1]
                on_host[expert] = self.host.submit(module, need.key, inputs(expert))
            partial: dict[int, dict[str, torch.Tensor]] = {}
            for key, part in work.units():
                expert = key[1]
                partial.setdefault(expert, {})[part] = self.parts[part].compute(
                    module, views(key, part), inputs(expert)
                )
            self.driver.end_layer(layer)
            for expert, by_part in partial.items():  # parts summed in the part order, whatever came first
                out = None
                for part in self.parts:
                    if part in by_part:
                        out = by_part[part] if out is None else out + by_part[part]
                outputs[expert] = out
            for expert, handle in on_host.items():
                outputs[expert] = self.host.result(handle)
        final = torch.zeros_like(hidden)
        norm = self._post_norm[layer]
        for expert in sorted(outputs):  # eager's order of accumulation
            token_idx, top_k_pos = tokens_of(expert)
            out = outputs[expert] if norm is None else norm(outputs[expert])
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, cast(out, final.dtype))
        return final

    def _grouped(self, module, layer, hidden, top_k_index, top_k_weights, index, work) -> torch.Tensor:
        """The layer with the grouped kernel: each batch of ready whole experts in one grouped computation
        (over the joint pool where a stream buffer's slots follow the cache's, else one per pool), every
        other unit (host, low precision, a split expert's segments) alone (on a CPU, a layer of several
        tokens whose device experts are ready and whose others are the host's: ``_ready_and_host``);
        each (token, expert) pair's weighted output in its row, the rows summed per token."""
        T, K = index.shape
        batches = work.batches()
        stacked, joint, offsets = self.stacked, self._joint, self._offsets
        if stacked is not None:
            one = not work.host and not work.skipped and len(work.chunks) == 1
            chunk0 = work.chunks[0] if one else ()
            if one and (self._only_full or all(parts == (FULL,) for _, parts in work.chunks[0])):
                # every expert of the layer a whole expert on the device: with nothing moving, all resident
                first = next(batches) if self.driver.cache.inflight else work.chunks[0]
                if len(first) == len(work.chunks[0]):  # all at once (every decode step of a model that fits)
                    if T == 1 and self._on_cpu:
                        slots = self.table.host[layer, index[0]].tolist()
                        rows = self._one_token(module, stacked, hidden, slots, top_k_weights)
                    else:  # in transformers' order of the pairs (``kernels.grouped_rows``)
                        table = self.table.on(hidden.device)[layer]  # [E]: each expert's slot, or none
                        order = reference_order(top_k_index) if self._on_cpu else None
                        rows = self._rows(module, stacked, hidden, table[top_k_index], top_k_weights, order)
                    self.driver.end_layer(layer)
                    return combine(rows, T, K, hidden.dtype)
                batches = itertools.chain([first], batches)  # the rest as it lands
            elif one and joint is not None and all(p[0] in offsets and len(p) == 1 for _, p in chunk0):
                # every expert whole in one of the joint pools (cached, or streamed past the cache)
                first = next(batches) if self.driver.cache.inflight else work.chunks[0]
                if len(first) == len(work.chunks[0]):
                    slots = self._joint_slots(layer, [(key, ps[0]) for key, ps in work.chunks[0]])
                    if T == 1 and self._on_cpu:
                        rows = self._one_token(module, joint, hidden, slots[index[0]].tolist(), top_k_weights)
                    else:
                        ids = torch.from_numpy(slots).to(hidden.device)[top_k_index]
                        order = reference_order(top_k_index) if self._on_cpu else None
                        rows = self._rows(module, joint, hidden, ids, top_k_weights, order)
                    self.driver.end_layer(layer)
                    return combine(rows, T, K, hidden.dtype)
                batches = itertools.chain([first], batches)
            elif self._on_cpu and T > 1 and work.host and not work.skipped and len(work.chunks) <= 1:
                rows = self._ready_and_host(module, layer, hidden, top_k_index, top_k_weights, index, work)
                if rows is not None:
                    return combine(rows, T, K, hidden.dtype)
                batches = work.batches()  # nothing taken from the work: the general way below
        flat_index = index.reshape(-1)
        rows: torch.Tensor | None = None
        device = hidden.device

        def put(flat: np.ndarray, values: torch.Tensor) -> None:
            nonlocal rows
            if rows is None:  # pairs left out (skipped experts) add nothing; weighted rows are in the
                # weights' precision where it is higher (DeepSeek-V3's float32 router), as transformers' are
                kind = torch.promote_types(hidden.dtype, top_k_weights.dtype)
                rows = torch.zeros(T * K, values.shape[-1], dtype=kind, device=values.device)
            rows[torch.from_numpy(flat).to(device)] = values.to(rows.dtype)

        # an expert's pairs in transformers' order of its group's rows (``kernels.grouped_rows``: on more
        # than one thread a row's bits depend on its place), on a CPU; in routing order elsewhere
        ref = reference_order(top_k_index) if self._on_cpu else None  # sorted once a layer
        ref_order = None if ref is None else ref.numpy()
        ids_in_order = None if ref is None else flat_index[ref_order]  # each pair's expert, in that order
        rank = None  # each pair's place in that order (``kernels.pair_ranks``, made once a layer)

        found: dict[int, np.ndarray] = {}  # an expert alone asks twice: its tokens, then its rows

        def pairs_of(expert: int) -> np.ndarray:
            got = found.get(expert)
            if got is None:
                mine = flat_index == expert if ref_order is None else ids_in_order == expert
                got = found[expert] = np.flatnonzero(mine) if ref_order is None else ref_order[mine]
            return got

        def alone(expert: int, out: torch.Tensor) -> None:
            """An expert computed alone: its output on each of its pairs, weighted, into their rows."""
            flat = pairs_of(expert)
            at = torch.from_numpy(flat).to(device)
            put(flat, out * top_k_weights.reshape(-1)[at, None])

        def tokens(expert: int) -> torch.Tensor:
            return hidden[torch.from_numpy(pairs_of(expert) // K).to(device)]

        on_host = {need.key[1]: self.host.submit(module, need.key, tokens(need.key[1])) for need in work.host}
        partial: dict[int, dict[str, torch.Tensor]] = {}  # expert -> part -> output (units computed alone)
        pools = self.pools
        if joint is not None:  # every joint pool's ready experts in one call
            groups = [(joint, tuple(offsets))]
        else:  # each pool's ready experts in one call
            groups = [(pool, (name,)) for name, (pool, _) in pools.items()]
        wanted = np.zeros(self.table.host.shape[1], dtype=bool) if groups else None  # the group's experts
        for batch in batches:
            for pool, names in groups:
                mine = [(key, part) for key, part in batch if part in names]
                if not mine:
                    continue
                experts = [key[1] for key, _ in mine]
                wanted[experts] = True
                flat = np.flatnonzero(wanted[flat_index])  # the group's pairs (``np.isin``, in a tenth)
                wanted[experts] = False
                table = None if joint is not None else pools[names[0]][1]
                slots = self._joint_slots(layer, mine) if table is None else table.host[layer]  # [E]
                if T == 1 and self._on_cpu:  # one token: its ready experts as decode steps compute them
                    weights = top_k_weights.reshape(-1)[torch.from_numpy(flat)]
                    put(flat, self._one_token(module, pool, hidden, slots[flat_index[flat]], weights))
                else:  # the group's pairs alone, each a row of its own: not the step's every pair
                    at = torch.from_numpy(flat).to(device)
                    if table is None:  # the joint slots, made on the host for these experts
                        ids = torch.from_numpy(slots[flat_index[flat]]).to(device).unsqueeze(1)
                    else:
                        ids = table.on(device)[layer][top_k_index].reshape(-1)[at].unsqueeze(1)
                    pairs = top_k_weights.reshape(-1)[at].unsqueeze(1)
                    order = None
                    if ref_order is not None:  # ``order_among(ref, at)``, on the host
                        rank = pair_ranks(ref_order) if rank is None else rank
                        order = order_from_ranks(rank, flat)
                    put(flat, self._rows(module, pool, hidden[at // K], ids, pairs, order))
            for key, part in batch:  # an expert's parts may come in different batches
                if part not in pools:
                    out = self.parts[part].compute(module, self.transport.views(key, part), tokens(key[1]))
                    partial.setdefault(key[1], {})[part] = out
        self.driver.end_layer(layer)
        for expert, by_part in partial.items():  # parts summed in the part order
            out = None
            for part in self.parts:
                if part in by_part:
                    out = by_part[part] if out is None else out + by_part[part]
            alone(expert, out)
        for expert, handle in on_host.items():
            alone(expert, self.host.result(handle))
        if rows is None:  # nothing computed: every expert skipped
            return torch.zeros_like(hidden)
        return combine(rows, T, K, hidden.dtype)

    def _ready_and_host(self, module, layer, hidden, top_k_index, top_k_weights, index, work):
        """A CPU's layer of several tokens whose device experts (whole, in the stacked or the joint pool)
        have all landed, the rest computed on the host (a batch's misses at most budgets under ``batch``,
        ``host``, ``hybrid``): the device experts in one grouped call over the layer's pairs, the host's
        pairs last in its order and left out of its groups (``grouped_rows``' sentinel slot), then each
        host expert's weighted output in its rows. The same rows, bit for bit, as the general way's (one
        group of the device experts' pairs alone, in the same order; each host expert alone on its pairs
        in transformers' order) with far fewer calls around them. None, having waited for nothing,
        where it does not apply (an expert not whole in those pools, or still moving)."""
        units = work.chunks[0] if work.chunks else []
        stacked, joint, offsets = self.stacked, self._joint, self._offsets
        if joint is not None and all(ps[0] in offsets and len(ps) == 1 for _, ps in units):
            pool, slots = joint, self._joint_slots(layer, [(key, ps[0]) for key, ps in units])
        elif self._only_full or all(ps == (FULL,) for _, ps in units):
            pool = stacked  # the units' slots alone: a host expert being filled has a slot, its bytes moving
            slots = np.full(self.table.host.shape[1], stacked.num_slots, dtype=np.int64)
            experts = [key[1] for key, _ in units]
            slots[experts] = self.table.host[layer, experts]
        else:
            return None
        inflight = self.driver.cache.inflight  # a device expert still moving (or landed, not yet waited
        if inflight and any((part, key) in inflight for key, parts in units for part in parts):  # for)
            return None
        # nothing of the layer's to wait for, its one chunk admitted when the work started
        K = index.shape[1]
        flat_index = index.reshape(-1)
        ref = reference_order(top_k_index).numpy()  # transformers' order of the layer's pairs
        pair_slots = slots[flat_index]
        here = pair_slots[ref] < pool.num_slots
        order = torch.from_numpy(np.concatenate([ref[here], ref[~here]]))
        ids_in_order = flat_index[ref]
        host = []
        for need in work.host:  # each host expert's pairs in that order, and its tokens in it (a route
            key = need.key  # sends an expert to the host or to the device, never both: ``LayerWork``)
            flat = ref[ids_in_order == key[1]]
            host.append((flat, self.host.submit(module, key, hidden[torch.from_numpy(flat // K)])))
        if units:
            rows = self._rows(module, pool, hidden, torch.from_numpy(pair_slots).view(index.shape),
                              top_k_weights, order)  # fmt: skip
        else:  # every expert the host's: no device call, each pair's row the host's (as the general way)
            kind = torch.promote_types(hidden.dtype, top_k_weights.dtype)
            rows = torch.zeros(flat_index.size, hidden.shape[-1], dtype=kind, device=hidden.device)
        self.driver.end_layer(layer)
        weights = top_k_weights.reshape(-1)
        for flat, handle in host:
            at = torch.from_numpy(flat)
            rows[at] = (self.host.result(handle) * weights[at, None]).to(rows.dtype)
        return rows

    def _joint_slots(self, layer: int, units) -> np.ndarray:
        """Each expert's slot in the joint pool [E] for the units (whole experts of the joint pools), the
        sentinel for the others: the slot of the part each unit is computed from (an expert may be in
        the cache and in the stream buffer at once)."""
        slots = np.full(self.table.host.shape[1], self._joint.num_slots, dtype=np.int64)
        pools, offsets = self.pools, self._offsets
        for (_, expert), part in units:
            slots[expert] = pools[part][1].host[layer, expert] + offsets[part]
        return slots

    def close(self) -> None:
        """Stop the threads and detach from the model. Detaching breaks the cycle model -> experts
        modules -> engine -> model, so that a closed model's memory (every expert in host memory, the
        slots) is freed when the last reference to it goes, not at some later garbage collection: a
        sweep loading one model after another in one process held every closed one until then."""
        self._hook.remove()
        self._out_hook.remove()
        for hook in self._router_hooks:
            hook.remove()
        self.driver.close()
        self.host.close()
        self.transport.worker.close()
        if self.transport.stage_worker is not None:
            self.transport.stage_worker.close()
        for module in self._experts:
            module._expertcache_engine = None
        self._experts = []
