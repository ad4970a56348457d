"""The engine at run time: the registered experts forward, step tracking and routing capture.

``expertcache_experts_forward`` is registered in transformers' ``ExpertsInterface`` under the name
``"expertcache"``; every ``...Experts`` module of a model built with that implementation calls it
with ``(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``. It takes the layer's distinct
experts in first-use order (``cache.group_experts``, the rule the simulator applies to a trace),
has the cache make them resident chunk by chunk, computes each expert exactly as transformers'
eager loop does, and adds the contributions in ascending expert order, as eager does, so the output
is bit-identical whatever order the experts became resident in.
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch.nn import functional as F
from transformers.integrations.moe import ExpertsInterface

from expertcache.cache.residency import group_experts
from expertcache.engine.cache import ExpertCache
from expertcache.errors import ExpertcacheError
from expertcache.trace.trace import Trace

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


def _expert_output(module, views, x: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens, with the operations of transformers' eager loop for the family."""
    if module.is_transposed:  # GPT-OSS: x @ W + b
        h = x @ views["gate_up_proj"] + views["gate_up_proj_bias"]
        h = module._apply_gate(h)
        return h @ views["down_proj"] + views["down_proj_bias"]
    gate, up = F.linear(x, views["gate_up_proj"]).chunk(2, dim=-1)
    h = module.act_fn(gate) * up
    return F.linear(h, views["down_proj"])


class Recorder:
    """Routing of every step (for ``--record-trace``): experts, weights, token ids, phase, sequence."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.steps: list[dict[str, object]] = []
        self.predicted = False  # some step recorded predictions

    def begin(self, token_ids: np.ndarray, prefill: bool, seq: np.ndarray) -> None:
        """A step of ``token_ids`` (rows flattened); ``seq`` gives each token's sequence id."""
        self.steps.append(
            {"token_id": token_ids, "prefill": prefill, "seq": seq, "experts": {}, "weights": {}, "pred": {}}
        )

    def predict(self, predictions: dict[int, list[int]]) -> None:
        """What the predictor said this step: target layer -> ranked experts."""
        if self.steps and predictions:
            self.steps[-1]["pred"].update(predictions)
            self.predicted = True

    def add(self, layer: int, index: np.ndarray, weights: torch.Tensor) -> None:
        step = self.steps[-1]
        step["experts"][layer] = index.astype(np.int16)
        step["weights"][layer] = weights.detach().to("cpu", torch.float32).numpy()

    def trace(self, meta: dict[str, object] | None = None) -> Trace:
        L, K = self.num_layers, self.top_k
        ex, wt, tok, pf, seq, step, pred = [], [], [], [], [], [], []
        for i, s in enumerate(self.steps):
            t = len(s["token_id"])
            e = np.full((t, L, K), -1, dtype=np.int16)
            w = np.zeros((t, L, K), dtype=np.float32)
            for layer, idx in s["experts"].items():
                e[:, layer] = idx
                w[:, layer] = s["weights"][layer]
            p = np.full((t, L, K), -1, dtype=np.int16)
            for layer, ranked in s["pred"].items():  # the step's ranked list, spread over its rows
                block = np.full(t * K, -1, dtype=np.int16)
                flat = ranked[: t * K]
                block[: len(flat)] = flat
                p[:, layer] = block.reshape(t, K)
            pred.append(p)
            ex.append(e)
            wt.append(w)
            tok.append(s["token_id"])
            pf.append(np.full(t, 1 if s["prefill"] else 0, dtype=np.int8))
            seq.append(s["seq"])
            step.append(np.full(t, i, dtype=np.int32))
        if not ex:
            raise ExpertcacheError("nothing was generated yet: the trace is empty")
        return Trace(
            experts=np.concatenate(ex),
            num_experts=self.num_experts,
            weights=np.concatenate(wt),
            seq_id=np.concatenate(seq),
            is_prefill=np.concatenate(pf),
            token_id=np.concatenate(tok).astype(np.int32),
            step_id=np.concatenate(step),
            predicted=np.concatenate(pred) if self.predicted else None,
            meta=dict(meta or {}),
        )


class PredictorThread:
    """A predictor run beside inference, on a thread of its own (ProMoE runs its MLPs on the CPU beside
    the GPU): the compute thread queues each call and goes on; one thread runs them in order, so a
    predictor with state (``eam``, ``token``) sees its calls as it would inline. ``ready()`` hands back,
    without waiting, the finished predictions of the current step in call order; those of an earlier
    step are dropped (their layers have been computed)."""

    def __init__(self, predictor) -> None:
        self.predictor = predictor
        self.window = predictor.window
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="expertcache-predict")
        self._pending: deque[tuple[int, Future]] = deque()
        self.step = 0
        self.calls = 0  # queued
        self.collected = 0  # handed back within their step
        self.stale = 0  # handed back after their step was over (dropped)

    def begin_step(self, *args) -> None:
        self.step += 1
        self._submit(self.predictor.begin_step, args)

    def after_router(self, *args) -> None:
        self._submit(self.predictor.after_router, args)

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


