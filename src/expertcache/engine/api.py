"""``expertcache.load``: a Hugging Face MoE checkpoint with its experts behind a bounded cache."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from expertcache.engine.cache import ExpertCache
from expertcache.engine.link import EmulatedLink
from expertcache.engine.loader import build_skeleton
from expertcache.engine.memory import SlotLayout, SlotPool, capacity_for, format_bytes, parse_size
from expertcache.engine.routing import router_fns
from expertcache.engine.runtime import Engine
from expertcache.engine.transfer import DiskTier, HostTier, TransferWorker
from expertcache.errors import ExpertcacheError, first_line
from expertcache.policy.base import Clock, PolicyContext
from expertcache.policy.registry import is_offline, make_policy, min_capacity, parse_policy, policy_class
from expertcache.predict.base import PredictContext
from expertcache.predict.registry import make_predictor, predictor_class
from expertcache.sim.api import default_trace
from expertcache.sim.schedule import build_schedule
from expertcache.trace.trace import Trace, load_trace

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "data" / "default"


def default_model_path() -> Path:
    return DEFAULT_MODEL


@dataclass
class Generation:
    """One generate() call: tokens, text, timings and the cache's work during it."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    total_s: float
    stats: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.tokens),
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "tokens_per_s": self.tokens_per_s,
            "total_s": self.total_s,
            **self.stats,
        }


class TokenTimer:
    """A generate() streamer that timestamps every new token (``times``), forwarding to another one."""

    def __init__(self, inner=None) -> None:
        self.inner, self.times, self._prompt_seen = inner, [], False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


