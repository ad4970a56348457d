"""What a load decides, in the order it decides it: the parts of an ``OffloadedModel``.

``Builder`` takes the options of ``OffloadedModel`` (one config object per domain, the device, the slow
tier, ...), checks those that need no loading before anything is read, then builds the skeleton, sizes
the expert memory and its parts, and assembles the slots, transfers, cache, predictor and engine; with
every expert fitting, it fills them and warms the model up. ``Built`` is the result: the facade
(``engine.offloaded``) only runs it and reports on it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from expertcache.cache.build import assemble, build_host_level, build_parts, part_capacities
from expertcache.cache.expert_cache import ExpertCache
from expertcache.cache.governor import PrefetchGovernor
from expertcache.cache.recorder import Recorder
from expertcache.cache.schedule import build_schedule
from expertcache.cache.stats import CacheStats
from expertcache.cache.step import InlinePredictor, StepDriver
from expertcache.cache.tiers import HOST_LEVEL_UNUSED, level_experts
from expertcache.cache.transfers import DEMAND
from expertcache.config import AUTO, CacheConfig, HostConfig, LinkConfig, MissConfig, PrefetchConfig
from expertcache.costs import (
    AUTO_CHUNKS,
    MAX_CHUNKS,
    CostModel,
    as_cost,
    check_shape,
    chunks_pay,
    profile_tier,
)
from expertcache.engine.dense import DenseReport, check_dense_format
from expertcache.engine.dense import quantize_dense as quantize_dense_weights
from expertcache.engine.families import Family
from expertcache.engine.host import HostExperts
from expertcache.engine.hub import DEFAULT_MODEL, model_label, resolve_model
from expertcache.engine.kernels import (
    AUTO_KERNEL,
    KERNELS,
    Kernel,
    StackedPool,
    compiled_rows,
    first_matrix,
    resolve_kernel,
)
from expertcache.engine.link import EmulatedLink
from expertcache.engine.loader import (
    build_skeleton,
    check_attention,
    layers_beyond,
    read_config,
    resolve_dtype,
)
from expertcache.engine.memory import SlotLayout, SlotPool, available_memory, release_freed
from expertcache.engine.packed import Packed, PackedPool, describe_format, require_gate
from expertcache.engine.parts import EnginePart, full_part, quantized_part, segment_part
from expertcache.engine.routing import router_fns
from expertcache.engine.runtime import Engine, PredictorThread
from expertcache.engine.slots import SlotTable, SlotTransport
from expertcache.engine.transfer import (
    SLOW_TIERS,
    STAGE_PART,
    DiskTier,
    HostTier,
    StackTier,
    Target,
    TransferWorker,
)
from expertcache.errors import ExpertcacheError, option
from expertcache.miss.base import FULL, MissContext, MissPath, PartSpec
from expertcache.miss.registry import miss_class
from expertcache.plan import Plan
from expertcache.policy.base import Clock, PolicyContext
from expertcache.policy.registry import policy_class
from expertcache.predict.base import PredictContext, Predictor
from expertcache.predict.registry import make_predictor, predictor_class
from expertcache.trace.default import default_trace
from expertcache.trace.trace import Trace, as_trace, load_trace
from expertcache.units import format_bytes, parse_share, parse_size, true_or_false

WARMUP_TOKENS = 32  # the prompt of the warm-up generation at load (every expert resident)


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


@dataclass(frozen=True)
class Built:
    """What a load built and decided: everything ``OffloadedModel`` serves and reports on."""

    path: Path  # the checkpoint folder
    plan: Plan | None
    notes: list[str]  # one line each, for the user: what was adjusted and why
    cache_config: CacheConfig
    prefetch_config_: PrefetchConfig
    link_config: LinkConfig
    miss_config: MissConfig
    device: torch.device
    link: EmulatedLink | None
    config: object  # the checkpoint's transformers config
    family: Family
    dtype: torch.dtype
    dtype_own: bool  # ``dtype`` is the checkpoint's own (its config's), not another one asked for
    num_layers: int
    num_experts: int
    top_k: int
    layout: SlotLayout  # one whole expert, as stored (packed bytes for a packed checkpoint)
    packed: Packed | None  # a packed checkpoint's experts (``engine.packed``)
    dense: DenseReport | None  # the dense weights quantised at load (``engine.dense``); None: as stored
    miss: MissPath
    parts: dict[str, EnginePart]
    budget: int  # bytes of expert memory
    capacities: dict[str, int | list[int]]  # slots of each part (per layer where they differ)
    capacity: int  # keys of the primary part
    tier: HostTier | DiskTier | StackTier
    host_capacity: int  # experts the host level holds (0: no host level)
    host_config: HostConfig | None
    spare_slots: int  # whole-expert slots beyond the capacity (an exclusive host level on a GPU)
    weight_files: list[Path]  # the checkpoint's files, for the memory in stats
    whole: bool  # nothing to offload: every expert is read into its slot at load
    targets: dict[tuple[str, int | None], Target]
    pool: SlotPool
    worker: TransferWorker
    chunking: dict[str, object] | None
    chunk_bytes: int | None
    kernel: Kernel
    transport: SlotTransport
    policy_ctx: PolicyContext
    model: torch.nn.Module
    host: HostExperts
    measured_costs: bool  # the miss path's costs were measured at load
    costs: CostModel | None
    prefetch: str  # the predictor's name (``auto`` resolved)
    predictor: Predictor | None
    driver: StepDriver
    cache: ExpertCache
    governor: PrefetchGovernor | None
    prefetch_limit: int | None
    engine: Engine
    preloaded: int
    warmup_s: float | None


class Builder:
    """Builds an ``OffloadedModel``'s parts as it is created, from the same options; ``built()`` hands
    them over. Its attributes while it builds are what ``engine.calibrate`` reads of a model."""

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
        quantize_dense: str | None = None,
        host: HostConfig | None = None,
        attention: str | None = None,
    ) -> None:
        for name, value in (("record", record), ("download", download), ("warmup", warmup)):
            true_or_false(value, name)
        measured_on = None  # a profile's path: its model's shape and its slow tier, checked below
        if isinstance(costs, str | os.PathLike):
            path_given, (costs, shape) = costs, CostModel.load_profile(costs)
            measured_on = (path_given, shape, profile_tier(path_given))
        costs = None if costs is None else as_cost(costs)  # a dict, as simulate_timing's
        self.path = resolve_model(path, download)
        self.plan = plan
        self.planned_cold = False  # a plan's eam priced learning from nothing: no warm start (_plans_data)
        self.notes: list[str] = []  # one line each, for the user: what was adjusted and why
        self.cache_config = cache = cache or CacheConfig()
        prefetch = prefetch or PrefetchConfig(AUTO)
        if plan is not None:
            prefetch = self._plans_data(plan, prefetch)
        self.prefetch_config_ = prefetch
        self.link_config = link = link or LinkConfig()
        self.miss_config = miss = miss or MissConfig()
        self.device = resolve_device(device)
        self._check_cheap(cache, prefetch, slow_tier, expert_memory, kernel)
        planned_tier = None if plan is None else plan.source.get("slow_tier")
        if planned_tier in SLOW_TIERS and slow_tier is None:  # the tier it was planned for
            slow_tier = planned_tier
            # a plan priced by the default cost model was measured on no tier: the tier is only named
            measured = plan.source.get("cost") not in (None, CostModel().to_dict())
            self.notes.append(
                f"slow tier {planned_tier}: the plan's ("
                + ("its costs were measured on it; " if measured else "it was planned for it; ")
                + f"{option('--slow-tier', 'slow_tier')} gives another)"
            )
        elif planned_tier in SLOW_TIERS and slow_tier != planned_tier:
            self.notes.append(
                f"the plan was priced on the {planned_tier} slow tier, and this runs on {slow_tier}: its "
                "predicted times and choices are another tier's"
            )
        check_dense_format(quantize_dense)
        check_attention(attention)
        self.link = EmulatedLink(link.bandwidth_Bps, link.latency_s) if link.emulated else None
        show = sys.stderr.isatty() if progress is None else progress
        dense = quantize_dense is not None
        sk = build_skeleton(
            self.path, dtype, progress=show, attention=attention, quantized_dense=dense, device=self.device
        )
        self.config, self.family, self.dtype = sk.config, sk.family, sk.dtype
        self.dtype_own = sk.dtype == resolve_dtype(None, read_config(self.path))
        self.num_layers, self.num_experts, self.top_k = len(sk.experts), sk.num_experts, sk.top_k
        if measured_on is not None:  # as timing, plan and doctor refuse it
            have = (self.num_layers, self.num_experts, self.top_k)
            hint = ": profile this model ('expertcache profile')"
            check_shape(measured_on[0], measured_on[1], have=have, what=model_label(self.path), hint=hint)
        beyond = layers_beyond(sk.store.ckpt, sk.config)
        if beyond:  # a config.json of 3 layers over weights of 6 ran another model without a word
            self.notes.append(
                f"the checkpoint holds weights of layer(s) {beyond}, beyond config.json's num_hidden_layers "
                f"({sk.config.num_hidden_layers}): they are not run (a config of another model, or a "
                "family's extra layers, as DeepSeek-V3's multi-token prediction)"
            )
        self.packed = sk.packed
        self.layout = sk.layout  # one whole expert, as stored
        self.dense = None  # the dense weights as stored, or quantised here (opt-in: engine.dense)
        if quantize_dense is not None:
            # sibling groups serve the CPU's loops; on a GPU each member would carry the group's pool there
            siblings = self.device.type == "cpu"
            self.dense = quantize_dense_weights(sk.model, quantize_dense, dtype=sk.dtype, siblings=siblings)
            label = model_label(self.path)
            which = "" if label == "embedded" else f" --model {label}"
            if not self.dtype_own:  # another dtype than the checkpoint's: the same in quality
                which += " --dtype " + str(sk.dtype).removeprefix("torch.")
            self.notes.append(
                f"{self.dense.describe()}: lossy, not the model's outputs (expertcache quality{which} "
                f"--quantize-dense {quantize_dense} says how far)"
            )
        if plan is not None:  # its budget is in experts: the timing model's unit
            plan.check_model(self.num_layers, self.num_experts, self.top_k, f"model {model_label(self.path)}")
            expert_memory = plan.capacity * self.layout.slot_bytes
            priced = (plan.source.get("cost") or {}).get("expert_bytes")
            if plan.source.get("cost") == CostModel().to_dict():  # chosen for a machine that is not this one
                self.notes.append(
                    "this plan was priced by the default cost model (a Mixtral-8x7B expert over PCIe 4 to a "
                    "GPU), not measured here: 'expertcache profile' measures this machine, and 'expertcache "
                    "plan --cost PROFILE.json' plans for it"
                )
            elif isinstance(priced, int) and priced != self.layout.nbytes:  # a profile of another model
                self.notes.append(
                    f"this plan was priced for experts of {priced} bytes; {model_label(self.path)}'s are "
                    f"{self.layout.nbytes} (another model of its shape, or another dtype): its predicted "
                    "times are not this model's ('expertcache profile' measures this one)"
                )
            planned = plan.source.get("cost")
            own = isinstance(planned, dict) and planned != CostModel().to_dict()
            own = own and priced == self.layout.nbytes  # measured for this model (a profile), not defaults
            if costs is None and own and miss_class(miss.name).needs_costs:  # decide as it was planned
                costs = CostModel.from_dict(planned)
                self.notes.append(
                    f"miss path {miss.name} decides by the costs the plan was made with, as the planner's "
                    "runs did; " + option("--cost", "costs") + " gives others"
                )
        if costs is not None and link.emulated and miss_class(miss.name).needs_costs:
            costs = self._emulated_link_costs(costs, link, miss.name)
        other = costs is not None and costs.expert_bytes != self.layout.nbytes
        if other and miss_class(miss.name).needs_costs:
            self.notes.append(
                f"the costs given price experts of {costs.expert_bytes} bytes; {model_label(self.path)}'s "
                f"are {self.layout.nbytes}: miss path {miss.name} decides as for those (a profile of this "
                "model, or expert_bytes in the cost file, prices these)"
            )
        self.miss = miss_class(miss.name)(
            MissContext(self.num_layers, self.num_experts, self.top_k, costs=costs), **miss.params
        )
        self._check_packed(kernel)
        self.parts = self._engine_parts(sk)
        slot_bytes = {name: p.slot_bytes() for name, p in self.parts.items()}
        self.budget = self._budget(expert_memory, cache)
        self.capacities = part_capacities(self.miss, self.budget, slot_bytes, self.top_k)
        self.notes += self.miss.capacity_notes(self.capacities)
        primary = self.capacities[self.miss.parts()[0].name]
        self.capacity = sum(primary) if isinstance(primary, list) else primary  # keys of the primary part
        if self.capacity == 0 and self.budget > 0:
            self.notes.append(
                f"miss path {self.miss.describe()} computes every expert on the host: the expert memory "
                f"({format_bytes(self.budget)}) holds none and is not used"
            )
        if plan is not None and plan.host_capacity is not None:  # its host level, in this model's slots
            plan.refuse_host([option("--host-memory", "host_memory")] if host is not None else [])
            host = plan.host_config(self.layout.slot_bytes)
        self.host_reserve = 0  # an exclusive host level's slots beyond its capacity (``cache.tiers``)
        self.host_config, self.host_capacity = host, self._host_capacity(host, slow_tier)
        self.spare_slots = self._spare_slots(host)
        self._check_fits(slow_tier)
        self.tier = self._tier(sk, slow_tier, show)
        if measured_on is not None and measured_on[2] not in (None, self.tier.name) and self.miss.needs_costs:
            theirs = measured_on[2]
            self.notes.append(
                f"the costs given ({measured_on[0]}) were measured on the {theirs} slow tier, and this runs "
                f"on {self.tier.name}: miss path {self.miss.name} decides by another tier's reads and "
                f"transfers ({option('--slow-tier ' + theirs, f'slow_tier={theirs!r}')} runs on theirs)"
            )
        self.weight_files = sorted({Path(f) for f in sk.store.ckpt.files.values()})  # for stats' memory
        # nothing to offload (every expert fits, and the miss path would keep them all: fetch, host,
        # hybrid): every slot is filled at load
        self.whole = self.miss.preloads() and self.capacity >= self.num_layers * self.num_experts
        if self.whole and self.link is not None:
            given = (
                f"{option('--link-bandwidth', 'link_bandwidth')}, {option('--link-latency', 'link_latency')}"
            )
            self.notes.append(
                f"every expert is resident from the load on: the emulated link ({given}) slows only the "
                "load, which fills every slot through it"
            )
        given = [  # options about moving experts, given where none moves
            name
            for name, on in (
                (option("--window", "window"), prefetch.window is not None),
                (option("--predictor", "predictor"), prefetch.data is not None),
                (option("--prefetch-limit", "prefetch_limit"), prefetch.limit is not None),
                (option("--chunk-size", "chunk_size"), prefetch.chunk_size is not None),
                (option("--no-chunking", "chunking=False"), not prefetch.chunking),
                (option("--no-preemption", "preemption=False"), not prefetch.preemption),
                (option("--predictor-thread", "predictor_thread"), prefetch.thread),
            )
            if on
        ]
        named = [f"prefetch {prefetch.predictor}"] if prefetch.predictor not in ("none", AUTO) else []
        if self.whole and (named or given):  # asked for, not the engine's default
            parts = named + given
            self.notes.append(
                f"every expert is resident from the load on: {', '.join(parts)} "
                f"{'has' if len(parts) == 1 else 'have'} nothing to move (give "
                f"{option('--expert-memory', 'expert_memory')} below 100%)"
            )
        self.targets = self._targets(show)  # (part, layer or None) -> its slots and their source
        self.pool = next(iter(self.targets.values())).pool
        # prefetching only while it pays has nothing to do when every expert is resident from the start
        idle = prefetch.governed and self.whole
        chunked = prefetch.chunked(background=self.miss.fills()) and not idle
        if (note := prefetch.idle_chunking_note(background=self.miss.fills())) is not None:
            self.notes.append(note)
        self.worker = TransferWorker(link=self.link, parts=self.targets)
        stager = None  # a host level's staging reads: a worker of their own, beside the link's
        if self.host_capacity and host.stage:
            stager = TransferWorker(parts={STAGE_PART: Target(self.tier.stager, self.tier.pool)}, steal=False)
        self.chunking = self._chunking(prefetch) if chunked else None
        self.worker.chunk_bytes = self.chunk_bytes = self.chunking["chunk_bytes"] if chunked else None
        self.kernel, pools = self._kernel(kernel, sk.experts[0])
        self._stacked = pools[FULL][0] if FULL in pools else None  # the cache's pool, for the warm-up
        tables = {(part, None): table for part, (_, table) in pools.items()}
        settle = prefetch.deterministic
        self.transport = SlotTransport(
            self.targets, self.worker, settle=settle, tables=tables, stage_worker=stager
        )
        self.policy_ctx = self._policy_context(cache)
        residencies = build_parts(self.miss, self.capacities, cache.policy, self.policy_ctx)
        self.notes += self.miss.policy_notes(next(iter(residencies.values())).policy, self.capacities)
        self.model = sk.model.to(self.device)
        self.host = HostExperts(self.tier, self.device)
        if self.miss.needs_costs and costs is None:
            from expertcache.engine.calibrate import calibrate

            measured = calibrate(self, sk.experts[0])
            self.miss.ctx = dataclasses.replace(self.miss.ctx, costs=measured)
            if prefetch.deterministic:
                self.notes.append(
                    f"miss path {self.miss.name} decides by costs measured at load, which differ from run to "
                    "run: give them ("
                    + option("--cost PROFILE.json", "load(costs=CostModel.load('PROFILE.json'))")
                    + ") for a run that repeats"
                )
        self.measured_costs = self.miss.needs_costs and costs is None
        self.costs = self.miss.ctx.costs
        self.prefetch = self._auto_predictor(prefetch) if prefetch.predictor == AUTO else prefetch.predictor
        idle_prefetch = prefetch.governed and self.whole
        self.predictor = self._make_predictor(prefetch) if prefetch.enabled and not idle_prefetch else None
        if self.predictor is not None and self.predictor.note:
            self.notes.append(self.predictor.note)
        runner = None
        if self.predictor is not None:
            runner = PredictorThread(self.predictor) if prefetch.thread else InlinePredictor(self.predictor)
        self.driver = assemble(
            residencies, self.transport, self.miss, self.policy_ctx, limit=prefetch.limit,
            preemption=prefetch.preemption, reorder=prefetch.reorder, predictor=runner,
            governor_clock=time.perf_counter if prefetch.governed else None,
            recorder=Recorder(self.num_layers, self.num_experts, self.top_k) if record else None,
            host_level=self._host_level(host),
        )  # fmt: skip
        self.cache, self.governor = self.driver.cache, self.driver.governor
        self.prefetch_limit = self.cache.limit
        self.engine = Engine(
            self.model, sk.experts, self.driver, self.transport, self.parts, self.host,
            kernel=self.kernel, pools=pools,
        )  # fmt: skip
        if self.host_capacity:  # what the measurements at load read is not the host level's work
            self.tier.disk_reads, self.tier.disk_read_s = 0, 0.0
        self.preloaded = self._preload(show)
        self.warmup_s = self._warm_up() if warmup and self.whole else None
        loops = self.device.type == "cpu" and self._host_loops(sk.experts[0])
        if warmup and loops and self.warmup_s is None:  # else the warm-up ran them
            self._warm_host_loops(sk.experts[0])
        if not warmup and not self.whole and not loops:  # as other options that do nothing are said
            self.notes.append(
                f"{option('--no-warmup', 'warmup=False')} changes nothing here: the warm-up runs with every "
                "expert resident (100 %), and this run computes no packed or low-precision expert on the CPU"
            )
        release_freed()  # what the load freed, given back: not resident, not charged to a cgroup

    def built(self) -> Built:
        return Built(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Built)})

    # -- the steps ---------------------------------------------------------------------------------
    def _preload(self, show: bool) -> int:
        """With a budget that holds every expert and a miss path that keeps them (``MissPath.preloads``:
        fetch, host, hybrid), there is nothing to offload:
        every expert is read into its slot now (a progress bar), as a model loads its weights, through the
        policy's inserts and the transfer worker a miss takes; the first request then finds them all
        resident (no first-use misses, no stall). The cache's work counts from the first step: these are
        in ``preloaded_experts``, not in misses, bytes moved or stall. Returns how many."""
        if not self.whole:
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

    def _host_kernels(self, experts) -> list:
        """The loops of packed or low-precision experts this run computes on the host, each once."""
        found = [part.kernels for part in self.parts.values()]
        found.append(getattr(experts, "_expertcache_packed", None))  # a packed checkpoint's, shared
        return list({id(k): k for k in found if k is not None}.values())

    def _host_loops(self, experts) -> bool:
        """Whether this run has loops to load before its first request (``_warm_host_loops``)."""
        return bool(self._host_kernels(experts)) or (
            self.kernel.name == "compiled" and isinstance(self._stacked, StackedPool)
        )

    def _warm_host_loops(self, experts) -> None:
        """Packed or low-precision experts computed on this CPU, or the compiled kernel: their loops loaded
        now, at load, not in the first request (``PackedKernels.warm_host``)."""
        for kernels in self._host_kernels(experts):
            kernels.warm_host()
        if self.kernel.name == "compiled" and isinstance(self._stacked, StackedPool):
            # its loops too (numba's cached code, or a first compile on a new machine): a first request
            # paid 0.3 s and more for them. One token through the pool's first slot; the output is dropped
            pool = self._stacked
            cols = pool.tensors[first_matrix(experts)].shape[-1]
            hidden = torch.zeros(cols, dtype=pool.layout.dtype)
            compiled_rows(experts, pool, hidden, [0], torch.ones(1, dtype=pool.layout.dtype))

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
        mask = torch.ones_like(ids)
        try:
            with torch.inference_mode():  # as ``OffloadedModel.generate``: greedy
                greedy = {"max_new_tokens": 2, "pad_token_id": 0, "do_sample": False}
                self.model.generate(ids, attention_mask=mask, **greedy)
        finally:
            engine.driver, engine._seq = driver, seq
            self.cache.stats = CacheStats(self.num_layers)
        return time.perf_counter() - start

    def _plans_data(self, plan: Plan, prefetch: PrefetchConfig) -> PrefetchConfig:
        """A plan whose predictor learned from a recorded trace (token, eam) runs with that trace, as it
        was planned (the embedded model's own trace would predict otherwise), unless given another."""
        path = plan.predictor_trace()
        if prefetch.data is not None or prefetch.predictor != plan.prefetch:
            return prefetch
        if path is None:  # planned learning from nothing (eam cold): run so, not warm from another trace
            from expertcache.predict.registry import trace_readers

            if trace_readers([plan.prefetch]):
                self.planned_cold = True
                self.notes.append(
                    f"prefetch {plan.prefetch} starts with nothing learned, as the plan priced it (planned "
                    f"without {option('--predictor TRACE.npz', 'predictor_trace')}; give "
                    f"{option('--predictor', 'predictor')} to start it from a recorded trace)"
                )
            return prefetch
        if not Path(path).is_file():
            raise ExpertcacheError(
                f"the plan's predictor {plan.prefetch} was planned learning from {path}, which is not "
                f"there: give the trace as {option('--predictor TRACE.npz', 'predictor=TRACE')}"
            )
        self.notes.append(
            f"prefetch {plan.prefetch} learns from {path}, the trace it was planned with (give "
            f"{option('--predictor', 'predictor')} for another)"
        )
        changed = plan.predictor_trace_changed()
        if changed is not None:
            self.notes.append(changed)
        return replace(prefetch, data=path)

    def _check_cheap(
        self, cache: CacheConfig, prefetch: PrefetchConfig, slow_tier, expert_memory, kernel=None
    ) -> None:
        """Option errors that need no loading, before any loading."""
        if cache.offline:
            raise ExpertcacheError(
                f"policy {cache.name} needs the future (simulator only); use it with "
                + option("'expertcache sim'", "expertcache.simulate")
            )
        named = prefetch.enabled and prefetch.predictor_object is None and prefetch.predictor != AUTO
        if named and predictor_class(prefetch.predictor).sim_only:
            raise ExpertcacheError(
                f"predictor {prefetch.predictor} needs the future (simulator only); use it with "
                + option("'expertcache timing'", "expertcache.simulate_timing")
            )
        bundled = named and prefetch.data is None and predictor_class(prefetch.predictor).trained
        if bundled and self.path.resolve() != DEFAULT_MODEL:
            raise ExpertcacheError(
                f"the bundled {prefetch.predictor} predictor is for the embedded model; for {self.path} "
                f"train one (expertcache train-predictor --model {self.path} --out DIR), then pass "
                + option("--predictor DIR", "predictor='DIR'")
            )
        if kernel not in (None, AUTO_KERNEL, *KERNELS):
            raise ExpertcacheError(
                f"experts kernel {kernel!r} is not one of: {AUTO_KERNEL}, {', '.join(KERNELS)}"
            )
        if slow_tier not in (None, *SLOW_TIERS):
            raise ExpertcacheError(f"slow tier {slow_tier!r} is not one of: {', '.join(SLOW_TIERS)}")
        if policy_class(cache.name).needs_profile and cache.profile is None:
            raise ExpertcacheError(
                f"policy {cache.name} ranks experts by a usage profile: pass "
                + option(
                    "--profile TRACE.npz (a trace of an earlier run, from --record-trace)",
                    "profile='TRACE.npz' (a trace of an earlier run, from model.save_trace)",
                )
            )
        text = str(expert_memory).strip()
        if not text.endswith("%"):
            parse_size(expert_memory, "expert memory")

    def _kernel(self, name: str | None, module) -> tuple[Kernel, dict[str, tuple[StackedPool, SlotTable]]]:
        """The experts kernel (``engine.kernels``), and for the grouped one each pool of whole experts as
        stacked tensors with its slot table, by part: the cache's (``full``), and any other part's pool of
        the same layout (``batch``'s stream buffer), so that experts streamed past the cache are computed
        in the same grouped calls as cached ones (a packed checkpoint: the packed kernels over its pool)."""
        if self.packed is not None:
            kernel = KERNELS["packed"]
            if getattr(module, "has_post_expert_norm", False):  # one packed expert at a time, normalised
                kernel = dataclasses.replace(kernel, stacked=False)
        else:
            kernel, note = resolve_kernel(name, self.device, module, self.layout)
            if note:
                self.notes.append(note)
        target = self.targets.get((FULL, None))
        if not kernel.stacked or target is None or target.layouts is not None or not len(target.pool):
            return kernel, {}
        pool = target.pool
        if self.packed is not None:
            stacked = PackedPool(pool, module._expertcache_packed)
            return kernel, {FULL: (stacked, SlotTable(self.num_layers, self.num_experts, len(pool)))}
        pools = {}
        for (part, group), other in self.targets.items():
            same = other.layouts is None and other.pool.layout == pool.layout
            if group is None and same and len(other.pool):
                table = SlotTable(self.num_layers, self.num_experts, len(other.pool))
                pools[part] = (StackedPool(other.pool), table)
        return kernel, pools

    def _check_packed(self, kernel: str | None) -> None:
        """A packed checkpoint runs on the packed kernels, with miss paths that move or compute whole
        experts; a full-precision one never on the packed kernels."""
        if self.packed is None:
            if kernel == "packed":
                raise ExpertcacheError(
                    f"experts kernel packed reads packed experts; the experts of {model_label(self.path)} "
                    f"are {str(self.dtype).removeprefix('torch.')} (write a packed checkpoint with "
                    "'expertcache quantize MODEL --bits 8 --checkpoint DIR')"
                )
            return
        what = f"{model_label(self.path)} stores its experts packed ({describe_format(self.packed)})"
        if kernel not in (None, AUTO_KERNEL, "packed"):
            raise ExpertcacheError(
                f"{what}: they run on the packed kernel only, not "
                + option(f"--kernel {kernel}", f"kernel={kernel!r}")
            )
        kinds = {spec.kind for spec in self.miss.parts()}
        if kinds - {"full"}:
            raise ExpertcacheError(
                f"{what}: miss path {self.miss.name} needs full-precision experts; packed ones run with "
                "fetch, host, hybrid, placement or batch"
            )

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
            interleaved = not getattr(sk.experts[0], "is_concatenated", True)  # GPT-OSS's gate and up
            return segment_part(spec, self.layout, transposed, self.num_layers, interleaved)
        if spec.kind == "quantized":
            require_gate(sk.shapes)  # the copies hold a gate projection: one line, not how to make them
            return quantized_part(spec, self.path, self.dtype, pin=self.device.type == "cuda")
        raise ExpertcacheError(f"part kind {spec.kind!r} is not supported by the engine")

    def _check_fits(self, slow_tier: str | None) -> None:
        """Refuse, before anything is read, host memory the machine (or the process's memory cgroup)
        does not have: the slots on a CPU, and every expert for the host tier. Left to run, the process
        would be killed for memory at load, or swap."""
        tier = slow_tier or ("host" if self.device.type == "cuda" else "disk")
        need = self.budget if self.device.type == "cpu" else 0
        need += (self.host_capacity + self.host_reserve) * self.layout.slot_bytes if self.host_capacity else 0
        if tier == "host" and not self.host_capacity:
            need += self.num_layers * self.num_experts * self.layout.slot_bytes
        room = available_memory()
        if room is not None and need > room[0]:
            parts = ["the expert slots"] if self.device.type == "cpu" else []  # a GPU's are on the GPU
            if self.host_capacity:
                parts.append(f"the host cache ({option('--host-memory', 'host_memory')})")
            elif tier == "host":
                parts.append("the host tier's copy of every expert")
            raise ExpertcacheError(
                f"{' and '.join(parts)} need {format_bytes(need)} of host memory, more than this process may "
                f"use ({format_bytes(room[0])}: {room[1]}); give a smaller "
                + (f"host cache ({option('--host-memory', 'host_memory')}) or " if self.host_capacity else "")
                + f"expert memory ({option('--expert-memory', 'expert_memory')})"
                + (
                    f" or {option('--slow-tier disk', 'slow_tier=disk')}"
                    if tier == "host" and not self.host_capacity
                    else ""
                )
            )

    def _targets(self, show: bool) -> dict[tuple[str, int | None], Target]:
        """The slot pools of every part: one for the part, one per layer for a part whose slots differ
        by layer, or one shared by layers of different layouts (slots of the largest). Host pools are
        prefaulted (``SlotPool``): the budget is memory the engine uses, so it is backed at load (unless
        every slot is about to be filled: ``_preload``). Pools of the cache's layout (``batch``'s stream
        buffer) are regions of the cache's buffer, after its slots: the grouped kernel computes experts of
        both in one call (``SlotPool.regions``)."""
        targets = {}
        bar, fault = _progress("expert memory", show), not self.whole
        pools, order = [], []  # (part, group, its source, layout, slots) of the pools of one layout each
        for name, part in self.parts.items():
            part.bind(self.tier)
            caps = self.capacities[name]
            if part.per_layer and part.spec.shared:
                pool = SlotPool(part.largest(), caps, self.device, prefault=fault, progress=bar)
                targets[(name, None)] = Target(part.source, pool, part.layouts)
                order.append((name, None))
                continue
            for group, layout in part.layouts.items():
                n = caps if group is None else caps[group]
                n += self.spare_slots if (name, group) == (FULL, None) else 0
                pools.append((name, group, part.source, layout, n))
                order.append((name, group))
        cache = next((p for p in pools if p[:2] == (FULL, None) and p[4]), None)
        joint = [p for p in pools if cache is not None and p[1] is None and p[3] == cache[3] and p[4]]
        if len(joint) > 1:
            whole = SlotPool(cache[3], sum(p[4] for p in joint), self.device, prefault=fault, progress=bar)
            regions = whole.regions([p[4] for p in joint])
            for (name, group, source, _, _), pool in zip(joint, regions, strict=True):
                targets[(name, group)] = Target(source, pool)
        for name, group, source, layout, n in pools:
            if (name, group) not in targets:
                pool = SlotPool(layout, n, self.device, prefault=fault, progress=bar)
                targets[(name, group)] = Target(source, pool)
        return {pid: targets[pid] for pid in order}

    def _budget(self, expert_memory: str | int | float, cache: CacheConfig) -> int:
        """Bytes of expert memory: as given, or a share of all experts at full precision."""
        text = str(expert_memory).strip()
        total = self.num_layers * self.num_experts * self.layout.slot_bytes
        if text.endswith("%"):
            budget = round(total * parse_share(expert_memory, "expert memory") / 100)
        else:
            number = isinstance(expert_memory, int | float) and not isinstance(expert_memory, bool)
            if number and (not math.isfinite(expert_memory) or expert_memory != int(expert_memory)):
                raise ExpertcacheError(
                    f"expert memory {expert_memory!r}: a number is bytes, a whole number of them; a share of "
                    "all experts is a string such as '25%'"
                )
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
            # other parts of whole experts, one pool for every layer (batch's stream buffer), take their
            # least room out of the same memory: the least that runs, said at once
            others = [s for s in self.miss.parts()[1:] if s.kind == "full" and s.shared]
            more = sum(s.least_room(self.top_k) for s in others)
            who = f"policy {cache.name}"
            if more:
                who += f" with miss path {self.miss.name}"
                why += f", and its part(s) {', '.join(s.name for s in others)} {more} more"
                need += more
            if cap < need and len(self.miss.host_layers()) < self.num_layers:
                bytes_given = isinstance(expert_memory, int | float) and not isinstance(expert_memory, bool)
                raise ExpertcacheError(
                    f"expert memory {expert_memory} holds {cap} expert(s) of {format_bytes(slot)}; "
                    f"{who} needs at least {need} ({format_bytes(need * slot)}, "
                    f"{need * slot}B): {why}"
                    + (" (a number is bytes; a share of all experts is a string, '25%')" * bytes_given)
                )
        return budget

    def _emulated_link_costs(self, costs: CostModel, link: LinkConfig, miss: str) -> CostModel:
        """The costs a cost-based path decides by under an emulated link: the link's bandwidth (and its
        latency, where given) over the costs given, as ``timing``, ``plan`` and ``doctor`` take the same
        flags over a cost file. The path priced transfers at the file's link (a profile's measured copy,
        6 GB/s) while each took the emulated 1 GB/s, and took other decisions than the doctor had timed."""
        over: dict[str, float] = {}
        if link.bandwidth is not None and link.bandwidth_Bps != costs.link_bandwidth:
            over["link_bandwidth"] = link.bandwidth_Bps
        if link.latency_s > 0 and link.latency_s != costs.link_latency:
            over["link_latency"] = link.latency_s
        if not over:
            return costs
        flags = " and ".join(option(f"--{k.replace('_', '-')}", k) for k in over)
        self.notes.append(
            f"miss path {miss} prices transfers at the emulated link ({flags}) over the costs given, as "
            "timing, plan and doctor do with the same flags"
        )
        return dataclasses.replace(costs, **over)

    def _host_level(self, host: HostConfig | None):
        """The host level's decisions (``cache.tiers``), where there is one."""
        return build_host_level(host, self.host_capacity, self.policy_ctx) if self.host_capacity else None

    def _host_capacity(self, host: HostConfig | None, slow_tier: str | None) -> int:
        """Experts the host level holds (0: none): ``host.memory`` over whole experts, at most all."""
        if host is None:
            return 0
        if slow_tier == "host":
            raise ExpertcacheError(
                f"a host level ({option('--host-memory', 'host_memory')}, or a plan's) is a host cache over "
                "the checkpoint on disk; slow tier host holds every expert in host memory: give slow tier "
                "disk (the default with a host level) or mapped"
            )
        if self.miss.name != "fetch":
            raise ExpertcacheError(
                f"a host level ({option('--host-memory', 'host_memory')}) serves the fetch miss path; miss "
                f"path {self.miss.name} reads experts its own way"
            )
        if host.stage and not self.prefetch_config_.enabled:
            raise ExpertcacheError(
                f"host stage {host.stage} reads predicted experts early: give a predictor "
                f"({option('--prefetch NAME', 'prefetch=NAME')})"
            )
        total, slot = self.num_layers * self.num_experts, self.layout.slot_bytes
        memory = host.bytes_of(total * slot) // slot  # experts the memory holds, all of them at most
        if host.exceeds(total * slot):  # more than every expert: said, as timing says
            self.notes.append(
                f"a host level of {host.memory} is more than all {total} experts; capped at {total}"
            )
        if memory < 1:
            raise ExpertcacheError(
                f"host memory {host.memory} holds no expert of {format_bytes(slot)}; give at least that"
            )
        if self.capacity >= total:
            self.notes.append(HOST_LEVEL_UNUSED)
            return 0
        experts = level_experts(memory, host.exclusive, self.top_k)
        self.host_reserve = memory - experts
        if experts < 1:
            raise ExpertcacheError(
                f"host memory {host.memory} holds {memory} expert(s) of {format_bytes(slot)}, all of them "
                f"the reserve an exclusive host level keeps for its hits in flight (a layer's top-k): give "
                f"at least {self.top_k + self.host_reserve} experts' memory"
            )
        if experts <= self.capacity and not host.exclusive:
            self.notes.append(
                f"the host level ({experts} experts) holds no more than the expert memory ({self.capacity}): "
                "inclusive, it hits only experts the expert memory let go recently; give it more memory"
            )
        return experts

    def _spare_slots(self, host: HostConfig | None) -> int:
        """Slots of the whole experts' pool beyond its capacity: one under an exclusive host level on a GPU,
        where each device victim is copied down before its slot may take the next expert. The transfer
        takes the spare instead, and the victim's slot becomes the spare (``SlotTransport.submit``), so
        the copy down and the transfer cross the link at once, one each way. The decisions (the capacity)
        are the simulator's as without it; the slot is memory beyond the budget, said in a note."""
        if not (self.host_capacity and host.exclusive and self.device.type == "cuda"):
            return 0
        if FULL not in self.parts or not isinstance(self.capacities.get(FULL), int) or not self.capacity:
            return 0
        self.notes.append(
            f"one expert slot ({format_bytes(self.layout.slot_bytes)}) beyond the expert memory, spare: an "
            "exclusive host level's copy down of a device victim overlaps the transfer that replaces it"
        )
        return 1

    def _tier(self, sk, slow_tier: str | None, show: bool):
        if self.host_capacity:
            pin = self.device.type == "cuda"
            disk = DiskTier(sk.store, self.layout, self.device, drop=slow_tier != "mapped")
            bar = _progress("host memory", show)
            return StackTier(
                disk, self.layout, self.host_capacity, pin=pin, progress=bar, reserve=self.host_reserve
            )
        tier = slow_tier or ("host" if self.device.type == "cuda" else "disk")
        if tier == "host":
            bar = _progress("experts to host memory", show)
            pin = self.device.type == "cuda"
            return HostTier(sk.store, self.layout, self.num_layers, self.num_experts, pin=pin, progress=bar)
        return DiskTier(sk.store, self.layout, self.device, drop=tier == "disk")

    def _policy_context(self, cache: CacheConfig) -> PolicyContext:
        prof = None
        if policy_class(cache.name).needs_profile:
            tr = as_trace(cache.profile, "the usage profile")  # a file, or "default": the embedded trace
            if (tr.num_layers, tr.num_experts) != (self.num_layers, self.num_experts):
                raise ExpertcacheError(
                    f"profile trace has {tr.num_layers} layers x {tr.num_experts} experts, the model "
                    f"{self.num_layers} x {self.num_experts}"
                )
            self._recorded_elsewhere(tr, "the usage profile")
            prof = build_schedule(tr, "layer").profile
        return PolicyContext(
            capacity=max(1, self.capacity), num_layers=self.num_layers, num_experts=self.num_experts,
            top_k=self.top_k, clock=Clock(), seed=cache.seed, profile=prof,
        )  # fmt: skip

    def _recorded_elsewhere(self, trace: Trace, what: str) -> None:
        """A note where ``trace`` was recorded on another checkpoint than this one (its
        ``model_fingerprint``): of the same shape it runs, and its routing is that model's. A user's
        profile of another model was taken in silence (a new user's trial)."""
        recorded = trace.meta.get("model_fingerprint")
        if recorded is None:
            return
        from expertcache.engine.quantized import fingerprint

        if recorded != fingerprint(self.path):
            self.notes.append(
                f"{what} {trace.source} was recorded on another checkpoint ({trace.meta.get('model', '?')}): "
                f"its routing is that model's, not {model_label(self.path)}'s"
            )

    def _chunking(self, prefetch: PrefetchConfig) -> dict[str, object]:
        """How speculative transfers move: in chunks of ``--chunk-size``, or by default in thirds of an
        expert where chunks pay (``costs.chunks_pay``: the data of an expert's transfer takes more than 5
        latencies of a chunk), else whole. The latency is the emulated link's, or measured at load
        (``calibrate.chunk_costs``: one expert whole against the same in chunks)."""
        third = -(-self.layout.nbytes // AUTO_CHUNKS)  # an expert's three matrices
        full = (FULL, None)
        if prefetch.chunk_bytes is not None:
            size, most = prefetch.chunk_bytes, MAX_CHUNKS  # the timing model's limit: a run it can replay
            if -(-self.layout.nbytes // size) > most:
                raise ExpertcacheError(
                    f"{option('--chunk-size', 'chunk_size')} {size} B cuts an expert of {self.layout.nbytes} "
                    f"bytes into {-(-self.layout.nbytes // size)} chunks; at most {most} (chunks of at least "
                    f"{-(-self.layout.nbytes // most)} bytes)"
                )
            return {"chunk_bytes": size, "why": "given (--chunk-size)"}
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
            if source == "default":  # the embedded trace, as the simulator's commands name it
                trace = default_trace()
            elif src.is_file() and src.suffix == ".npz":
                trace = load_trace(src)
            elif src.is_dir():
                path = str(src)
            else:
                raise ExpertcacheError(
                    f"{src}: predictor data must be a trained predictor directory or a .npz trace"
                )
        if source is not None:  # what the predictor reads, and only that: a datum it ignores is refused
            name, reads = self.prefetch, predictor_class(self.prefetch).reads
            if reads is None:
                raise ExpertcacheError(
                    f"{option(f'--predictor {source}', f'predictor={source!r}')}: prefetch {name} reads no "
                    "predictor data (learned reads a trained predictor directory; token and eam a recorded "
                    "trace)"
                )
            if (reads == "directory") != (path is not None):
                given, wants = (
                    ("a trace", "a trained predictor directory (expertcache train-predictor)")
                    if (reads == "directory")
                    else ("a directory", "a recorded trace (.npz)")
                )
                raise ExpertcacheError(
                    f"{option(f'--predictor {source}', f'predictor={source!r}')} is {given}: prefetch {name} "
                    f"reads {wants}"
                )
        if trace is None and source is None and self.path == DEFAULT_MODEL and not self.planned_cold:
            trace = default_trace()  # token's table and eam's warm start on the embedded model
            if predictor_class(self.prefetch).reads == "trace":  # said: predictor-accuracy asks for one
                self.notes.append(
                    f"prefetch {self.prefetch} learns from the embedded model's own recorded trace (give "
                    f"{option('--predictor TRACE.npz', 'predictor=TRACE')} for another)"
                )
        if trace is not None and (trace.num_layers, trace.num_experts) != (self.num_layers, self.num_experts):
            raise ExpertcacheError(
                f"predictor trace has {trace.num_layers} layers x {trace.num_experts} experts, the model "
                f"{self.num_layers} x {self.num_experts}"
            )
        if trace is not None:
            self._recorded_elsewhere(trace, f"prefetch {self.prefetch}'s trace")
        ctx = PredictContext(
            num_layers=self.num_layers, num_experts=self.num_experts, top_k=self.top_k,
            window=None if prefetch.window is None else int(prefetch.window), routers=router_fns(self.model),
            trace=trace, path=path, seed=self.cache_config.seed,
        )  # fmt: skip
        return make_predictor(self.prefetch, ctx)


def _progress(desc: str, show: bool):
    if not show:
        return None
    from tqdm.auto import tqdm

    return lambda items: tqdm(items, desc=desc, unit="expert", leave=False)
