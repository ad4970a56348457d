"""``expertcache.load``: a Hugging Face MoE checkpoint with its experts behind a bounded cache."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from expertcache.cache.stats import prediction_quality
from expertcache.config import (
    AUTO,
    CacheConfig,
    HostConfig,
    LinkConfig,
    MissConfig,
    PrefetchConfig,
    SamplingConfig,
    as_config,
)
from expertcache.costs import CostModel
from expertcache.engine import generation as gen
from expertcache.engine.builder import Builder, resolve_device  # noqa: F401  (tools.selftest's import)
from expertcache.engine.generation import Generation, timed_generate
from expertcache.engine.hub import DEFAULT_MODEL, model_label, resolve_model
from expertcache.engine.loader import build_skeleton
from expertcache.engine.memory import resident_memory
from expertcache.engine.packed import SOURCE_KEY, describe_format
from expertcache.errors import ExpertcacheError, did_you_mean, first_line, warn_notes
from expertcache.miss.base import FULL
from expertcache.plan import Plan, as_plan
from expertcache.policy.registry import policy_class
from expertcache.trace.trace import Trace, check_save_path
from expertcache.units import true_or_false, whole_number
from expertcache.workers import quota_threads

# the builder's names of the parts this model keeps private
_PRIVATE = {
    "whole": "_whole",
    "policy_ctx": "_policy_ctx",
    "measured_costs": "_measured_costs",
    "weight_files": "_weight_files",
}


def default_model_path() -> Path:
    return DEFAULT_MODEL


def batch_seed(sampling: SamplingConfig, batch: int) -> SamplingConfig:
    """Batch ``batch``'s sampling of a run of several: seed + batch, so that one seed repeats the whole run
    and each batch draws its own (every batch was reseeded with the same seed: a prompt listed twice, in two
    batches, was sampled twice alike)."""
    if sampling.greedy or sampling.seed is None or batch == 0:
        return sampling
    import dataclasses

    return dataclasses.replace(sampling, seed=(sampling.seed + batch) % 2**63)


class OffloadedModel:
    """A causal LM whose experts stream through a bounded cache; use like a transformers model.

    Built from one config object per domain (``cache``, ``prefetch``, ``link``, ``miss``), each
    validated on creation; ``expertcache.load`` builds them from keyword arguments. What the load decides
    is ``engine.builder``'s; this class keeps its parts (``Built``'s fields, as attributes) and runs them."""

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
        built = Builder(
            path, expert_memory, cache=cache, prefetch=prefetch, link=link, miss=miss, device=device,
            dtype=dtype, slow_tier=slow_tier, costs=costs, progress=progress, record=record,
            download=download, plan=plan, warmup=warmup, kernel=kernel, quantize_dense=quantize_dense,
            host=host, attention=attention,
        ).built()  # fmt: skip
        for field in dataclasses.fields(built):  # the parts as this model's attributes
            setattr(self, _PRIVATE.get(field.name, field.name), getattr(built, field.name))
        self._tokenizer = None
        self.closed = False
        # one generation at a time: a step's routing, its recording and a run's counts are the model's
        # (two threads' generations at once broke the recorder's step and lost one: a new user's trial)
        self._turn = threading.RLock()
        # the attention asked for, where its modules run another by name with the same effect (a server's
        # sdpa_no_cudnn: engine.attention.serve_without_cudnn); None: what the modules run
        self.attention: str | None = None

    def __repr__(self) -> str:
        total = self.num_layers * self.num_experts
        state = "closed" if self.closed else f"{self.capacity} of {total} experts"
        level = None if self.closed else getattr(self.cache.transport, "level", None)
        host = (  # a host level below the expert memory (cache.tiers): its experts, policy and kind
            ""
            if level is None
            else f", host level {level.policy.capacity} experts ({self.host_config.policy}"
            + (", exclusive)" if level.exclusive else ")")
        )
        return (  # the specs as given, their parameters too (the names alone hid them: a new user's trial)
            f"<OffloadedModel {model_label(self.path)}: {state}, policy {self.cache_config.policy}, "
            f"miss {self.miss_config.path}{host}, {self.device}>"
        )

    def _open(self) -> None:
        if self.closed:
            raise ExpertcacheError("this model is closed (close() was called): load it again")

    # ----------------------------------------------------------------- transformers-style use
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            tok = load_tokenizer(self.path)
            tok.padding_side = "left"  # batches: every row's new tokens start at the same position
            if tok.pad_token is None and tok.eos_token is not None:
                tok.pad_token = tok.eos_token
            self._tokenizer = tok
        return self._tokenizer

    def __call__(self, *args, **kwargs):
        self._open()
        with self._turn, torch.inference_mode():
            return self.model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """``transformers`` ``generate`` on the offloaded model (greedy unless asked otherwise). One
        generation runs at a time: a call from another thread waits for the one running."""
        self._open()
        given = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        if isinstance(given, str | list | tuple):
            raise ExpertcacheError(
                f"generate takes token ids (a tensor [batch, tokens], as transformers' generate), got "
                f"{type(given).__name__}: give text to generate_text, or ids from encode()"
            )
        if isinstance(given, torch.Tensor):
            self._check_ids(given, kwargs.get("max_new_tokens"))
        kwargs.setdefault("do_sample", False)
        with self._turn, torch.inference_mode():
            return self.model.generate(*args, **kwargs)

    def _check_ids(self, ids: torch.Tensor, new: object) -> None:
        """Token ids ``generate`` can run, or one line: integers, ``[batch, tokens]`` with some tokens, each
        one of the model's, and no more than its context (they failed deep in torch: a new user's trial)."""
        if ids.dtype in (torch.bool, *_FLOATS) or ids.is_complex():
            raise ExpertcacheError(f"token ids must be integers, got a tensor of {ids.dtype}")
        if ids.dim() != 2 or not ids.numel():
            raise ExpertcacheError(
                f"token ids: a tensor [batch, tokens] with at least one token, got shape {list(ids.shape)}"
            )
        rows = self.model.get_input_embeddings().num_embeddings
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise ExpertcacheError(f"token id {bad} is not one of the model's (0 .. {rows - 1})")
        limit = getattr(self.config, "max_position_embeddings", None)
        more = new if isinstance(new, int) and not isinstance(new, bool) else 0
        if limit is not None and ids.shape[1] + more > limit:
            raise ExpertcacheError(
                f"{ids.shape[1]} tokens{f' + {more} new tokens' if more else ''} exceed the model's context "
                f"of {limit}"
            )

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
        Each result has tokens, text, finish reason, TTFT/TPOT and the cache's work during its batch.
        Other keyword arguments go to transformers' ``generate`` (its generation settings)."""
        self._open()
        max_new_tokens = whole_number(max_new_tokens, "max_new_tokens")  # numpy's integers too
        batch_size = whole_number(batch_size, "batch_size")
        true_or_false(chat, "chat")
        gen.check_generate_kwargs(kwargs, self.model)
        least = kwargs.get("min_new_tokens")
        if least is not None and whole_number(least, "min_new_tokens", 0) > max_new_tokens:
            raise ExpertcacheError(f"min_new_tokens {least} is more than max_new_tokens {max_new_tokens}")
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise ExpertcacheError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        sampling = sampling or SamplingConfig()
        one = isinstance(prompt, str) or (
            chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        )
        if not one and not isinstance(prompt, list | tuple):
            raise ExpertcacheError(
                f"prompt must be a string or a list of them{' (or of chat messages)' if chat else ''}, "
                f"got {type(prompt).__name__}"
            )
        prompts = [prompt] if one else list(prompt)
        if not prompts:
            raise ExpertcacheError("no prompts were given")
        if streamer is not None and len(prompts) > 1:
            raise ExpertcacheError("streaming is for one prompt at a time")
        gen.check_streamer(streamer)
        texts = [gen.render(self.tokenizer, p, chat, f"prompt {i + 1}" if not one else "the prompt")
                 for i, p in enumerate(prompts)]  # fmt: skip
        if not sampling.greedy and sampling.seed is None and len(texts) > batch_size:
            import dataclasses
            import secrets

            sampling = dataclasses.replace(sampling, seed=secrets.randbelow(2**31))  # one for the call
        results: list[Generation] = []
        for i, start in enumerate(range(0, len(texts), batch_size)):
            results += self._generate_batch(texts[start : start + batch_size], max_new_tokens, streamer,
                                            batch_seed(sampling, i), chat, kwargs)  # fmt: skip
        return results[0] if one else results

    def _generate_batch(self, texts, max_new_tokens, streamer, sampling, chat, kwargs) -> list[Generation]:
        with self._turn:  # the batch's counts, before and after, are its own
            return self._run_batch(texts, max_new_tokens, streamer, sampling, chat, kwargs)

    def _run_batch(self, texts, max_new_tokens, streamer, sampling, chat, kwargs) -> list[Generation]:
        tok = self.tokenizer
        kwargs = dict(kwargs)
        ids, mask = gen.encode(tok, texts, chat)
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and ids.shape[1] + max_new_tokens > limit:
            raise ExpertcacheError(
                f"prompt of {ids.shape[1]} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"context of {limit}"
            )
        vocab = getattr(self.config, "vocab_size", None)
        if sampling.top_k is not None and vocab is not None and sampling.top_k > vocab:  # as serve refuses it
            raise ExpertcacheError(f"top-k {sampling.top_k} is more than the vocabulary's {vocab} tokens")
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
        predicted = self.cache.stats.prediction_counts()
        run = timed_generate(
            self.generate, ids.to(self.device), streamer, attention_mask=mask.to(self.device),
            max_new_tokens=max_new_tokens, pad_token_id=pad, **{**decode_kw, **kwargs},
        )  # fmt: skip
        with self._turn:  # what its last step's prefetches moved is this generation's, not the next one's
            self.cache.settle()
        after = self._stats(memory=False)
        counted = (
            "hits", "misses", "bytes_transferred", "stall_s", "decode_stall_s", "prefill_stall_s",
            "host_wait_s", "host_computed", "low_precision", "skipped", "prefetch_issued", "prefetch_used",
            "prefetch_late", "prefetch_evicted", "prefetch_cancelled", "prefetch_skipped", "prefetch_unused",
            "shadow_guesses", "shadow_hits", "filled", "retried_chunks", "requests", "prefill_misses",
            "decode_misses", "steps",
        )  # fmt: skip
        delta = {**{k: after[k] - before[k] for k in counted}, **self.prefetch_config, **self._describe()}
        delta["misses_by_layer"] = [
            b - a for a, b in zip(before["misses_by_layer"], after["misses_by_layer"], strict=True)
        ]
        # the prediction quality of this generation's steps (ratios of counts, not of the totals')
        now = self.cache.stats.prediction_counts()
        delta.update(prediction_quality(*(b - a for a, b in zip(predicted, now, strict=True))))
        for name in ("part_misses", "part_prefetches", "part_cancelled", "part_fills", "part_reused"):
            parts = before[name]
            delta[name] = {p: n - parts.get(p, 0) for p, n in after[name].items() if n > parts.get(p, 0)}
        delta.update(expert_memory_bytes=after["expert_memory_bytes"], slow_tier=after["slow_tier"],
                     memory=resident_memory(self._weight_files))  # fmt: skip
        if "host_requests" in after:  # the host level's work in this generation (``cache.tiers``)
            level = ("host_requests", "host_hits", "host_misses", "host_evicted", "host_bypassed",
                     "host_staged", "host_demoted", "host_returned", "host_dropped", "host_slot_waits",
                     "host_slot_wait_s", "disk_reads", "disk_read_s", "disk_read_errors")  # fmt: skip
            delta.update({k: after[k] - before[k] for k in level})
            # the level as laid out: an exclusive one's reserve is beyond its capacity (a replay's
            # --host-capacity is its memory in experts, capacity + reserve)
            delta.update({k: after[k] for k in ("host_capacity", "host_reserve", "host_memory_bytes",
                                                "host_policy", "host_exclusive", "host_over")})  # fmt: skip
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
    @property
    def _experts_lossy(self) -> bool:
        """The experts' outputs are not those of the full-precision model: packed by expertcache (whatever
        the format: an FP8 checkpoint ``quantize`` made stands for its source with a loss), or read through
        a kernel that does not compute the stored weights exactly. Another tool's quantised checkpoint read
        exactly is that model."""
        return self.packed is not None and (not self.packed.exact or self._made_from is not None)

    @property
    def _made_from(self) -> str | None:
        """The full-precision checkpoint expertcache packed this one from (``quantize``), if it did."""
        return (getattr(self.config, SOURCE_KEY, None) or {}).get("path") if self.packed else None

    @property
    def memory_experts(self) -> int:
        """The expert memory in whole experts (not the slots of a miss path's parts: half experts, copies)."""
        return self.budget // self.layout.slot_bytes

    def _describe(self) -> dict[str, object]:
        """What this model is: its cache's size and parts, policy, miss path, device."""
        return {
            "model": model_label(self.path),
            "capacity_experts": self.capacity,  # keys of the primary part (a split path's: its segments)
            "memory_experts": self.memory_experts,
            "total_experts": self.num_layers * self.num_experts,
            "expert_bytes": self.layout.nbytes,
            "expert_format": describe_format(self.packed, self.dtype),
            # a checkpoint expertcache quantised: the full-precision one it was made from (quality's)
            "made_from": self._made_from,
            # the kernels compute the checkpoint's stored weights exactly (another tool's format)
            "experts_as_stored": self.packed is not None and self.packed.exact,
            "policy": self.cache_config.policy,
            # what a randomized policy drew from (--policy-seed); None for one that draws nothing
            "policy_seed": self.cache_config.seed if policy_class(self.cache_config.name).seeded else None,
            "miss": self.miss.describe(),
            # the outputs may differ from the checkpoint's model: a lossy miss path, experts packed by
            # expertcache (another tool's quantised checkpoint is that model: its weights are read exactly),
            # dense weights quantised at load, or the compiled kernel (its sums in another order)
            "lossy": self.miss.lossy or self._experts_lossy or self.dense is not None or self.kernel.rounds,
            "experts_lossy": self._experts_lossy,
            "dense": None if self.dense is None else self.dense.to_dict(),
            "parts": {name: {"slots": self.capacities[name], "slot_bytes": p.slot_bytes(),
                             "transfer_bytes": p.transfer_bytes(),
                             **({"copies": p.copies} if p.copies else {})}
                      for name, p in self.parts.items()},
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),  # the modules' compute dtype (``--dtype``)
            "dtype_own": self.dtype_own,  # the checkpoint's own dtype (else one --dtype asked for)
            "kernel": self.kernel.name,
            "attention": self.attention or getattr(self.model.config, "_attn_implementation", None),
            "preloaded_experts": self.preloaded,
            "warmup_s": self.warmup_s,
        }  # fmt: skip

    @property
    def stats(self) -> dict[str, object]:
        """The cache's work since load: hits, misses, bytes moved, stall time, per layer too; and the
        memory the process holds now (``engine.memory.resident_memory``)."""
        return self._stats(memory=True)

    def _stats(self, memory: bool) -> dict[str, object]:
        t, driver = self.transport, self.driver
        counts = self.cache.stats.to_dict()
        for row, phase in enumerate(("decode", "prefill")):  # the engine's share of the per-phase counts
            counts["phases"][phase].update(
                steps=driver.steps_by_phase[row],
                tokens=driver.tokens_by_phase[row],
                stall_s=t.stall_by_phase[row],
            )
        return {
            **counts,
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
            **self._host_level(),
            "link": self.link.describe() if self.link else None,
            "costs": None if self.costs is None else self.costs.to_dict(),
            **self.prefetch_config,
            "retried_chunks": self.worker.retried,
            "plan": None if self.plan is None else self.plan.describe(),
        }

    def _host_level(self) -> dict[str, object]:
        """The host level's counts and the disk reads below it (``cache.tiers``), where there is one."""
        level = getattr(self.cache.transport, "level", None)
        if level is None:
            return {}
        tier = self.tier
        return {
            **level.stats.to_dict(),
            "host_memory_bytes": len(tier.pool) * tier.pool.layout.slot_bytes,  # the reserve's slots too
            "host_capacity": level.policy.capacity,
            "host_policy": self.host_config.policy,  # the spec as given, its parameters too
            "host_exclusive": level.exclusive,
            "host_reserve": len(tier.pool) - level.policy.capacity,  # exclusive: hits' slots still read
            "device_spare_slots": self.spare_slots,  # beyond the expert memory: copies down overlap
            "host_slot_waits": tier.slot_waits,
            "host_slot_wait_s": tier.slot_wait_s,
            "host_over": "mapped checkpoint" if tier.disk.name == "mapped" else "disk",
            "host_stage": level.stage_limit,
            "disk_reads": tier.disk_reads,
            "disk_read_s": tier.disk_read_s,
            "disk_read_errors": tier.disk_read_errors,
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
            "memory": self.memory_experts,
            "expert_bytes": self.layout.nbytes,  # what a whole expert moves (a profile's must match)
            "device": self.device.type,  # a CPU's copies land almost at once: its replay is nearly settled
        }  # fmt: skip
        if getattr(self, "_fingerprint", None) is None:  # the checkpoint's identity, read once
            from expertcache.engine.quantized import fingerprint

            self._fingerprint = fingerprint(self.path)
        meta["model_fingerprint"] = self._fingerprint  # a profile or predictor trace of another model: said
        bits = 8 * torch.empty((), dtype=self.dtype).element_size()
        if bits in (16, 32):  # its weights' width: a replay sizes low-precision copies of them by it
            meta["weight_bits"] = bits
        if self.link is not None:  # the emulated link its transfers took: a replay's, where none is given
            meta.update(link_bandwidth=float(self.link.bandwidth), link_latency=float(self.link.latency))
        if self.preloaded:  # every expert read at load: the run missed none (a replay starts empty)
            meta["preloaded"] = self.preloaded
        if any(name != FULL for name in self.parts):  # a part's transfer's bytes (a segment's whole neurons)
            meta["part_bytes"] = json.dumps({name: p.transfer_bytes() for name, p in self.parts.items()})
        if policy_class(self.cache_config.name).seeded:  # what it drew from: a replay needs the same
            meta["policy_seed"] = self.cache_config.seed
        profile = self.cache_config.profile
        if profile is not None:  # a static policy's ranking: the simulator needs the same (--profile)
            where = Path(profile.source if isinstance(profile, Trace) else profile)
            meta["profile"] = str(where.resolve() if where.is_file() else where)
        if self.costs is not None and self.miss.needs_costs:  # what a cost-based path decided by
            meta["costs"] = json.dumps(self.costs.to_dict())
            meta["costs_measured"] = bool(self._measured_costs)  # or given (--cost, a plan's)
        if self.predictor is not None:
            meta.update(predictor=self.prefetch, window=self.predictor.window)
            # where it predicted (a layer's router or the step's start): a replay of a predictor it does
            # not know (the user's own object) issues the recorded predictions at the same points
            meta["predictor_needs_model"] = bool(getattr(self.predictor, "needs_model", True))
            # every transfer landed before the next decision: the counts are an instant link's
            meta["deterministic"] = bool(self.prefetch_config_.deterministic)
            if self.prefetch_limit is not None:
                meta["prefetch_limit"] = self.prefetch_limit
        level = getattr(self.cache.transport, "level", None)
        if level is not None:  # the host level (``cache.tiers``): replayed at its own capacity
            meta.update(host_capacity=level.policy.capacity, host_policy=self.host_config.policy,
                        host_exclusive=level.exclusive, host_stage=level.stage_limit)  # fmt: skip
        return self.driver.recorder.trace(meta=meta)

    def save_trace(self, path: str | Path) -> None:
        """Write ``trace()`` to ``path`` (.npz); a closed model's run can still be saved."""
        check_save_path(path)  # before trace(): a wrong path is the first thing to say
        self.trace().save(path)

    def close(self) -> None:
        """Stop the engine's threads and free its memory; the model cannot be used after (idempotent)."""
        if not self.closed:
            self.closed = True
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
    layout = sk.layout  # as stored: packed bytes for a packed checkpoint
    total = len(sk.experts) * sk.num_experts
    dense = stored_bytes(sk.model)  # in memory, in the model's dtype (dequantised where stored quantised)
    ckpt = sk.store.ckpt
    sizes = [math.prod(ckpt.shape(k)) * getattr(ckpt.dtype(k), "itemsize", 0) for k in ckpt]
    stored = sum(sizes) - total * layout.nbytes if all(sizes) else None  # None: a dtype torch lacks
    return {
        "path": str(path),
        "family": sk.family.name,
        "dtype": str(sk.dtype).removeprefix("torch."),
        "moe_layers": len(sk.experts),
        "experts_per_layer": sk.num_experts,
        "top_k": sk.top_k,
        "expert_format": describe_format(sk.packed, sk.dtype),
        "expert_bytes": layout.nbytes,  # what a miss moves
        # what an expert takes in memory: its bytes with each tensor's padding for alignment (an FP8 expert
        # of 9228 bytes takes 9344); budgets count these, a share of all of them (100 %) included
        "expert_slot_bytes": layout.slot_bytes,
        "all_experts_bytes": total * layout.nbytes,  # as stored (beside dense_stored_bytes: the files')
        "dense_bytes": dense,
        # as the checkpoint stores them (another tool's FP8 or compressed-tensors dense layers: fewer bytes)
        "dense_stored_bytes": stored if stored is not None and stored != dense else dense,
        "min_expert_memory_bytes": sk.top_k * layout.slot_bytes,
    } | (  # a checkpoint expertcache quantised: the full-precision one it was made from
        {"made_from": source.get("path")} if (source := getattr(sk.config, SOURCE_KEY, None) or {}) else {}
    )


