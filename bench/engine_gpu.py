"""Engine on a GPU at real model dimensions: TPOT against budget and policy, and the bound it meets.

A random-weight checkpoint with the shapes of a real model (default Qwen1.5-MoE-A2.7B: qwen2_moe,
hidden 2048, 24 MoE layers, 60 experts top-4, expert FFN 1408, shared expert 5632, bf16, ~28.6 GB)
is written once to ``--cache-dir``; routing is replayed from the shared real trace
(``../shared/traces/*.npz`` beside the repository, read in place) through
``expertcache.engine.routing.replay_routing``, so the cache sees real routing although the weights
are random. The prompt is the trace request's own prompt tokens (``token_id``), the number of new
tokens that request's decode length (capped by ``--new-tokens``).

Measured (``--device cuda``, slow tier = pinned host memory):

- host-to-device bandwidth: pinned, 1 GiB copies (and expert-sized copies, one at a time);
- all-resident TPOT: ``load_reference`` (transformers' grouped_mm by default, every weight on the GPU)
  and the engine at 100%, both with the replayed routing (their tokens are compared);
- the engine at each budget x policy: a warm-up (``--warmup-tokens`` new tokens of request
  ``--warm-seq``), then request ``--seq`` measured: TTFT, TPOT, tokens/s, decode misses, stall;
- the limit per decode token at each budget: ``max(all-resident TPOT, OPT decode misses / decode
  steps x expert bytes / bandwidth)``, OPT misses from the simulator on the measured request
  (``replay(build_schedule(slice, "layer"), "opt", capacity)``, cold start), beside the serial
  figure (resident TPOT + that transfer time, i.e. no overlap at all);
- a consistency check: the simulator replaying the engine's recorded trace with the same policy and
  capacity gives the engine's miss count (other miss paths: ``simulate_timing`` with the same path,
  policy, expert memory and the costs the engine measured at load);
- ``--miss``: each budget x policy also runs under the given miss paths (``expertcache.load(...,
  miss=SPEC)``: ``host``, ``host:fill=1``, ``hybrid``, ``placement:first=N``, ``split:theta=0.5``, ...);
  the path is recorded in each row (``miss``: the spec as given, ``miss_path``: the engine's form).

Results are written after every configuration; ``--resume`` keeps the configurations already in
``--out`` (same model and trace), so a sweep can be split over several runs of at most ~10 minutes:

    .venv/bin/python bench/engine_gpu.py --build-only            # write the checkpoint (once)
    .venv/bin/python bench/engine_gpu.py --resume                # repeat until it reports done
    OMP_NUM_THREADS=1 .venv/bin/python bench/engine_gpu.py --device cpu --tiny   # smoke test (tiny dims)
    .venv/bin/python bench/engine_gpu.py --resume --policies lru --miss fetch host hybrid split:theta=0.5

``--shape mixtral-8x7b`` uses Mixtral-8x7B dimensions (truncated to ``--layers``, default 8: all 32
layers are ~93 GB, more than a 64 GB disk) with a synthetic sticky-Zipf trace, as no real Mixtral
trace is shared; ``--shape qwen3-30b-a3b`` Qwen3-30B-A3B's (128 experts top-8, expert FFN 768; default
24 of its 48 layers, ~30 GB) with the same kind of trace.

``--packed int4`` (or ``int8``; ``fp8``: block-scaled FP8 as DeepSeek-V3's checkpoints store it, a family
storing experts one by one) writes the checkpoint once more with its experts packed (``expertcache
quantize --checkpoint``, beside it) and runs that (no transformers reference); ``--miss hobbit...`` builds
the low-precision copies it needs first. A random router splits a token's weight evenly, so HOBBIT's
thresholds send nothing to low precision; ``--gate-weights hobbit`` replays top-2 weights drawn as HOBBIT
reports Mixtral's (``bench/hobbit_weights_sim.py`` projects what that changes).

``--build-only --tokenizer DIR`` (for ``bench/serve_load.py``, whose clients send text) copies DIR's
tokenizer into the checkpoint and gives the model that tokenizer's vocabulary and special tokens (the
name says so: ``-v4096`` for the embedded model's): a random model samples every id of its vocabulary, and
ids past the tokenizer's decode to no text. The experts' shapes do not change.

Three tiers: ``--host-memory 16GiB`` runs each budget with a host level of that memory (pinned) over
exact reads of the checkpoint on disk (``--slow-tier disk``), ``--host-levels inclusive exclusive`` both
kinds, ``--host-policy`` its policy (``none`` among the sizes: every expert in pinned host memory). Each
such row records the host level's hits, misses and disk reads over the measured request, the timing
model's replay of the engine's recorded routing at both levels (its host-level misses since load equal
the engine's where nothing was prefetched), ``torch.cuda.max_memory_allocated`` beside the budget and
the dense weights, and the three-level limit: the all-resident TPOT or, if larger, OPT's decode misses
at the device's capacity times one expert's copy plus OPT's decode misses at the host level's capacity
(exclusive: both levels', as it holds what the device does not) times the run's mean read, per token
(the issue's limit); and the same with OPT over both memories' experts for either kind, a bound for any
placement (the inclusive level does not enforce inclusion).

The first engine configuration of a process has measured 36-53 ms at 100 % where later ones took 6-13 ms
(the cause is not established): with ``--no-reference`` the 100 % row runs first, so give ``--budgets
100 ...`` to run it again, or compare with a run that had its reference.

``--kernel`` is the engine's experts kernel (``grouped``, ``eager``, default ``auto``: grouped where torch
has ``grouped_mm``); the all-resident references are transformers with each of ``--references`` (default
``grouped_mm`` and ``eager``: each kernel is exact against one, so their tokens are compared with the
matching one). Also measured: device memory bandwidth (a 1 GiB device-to-device copy), from which the
weight-read floor of a decode token (the bytes it reads: the dense weights but the embedding, and top-k
experts a layer, over that bandwidth), and at each budget the engine's overhead per decode miss beyond
its transfer (TPOT over the engine's 100 %, per decode miss, less one expert's measured copy time).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from provenance import ROOT, SHARED, portable_text, provenance, write_json

from expertcache.config import MissConfig
from expertcache.costs import CostModel
from expertcache.engine import load
from expertcache.engine.families import FAMILIES
from expertcache.engine.loader import load_reference
from expertcache.engine.offloaded import timed_generate
from expertcache.engine.routing import replay_routing
from expertcache.errors import ExpertcacheError
from expertcache.sim import build_schedule, replay
from expertcache.sim.timing import simulate_timing
from expertcache.trace import Trace, load_trace, synthesize

SHAPES: dict[str, dict[str, object]] = {
    "qwen15-moe-a2.7b": dict(
        model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, num_experts=60,
        num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        norm_topk_prob=False, max_position_embeddings=8192, rope_theta=1e6, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151643,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, max_position_embeddings=40960,
        rope_theta=1e6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip
TINY: dict[str, dict[str, object]] = {  # same L, E, K (the trace must fit), small widths
    "qwen15-moe-a2.7b": dict(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=128,
        bos_token_id=0, eos_token_id=0,
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, bos_token_id=0, eos_token_id=0,
    ),
    "mixtral-8x7b": dict(
        vocab_size=4096, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        bos_token_id=0, eos_token_id=0,
    ),
}  # fmt: skip
DEFAULT_LAYERS = {"mixtral-8x7b": 8, "qwen3-30b-a3b": 24}  # the whole models exceed a 64 GB disk
SHARD_BYTES = 4 * 2**30
# the measured generation's share of the engine's cumulative counters
DELTAS = (
    "misses", "decode_misses", "prefill_misses", "stall_s", "decode_stall_s", "bytes_transferred",
    "host_computed", "host_wait_s", "host_busy_s", "prefetch_issued", "prefetch_used", "low_precision",
    "skipped",
)  # fmt: skip
HOST_DELTAS = ("host_requests", "host_hits", "host_misses", "disk_reads", "disk_read_s", "host_demoted")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------- the checkpoint
def shape_spec(args) -> dict[str, object]:
    spec = dict(SHAPES[args.shape])
    if args.tiny:
        spec.update(TINY[args.shape])
    if args.layers:
        spec["num_hidden_layers"] = args.layers
    elif args.shape in DEFAULT_LAYERS:
        spec["num_hidden_layers"] = DEFAULT_LAYERS[args.shape]
    return spec


def write_random_checkpoint(out: Path, spec: dict[str, object], dtype: torch.dtype, seed: int = 0) -> Path:
    """A safetensors checkpoint (sharded, with index) laid out as the family's checkpoints are.

    Tensors are drawn one by one (normal, std 0.02; norms 1, biases 0) on the GPU when there is one,
    and written shard by shard, so the model is never materialised; experts are written per expert
    under the family's checkpoint names, other tensors under the model's names (old block names
    restored, e.g. Mixtral's ``block_sparse_moe``).
    """
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    model_type = spec.pop("model_type")
    family = FAMILIES[model_type]
    config = AutoConfig.for_model(model_type, dtype=dtype, **spec)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    gen_dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=gen_dev).manual_seed(seed)

    def rand(shape, name: str) -> torch.Tensor:
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=dtype)
        if "norm" in name.split(".")[-2]:
            return torch.ones(shape, dtype=dtype)
        t = torch.randn(shape, generator=gen, device=gen_dev, dtype=torch.float32).mul_(0.02)
        return t.to(dtype).cpu()

    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    sizes = {"bytes": 0, "shard": 0, "total": 0}

    def put(key: str, t: torch.Tensor) -> None:
        shard[key] = t.contiguous()
        sizes["bytes"] += t.numel() * t.element_size()
        sizes["total"] += t.numel() * t.element_size()
        if sizes["bytes"] >= SHARD_BYTES:
            flush()

    def flush() -> None:
        if not shard:
            return
        sizes["shard"] += 1
        name = f"model-{sizes['shard']:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()
        sizes["bytes"] = 0

    renames = [(new, old) for old, new in family.renames]
    for mod_name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        if mod_name.endswith(".experts") and "gate_up_proj" in own:  # fused experts -> per expert
            prefix = mod_name[: mod_name.index(".layers.") + len(".layers.")]
            layer = mod_name[len(prefix) :].split(".")[0]
            for e in range(int(module.num_experts)):
                keys = family.expert_keys(f"{prefix}{layer}", e)
                for pname, srcs in keys.items():
                    rows = own[pname].shape[1]
                    cols = own[pname].shape[2:]
                    per = rows // len(srcs)
                    for ckey, fused in srcs:
                        if fused:
                            raise SystemExit(f"{model_type}: fused expert checkpoints are not generated")
                        put(ckey, rand((per, *cols), ckey))
            continue
        for pname, p in own.items():
            key = f"{mod_name}.{pname}"
            for new, old in renames:
                key = key.replace(new, old)
            put(key, rand(tuple(p.shape), key))
    flush()
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sizes["total"]}, "weight_map": weight_map}, indent=1)
    )
    config.save_pretrained(str(tmp))
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def checkpoint(args, spec: dict[str, object], dtype: torch.dtype) -> tuple[Path, float]:
    vocab = "" if args.tokenizer is None else f"-v{spec['vocab_size']}"  # the tokenizer's vocabulary
    name = (
        f"{args.shape}{'-tiny' if args.tiny else ''}-l{spec['num_hidden_layers']}{vocab}-"
        + str(dtype).split(".")[-1]
    )
    path = args.cache_dir / name
    if (path / ".complete").is_file():
        return path, 0.0
    log(f"writing random checkpoint {path}")
    t0 = time.perf_counter()
    write_random_checkpoint(path, spec, dtype)
    return path, time.perf_counter() - t0


TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template")


def tokenizer_vocab(spec: dict[str, object], source: Path) -> dict[str, object]:
    """``spec`` with the vocabulary of ``source``'s tokenizer and its special tokens: a random model
    samples its whole vocabulary, and ids past the tokenizer's decode to no text, so the served text of a
    model with Qwen's 151936 ids and a 4096-token tokenizer would be mostly empty (the experts' shapes,
    what the benchmarks measure, do not change; the embedding and the head shrink)."""
    from transformers import AutoTokenizer

    if not source.is_dir() or not any(f.name.startswith(TOKENIZER_FILES) for f in source.iterdir()):
        raise SystemExit(f"--tokenizer {source}: no tokenizer files there")
    tok = AutoTokenizer.from_pretrained(str(source))
    spec = {**spec, "vocab_size": len(tok)}
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in spec:
            own = getattr(tok, key, None)
            spec[key] = own if own is not None else eos
    return spec


def add_tokenizer(path: Path, source: Path) -> None:
    """Copy ``source``'s tokenizer into the random checkpoint ``path`` (for ``bench/serve_load.py``, whose
    clients send text), once; the checkpoint's vocabulary is the tokenizer's (``tokenizer_vocab``)."""
    files = [f for f in sorted(source.iterdir()) if f.is_file() and f.name.startswith(TOKENIZER_FILES)]
    for f in files:
        if not (path / f.name).exists():
            (path / f.name).write_bytes(f.read_bytes())


def packed_checkpoint(path: Path, fmt: str) -> Path:
    """``path`` written as a packed checkpoint (``expertcache quantize --checkpoint``: ``--bits`` for int8
    and int4, ``--format`` for another tool's layout, fp8), once."""
    from expertcache.tools.published import write_published
    from expertcache.tools.quantize import write_checkpoint

    out = path.with_name(f"{path.name}-{fmt}")
    if (out / ".complete").is_file():
        return out
    if out.exists():
        shutil.rmtree(out)
    log(f"writing packed checkpoint {out}")
    if fmt.startswith("int"):
        record = write_checkpoint(path, int(fmt.removeprefix("int")), out, progress=False)
    else:
        record = write_published(path, fmt, out)
    (out / ".complete").write_text(json.dumps(record))
    return out


def hobbit_copies(path: Path, misses: list[str]) -> None:
    """The low-precision copies each ``hobbit`` miss path needs (``expertcache quantize``), once."""
    from expertcache.engine.quantized import find_copy
    from expertcache.miss.base import MissPathError
    from expertcache.tools.quantize import quantize_model

    for miss in misses:
        if not miss.startswith("hobbit"):
            continue
        opts = dict(kv.split("=") for kv in miss.partition(":")[2].split(",") if kv)
        bits, group = int(opts.get("bits", 4)), int(opts.get("group", 64))
        try:
            find_copy(path, bits, group)
        except MissPathError:
            log(f"writing int{bits} copies of {path}")
            quantize_model(path, bits=[bits], group=group, progress=False, log=log)


# ------------------------------------------------------------------------------------ the trace
def find_trace(args, L: int, E: int, K: int) -> tuple[Trace, str]:
    if args.trace is not None:
        return load_trace(args.trace), str(args.trace)
    if args.shape != "qwen15-moe-a2.7b":  # no shared trace of these models
        tr = synthesize(
            "sticky", tokens=6 * 190, layers=L, experts=E, top_k=K, a=1.0, stickiness=0.3, seed=0,
            sequences=6, prompt_len=60,
        )  # fmt: skip
        return tr, "synthetic sticky Zipf (a=1, stickiness 0.3, 6 requests of 60 prompt + 130 tokens)"
    shared = [SHARED / "traces", ROOT / "shared" / "traces"]  # beside the repo, or inside
    found = [f for d in shared for f in sorted(d.glob("*.npz"))]
    for f in found:
        tr = load_trace(f)
        if (tr.num_layers, tr.num_experts, tr.top_k) == (L, E, K):
            where = Path("..") / f.relative_to(ROOT.parent) if f.is_relative_to(ROOT.parent) else f
            return tr, str(where)
    raise SystemExit(f"no trace with L={L}, E={E}, K={K} in {[str(d) for d in shared]}; pass --trace")


def request_rows(trace: Trace, seq: int) -> tuple[int, int, int]:
    """(first row, prompt tokens, rows) of request ``seq``."""
    if trace.seq_id is None:
        raise SystemExit("the trace has no seq_id: cannot pick a request")
    rows = np.flatnonzero(trace.seq_id == seq)
    if len(rows) == 0:
        raise SystemExit(f"the trace has no request {seq}")
    start = int(rows[0])
    prompt = int((trace.is_prefill[rows] == 1).sum()) if trace.is_prefill is not None else 1
    return start, max(prompt, 1), len(rows)


def prompt_ids(trace: Trace, start: int, prompt: int, vocab: int, device) -> torch.Tensor:
    if trace.token_id is not None and (trace.token_id[start : start + prompt] >= 0).all():
        ids = trace.token_id[start : start + prompt].astype(np.int64) % vocab
    else:
        ids = np.random.default_rng(start).integers(0, vocab, prompt)
    return torch.tensor(ids[None], device=device)


def trace_slice(trace: Trace, a: int, b: int) -> Trace:
    opt = lambda x: None if x is None else x[a:b]  # noqa: E731
    return Trace(
        experts=trace.experts[a:b],
        num_experts=trace.num_experts,
        weights=opt(trace.weights),
        seq_id=opt(trace.seq_id),
        is_prefill=opt(trace.is_prefill),
    )


# ---------------------------------------------------------------------------------- measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(device: torch.device, expert_bytes: int, big: int) -> dict[str, object]:
    """Host-to-device copy speed: pinned large copies, pinned expert-sized ones, pageable large ones."""
    cuda = device.type == "cuda"
    src = torch.empty(big, dtype=torch.uint8, pin_memory=cuda)
    src.fill_(1)
    dst = torch.empty(big, dtype=torch.uint8, device=device)

    def timed(fn, reps: int) -> float:
        fn()
        sync(device)
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync(device)
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    t_big = timed(lambda: dst.copy_(src, non_blocking=True), 10)
    n = max(1, min(64, big // expert_bytes))

    def experts() -> None:  # one at a time, as the transfer worker does
        for i in range(n):
            dst[i * expert_bytes : (i + 1) * expert_bytes].copy_(
                src[i * expert_bytes : (i + 1) * expert_bytes], non_blocking=True
            )
            sync(device)

    t_exp = timed(experts, 3) / n
    pageable = torch.empty(big, dtype=torch.uint8)
    pageable.fill_(1)
    t_page = timed(lambda: dst.copy_(pageable), 3)
    other = torch.empty_like(dst)
    t_dev = timed(lambda: other.copy_(dst), 10)  # reads big bytes and writes as many
    return {
        "device_bytes_per_s": 2 * big / t_dev,
        "copy_bytes": big,
        "pinned_bytes_per_s": big / t_big,
        "expert_copy_s": t_exp,
        "expert_copy_bytes_per_s": expert_bytes / t_exp,
        "pageable_bytes_per_s": big / t_page,
        "note": "host to device" if cuda else "host to host (CPU run: no link)",
    }


def generate(model, ids: torch.Tensor, new_tokens: int, pad: int) -> dict[str, object]:
    with torch.inference_mode():
        return timed_generate(
            model.generate,
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )


class Workload:
    """The warm-up and measured requests, replayed from the trace through the routers."""

    def __init__(self, trace: Trace, args, vocab: int, device: torch.device) -> None:
        self.trace = trace
        self.warm_start, warm_p, _ = request_rows(trace, args.warm_seq)
        self.start, self.prompt, rows = request_rows(trace, args.seq)
        self.new_tokens = min(args.new_tokens, rows - self.prompt + 1)
        self.warm_tokens = args.warmup_tokens
        self.warm_ids = prompt_ids(trace, self.warm_start, warm_p, vocab, device)
        self.ids = prompt_ids(trace, self.start, self.prompt, vocab, device)
        self.rows = self.prompt + self.new_tokens - 1  # the last new token is not run
        self.slice = trace_slice(trace, self.start, self.start + self.rows)

    def run(self, model, replayer, pad: int) -> dict[str, object]:
        replayer.reset(self.warm_start)
        generate(model, self.warm_ids, self.warm_tokens, pad)
        replayer.reset(self.start)
        r = generate(model, self.ids, self.new_tokens, pad)
        if replayer.position != self.start + self.rows:
            raise RuntimeError(
                f"replay consumed rows up to {replayer.position}, expected {self.start + self.rows}"
            )
        return r


def run_reference(
    path: Path, work: Workload, device: torch.device, pad: int, experts: str = "grouped_mm"
) -> dict[str, object]:
    t0 = time.perf_counter()
    model = load_reference(path, device=str(device), experts=experts)
    load_s = time.perf_counter() - t0
    with replay_routing(model, work.trace) as rep:
        r = work.run(model, rep, pad)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"kind": "reference", "budget": "100%", "policy": None, "miss": experts, "experts": experts,
            "load_s": load_s, **r}  # fmt: skip


def dense_read_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode token reads outside the experts: every parameter the engine's model
    holds (the experts live in the slot pool), less the input embedding (one row of it is read)."""
    embed = model.get_input_embeddings().weight
    tied = embed is getattr(model.get_output_embeddings(), "weight", None)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - (0 if tied else embed.numel() * embed.element_size())


def sim_misses(m, recorded: Trace, policy: str, miss: str) -> tuple[int, dict[str, object]]:
    """The simulator's misses on the engine's recorded routing (cold start, as the engine's since load):
    the counting replay for fetch; for other miss paths the timing model with the same path, policy and
    expert memory, deciding by the costs the engine measured at load. Also the parts' capacities. A
    budget that holds every expert is filled at load (``ExpertStore.fill``): nothing misses."""
    if m.miss.name == "fetch" and m.capacity >= m.num_layers * m.num_experts:
        return 0, {}
    if m.miss.name == "fetch":
        return replay(build_schedule(recorded, "layer"), policy, m.capacity).misses, {}
    cost = dataclasses.replace(m.costs or CostModel(), expert_bytes=m.layout.nbytes)
    whole = m.budget // m.layout.slot_bytes
    res = simulate_timing(recorded, whole, cache=policy, miss=miss, cost=cost)
    return res.misses, res.capacities


def sim_host(recorded: Trace) -> dict[str, object]:
    """The timing model's replay of the engine's recorded routing with its host level (capacities and
    policies from the trace's meta, cold start as the engine's since load): its misses at both levels,
    the engine's where nothing was prefetched."""
    from expertcache.config import HostConfig

    meta = recorded.meta
    host = HostConfig(None, meta["host_policy"], exclusive=bool(meta.get("host_exclusive", False)))
    r = simulate_timing(
        recorded, meta["capacity"], cache=meta["policy"], capacities=json.loads(meta["capacities"]),
        host=host, host_capacity=meta["host_capacity"],
    )  # fmt: skip
    return {k: r.cache.get(k) for k in ("misses", "host_hits", "host_misses", "disk_reads")}


def run_engine(
    path: Path,
    work: Workload,
    device: torch.device,
    pad: int,
    budget: str,
    policy: str,
    miss: str = "fetch",
    kernel: str = "auto",
    host: str | None = None,
) -> dict:
    """One configuration; ``host`` (``SIZE``, ``SIZE:exclusive``, either with ``:POLICY``) puts a host
    level of that memory between the expert memory and the checkpoint on disk (three tiers), inclusive
    or exclusive, under that policy (default LRU), else every expert is in (pinned) host memory."""
    tiers = {"slow_tier": "host"}
    if host is not None:
        memory, *rest = host.split(":")
        exclusive = "exclusive" in rest
        host_policy = next((x for x in rest if x != "exclusive"), "lru")
        tiers = {
            "slow_tier": "disk",
            "host_memory": memory,
            "host_exclusive": exclusive,
            "host_policy": host_policy,
        }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    m = load(
        path, expert_memory=budget, policy=policy, device=str(device), miss=miss, progress=False,
        kernel=kernel, **tiers,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    try:
        with replay_routing(m.model, work.trace) as rep:
            rep.reset(work.warm_start)
            generate(m, work.warm_ids, work.warm_tokens, pad)
            before = m.stats
            rep.reset(work.start)
            r = generate(m, work.ids, work.new_tokens, pad)
            after = m.stats
            if rep.position != work.start + work.rows:
                raise RuntimeError(f"replay consumed rows up to {rep.position}, not {work.start + work.rows}")
        sim, sim_caps = sim_misses(m, m.trace(), policy, miss)
        delta = {k: after[k] - before[k] for k in DELTAS}
        level = {}
        if host is not None:  # the host level's counts over the measured request, and its model's
            level = {k: after[k] - before[k] for k in HOST_DELTAS}
            level.update({k: after[k] for k in ("host_capacity", "host_memory_bytes", "host_exclusive")})
            level["sim_host"] = sim_host(m.trace())
            level["host_misses_since_load"] = after["host_misses"]
        if device.type == "cuda":  # the device's peak beside what the budget and the dense weights allow
            level["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
            level["dense_bytes"] = sum(p.numel() * p.element_size() for p in m.model.parameters())
        out = {
            "kind": "engine",
            "budget": budget,
            "policy": policy,
            "miss": miss,
            "host": host,
            "miss_path": m.miss.describe(),
            "slow_tier": m.tier.name,
            "kernel": m.kernel.name,
            "kernel_reference": m.kernel.reference,
            "dense_read_bytes": dense_read_bytes(m.model),
            "top_k": m.top_k,
            "num_layers": m.num_layers,
            "capacity_experts": m.capacity,
            "whole_expert_capacity": m.budget // m.layout.slot_bytes,
            "parts": {name: p["slots"] for name, p in after["parts"].items()},
            "total_experts": m.num_layers * m.num_experts,
            "expert_bytes": m.layout.nbytes,
            "expert_memory_bytes": after["expert_memory_bytes"],
            "costs": after["costs"],
            "load_s": load_s,
            **r,
            **delta,
            "sim_misses_same_policy": sim,
            "sim_capacities": sim_caps,
            "engine_misses_since_load": after["misses"],
            # the replay has no predictor: it is the engine's count only where nothing was prefetched
            "sim_matches_engine": sim == after["misses"] if after["prefetch_issued"] == 0 else None,
            "prefetch": after.get("prefetch"),
            **level,
        }
    finally:
        m.close()
    del m
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def limits(work: Workload, runs: list[dict], bw: dict, expert_bytes: int) -> list[dict]:
    """Per budget: OPT decode misses of the measured request and the TPOT they allow (whole experts: the
    expert memory of every miss path's row counted in whole experts, as fetch would use it); the weight-read
    floor of a decode token (its bytes over the device's bandwidth); each engine row's overhead per decode
    miss beyond its transfer."""
    engine = [r for r in runs if r["kind"] == "engine"]
    full = [r for r in engine if r["budget"] == "100%" and r.get("miss", "fetch") == "fetch"]
    resident = [r["tpot_s"] for r in full] + [r["tpot_s"] for r in runs if r["kind"] == "reference"]
    if not resident:
        return []
    t_res = min(resident)
    floor = None
    if full and bw.get("device_bytes_per_s") and full[0].get("dense_read_bytes") is not None:
        r = full[0]
        floor = (r["dense_read_bytes"] + r["num_layers"] * r["top_k"] * expert_bytes) / bw[
            "device_bytes_per_s"
        ]
    sched = build_schedule(work.slice, "layer")
    steps = work.new_tokens - 1
    for r in engine:  # what each miss costs beyond moving the expert
        if full and r.get("decode_misses") and steps > 0:
            per_miss = (r["tpot_s"] - full[0]["tpot_s"]) * steps / r["decode_misses"]
            r["overhead_per_miss_s"] = per_miss - bw["expert_copy_s"]
    out, seen = [], set()
    for r in engine:
        cap = r.get("whole_expert_capacity", r["capacity_experts"])  # rows of older runs: fetch only
        if cap in seen:
            continue
        seen.add(cap)
        res = replay(sched, "opt", cap).to_dict()
        opt_dec = res["phases"]["decode"]["misses"]
        transfer = opt_dec / max(steps, 1) * expert_bytes / bw["pinned_bytes_per_s"]
        out.append(
            {
                "budget": r["budget"],
                "capacity_experts": cap,
                "opt_decode_misses": opt_dec,
                "opt_prefill_misses": res["phases"]["prefill"]["misses"],
                "decode_steps": steps,
                "transfer_s_per_token": transfer,
                "resident_tpot_s": t_res,
                "weight_read_floor_s": floor,
                "limit_tpot_s": max(t_res, transfer),
                "serial_tpot_s": t_res + transfer,
            }
        )
    for r in engine:  # three tiers: the misses OPT cannot avoid at each level, each at its measured time
        if r.get("host") is None or not r.get("host_capacity"):
            continue
        cap = r.get("whole_expert_capacity", r["capacity_experts"])
        dev = replay(sched, "opt", cap).to_dict()["phases"]["decode"]["misses"]
        link = dev / max(steps, 1) * expert_bytes / bw["pinned_bytes_per_s"]
        read_s = r["disk_read_s"] / r["disk_reads"] if r["disk_reads"] else None  # the run's mean read

        def disk_term(held: int, read_s: float | None = read_s) -> tuple[int, float | None]:
            """OPT's decode misses with ``held`` experts in host memory, and their read time a token
            (None: the run read nothing to price them by)."""
            n = replay(sched, "opt", held).to_dict()["phases"]["decode"]["misses"]
            return n, (0.0 if n == 0 else None if read_s is None else n / max(steps, 1) * read_s)

        # the limit: each level's OPT at that level's capacity (the host level's own experts, or
        # with an exclusive level both levels' as it holds what the device does not); a bound for any
        # placement over the two memories: OPT over both (the inclusive level does not enforce inclusion:
        # it may drop experts the device holds, so the two together can hold that many too)
        level, level_t = disk_term(r["host_capacity"] + (cap if r["host_exclusive"] else 0))
        union, union_t = disk_term(r["host_capacity"] + cap)
        limit = None if level_t is None else max(t_res, link + level_t)
        union_limit = None if union_t is None else max(t_res, link + union_t)
        r["three_levels"] = {
            "opt_device_decode_misses": dev,
            "opt_disk_decode_reads": level,
            "opt_disk_decode_reads_both_memories": union,
            "disk_read_s_each": read_s,
            "link_s_per_token": link,
            "disk_s_per_token": level_t,
            "resident_tpot_s": t_res,
            "limit_tpot_s": limit,
            "both_memories_limit_tpot_s": union_limit,
            "tpot_over_limit": None if limit is None else r["tpot_s"] / limit,
            "tpot_over_both_memories_limit": None if union_limit is None else r["tpot_s"] / union_limit,
        }
    out.sort(key=lambda x: x["capacity_experts"])
    return out


def summary_table(runs: list[dict]) -> str:
    """Every engine row as a markdown table; vs fetch: fetch's TPOT at the same budget and policy with
    every expert in host memory (two tiers)."""
    engine = [r for r in runs if r["kind"] == "engine"]
    fetch = {(r["budget"], r["policy"]): r["tpot_s"] for r in engine
             if r.get("miss", "fetch") == "fetch" and r.get("host") is None}  # fmt: skip
    out = [
        "| budget | host level | policy | miss path | TPOT ms | vs fetch | TTFT ms | decode misses | "
        "host computed | stall s | tokens = reference |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in engine:
        base = fetch.get((r["budget"], r["policy"]))
        vs = f"{base / r['tpot_s']:.2f}x" if base else "-"
        out.append(
            f"| {r['budget']} | {r.get('host') or '-'} | {r['policy']} | {r.get('miss', 'fetch')} | "
            f"{r['tpot_s'] * 1e3:.2f} | {vs} | {r['ttft_s'] * 1e3:.1f} | {r['decode_misses']} | "
            f"{r.get('host_computed', 0)} | {r['stall_s']:.3f} | {r['tokens_match_reference']} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- main
def budget_spec(value: str) -> str:
    """``25`` -> ``25%``; a size (``8GiB``) or a share (``25%``) as given."""
    try:
        return f"{float(value):g}%"
    except ValueError:
        return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen15-moe-a2.7b")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (same L, E, K): a CPU smoke test")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "expertcache-bench")
    ap.add_argument("--trace", type=Path, default=None, help="default: the matching ../shared/traces/*.npz")
    ap.add_argument("--seq", type=int, default=1, help="the trace request measured")
    ap.add_argument("--warm-seq", type=int, default=0, help="the trace request of the warm-up")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=4)
    ap.add_argument("--budgets", nargs="+", default=["10", "20", "30", "50", "75"],
                    help="expert memory: percent of all experts (25) or bytes (8GiB)")  # fmt: skip
    ap.add_argument(
        "--host-memory",
        nargs="+",
        default=["none"],
        help="three tiers: each budget also runs with a host level of this memory over the checkpoint on "
        "disk (16GiB; none: every expert in pinned host memory, two tiers)",
    )
    ap.add_argument(
        "--host-levels",
        nargs="+",
        choices=["inclusive", "exclusive"],
        default=["inclusive"],
        help="the host level's kinds measured (with --host-memory)",
    )
    ap.add_argument("--host-policy", default="lru",
                    help="the host level's policy (with --host-memory)")  # fmt: skip
    ap.add_argument("--policies", nargs="+", default=["lru", "lfu", "llru"])
    ap.add_argument(
        "--miss",
        nargs="+",
        default=["fetch"],
        help="miss paths each budget x policy runs under (fetch, host, host:fill=1, hybrid, "
        "placement:first=N, split:theta=0.5, ...; see `expertcache misses`)",
    )
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers all-resident runs")
    ap.add_argument("--kernel", default="auto", choices=["auto", "grouped", "eager"], help="the engine's")
    ap.add_argument("--references", nargs="+", default=["grouped_mm", "eager"],
                    help="transformers experts implementations measured all-resident")  # fmt: skip
    ap.add_argument("--bandwidth-bytes", type=int, default=2**30)
    ap.add_argument(
        "--packed",
        choices=["int8", "int4", "fp8"],
        default=None,
        help="run a packed checkpoint of the model (written once beside it; no eager reference)",
    )
    ap.add_argument(
        "--gate-weights", choices=["trace", "hobbit"], default="trace",
        help="the routing's weights: the trace's (even where it has none, as a random router's), or top-2 "
        "weights drawn as HOBBIT reports Mixtral's (what its thresholds act on)",
    )  # fmt: skip
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a checkpoint whose tokenizer (and vocabulary size) a random one gets")  # fmt: skip
    ap.add_argument("--resume", action="store_true", help="keep configurations already in --out")
    ap.add_argument(
        "--no-process-warmup", action="store_true",
        help="on a GPU, measure the first configuration without running the measured request once first",
    )  # fmt: skip
    ap.add_argument(
        "--out", type=Path, default=None, help="default bench/results/engine_gpu.json (tiny: /tmp)"
    )
    args = ap.parse_args()
    for miss in args.miss:  # a bad spec fails here, in one line, before any loading
        try:
            MissConfig(miss)
        except ExpertcacheError as exc:
            raise SystemExit(f"--miss {miss}: {exc}") from None
    from expertcache.config import HostConfig

    for memory in args.host_memory:  # the host level's options too
        try:
            if memory != "none":
                HostConfig(memory, args.host_policy).bytes_of(1)
        except ExpertcacheError as exc:
            raise SystemExit(f"--host-memory {memory} --host-policy {args.host_policy}: {exc}") from None
    if args.host_memory == ["none"] and (args.host_levels != ["inclusive"] or args.host_policy != "lru"):
        raise SystemExit("--host-levels and --host-policy need --host-memory (the host level they rule)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --device cpu --tiny for the smoke test)")
    dtype = getattr(torch, args.dtype)
    out_path = args.out or (
        Path(tempfile.gettempdir()) / "engine_gpu.tiny.json"
        if args.tiny
        else ROOT / "bench/results/engine_gpu.json"
    )
    spec = shape_spec(args)
    if args.tokenizer is not None:
        spec = tokenizer_vocab(spec, args.tokenizer)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    path, build_s = checkpoint(args, spec, dtype)
    if args.tokenizer is not None:
        add_tokenizer(path, args.tokenizer)
    if args.packed:
        path = packed_checkpoint(path, args.packed)
        args.no_reference = True  # transformers cannot run the packed experts
    else:
        hobbit_copies(path, args.miss)
    ckpt_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    log(
        f"checkpoint {path}: {ckpt_bytes / 1e9:.2f} GB"
        + (f" (written in {build_s:.0f} s)" if build_s else "")
    )
    if args.build_only:
        return
    L = int(spec["num_hidden_layers"])
    E = int(spec.get("num_experts") or spec.get("num_local_experts"))
    K = int(spec["num_experts_per_tok"])
    trace, trace_source = find_trace(args, L, E, K)
    if args.gate_weights == "hobbit":
        from miss_projection import hobbit_weights

        if K != 2:
            raise SystemExit(f"--gate-weights hobbit draws top-2 weights; this model routes top-{K}")
        trace = dataclasses.replace(trace, weights=hobbit_weights(trace.experts.shape, 0))
        trace_source += "; gate weights drawn as HOBBIT reports Mixtral's (miss_projection.hobbit_weights)"
    work = Workload(trace, args, int(spec["vocab_size"]), device)
    pad = int(spec["eos_token_id"])
    log(
        f"trace {trace_source}: measured request {args.seq} ({work.prompt} prompt tokens, "
        f"{work.new_tokens} new), warm-up request {args.warm_seq} ({work.warm_tokens} new)"
    )
    header = {
        "shape": args.shape,
        "tiny": args.tiny,
        "config": spec,
        "dtype": args.dtype,
        "checkpoint": str(path),
        "checkpoint_bytes": ckpt_bytes,
        "trace": trace_source,
        "seq": args.seq,
        "warm_seq": args.warm_seq,
        "prompt_tokens": work.prompt,
        "new_tokens": work.new_tokens,
        "warmup_tokens": work.warm_tokens,
        "process_warmup": device.type == "cuda" and not args.no_process_warmup,
        "kernel": args.kernel,
        "packed": args.packed,
    }
    runs: list[dict] = []
    if args.resume and out_path.is_file():
        old = json.loads(out_path.read_text())
        if {k: old.get(k) for k in header} == json.loads(portable_text(json.dumps(header))):  # as written
            runs = old.get("runs", [])
            log(f"resuming: {len(runs)} configuration(s) from {out_path}")
        else:
            log(f"{out_path} is for another model or trace: starting over")
    done = {(r["kind"], r["budget"], r["policy"], r.get("miss", "fetch" if r["kind"] == "engine" else None),
             r.get("host")) for r in runs}  # fmt: skip
    bw = next((r for r in runs if r["kind"] == "bandwidth"), None)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    def save(finished: bool) -> None:
        ref = next((r for r in runs if r["kind"] == "reference"), None)
        engine = [r for r in runs if r["kind"] == "engine"]
        expert_bytes = engine[0]["expert_bytes"] if engine else None
        lim = limits(work, runs, bw, expert_bytes) if bw and engine else []
        refs = {r.get("experts", "eager"): r for r in runs if r["kind"] == "reference"}
        ref_of = lambda r: refs.get(r.get("kernel_reference", "eager"))  # noqa: E731 (its own reference)
        match = None if ref is None else all(ref_of(r) and r["tokens"] == ref_of(r)["tokens"] for r in engine)
        by_miss = {}  # host compute rounds as the CPU does: on a GPU its tokens may differ
        for r in engine if ref is not None else []:
            m = r.get("miss", "fetch")
            by_miss[m] = by_miss.get(m, True) and bool(ref_of(r)) and r["tokens"] == ref_of(r)["tokens"]
        body = {
            **provenance(),
            **header,
            "device": dev_name,
            "torch": torch.__version__,
            "finished": finished,
            "tokens_match_reference": match,
            "tokens_match_reference_by_miss": by_miss,
            "sim_matches_engine": (
                all(r["sim_matches_engine"] is not False for r in engine) if engine else None
            ),
            "limits": lim,
            "runs": runs,
        }
        out_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(out_path, body)

    def show(r: dict) -> str:
        s = f"{r['tokens_per_s']:8.2f} tok/s  TTFT {r['ttft_s'] * 1e3:8.1f} ms"
        s += f"  TPOT {r['tpot_s'] * 1e3:7.2f} ms"
        if r["kind"] == "engine":
            s += f"  decode misses {r['decode_misses']:5d}  stall {r['stall_s']:6.2f} s"
            if r["miss"] != "fetch":
                s += f"  host {r['host_computed']:5d} ({r['host_busy_s']:.2f} s)"
            if r.get("low_precision") or r.get("skipped"):
                s += f"  low precision {r['low_precision']}  skipped {r['skipped']}"
            s += f"  sim==engine {r['sim_matches_engine']}"
            if r.get("host"):
                s += (f"  host {r['host']}: {r['host_hits']} hits {r['host_misses']} misses, "
                      f"{r['disk_reads']} reads ({r['disk_read_s']:.2f} s); since load "
                      f"{r['host_misses_since_load']} host misses, timing model "
                      f"{r['sim_host']['host_misses']}")  # fmt: skip
            if "max_memory_allocated" in r:
                s += f"  peak {r['max_memory_allocated'] / 2**30:.2f} GiB"
        return s

    if bw is None:
        ffn = int(spec.get("moe_intermediate_size") or spec["intermediate_size"])
        expert_bytes = 3 * int(spec["hidden_size"]) * ffn * dtype.itemsize  # gate, up, down
        big = min(args.bandwidth_bytes, 2**26) if args.tiny else args.bandwidth_bytes
        bw = {"kind": "bandwidth", "budget": None, "policy": None, **bandwidth(device, expert_bytes, big)}
        runs.append(bw)
        log(
            f"bandwidth: pinned {bw['pinned_bytes_per_s'] / 1e9:.1f} GB/s, one expert "
            f"({expert_bytes / 1e6:.1f} MB) {bw['expert_copy_s'] * 1e3:.2f} ms, pageable "
            f"{bw['pageable_bytes_per_s'] / 1e9:.1f} GB/s"
        )
        save(False)
    refs = [] if args.no_reference else args.references
    plan = [("reference", "100%", None, impl, None) for impl in refs]
    plan += [("engine", "100%", "lru", "fetch", None)]
    pol = "" if args.host_policy == "lru" else f":{args.host_policy}"
    hosts = [None if h == "none" else h + ("" if kind == "inclusive" else ":exclusive") + pol
             for h in args.host_memory
             for kind in (["inclusive"] if h == "none" else args.host_levels)]  # fmt: skip
    plan += [
        ("engine", budget_spec(b), p, m, h)
        for b in args.budgets for p in args.policies for m in args.miss for h in hosts
    ]  # fmt: skip
    todo = [c for c in plan if c not in done]
    if device.type == "cuda" and not args.no_process_warmup and any(c[0] == "engine" for c in todo):
        # the process's first decode steps pay one-time costs per shape (each new key length: 36-62 ms
        # a token at 100 % on Mixtral's 4 layers against 6-8 later): one run of the measured request at
        # the plan's first budget below 100 % first, not kept, so that the first configuration measured is not
        # the process's first (docs/BENCHMARKS.md, "The server on a GPU (H100): where the step goes")
        budget = next((c[1] for c in todo if c[0] == "engine" and c[1] != "100%"), "100%")  # a cheap load
        t = time.perf_counter()
        run_engine(path, work, device, pad, budget, args.policies[0], "fetch", args.kernel, None)
        log(f"process warm-up: the measured request once at {budget} lru fetch, not kept "
            f"({time.perf_counter() - t:.1f} s)")  # fmt: skip
    for kind, budget, policy, miss, host in plan:
        if (kind, budget, policy, miss, host) in done:
            continue
        if kind == "reference":
            r = run_reference(path, work, device, pad, miss)
        else:
            r = run_engine(path, work, device, pad, budget, policy, miss, args.kernel, host)
        want = r.get("kernel_reference", r.get("experts"))
        ref = next((x for x in runs if x["kind"] == "reference" and x.get("experts") == want), None)
        r["tokens_match_reference"] = None if ref is None else r["tokens"] == ref["tokens"]
        runs.append(r)
        log(
            f"{kind:9s} {budget:>5s} {policy or '':5s} {miss or '':18s} {host or '':14s} {show(r)}  "
            f"match={r['tokens_match_reference']}"
        )
        save(False)
    save(True)
    print(summary_table(runs), flush=True)
    body = json.loads(out_path.read_text())
    for x in body["limits"]:
        log(
            f"limit at {x['budget']:>5s} ({x['capacity_experts']} experts): OPT decode misses "
            f"{x['opt_decode_misses']}, limit TPOT {x['limit_tpot_s'] * 1e3:.2f} ms "
            f"(resident {x['resident_tpot_s'] * 1e3:.2f}, transfer {x['transfer_s_per_token'] * 1e3:.2f}, "
            f"weight-read floor {(x['weight_read_floor_s'] or 0) * 1e3:.2f})"
        )
    for r in body["runs"]:
        x = r.get("three_levels")
        if x:
            ratio = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
            log(
                f"three levels at {r['budget']}, host {r['host']}: TPOT {r['tpot_s'] * 1e3:.1f} ms, "
                f"{ratio(x['tpot_over_limit'])} the limit ({ratio(x['tpot_over_both_memories_limit'])} the "
                f"one over both memories; OPT {x['opt_device_decode_misses']} device misses, "
                f"{x['opt_disk_decode_reads']} / {x['opt_disk_decode_reads_both_memories']} disk reads of "
                f"{(x['disk_read_s_each'] or 0) * 1e3:.1f} ms)"
            )
    log(f"wrote {out_path}: tokens match reference: {body['tokens_match_reference']}")


if __name__ == "__main__":
    main()