def timed_generate(generate, ids: torch.Tensor, streamer=None, **kwargs) -> dict[str, object]:
    """Run ``generate(ids, streamer=..., **kwargs)`` (a transformers-style generate) and time it:
    the new tokens of row 0, TTFT (start to first new token), TPOT (mean gap between new tokens),
    tokens per second over the whole call."""
    timer = TokenTimer(streamer)
    start = time.perf_counter()
    out = generate(ids, streamer=timer, **kwargs)
    total = time.perf_counter() - start
    new = out[0, ids.shape[1] :].tolist()
    times = timer.times
    return {
        "tokens": new,
        "prompt_tokens": int(ids.shape[1]),
        "new_tokens": len(new),
        "ttft_s": (times[0] - start) if times else total,
        "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0,
        "tokens_per_s": len(new) / total if total > 0 else 0.0,
        "total_s": total,
    }


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ExpertcacheError(f"device {device!r} is not a torch device (cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ExpertcacheError("device cuda was asked for, but torch sees no CUDA GPU (use --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise ExpertcacheError(f"device {device!r} is not supported (cpu or cuda)")
    return dev


class OffloadedModel:
    """A causal LM whose experts stream through a bounded cache; use like a transformers model."""

    def __init__(
        self,
        path: str | Path | None = None,
        expert_memory: str | int | float = "100%",
        policy: str = "lru",
        device: str | torch.device | None = None,
        dtype=None,
        link_bandwidth: str | float | None = None,
        link_latency: str | float = 0.0,
        slow_tier: str | None = None,
        profile: str | Path | Trace | None = None,
        seed: int = 0,
        progress: bool | None = None,
        record: bool = True,
        prefetch: str | None = "none",
        window: int | None = None,
        predictor: str | Path | Trace | None = None,
        chunking: bool = True,
        chunk_size: str | int | None = None,
        preemption: bool = True,
        reorder: bool = True,
        prefetch_limit: int | None = None,
        predictor_thread: bool = False,
    ) -> None:
        self.path = Path(path) if path is not None else DEFAULT_MODEL
        self.device = _device(device)
        prefetch = "none" if prefetch in (None, "none") else str(prefetch)
        if prefetch != "none":
            pcls = predictor_class(prefetch)
            if pcls.sim_only:
                raise ExpertcacheError(
                    f"predictor {prefetch} needs the future (simulator only); "
                    "use it with 'expertcache timing'"
                )
        if window is not None and int(window) < 1:
            raise ExpertcacheError(f"prefetch window must be at least 1 layer, got {window}")
        chunk_bytes = parse_size(chunk_size, "chunk size") if chunk_size is not None else None
        if prefetch_limit is not None and int(prefetch_limit) < 1:
            raise ExpertcacheError(
                f"prefetch limit must be at least 1 expert per layer, got {prefetch_limit}"
            )
        if chunk_bytes is not None and chunk_bytes < 1:
            raise ExpertcacheError(f"chunk size must be positive, got {chunk_size}")
        name, params = parse_policy(policy)
        if is_offline(name):
            raise ExpertcacheError(
                f"policy {name} needs the future (simulator only); use it with 'expertcache sim'"
            )
        tier = slow_tier or ("host" if self.device.type == "cuda" else "disk")
        if tier not in ("host", "disk"):
            raise ExpertcacheError(f"slow tier {slow_tier!r} is not one of: host, disk")
        self.link = EmulatedLink.parse(link_bandwidth, link_latency)
        show = sys.stderr.isatty() if progress is None else progress
        sk = build_skeleton(self.path, dtype, progress=show)
        self.config, self.family, self.dtype = sk.config, sk.family, sk.dtype
        self.num_layers, self.num_experts, self.top_k = len(sk.experts), sk.num_experts, sk.top_k
        layout = SlotLayout.of(sk.shapes, sk.dtype)
        self.layout = layout
        total = self.num_layers * self.num_experts
        capacity = capacity_for(expert_memory, layout.slot_bytes, total)
        need = min_capacity(name, self.num_layers, params, min_room=self.top_k)
        if capacity < need:
            raise ExpertcacheError(
                f"expert memory {expert_memory} holds {capacity} expert(s) of "
                f"{format_bytes(layout.slot_bytes)}; "
                f"policy {name} needs at least {need} ({format_bytes(need * layout.slot_bytes)}): "
                f"a layer's top-{self.top_k} experts must be resident together"
            )
        self.capacity = capacity
        self.policy_name = policy
        prof = None
        if policy_class(name).needs_profile:
            if profile is None:
                raise ExpertcacheError(f"policy {name} ranks experts by a usage profile: pass profile=TRACE")
            tr = profile if isinstance(profile, Trace) else load_trace(profile)
            if (tr.num_layers, tr.num_experts) != (self.num_layers, self.num_experts):
                raise ExpertcacheError(
                    f"profile trace has {tr.num_layers} layers x {tr.num_experts} experts, the model "
                    f"{self.num_layers} x {self.num_experts}"
                )
            prof = build_schedule(tr, "layer").profile
        ctx = PolicyContext(
            capacity=capacity,
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            clock=Clock(),
            seed=seed,
            profile=prof,
        )
        pol = make_policy(name, ctx, **params)
        low = [layer for layer in range(self.num_layers) if pol.room(layer) < self.top_k]
        if low:
            raise ExpertcacheError(
                f"policy {name} gives layer {low[0]} {pol.room(low[0])} slot(s), below top-k {self.top_k}"
            )
        if tier == "host":
            bar = _progress("experts to host memory", show)
            self.tier = HostTier(
                sk.store,
                layout,
                self.num_layers,
                self.num_experts,
                pin=self.device.type == "cuda",
                progress=bar,
            )
        else:
            self.tier = DiskTier(sk.store, layout, self.device)
        self.pool = SlotPool(layout, capacity, self.device)
        if not chunking:
            chunk_bytes = None
        elif chunk_bytes is None:  # the expert's three matrices
            chunk_bytes = -(-layout.nbytes // 3)
        self.chunk_bytes = None if chunk_bytes is None else int(chunk_bytes)
        worker = TransferWorker(self.tier, self.pool, self.link, chunk_bytes=self.chunk_bytes)
        # ProMoE: as many experts per predicted layer as the model activates for one token
        self.prefetch_limit = self.top_k if prefetch_limit is None else int(prefetch_limit)
        self.cache = ExpertCache(
            pol,
            self.pool,
            worker,
            self.num_layers,
            limit=self.prefetch_limit,
            preemption=preemption,
            reorder=reorder,
        )
        self.model = sk.model.to(self.device)
        self.prefetch = prefetch
        self.predictor = None
        if prefetch != "none":
            self.predictor = self._make_predictor(prefetch, window, predictor, seed)
        self.engine = Engine(
            self.model,
            sk.experts,
            self.cache,
            self.top_k,
            record=record,
            predictor=self.predictor,
            predictor_thread=predictor_thread,
        )
        self._tokenizer = None

    def _make_predictor(self, name: str, window, source, seed: int):
        routers = router_fns(self.model)
        trace = source if isinstance(source, Trace) else None
        path = None
        if source is not None and trace is None:
            src = Path(source)
            if src.is_file() and src.suffix == ".npz":
                trace = load_trace(src)
            elif src.is_dir():
                path = str(src)
            else:
                raise ExpertcacheError(
                    f"{src}: predictor data must be a trained predictor directory or a .npz trace"
                )
        if trace is None and source is None and self.path == DEFAULT_MODEL:
            trace = default_trace()  # token's table and eam's warm start on the embedded model
        if trace is not None and (trace.num_layers, trace.num_experts) != (self.num_layers, self.num_experts):
            raise ExpertcacheError(
                f"predictor trace has {trace.num_layers} layers x {trace.num_experts} experts, the model "
                f"{self.num_layers} x {self.num_experts}"
            )
        ctx = PredictContext(
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            window=None if window is None else int(window),
            routers=routers,
            trace=trace,
            path=path,
            seed=seed,
        )
        return make_predictor(name, ctx)

    # ----------------------------------------------------------------- transformers-style use
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(str(self.path))
            except Exception as exc:
                raise ExpertcacheError(f"{self.path}: no usable tokenizer ({first_line(exc)})") from None
        return self._tokenizer

    def __call__(self, *args, **kwargs):
        with torch.inference_mode():
            return self.model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """``transformers`` ``generate`` on the offloaded model (greedy unless asked otherwise)."""
        kwargs.setdefault("do_sample", False)
        with torch.inference_mode():
            return self.model.generate(*args, **kwargs)

    # ------------------------------------------------------------------------ text in, text out
    def encode(self, prompt: str) -> torch.Tensor:
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            raise ExpertcacheError("the prompt is empty")
        return ids

    def generate_text(self, prompt: str, max_new_tokens: int = 32, streamer=None, **kwargs) -> Generation:
        """Generate from a text prompt; returns tokens, text, TTFT/TPOT and the cache's work."""
        if max_new_tokens < 1:
            raise ExpertcacheError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        ids = self.encode(prompt)
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and ids.shape[1] + max_new_tokens > limit:
            raise ExpertcacheError(
                f"prompt of {ids.shape[1]} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"context of {limit}"
            )
        before = self.stats
        pad = self.tokenizer.pad_token_id
        run = timed_generate(
            self.generate,
            ids.to(self.device),
            streamer,
            attention_mask=torch.ones_like(ids).to(self.device),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad if pad is not None else self.tokenizer.eos_token_id,
            **kwargs,
        )
        after = self.stats
        delta = {
            "hits": after["hits"] - before["hits"],
            "misses": after["misses"] - before["misses"],
            "bytes_transferred": after["bytes_transferred"] - before["bytes_transferred"],
            "stall_s": after["stall_s"] - before["stall_s"],
            "decode_stall_s": after["decode_stall_s"] - before["decode_stall_s"],
            "prefill_stall_s": after["prefill_stall_s"] - before["prefill_stall_s"],
            **{
                k: after[k] - before[k]
                for k in ("prefetch_issued", "prefetch_used", "prefetch_late", "prefetch_cancelled")
            },
            **self.prefetch_config,
            "capacity_experts": self.capacity,
            "total_experts": self.num_layers * self.num_experts,
            "expert_bytes": self.layout.nbytes,
            "policy": self.policy_name,
            "device": str(self.device),
        }
        return Generation(
            tokens=run["tokens"],
            text=self.tokenizer.decode(run["tokens"], skip_special_tokens=True),
            prompt_tokens=run["prompt_tokens"],
            ttft_s=run["ttft_s"],
            tpot_s=run["tpot_s"],
            tokens_per_s=run["tokens_per_s"],
            total_s=run["total_s"],
            stats=delta,
        )

    # ------------------------------------------------------------------------------- reports
    @property
    def stats(self) -> dict[str, object]:
        """The cache's work since load: hits, misses, bytes moved, stall time, per layer too."""
        return {
            **self.cache.stats.to_dict(),
            "capacity_experts": self.capacity,
            "total_experts": self.num_layers * self.num_experts,
            "expert_bytes": self.layout.nbytes,
            "expert_memory_bytes": self.capacity * self.layout.slot_bytes,
            "policy": self.policy_name,
            "device": str(self.device),
            "slow_tier": self.tier.name,
            "link": self.link.describe() if self.link else None,
            **self.prefetch_config,
            **self.cache.proactive.stats.to_dict(),
            "retried_chunks": self.cache.worker.retried,
        }

    @property
    def prefetch_config(self) -> dict[str, object]:
        """How transfers are scheduled: predictor, window, chunk size, preemption, reordering."""
        pro = self.cache.proactive
        return {
            "prefetch": self.prefetch,
            "window": self.predictor.window if self.predictor is not None else None,
            "prefetch_limit": pro.limit,
            "predictor_thread": self.engine.predictor_thread is not None,
            "chunk_bytes": self.chunk_bytes,
            "preemption": pro.preemption,
            "reorder": pro.reorder,
        }

    def trace(self) -> Trace:
        """The routing of everything run since load, in the simulator's trace format."""
        if self.engine.recorder is None:
            raise ExpertcacheError("routing was not recorded: load with record=True to get a trace")
        meta = {"model": str(self.path), "policy": self.policy_name, "capacity": self.capacity}
        if self.predictor is not None:
            meta.update(predictor=self.prefetch, window=self.predictor.window)
        return self.engine.recorder.trace(meta=meta)

    def save_trace(self, path: str | Path) -> None:
        self.trace().save(path)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> OffloadedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def model_info(path: str | Path | None = None) -> dict[str, object]:
    """What a checkpoint holds, without reading any expert: family, MoE layers, experts, bytes."""
    sk = build_skeleton(path if path is not None else DEFAULT_MODEL)
    layout = SlotLayout.of(sk.shapes, sk.dtype)
    total = len(sk.experts) * sk.num_experts
    dense = sum(t.numel() * t.element_size() for t in sk.model.state_dict().values())
    return {
        "path": str(path if path is not None else DEFAULT_MODEL),
        "family": sk.family.name,
        "dtype": str(sk.dtype).removeprefix("torch."),
        "moe_layers": len(sk.experts),
        "experts_per_layer": sk.num_experts,
        "top_k": sk.top_k,
        "expert_bytes": layout.nbytes,
        "all_experts_bytes": total * layout.nbytes,
        "dense_bytes": dense,
        "min_expert_memory_bytes": sk.top_k * layout.slot_bytes,
    }


def _progress(desc: str, show: bool):
    if not show:
        return None
    from tqdm.auto import tqdm

    return lambda items: tqdm(items, desc=desc, unit="expert", leave=False)


def load(
    path: str | Path | None = None,
    expert_memory: str | int | float = "100%",
    policy: str = "lru",
    device: str | torch.device | None = None,
    **kwargs,
) -> OffloadedModel:
    """Load a Hugging Face MoE checkpoint (default: the embedded demo model) with experts offloaded.

    ``expert_memory`` is bytes (``"6GiB"``, ``500_000_000``) or a share of all expert bytes (``"30%"``);
    ``policy`` any online policy of the library (``"lru"``, ``"llru"``, ``"lfu-dist"``, ``"lru:param=v"``).
    Further options: ``dtype``, ``link_bandwidth`` / ``link_latency`` (emulated link), ``slow_tier``
    (``"host"`` or ``"disk"``), ``profile`` (a trace, for ``static``), ``seed``, ``progress``, ``record``
    (keep the routing for ``trace()``; on by default, a few bytes per token and layer).
    Proactive caching: ``prefetch`` (a predictor name: ``"next-gate"``, ``"window"``, ``"learned"``,
    ``"token"``, ``"eam"``; ``"none"`` by default), ``window`` (layers ahead), ``predictor`` (a trained
    predictor directory for ``learned``, a recorded trace for ``token``/``eam``), ``chunking`` and
    ``chunk_size`` (default: a third of an expert), ``preemption``, ``reorder`` (both on),
    ``prefetch_limit`` (experts prefetched per predicted layer; default top-k, as ProMoE),
    ``predictor_thread`` (run the predictor on a thread beside inference instead of inline).
    """
    return OffloadedModel(path, expert_memory=expert_memory, policy=policy, device=device, **kwargs)
