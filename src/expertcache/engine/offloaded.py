"""``expertcache.load``: a Hugging Face MoE checkpoint with its experts behind a bounded cache."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from expertcache.cache.build import assemble, build_parts, part_capacities
from expertcache.cache.recorder import Recorder
from expertcache.cache.schedule import build_schedule
from expertcache.cache.stats import CacheStats
from expertcache.cache.step import InlinePredictor, StepDriver
from expertcache.cache.transfers import DEMAND
from expertcache.config import (
    AUTO,
    CacheConfig,
    LinkConfig,
    MissConfig,
    PrefetchConfig,
    SamplingConfig,
    as_config,
)
from expertcache.costs import AUTO_CHUNKS, CostModel, chunks_pay
from expertcache.engine import generation as gen
from expertcache.engine.generation import Generation, timed_generate
from expertcache.engine.host import HostExperts
from expertcache.engine.hub import DEFAULT_MODEL, model_label, resolve_model
from expertcache.engine.kernels import AUTO_KERNEL, KERNELS, Kernel, StackedPool, resolve_kernel
from expertcache.engine.link import EmulatedLink
from expertcache.engine.loader import build_skeleton
from expertcache.engine.memory import SlotLayout, SlotPool, available_memory, resident_memory
from expertcache.engine.parts import EnginePart, full_part, quantized_part, segment_part
from expertcache.engine.routing import router_fns
from expertcache.engine.runtime import Engine, PredictorThread
from expertcache.engine.slots import SlotTable, SlotTransport
from expertcache.engine.transfer import SLOW_TIERS, DiskTier, HostTier, Target, TransferWorker
from expertcache.errors import ExpertcacheError, first_line
from expertcache.miss.base import FULL, MissContext, PartSpec
from expertcache.miss.registry import miss_class
from expertcache.plan import Plan, as_plan
from expertcache.policy.base import Clock, PolicyContext
from expertcache.policy.registry import policy_class
from expertcache.predict.base import PredictContext
from expertcache.predict.registry import make_predictor, predictor_class
from expertcache.trace.default import default_trace
from expertcache.trace.trace import Trace, load_trace
from expertcache.units import format_bytes, parse_size

WARMUP_TOKENS = 32  # the prompt of the warm-up generation at load (every expert resident)


def default_model_path() -> Path:
    return DEFAULT_MODEL


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch device (None: CUDA when torch sees a GPU); one clear line when unusable."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ExpertcacheError(f"device {device!r} is not a torch device (cpu, cuda, cuda:1)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ExpertcacheError(f"device {device!r} is not supported (cpu or cuda)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ExpertcacheError(
            f"device {device} was asked for, but torch {torch.__version__} sees no GPU ({why})"
        )
    return dev


class OffloadedModel:
    """A causal LM whose experts stream through a bounded cache; use like a transformers model.

    Built from one config object per domain (``cache``, ``prefetch``, ``link``, ``miss``), each
    validated on creation; ``expertcache.load`` builds them from keyword arguments."""

    def __init__(
        self,
        path: str | Path | None = None,
        expert_memory: str | int | float = "100%",
        *,
        cache: CacheConfig | None = None,
        prefetch: PrefetchConfig | None = None,
        link: LinkConfig | None = None,
        miss: MissConfig | None = None,
        device: str | torch.device | None = None,
        dtype=None,
        slow_tier: str | None = None,
        costs: CostModel | None = None,
        progress: bool | None = None,
        record: bool = True,
        download: bool = False,
        plan: Plan | None = None,
        warmup: bool = True,
        kernel: str | None = None,
    ) -> None:
        self.path = resolve_model(path, download)
        self.plan = plan
        self.notes: list[str] = []  # one line each, for the user: what was adjusted and why
        self.cache_config = cache = cache or CacheConfig()
        self.prefetch_config_ = prefetch = prefetch or PrefetchConfig(AUTO)
        self.link_config = link = link or LinkConfig()
        self.miss_config = miss = miss or MissConfig()
        self.device = resolve_device(device)
        self._check_cheap(cache, prefetch, slow_tier, expert_memory, kernel)
        self.link = EmulatedLink(link.bandwidth_Bps, link.latency_s) if link.emulated else None
        show = sys.stderr.isatty() if progress is None else progress
        sk = build_skeleton(self.path, dtype, progress=show)
        self.config, self.family, self.dtype = sk.config, sk.family, sk.dtype
        self.num_layers, self.num_experts, self.top_k = len(sk.experts), sk.num_experts, sk.top_k
        self.layout = SlotLayout.of(sk.shapes, sk.dtype)  # one whole expert
        if plan is not None:  # its budget is in experts: the timing model's unit
            plan.check_model(self.num_layers, self.num_experts, self.top_k, f"model {model_label(self.path)}")
            expert_memory = plan.capacity * self.layout.slot_bytes
        self.miss = miss_class(miss.name)(
            MissContext(self.num_layers, self.num_experts, self.top_k, costs=costs), **miss.params
        )
        self.parts = self._engine_parts(sk)
        slot_bytes = {name: p.slot_bytes() for name, p in self.parts.items()}
        self.budget = self._budget(expert_memory, cache)
        self.capacities = part_capacities(self.miss, self.budget, slot_bytes, self.top_k)
        primary = self.capacities[self.miss.parts()[0].name]
        self.capacity = sum(primary) if isinstance(primary, list) else primary  # keys of the primary part
        if self.capacity == 0 and self.budget > 0:
            self.notes.append(
                f"miss path {self.miss.describe()} computes every expert on the host: the expert memory "
                f"({format_bytes(self.budget)}) holds none and is not used"
            )
        self._check_fits(slow_tier)
        self.tier = self._tier(sk, slow_tier, show)
        self._weight_files = sorted({Path(f) for f in sk.store.ckpt.files.values()})  # for stats' memory
        # nothing to offload (the plain fetch path, every expert fits): every slot is filled at load
        self._whole = miss.name == "fetch" and self.capacity >= self.num_layers * self.num_experts
        self.targets = self._targets(show)  # (part, layer or None) -> its slots and their source
        self.pool = next(iter(self.targets.values())).pool
        # prefetching only while it pays has nothing to do when every expert is resident from the start
        idle = prefetch.governed and self._whole
        chunked = prefetch.chunked(background=miss.name != "fetch") and not idle
        self.worker = TransferWorker(link=self.link, parts=self.targets)
        self.chunking = self._chunking(prefetch) if chunked else None
        self.worker.chunk_bytes = self.chunk_bytes = self.chunking["chunk_bytes"] if chunked else None
        self.kernel, stacked, table = self._kernel(kernel, sk.experts[0])
        tables = {} if table is None else {(FULL, None): table}
        settle = prefetch.deterministic
        self.transport = SlotTransport(self.targets, self.worker, settle=settle, tables=tables)
        self._policy_ctx = self._policy_context(cache)
        residencies = build_parts(self.miss, self.capacities, cache.policy, self._policy_ctx)
        self.model = sk.model.to(self.device)
        self.host = HostExperts(self.tier, self.device)
        if self.miss.needs_costs and costs is None:
            from expertcache.engine.calibrate import calibrate

            measured = calibrate(self, sk.experts[0])
            self.miss.ctx = dataclasses.replace(self.miss.ctx, costs=measured)
            if prefetch.deterministic:
                self.notes.append(
                    f"miss path {self.miss.name} decides by costs measured at load, which differ from run to "
                    "run: give them (load(costs=CostModel.load(PROFILE.json))) for a run that repeats"
                )
        self._measured_costs = self.miss.needs_costs and costs is None
        self.costs = self.miss.ctx.costs
        self.prefetch = self._auto_predictor(prefetch) if prefetch.predictor == AUTO else prefetch.predictor
        idle_prefetch = prefetch.governed and self._whole
        self.predictor = self._make_predictor(prefetch) if prefetch.enabled and not idle_prefetch else None
        if self.predictor is not None and self.predictor.note:
            self.notes.append(self.predictor.note)
        runner = None
        if self.predictor is not None:
            runner = PredictorThread(self.predictor) if prefetch.thread else InlinePredictor(self.predictor)
        self.driver = assemble(
            residencies, self.transport, self.miss, self._policy_ctx, limit=prefetch.limit,
            preemption=prefetch.preemption, reorder=prefetch.reorder, predictor=runner,
            governor_clock=time.perf_counter if prefetch.governed else None,
            recorder=Recorder(self.num_layers, self.num_experts, self.top_k) if record else None,
        )  # fmt: skip
        self.cache, self.governor = self.driver.cache, self.driver.governor
        self.prefetch_limit = self.cache.limit
        self.engine = Engine(
            self.model, sk.experts, self.driver, self.transport, self.parts, self.host,
            kernel=self.kernel, stacked=stacked, table=table,
        )  # fmt: skip
        self._tokenizer = None
        self.preloaded = self._preload(show)
        self.warmup_s = self._warm_up() if warmup and self._whole else None

    # -- construction ------------------------------------------------------------------------------
    def _preload(self, show: bool) -> int:
        """With the plain fetch path and a budget that holds every expert, there is nothing to offload:
        every expert is read into its slot now (a progress bar), as a model loads its weights, through the
        policy's inserts and the transfer worker a miss takes; the first request then finds them all
        resident (no first-use misses, no stall). The cache's work counts from the first step: these are
        in ``preloaded_experts``, not in misses, bytes moved or stall. Returns how many."""
        if not self._whole:
            return 0
        import contextlib

        keys = [(layer, e) for layer in range(self.num_layers) for e in range(self.num_experts)]
        residency, part = self.cache.residency, self.cache.primary
        bar = _progress("experts to expert memory", show)
        # the checkpoint's tiers note each expert's copy and read them all at once after, in long runs of
        # the files on several threads (``ExpertStore.fill``); the host tier copies each from memory
        store = getattr(self.tier, "store", None)
        with store.collecting() if store is not None else contextlib.nullcontext() as jobs:
            for key in bar(keys) if bar and store is None else keys:
                victim = residency.insert(key, ())
                self.worker.wait(self.transport.submit(key, victim, DEMAND, part))
        if jobs:
            store.fill(jobs, bar)
        self.worker.bytes_moved = 0
        return len(keys)

    def _warm_up(self) -> float:
        """With every expert resident, one generation of 2 tokens after a ``WARMUP_TOKENS``-token prompt
        now, on a driver of its own (no predictor, recorder or governor; the cache's counters reset
        after it): the first request would otherwise pay torch's and transformers' first-call costs
        (on the development VM a Granite-shaped model's first TTFT was 0.39-0.44 s, 0.23-0.26 s after
        this). Nothing is moved or evicted: every expert is already in its slot. Returns its seconds."""
        start = time.perf_counter()
        driver, seq, engine = self.engine.driver, self.engine._seq, self.engine
        engine.driver = StepDriver(self.cache, self.num_layers)
        vocab = int(getattr(self.model.config, "vocab_size", 0) or WARMUP_TOKENS + 1)
        ids = (torch.arange(1, WARMUP_TOKENS + 1) % vocab)[None].to(self.device)
        try:
            self.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, pad_token_id=0)
        finally:
            engine.driver, engine._seq = driver, seq
            self.cache.stats = CacheStats(self.num_layers)
        return time.perf_counter() - start

    def _check_cheap(
        self, cache: CacheConfig, prefetch: PrefetchConfig, slow_tier, expert_memory, kernel=None
    ) -> None:
        """Option errors that need no loading, before any loading."""
        if cache.offline:
            raise ExpertcacheError(
                f"policy {cache.name} needs the future (simulator only); use it with 'expertcache sim'"
            )
        named = prefetch.enabled and prefetch.predictor_object is None and prefetch.predictor != AUTO
        if named and predictor_class(prefetch.predictor).sim_only:
            raise ExpertcacheError(
                f"predictor {prefetch.predictor} needs the future (simulator only); "
                "use it with 'expertcache timing'"
            )
        bundled = named and prefetch.data is None and predictor_class(prefetch.predictor).trained
        if bundled and self.path.resolve() != DEFAULT_MODEL:
            raise ExpertcacheError(
                f"the bundled {prefetch.predictor} predictor is for the embedded model; for {self.path} "
                f"train one (expertcache train-predictor --model {self.path} --out DIR), then pass "
                "--predictor DIR"
            )
        if kernel not in (None, AUTO_KERNEL, *KERNELS):
            raise ExpertcacheError(
                f"experts kernel {kernel!r} is not one of: {AUTO_KERNEL}, {', '.join(KERNELS)}"
            )
        if slow_tier not in (None, *SLOW_TIERS):
            raise ExpertcacheError(f"slow tier {slow_tier!r} is not one of: {', '.join(SLOW_TIERS)}")
        if policy_class(cache.name).needs_profile and cache.profile is None:
            raise ExpertcacheError(
                f"policy {cache.name} ranks experts by a usage profile: pass --profile TRACE.npz (a "
                "trace of an earlier run, from --record-trace; in Python: profile=TRACE.npz)"
            )
        text = str(expert_memory).strip()
        if not text.endswith("%"):
            parse_size(expert_memory, "expert memory")

    def _kernel(self, name: str | None, module) -> tuple[Kernel, StackedPool | None, SlotTable | None]:
        """The experts kernel (``engine.kernels``), and for the grouped one the whole-expert pool as stacked
        tensors with its slot table."""
        kernel, note = resolve_kernel(name, self.device, module, self.layout)
        if note:
            self.notes.append(note)
        target = self.targets.get((FULL, None))
        if kernel.name != "grouped" or target is None or target.layouts is not None or not len(target.pool):
            return kernel, None, None
        pool = target.pool
        return kernel, StackedPool(pool), SlotTable(self.num_layers, self.num_experts, len(pool))

    def _engine_parts(self, sk) -> dict[str, EnginePart]:
        parts = {}
        for spec in self.miss.parts():
            parts[spec.name] = self._engine_part(spec, sk)
        return parts

    def _engine_part(self, spec: PartSpec, sk) -> EnginePart:
        if spec.kind == "full":
            return full_part(spec, self.layout)
        if spec.kind == "segment":
            transposed = bool(sk.experts[0].is_transposed)
            return segment_part(spec, self.layout, transposed, self.num_layers)
        if spec.kind == "quantized":
            return quantized_part(spec, self.path, self.dtype, pin=self.device.type == "cuda")
        raise ExpertcacheError(f"part kind {spec.kind!r} is not supported by the engine")

    def _check_fits(self, slow_tier: str | None) -> None:
        """Refuse, before anything is read, host memory the machine (or the process's memory cgroup)
        does not have: the slots on a CPU, and every expert for the host tier. Left to run, the process
        would be killed for memory at load, or swap."""
        tier = slow_tier or ("host" if self.device.type == "cuda" else "disk")
        need = self.budget if self.device.type == "cpu" else 0
        if tier == "host":
            need += self.num_layers * self.num_experts * self.layout.slot_bytes
        room = available_memory()
        if room is not None and need > room[0]:
            what = "the expert slots" + (
                " and the host tier's copy of every expert" if tier == "host" else ""
            )
            raise ExpertcacheError(
                f"{what} need {format_bytes(need)} of host memory, more than this process may use "
                f"({format_bytes(room[0])}: {room[1]}); give a smaller expert memory (--expert-memory)"
                + (" or --slow-tier disk" if tier == "host" else "")
            )

    def _targets(self, show: bool) -> dict[tuple[str, int | None], Target]:
        """The slot pools of every part: one for the part, one per layer for a part whose slots differ
        by layer, or one shared by layers of different layouts (slots of the largest). Host pools are
        prefaulted (``SlotPool``): the budget is memory the engine uses, so it is backed at load (unless
        every slot is about to be filled: ``_preload``)."""
        targets = {}
        bar, fault = _progress("expert memory", show), not self._whole
        for name, part in self.parts.items():
            part.bind(self.tier)
            caps = self.capacities[name]
            if part.per_layer and part.spec.shared:
                pool = SlotPool(part.largest(), caps, self.device, prefault=fault, progress=bar)
                targets[(name, None)] = Target(part.source, pool, part.layouts)
                continue
            for group, layout in part.layouts.items():
                n = caps if group is None else caps[group]
                pool = SlotPool(layout, n, self.device, prefault=fault, progress=bar)
                targets[(name, group)] = Target(part.source, pool)
        return targets

    def _budget(self, expert_memory: str | int | float, cache: CacheConfig) -> int:
        """Bytes of expert memory: as given, or a share of all experts at full precision."""
        text = str(expert_memory).strip()
        total = self.num_layers * self.num_experts * self.layout.slot_bytes
        if text.endswith("%"):
            try:
                share = float(text[:-1])
            except ValueError:
                raise ExpertcacheError(f"expert memory {expert_memory!r} is not a percentage") from None
            if not 0 < share <= 100:
                raise ExpertcacheError(f"expert memory {expert_memory!r} must be a share in (0%, 100%]")
            budget = round(total * share / 100)
        else:
            budget = int(parse_size(expert_memory, "expert memory"))
        if budget > total:
            self.notes.append(
                f"expert memory {expert_memory} is more than all experts take; capped at "
                f"{format_bytes(total)} (100%: no offloading)"
            )
        budget = min(budget, total)
        slot = self.parts[FULL].slot_bytes() if FULL in self.parts else None
        if slot is not None and self.miss.parts()[0].name == FULL:  # the whole-expert cache's own message
            from expertcache.policy.registry import fixed_capacity, min_capacity

            need = min_capacity(cache.name, self.num_layers, cache.params, min_room=self.top_k)
            cap = budget // slot
            why = f"a layer's top-{self.top_k} experts must be resident together"
            if fixed_capacity(cache.name, cache.params) is not None:
                why = f"its budgets sum to {need}"
            if cap < need and len(self.miss.host_layers()) < self.num_layers:
                raise ExpertcacheError(
                    f"expert memory {expert_memory} holds {cap} expert(s) of {format_bytes(slot)}; "
                    f"policy {cache.name} needs at least {need} ({format_bytes(need * slot)}): {why}"
                )
        return budget

    def _tier(self, sk, slow_tier: str | None, show: bool):
        tier = slow_tier or ("host" if self.device.type == "cuda" else "disk")
        if tier == "host":
            bar = _progress("experts to host memory", show)
            pin = self.device.type == "cuda"
            return HostTier(sk.store, self.layout, self.num_layers, self.num_experts, pin=pin, progress=bar)
        return DiskTier(sk.store, self.layout, self.device, drop=tier == "disk")

    def _policy_context(self, cache: CacheConfig) -> PolicyContext:
        prof = None
        if policy_class(cache.name).needs_profile:
            tr = cache.profile if isinstance(cache.profile, Trace) else load_trace(cache.profile)
            if (tr.num_layers, tr.num_experts) != (self.num_layers, self.num_experts):
                raise ExpertcacheError(
                    f"profile trace has {tr.num_layers} layers x {tr.num_experts} experts, the model "
                    f"{self.num_layers} x {self.num_experts}"
                )
            prof = build_schedule(tr, "layer").profile
        return PolicyContext(
            capacity=max(1, self.capacity), num_layers=self.num_layers, num_experts=self.num_experts,
            top_k=self.top_k, clock=Clock(), seed=cache.seed, profile=prof,
        )  # fmt: skip

    def _chunking(self, prefetch: PrefetchConfig) -> dict[str, object]:
        """How speculative transfers move: in chunks of ``--chunk-size``, or by default in thirds of an
        expert where chunks pay (``costs.chunks_pay``: the data of an expert's transfer takes more than 5
        latencies of a chunk), else whole. The latency is the emulated link's, or measured at load
        (``calibrate.chunk_costs``: one expert whole against the same in chunks)."""
        third = -(-self.layout.nbytes // AUTO_CHUNKS)  # an expert's three matrices
        full = (FULL, None)
        if prefetch.chunk_bytes is not None:
            return {"chunk_bytes": prefetch.chunk_bytes, "why": "given (--chunk-size)"}
        if self.link is not None:
            data, latency, source = self.layout.nbytes / self.link.bandwidth, self.link.latency, "link"
        elif full in self.targets and self.targets[full].layouts is None and len(self.targets[full].pool):
            from expertcache.engine.calibrate import chunk_costs

            keys = [(layer, e) for layer in range(self.num_layers) for e in range(self.num_experts)][:8]
            (data, latency), source = chunk_costs(self.worker, full, keys), "measured"
        else:  # no whole-expert slot to measure in (split experts, low-precision copies, placement): thirds
            return {"chunk_bytes": third, "why": "thirds of an expert (nothing to measure them by)"}
        pays = chunks_pay(data, latency)
        why = (f"{source}: an expert's data takes {data * 1e6:.0f} us, a chunk's latency "
               f"{latency * 1e6:.0f} us: " + ("thirds" if pays else "whole (chunks do not pay)"))  # fmt: skip
        return {
            "chunk_bytes": third if pays else None,
            "data_s": data,
            "chunk_latency_s": latency,
            "why": why,
        }

    def _auto_predictor(self, prefetch: PrefetchConfig) -> str:
        """``auto``'s predictor for this model: ``learned`` where a trained one is given (or bundled: the
        embedded model's), ``eam`` learning from a recorded trace given as its data, else ``next-gate``
        (every family's routers, nothing to train)."""
        data = prefetch.data
        if data is not None and not (isinstance(data, str | Path) and Path(data).is_dir()):
            return "eam"  # a recorded trace (a file, or a Trace object)
        if data is not None or self.path.resolve() == DEFAULT_MODEL:
            return "learned"
        return "next-gate"

    def _make_predictor(self, prefetch: PrefetchConfig):
        if prefetch.predictor_object is not None:
            return prefetch.predictor_object
        source = prefetch.data
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
            num_layers=self.num_layers, num_experts=self.num_experts, top_k=self.top_k,
            window=None if prefetch.window is None else int(prefetch.window), routers=router_fns(self.model),
            trace=trace, path=path, seed=self.cache_config.seed,
        )  # fmt: skip
        return make_predictor(self.prefetch, ctx)

    # ----------------------------------------------------------------- transformers-style use
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(self.path))
            except Exception as exc:
                raise ExpertcacheError(f"{self.path}: no usable tokenizer ({first_line(exc)})") from None
            tok.padding_side = "left"  # batches: every row's new tokens start at the same position
            if tok.pad_token is None and tok.eos_token is not None:
                tok.pad_token = tok.eos_token
            self._tokenizer = tok
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
        return gen.encode(self.tokenizer, [gen.render(self.tokenizer, prompt, False)], False)[0]

    def generate_text(
        self,
        prompt: gen.Prompt | Sequence[gen.Prompt],
        max_new_tokens: int = 32,
        streamer=None,
        *,
        sampling: SamplingConfig | None = None,
        chat: bool = False,
        batch_size: int = 8,
        **kwargs,
    ) -> Generation | list[Generation]:
        """Generate from a prompt (one ``Generation``) or a list of them (a list, run ``batch_size`` at a
        time, padded on the left). ``sampling``: greedy by default (the reference's tokens), or a
        ``SamplingConfig`` (temperature, top-p, top-k, seed, repetition penalty, stop strings). ``chat``:
        prompts go through the tokenizer's chat template (a prompt may then be a list of messages).
        Each result has tokens, text, finish reason, TTFT/TPOT and the cache's work during its batch."""
        if max_new_tokens < 1:
            raise ExpertcacheError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if batch_size < 1:
            raise ExpertcacheError(f"batch size must be at least 1, got {batch_size}")
        sampling = sampling or SamplingConfig()
        one = isinstance(prompt, str) or (
            chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        )
        prompts = [prompt] if one else list(prompt)
        if not prompts:
            raise ExpertcacheError("no prompts were given")
        if streamer is not None and len(prompts) > 1:
            raise ExpertcacheError("streaming is for one prompt at a time")
        texts = [gen.render(self.tokenizer, p, chat, f"prompt {i + 1}" if not one else "the prompt")
                 for i, p in enumerate(prompts)]  # fmt: skip
        results: list[Generation] = []
        for start in range(0, len(texts), batch_size):
            results += self._generate_batch(texts[start : start + batch_size], max_new_tokens, streamer,
                                            sampling, chat, kwargs)  # fmt: skip
        return results[0] if one else results

    def _generate_batch(self, texts, max_new_tokens, streamer, sampling, chat, kwargs) -> list[Generation]:
        tok = self.tokenizer
        kwargs = dict(kwargs)
        ids, mask = gen.encode(tok, texts, chat)
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and ids.shape[1] + max_new_tokens > limit:
            raise ExpertcacheError(
                f"prompt of {ids.shape[1]} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"context of {limit}"
            )
        decode_kw, seed = gen.sampling_kwargs(sampling, tok)
        if sampling.stop:
            from transformers import StoppingCriteriaList

            stop = gen.StopOnText(tok, sampling.stop, ids.shape[1])  # and the caller's criteria, if any
            theirs = kwargs.pop("stopping_criteria", [])
            decode_kw["stopping_criteria"] = StoppingCriteriaList([stop, *theirs])
        if seed is not None:
            torch.manual_seed(seed)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        before = self._stats(memory=False)
        run = timed_generate(
            self.generate, ids.to(self.device), streamer, attention_mask=mask.to(self.device),
            max_new_tokens=max_new_tokens, pad_token_id=pad, **{**decode_kw, **kwargs},
        )  # fmt: skip
        after = self._stats(memory=False)
        counted = (
            "hits", "misses", "bytes_transferred", "stall_s", "decode_stall_s", "prefill_stall_s",
            "host_wait_s", "host_computed", "low_precision", "skipped", "prefetch_issued", "prefetch_used",
            "prefetch_late", "prefetch_cancelled", "shadow_guesses", "shadow_hits", "filled",
        )  # fmt: skip
        delta = {**{k: after[k] - before[k] for k in counted}, **self.prefetch_config, **self._describe()}
        parts = before["part_misses"]
        delta["part_misses"] = {
            p: n - parts.get(p, 0) for p, n in after["part_misses"].items() if n > parts.get(p, 0)
        }
        delta.update(expert_memory_bytes=after["expert_memory_bytes"], slow_tier=after["slow_tier"],
                     memory=resident_memory(self._weight_files))  # fmt: skip
        eos = gen.eos_ids(self.model, tok)
        out, width = run["output"], ids.shape[1]
        rows = [
            gen.finish(
                out[r, width:].tolist(), lambda t: tok.decode(t, skip_special_tokens=True), eos, sampling.stop
            )
            for r in range(len(texts))
        ]
        rate = sum(len(t) for t, _, _ in rows) / run["total_s"] if run["total_s"] > 0 else 0.0
        results = [
            Generation(
                tokens=tokens, text=text, prompt_tokens=int(mask[r].sum()), ttft_s=run["ttft_s"],
                tpot_s=run["tpot_s"], tokens_per_s=rate, total_s=run["total_s"], stats=delta,
                finish_reason=reason, seed=seed, batch_size=len(texts),
            )
            for r, (tokens, text, reason) in enumerate(rows)
        ]  # fmt: skip
        return results

    # ------------------------------------------------------------------------------- reports
    def _describe(self) -> dict[str, object]:
        """What this model is: its cache's size and parts, policy, miss path, device."""
        return {
            "capacity_experts": self.capacity,
            "total_experts": self.num_layers * self.num_experts,
            "expert_bytes": self.layout.nbytes,
            "policy": self.cache_config.policy,
            "miss": self.miss.describe(),
            "lossy": self.miss.lossy,
            "parts": {name: {"slots": self.capacities[name], "slot_bytes": p.slot_bytes()}
                      for name, p in self.parts.items()},
            "device": str(self.device),
            "kernel": self.kernel.name,
            "preloaded_experts": self.preloaded,
            "warmup_s": self.warmup_s,
        }  # fmt: skip

    @property
    def stats(self) -> dict[str, object]:
        """The cache's work since load: hits, misses, bytes moved, stall time, per layer too; and the
        memory the process holds now (``engine.memory.resident_memory``)."""
        return self._stats(memory=True)

    def _stats(self, memory: bool) -> dict[str, object]:
        t = self.transport
        return {
            **self.cache.stats.to_dict(),
            **self._describe(),
            "bytes_transferred": t.bytes_moved,
            "stall_s": t.stall_s,
            "decode_stall_s": t.stall_by_phase[0],
            "prefill_stall_s": t.stall_by_phase[1],
            "host_wait_s": self.host.wait_s,
            "host_busy_s": self.host.busy_s,
            "steps": self.driver.steps,
            "expert_memory_bytes": self._memory_bytes(),
            "memory": resident_memory(self._weight_files) if memory else None,
            "slow_tier": self.tier.name,
            "link": self.link.describe() if self.link else None,
            "costs": None if self.costs is None else self.costs.to_dict(),
            **self.prefetch_config,
            "retried_chunks": self.worker.retried,
            "plan": None if self.plan is None else self.plan.describe(),
        }

    def _memory_bytes(self) -> int:
        return sum(len(t.pool) * t.pool.layout.slot_bytes for t in self.targets.values())

    @property
    def prefetch_config(self) -> dict[str, object]:
        """How transfers are scheduled: predictor, window, chunk size, preemption, reordering."""
        pf = self.prefetch_config_
        return {
            "prefetch": self.prefetch if pf.enabled else "none",
            "prefetch_when": pf.when if pf.enabled else None,
            "prefetch_governor": self._governor_summary(),
            "window": self.predictor.window if self.predictor is not None else None,
            "prefetch_limit": self.cache.limit,
            "predictor_thread": pf.thread and self.predictor is not None,
            "chunk_bytes": self.chunk_bytes,
            "chunking": None if self.chunking is None else self.chunking["why"],
            "preemption": pf.preemption,
            "reorder": pf.reorder,
            "deterministic": pf.deterministic,
            "varies_by": self._varies_by(),
        }

    def _varies_by(self) -> list[str]:
        """What makes two runs of the same input differ in hits, misses and what the miss path did (and
        so in a lossy path's output): empty when the run repeats."""
        why = []
        if self.governor is not None:
            why.append("the prefetch governor's measured step times")
        if self.predictor is not None and self.prefetch_config_.thread:
            why.append("the predictor thread")
        moving = (
            (self.predictor is not None or self.miss.name != "fetch")
            and self.capacity > 0
            and not self._whole
        )
        if moving and not self.transport.settle:
            why.append("when transfers in flight land")
        if self._measured_costs:
            why.append(f"the costs {self.miss.name} measured at load")
        return why

    def _governor_summary(self) -> dict[str, object] | None:
        """What ``prefetch_when="pays"`` decided and why (None: prefetching is always on, or off)."""
        if self.governor is not None:
            return self.governor.summary()
        if self.prefetch_config_.governed:  # idle: every expert read at load
            return {
                "prefetching": False,
                "state": "idle",
                "reason": "every expert is resident: nothing to fetch",
            }
        return None

    def trace(self) -> Trace:
        """The routing of everything run since load, in the simulator's trace format."""
        if self.driver.recorder is None:
            raise ExpertcacheError("routing was not recorded: load with record=True to get a trace")
        meta = {
            "model": model_label(self.path), "policy": self.cache_config.policy, "capacity": self.capacity,
            "miss": self.miss.describe(), "capacities": json.dumps(self.capacities),
        }  # fmt: skip
        if self.predictor is not None:
            meta.update(predictor=self.prefetch, window=self.predictor.window)
        return self.driver.recorder.trace(meta=meta)

    def save_trace(self, path: str | Path) -> None:
        self.trace().save(path)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> OffloadedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stored_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's saved tensors (parameters and persistent buffers), a tensor that several names
    share counted once: a tied ``lm_head`` is the input embedding, one tensor in memory."""
    unique = {id(t): t for t in module.state_dict(keep_vars=True).values()}  # tied names: one object
    return sum(t.numel() * t.element_size() for t in unique.values())


def model_info(path: str | Path | None = None) -> dict[str, object]:
    """What a checkpoint holds, without reading any expert: family, MoE layers, experts, bytes."""
    path = resolve_model(path)
    sk = build_skeleton(path)
    layout = SlotLayout.of(sk.shapes, sk.dtype)
    total = len(sk.experts) * sk.num_experts
    dense = stored_bytes(sk.model)
    return {
        "path": str(path),
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
    policy: str | CacheConfig = "lru",
    device: str | torch.device | None = None,
    *,
    miss: str | MissConfig = "fetch",
    prefetch: str | PrefetchConfig | None = AUTO,
    link_bandwidth: str | float | None = None,
    link_latency: str | float = 0.0,
    seed: int = 0,
    profile: str | Path | Trace | None = None,
    window: int | None = None,
    predictor: str | Path | Trace | None = None,
    prefetch_limit: int | None = None,
    chunking: bool = True,
    chunk_size: str | int | None = None,
    preemption: bool = True,
    reorder: bool = True,
    predictor_thread: bool = False,
    prefetch_when: str | None = None,
    deterministic: bool = False,
    plan: str | Path | Plan | None = None,
    **options,
) -> OffloadedModel:
    """Load a Hugging Face MoE checkpoint (default: the embedded demo model) with experts offloaded.

    ``path`` is a checkpoint folder or a Hugging Face id (``org/name``) found in the local Hugging Face
    cache; ``download=True`` fetches one that is not there (nothing is downloaded otherwise).

    ``expert_memory`` is bytes (``"6GiB"``, ``500_000_000``) or a share of all expert bytes (``"30%"``);
    ``policy`` any online policy of the library (``"lru"``, ``"llru"``, ``"lfu-dist"``, ``"lru:param=v"``);
    ``miss`` what to do on a miss (``"fetch"``, ``"host"``, ``"hybrid"``, ``"split:theta=0.5"``, ...,
    see ``expertcache misses``). Link emulation: ``link_bandwidth``, ``link_latency``. ``seed`` and
    ``profile`` (a trace, for ``static``) go to the policy. Proactive caching: ``prefetch`` (a predictor
    name: ``"next-gate"``, ``"window"``, ``"learned"``, ``"token"``, ``"eam"``; ``"none"``; by default
    ``"auto"``: the model's predictor, used only while it measurably pays), ``prefetch_when``
    (``"always"`` or ``"pays"``; default ``"pays"`` for ``"auto"``, ``"always"`` for a named predictor),
    ``window`` (layers ahead), ``predictor`` (a trained predictor directory for ``learned``, a recorded
    trace for ``token``/``eam``), ``prefetch_limit`` (per predicted layer; default top-k), ``chunking``
    and ``chunk_size`` (default: a third of an expert), ``preemption``, ``reorder`` (both on),
    ``predictor_thread``. ``deterministic``: a run that repeats exactly, hits, misses and lossy outputs
    included (``config.PrefetchConfig``; ``stats["varies_by"]`` says what else would vary). Config
    objects (``CacheConfig``, ``PrefetchConfig``, ``MissConfig``) may be passed for ``policy``,
    ``prefetch`` and ``miss`` instead. Further options: ``dtype``, ``kernel`` (how a layer's experts are
    computed: ``"grouped"``, one grouped matrix product over the slot pool, exact against transformers'
    ``grouped_mm``; ``"eager"``, one at a time, exact against its eager loop; default ``"auto"``:
    grouped where torch has it; ``engine.kernels``), ``slow_tier``
    (``"host"``, ``"disk"`` or ``"mapped"``: ``engine.transfer.DiskTier``), ``costs`` (a ``CostModel``
    for cost-based miss paths; default: measured
    at load), ``progress``, ``record`` (keep the routing for ``trace()``; on by default), ``download``,
    ``warmup`` (on by default: with every expert resident, a 2-token generation at load takes the first
    request's one-time costs; ``stats["warmup_s"]`` its time).
    ``plan`` (a ``Plan`` or a ``plan.json`` from ``expertcache plan``) sets the expert memory, the policy
    and its per-layer budgets, the miss path and the predictor; giving one of those as well is an error.
    """
    plan = as_plan(plan)
    if plan is not None:
        defaults = {
            "expert_memory": "100%",
            "policy": "lru",
            "miss": "fetch",
            "prefetch": AUTO,
            "window": None,
        }
        given = {
            "expert_memory": expert_memory,
            "policy": policy,
            "miss": miss,
            "prefetch": prefetch,
            "window": window,
        }
        extra = [k for k, v in given.items() if v != defaults[k] and not _is_plans(v, plan)]
        if extra:
            raise ExpertcacheError(
                f"plan sets the expert memory, policy, miss path and predictor; leave out {extra[0]}"
            )
        policy = policy if isinstance(policy, CacheConfig) else plan.cache_config(seed)
        miss = plan.miss_config()
        if not isinstance(prefetch, PrefetchConfig):
            prefetch, window = plan.prefetch, plan.window
    cache = policy if isinstance(policy, CacheConfig) else CacheConfig(policy, seed=seed, profile=profile)
    if isinstance(prefetch, PrefetchConfig):
        pf = prefetch
    else:
        pf = PrefetchConfig(
            prefetch, window=window, data=predictor, limit=prefetch_limit, chunking=chunking,
            chunk_size=chunk_size, preemption=preemption, reorder=reorder, thread=predictor_thread,
            when=prefetch_when, deterministic=deterministic,
        )  # fmt: skip
    return OffloadedModel(
        path, expert_memory, cache=cache, prefetch=pf, link=LinkConfig(link_bandwidth, link_latency),
        miss=as_config(miss, MissConfig), device=device, plan=plan, **options,
    )  # fmt: skip


def _is_plans(value: object, plan: Plan) -> bool:
    """A config the plan itself gives (what the CLI passes along with the plan)."""
    return value in (plan.cache_config(), plan.miss_config()) or (
        isinstance(value, PrefetchConfig) and value.predictor == plan.prefetch and value.window == plan.window
    )


__all__ = ["DEFAULT_MODEL", "Generation", "OffloadedModel", "default_model_path", "load"]