def _inference(fn, args):
    with torch.inference_mode():  # inference mode is per thread
        return fn(*args)


class Engine:
    """Runs a model's experts through an ``ExpertCache``; tracks forward steps with a pre-hook.

    With a predictor, every step asks it for predictions at the step's start and after each layer's
    router, and the cache prefetches them (``Proactive``): after the layer's own misses are queued,
    before its experts are computed, so the transfers overlap the computation. With
    ``predictor_thread`` the predictor runs beside the computation instead (``PredictorThread``), and
    what it has finished is prefetched at the next layer boundary (before and after each layer's
    experts), for layers still ahead."""

    def __init__(
        self,
        model: torch.nn.Module,
        experts: list[torch.nn.Module],
        cache: ExpertCache,
        top_k: int,
        record: bool = True,
        predictor=None,
        predictor_thread: bool = False,
    ):
        self.model, self.cache, self.top_k = model, cache, top_k
        self.predictor = predictor
        self.predictor_thread = PredictorThread(predictor) if predictor and predictor_thread else None
        self.num_layers = len(experts)
        self.num_experts = int(experts[0].num_experts)
        for layer, module in enumerate(experts):
            module._expertcache_engine = self
            module._expertcache_layer = layer
        self.recorder = Recorder(self.num_layers, self.num_experts, top_k) if record else None
        self._tokens = 0  # tokens run so far (the clock's token counter)
        self._seq = 0  # sequences started so far (one per row of each prefill)
        self._hook = model.register_forward_pre_hook(self._begin_step, with_kwargs=True)

    def _begin_step(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ExpertcacheError("the engine needs input_ids (inputs_embeds alone is not supported)")
        past = kwargs.get("past_key_values")
        prefill = past is None or past.get_seq_length() == 0
        rows, cols = ids.shape if ids.dim() == 2 else (1, ids.numel())
        if prefill:
            self._seq += rows
        seq = np.repeat(np.arange(self._seq - rows, self._seq, dtype=np.int32), cols)
        flat = ids.detach().reshape(-1).to("cpu").numpy().astype(np.int32)
        self.cache.begin_step(self._tokens, prefill, self._seq - rows)
        if self.recorder is not None:
            self.recorder.begin(flat, prefill, seq)
        self._tokens += len(flat)
        if self.predictor_thread is not None:
            self.predictor_thread.begin_step(flat, prefill, prefill)
        elif self.predictor is not None:
            self._prefetch(self.predictor.begin_step(flat, prefill, prefill), ())
        return None

    def _collect(self, layer: int, current) -> None:
        """Prefetch what the predictor thread has finished, for the layers still ahead of ``layer``."""
        for predictions in self.predictor_thread.ready():
            self._prefetch({t: r for t, r in predictions.items() if t > layer}, current)

    def _prefetch(self, predictions: dict[int, list[int]], current) -> None:
        if predictions:
            if self.recorder is not None:
                self.recorder.predict(predictions)
            self.cache.prefetch(predictions, current)

    def run_experts(self, module, layer, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        index = top_k_index.detach().cpu().numpy()  # one host copy: grouping, recording, predicting
        if self.recorder is not None:
            self.recorder.add(layer, index, top_k_weights)
        order = group_experts(index.tolist())
        outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        serving = self.cache.serve(layer, order)
        first = next(serving)  # the layer's misses are queued (and its stale prefetches dropped)
        current = [(layer, e) for e in order] if self.predictor is not None else ()
        if self.predictor_thread is not None:
            self._collect(layer, current)
            self.predictor_thread.after_router(layer, index, hidden)
        elif self.predictor is not None:
            self._prefetch(self.predictor.after_router(layer, index, hidden), current)
        for expert, views in itertools.chain((first,), serving):
            top_k_pos, token_idx = torch.where(expert == top_k_index.T)
            out = _expert_output(module, views, hidden[token_idx])
            outputs[expert] = (token_idx, out * top_k_weights[token_idx, top_k_pos, None])
        if self.predictor_thread is not None:
            self._collect(layer, current)
        final = torch.zeros_like(hidden)
        for expert in sorted(outputs):  # eager's order of accumulation
            token_idx, out = outputs[expert]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def close(self) -> None:
        self._hook.remove()
        if self.predictor_thread is not None:
            self.predictor_thread.close()
        self.cache.worker.close()