# the files one of which a checkpoint's tokenizer is saved in
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str | Path) -> bool:
    """Whether a checkpoint's folder holds a tokenizer (a model saved by ``save_pretrained`` alone: none)."""
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path: Path):
    """transformers' tokenizer of the checkpoint at ``path``, or one whole line saying what is wrong (a
    model saved without its tokenizer: what to save)."""
    from transformers import AutoTokenizer

    # without one of its files transformers may still build an empty tokenizer from the config alone
    # (qwen3_moe's, olmoe's), whose every prompt has no tokens: the missing files are what to say
    if not has_tokenizer(path):
        raise ExpertcacheError(
            f"{path}: no tokenizer beside the weights (no {', '.join(TOKENIZER_FILES)}): save the "
            "model's tokenizer into the folder too (tokenizer.save_pretrained(FOLDER))"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ExpertcacheError(f"{path}: no usable tokenizer ({first_line(exc).rstrip(',;: ')})") from None


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Unset(str):
    """One of ``load``'s defaults that a plan sets: the value itself, marked as not given, so that a value
    given beside a plan is told from the default (``miss="fetch"`` beside a plan of ``host`` was run as
    the plan's, silently: a new user's trial)."""

    __slots__ = ()


_ALL, _LRU, _FETCH, _AUTO = _Unset("100%"), _Unset("lru"), _Unset("fetch"), _Unset(AUTO)


def load(
    path: str | Path | None = None,
    expert_memory: str | int | float = _ALL,
    policy: str | CacheConfig = _LRU,
    device: str | torch.device | None = None,
    *,
    miss: str | MissConfig = _FETCH,
    prefetch: str | PrefetchConfig | None = _AUTO,
    link_bandwidth: str | float | None = None,
    link_latency: str | float = 0.0,
    link: LinkConfig | None = None,
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
    host_memory: str | int | None = None,
    host_policy: str | None = "lru",
    host_stage: int = 0,
    host_exclusive: bool = False,
    **options,
) -> OffloadedModel:
    """Load a Hugging Face MoE checkpoint (default: the embedded demo model) with experts offloaded.

    ``path`` is a checkpoint folder or a Hugging Face id (``org/name``) found in the local Hugging Face
    cache; ``download=True`` fetches one that is not there (nothing is downloaded otherwise).

    ``expert_memory`` is bytes (``"6GiB"``, ``500_000_000``) or a share of all expert bytes (``"30%"``);
    ``policy`` any online policy of the library (``"lru"``, ``"llru"``, ``"lfu-dist"``, ``"lru:param=v"``);
    ``miss`` what to do on a miss (``"fetch"``, ``"host"``, ``"hybrid"``, ``"split:theta=0.5"``, ...,
    see ``expertcache misses``). Link emulation: ``link_bandwidth`` and ``link_latency`` (a number is bytes a
    second and seconds: ``link_latency=20`` is 20 s; or a string with its unit, ``"16GB/s"``, ``"20us"``), or
    ``link``, a
    ``expertcache.config.LinkConfig`` (giving both ways is an error). ``seed`` and ``profile`` (a trace,
    for ``static``) go to the policy. Proactive caching: ``prefetch`` (a predictor
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
    ``grouped_mm``; ``"eager"``, one at a time, exact against its eager loop; ``"compiled"`` (CPU,
    opt-in), grouped with decode steps' experts in compiled loops, faster and not bit-equal to
    transformers (``expertcache quality --kernel compiled`` measures how far); default ``"auto"``:
    grouped where torch has it; ``engine.kernels``), ``quantize_dense`` (``"int8"``: the dense layers
    quantised at load and computed packed, lossy and opt-in: ``engine.dense``; default None: as stored),
    ``attention`` (transformers' attention implementation: ``"sdpa"``, ``"eager"`` or ``"sdpa_no_cudnn"``
    (``sdpa`` without cuDNN's backend, which plans every new key length on a GPU: ``engine.attention``),
    exact against transformers loaded with the same; default None: transformers' default, ``sdpa`` or
    ``eager`` where it has none, with ``sdpa_no_cudnn`` in ``sdpa``'s place on a GPU
    (``engine.loader.default_attention``); on a CPU in bfloat16 ``eager`` decodes faster at long contexts:
    ``engine.loader.ATTENTION``),
    ``slow_tier``
    (``"host"``, ``"disk"`` or ``"mapped"``: ``engine.transfer.DiskTier``), ``costs`` (a ``CostModel``,
    a dict of its fields or a cost model or profile file, for cost-based miss paths; default: measured
    at load), ``progress``, ``record`` (keep the routing for ``trace()``; on by default), ``download``,
    ``warmup`` (on by default: with every expert resident, a 2-token generation at load takes the first
    request's one-time costs; ``stats["warmup_s"]`` its time).
    ``plan`` (a ``Plan`` or a ``plan.json`` from ``expertcache plan``) sets the expert memory, the policy
    and its per-layer budgets, the miss path and the predictor; giving one of those as well is an error.
    Three tiers (``cache.tiers``): ``host_memory`` (bytes or a share of all experts, like
    ``expert_memory``) puts a host cache of experts under ``host_policy`` between the expert memory and
    the checkpoint on disk (pinned host memory on a GPU); ``stats`` then counts its hits and misses;
    ``host_stage`` reads up to that many more predicted experts a layer into it early;
    ``host_exclusive`` makes it hold what the expert memory does not (a hit moves up, the expert memory's
    victim comes down; ``cache.tiers``); or ``host``, a ``config.HostConfig`` of them all (also taken as
    ``host_memory``). Under a CPU quota (``docker --cpus``, a Kubernetes CPU limit)
    with neither ``OMP_NUM_THREADS`` nor ``NUMBA_NUM_THREADS`` set, torch's threads are lowered to the
    quota, rounded up (``workers.quota_threads``).
    """
    _check_options(options)  # a misspelt argument, before anything loads
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ExpertcacheError(f"seed must be a whole number, got {seed!r}")
    if path is not None and not isinstance(path, str | os.PathLike):
        raise ExpertcacheError(
            f"path: a checkpoint folder or a Hugging Face id (org/name), got {type(path).__name__} {path!r}"
        )
    threads = quota_threads()  # torch starts a thread per CPU of the mask and ignores a CPU quota
    if threads is not None and torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
    plan = as_plan(plan)
    if plan is not None:
        given = {
            "expert_memory": expert_memory,
            "policy": policy,
            "miss": miss,
            "prefetch": prefetch,
            "window": window,
        }
        extra = [k for k, v in given.items() if not isinstance(v, _Unset | None) and not _is_plans(v, plan)]
        if extra:
            raise ExpertcacheError(
                f"plan sets the expert memory, policy, miss path and predictor; leave out {extra[0]}"
            )
        policy = policy if isinstance(policy, CacheConfig) else plan.cache_config(seed, profile)
        miss = plan.miss_config()
        if not isinstance(prefetch, PrefetchConfig):
            prefetch, window = plan.prefetch, plan.window
        elif plan.deterministic and not prefetch.deterministic:  # planned settled: run so
            prefetch = dataclasses.replace(prefetch, deterministic=True)
        deterministic = deterministic or plan.deterministic
    cache = policy if isinstance(policy, CacheConfig) else CacheConfig(policy, seed=seed, profile=profile)
    if isinstance(prefetch, PrefetchConfig):
        pf = prefetch
    else:
        pf = PrefetchConfig(
            prefetch, window=window, data=predictor, limit=prefetch_limit, chunking=chunking,
            chunk_size=chunk_size, preemption=preemption, reorder=reorder, thread=predictor_thread,
            when=prefetch_when, deterministic=deterministic,
        )  # fmt: skip
    if isinstance(host_memory, HostConfig):  # the whole level given where its size is asked: taken as host=
        if "host" in options:
            raise ExpertcacheError("give the host level once: host=HostConfig(...) or host_memory=...")
        options["host"], host_memory = host_memory, None
        if host_policy not in (None, "lru") or host_stage or host_exclusive:
            raise ExpertcacheError("a HostConfig sets the host level's policy, staging and kind: leave out "
                                   "host_policy, host_stage and host_exclusive")  # fmt: skip
    host_policy = "lru" if host_policy is None else host_policy  # None: the default, as elsewhere
    if not isinstance(host_policy, str):
        raise ExpertcacheError(f"host_policy: a policy's name (lru, lfu:...), got {host_policy!r}")
    if host_memory is None and (host_policy != "lru" or host_stage or host_exclusive):
        raise ExpertcacheError(
            "host_policy, host_stage and host_exclusive need host_memory (the host cache they rule)"
        )
    host = options.pop("host", None) or HostConfig(
        host_memory, host_policy, exclusive=host_exclusive, stage=host_stage
    )
    model = OffloadedModel(
        path, expert_memory, cache=cache, prefetch=pf, link=_link(link, link_bandwidth, link_latency),
        miss=as_config(miss, MissConfig), device=device, plan=plan, host=host if host.enabled else None,
        **options,
    )  # fmt: skip
    warn_notes(model.notes)  # also in ``model.notes``; the command line prints them
    return model


def _check_options(options: dict) -> None:
    """``load``'s further keyword arguments are ``OffloadedModel``'s own (``dtype``, ``kernel``, ...);
    another is refused in one line, with the nearest names (``expert_memroy``: did you mean ...?)."""
    import inspect

    own = {"cache", "prefetch", "link", "miss", "path", "expert_memory", "plan"}  # load's own spelling
    known = set(inspect.signature(OffloadedModel.__init__).parameters) - {"self"} - own
    for name in options:
        if name not in known:
            every = known | set(inspect.signature(load).parameters) - {"options"}
            raise ExpertcacheError(f"load got an unknown argument {name!r}{did_you_mean(name, every)}")


def _link(link: LinkConfig | None, bandwidth: str | float | None, latency: str | float) -> LinkConfig:
    """The link as a config: ``link`` itself, or one made of ``link_bandwidth`` and ``link_latency``."""
    if link is None:
        return LinkConfig(bandwidth, latency)
    if not isinstance(link, LinkConfig):
        raise ExpertcacheError(f"link must be a LinkConfig (expertcache.config), not {type(link).__name__}")
    if bandwidth is not None or latency != 0.0:
        raise ExpertcacheError(
            "the link is given twice: pass link=LinkConfig(...) or link_bandwidth/link_latency, not both"
        )
    return link


def _is_plans(value: object, plan: Plan) -> bool:
    """A config the plan itself gives (what the CLI passes along with the plan)."""
    return (
        value in (plan.cache_config(), plan.miss_config())
        or (isinstance(value, CacheConfig) and value.policy == plan.policy_spec)
        or (
            isinstance(value, PrefetchConfig)
            and value.predictor == plan.prefetch
            and value.window == plan.window
        )
    )


__all__ = ["DEFAULT_MODEL", "Generation", "OffloadedModel", "default_model_path", "load"]
