"""Engine speed on CPU: tokens/s, TTFT, TPOT and stall time against budget, policy and baselines.

Greedy generation of one fixed code prompt (a fixed number of new tokens, end-of-sequence
suppressed by ``min_new_tokens``). Each configuration is loaded, warmed up with one short
generation of the same prompt, then measured ``--repeats`` times (medians reported, every run
kept); the cache stays warm from the generation before, so the figures are those of a repeated
request. Two models: the embedded demo model (its own trained router) and a larger random-weight
Mixtral-family checkpoint built once into ``--cache-dir`` (a random router degenerates to a few
experts, so its routing is replayed from a synthetic sticky-Zipf trace through
``expertcache.engine.routing``, identically for every run). For each:

- ``reference``: ``load_reference`` (transformers, all resident, the experts implementation the engine's
  default kernel is exact against: grouped_mm on a CPU);
- ``engine``: ``expertcache.engine.load`` at 100% and at each budget x policy, slow tier = the
  memory-mapped checkpoint (``slow_tier="mapped"``, the ``disk`` tier before it dropped pages; on a
  warm page cache each miss is a memcpy);
- ``accelerate``: transformers/accelerate disk offload of the same checkpoint (the naive
  baseline): an explicit device_map that sends whole ``...mlp.experts`` modules of the first
  ``round((1 - budget) * L)`` layers to "disk" (``offload_folder``), everything else "cpu", so about
  the budget's share of expert bytes stays in the process; accelerate fetches every offloaded
  experts module at every forward, through a memory map of the offload folder (no copy);
- ``engine+link``: the engine with an emulated link (``link_bandwidth``/``link_latency``) whose
  bandwidth makes one expert's transfer take ``--link-ratio`` times the measured compute time of one
  expert for one token (median over 64 distinct experts), latency 20 us.

Every engine and accelerate run's tokens are compared with the reference's.

    .venv/bin/python bench/engine_cpu.py [--quick] [--wait-idle] [--out bench/results/engine_cpu.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from provenance import ROOT, provenance, write_json

from expertcache.engine import load
from expertcache.engine.loader import load_reference
from expertcache.engine.offloaded import DEFAULT_MODEL
from expertcache.engine.offloaded import timed_generate as engine_timed_generate
from expertcache.engine.parts import expert_output as _expert_output
from expertcache.engine.random_checkpoint import make_checkpoint
from expertcache.engine.routing import replay_routing
from expertcache.trace import Trace, synthesize
from expertcache.units import parse_duration

PROMPT = (
    "import json\n"
    "from pathlib import Path\n\n\n"
    "def read_config(path):\n"
    '    """Read a JSON configuration file and return it as a dictionary."""\n'
)
BUSY_PROCESS = "train_default_model"  # a job that disturbs CPU timings while it runs

# name -> make_checkpoint arguments (full run, quick run)
LARGE = dict(
    family="mixtral", hidden=1024, layers=16, experts=32, top_k=2, intermediate=448, heads=16, kv_heads=4
)
LARGE_QUICK = dict(
    family="mixtral", hidden=256, layers=4, experts=8, top_k=2, intermediate=128, heads=4, kv_heads=2
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def busy_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-af", BUSY_PROCESS], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def wait_idle(poll_s: float = 60.0) -> float:
    """Sleep until no BUSY_PROCESS runs; returns the seconds waited."""
    start = time.time()
    while busy_processes():
        log(f"{BUSY_PROCESS} is running; waiting {poll_s:.0f} s")
        time.sleep(poll_s)
    return time.time() - start


# --------------------------------------------------------------------------------------- models
def large_model(cache_dir: Path, spec: dict, tokenizer: Path) -> tuple[Path, float]:
    """The generated checkpoint for ``spec``, built once (atomically) and reused; (path, build seconds)."""
    s = spec
    name = (
        f"{s['family']}-h{s['hidden']}-l{s['layers']}-e{s['experts']}-k{s['top_k']}"
        f"-i{s['intermediate']}-a{s['heads']}x{s['kv_heads']}-fp32"
    )
    path = cache_dir / name
    if (path / "config.json").is_file() and (path / ".complete").is_file():
        return path, 0.0
    log(f"building {path}")
    t0 = time.perf_counter()
    tmp = cache_dir / f".{name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    make_checkpoint(tmp, dtype="float32", tokenizer=tokenizer, max_shard_size="1GB", **spec)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path, time.perf_counter() - t0


def model_info(path: Path) -> dict[str, object]:
    cfg = json.loads((path / "config.json").read_text())
    files = [f for f in path.iterdir() if f.suffix == ".safetensors"]
    keys = (
        "model_type", "hidden_size", "num_hidden_layers", "num_local_experts", "num_experts",
        "num_experts_per_tok", "intermediate_size", "num_attention_heads", "num_key_value_heads", "dtype",
        "vocab_size",
    )  # fmt: skip
    return {
        "path": str(path),
        "config": {k: cfg[k] for k in keys if k in cfg},
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
    }


# ------------------------------------------------------------------------------------- timing
def timed_generate(model, tok, prompt: str, new_tokens: int) -> dict[str, object]:
    """Greedy generation on a transformers model, timed as ``OffloadedModel.generate_text`` times it."""
    ids = tok(prompt, return_tensors="pt").input_ids
    pad = tok.pad_token_id
    with torch.inference_mode():
        return engine_timed_generate(
            model.generate,
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad if pad is not None else tok.eos_token_id,
        )


def summary(r: dict[str, object]) -> str:
    stall = r.get("stall_s")
    return (
        f"{r['tokens_per_s']:7.2f} tok/s  TTFT {r['ttft_s'] * 1e3:8.1f} ms  TPOT {r['tpot_s'] * 1e3:7.2f} ms"
        + (f"  stall {stall:6.3f} s  misses {r['misses']}" if stall is not None else "")
        + f"  match={r.get('tokens_match_reference')}"
    )


# ------------------------------------------------------------------------------------- runs
TIMES = ("tokens_per_s", "ttft_s", "tpot_s", "total_s", "stall_s")
COUNTS = ("hits", "misses", "bytes_transferred")


def measure(generate, warmup: int, new_tokens: int, repeats: int, replay=None) -> dict[str, object]:
    """One warm-up generation, then ``repeats`` measured ones; medians of the times, every run kept.

    With a routing replay, every generation starts again at the trace's first row (as the same
    prompt gives the same routing on a model that routes by itself).
    """

    def one(n: int) -> dict[str, object]:
        if replay is not None:
            replay.reset(0)
        return generate(n)

    one(warmup)
    runs = [one(new_tokens) for _ in range(repeats)]
    out = dict(runs[0])
    for k in (*TIMES, *COUNTS):
        if k in out:
            values = [r[k] for r in runs]
            out[k + "_runs"] = values
            out[k] = statistics.median(values) if k in TIMES else statistics.median_low(values)
    out["tokens_same_every_repeat"] = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    return out


def routing_replay(model, trace):
    return None if trace is None else replay_routing(model, trace)


def measure_hf(load_model, path: Path, args, trace) -> dict[str, object]:
    """Load a plain transformers model with ``load_model()``, measure it, and free it before the next
    configuration loads: {"load_s": ..., **measure(...)}."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    model = load_model()
    tok = AutoTokenizer.from_pretrained(str(path))
    load_s = time.perf_counter() - t0
    r = measure(
        lambda n: timed_generate(model, tok, PROMPT, n),
        args.warmup_tokens,
        args.new_tokens,
        args.repeats,
        routing_replay(model, trace),
    )
    model = None
    gc.collect()
    return {"load_s": load_s, **r}


def run_reference(path: Path, args, trace) -> dict[str, object]:
    return {"kind": "reference", **measure_hf(lambda: load_reference(path), path, args, trace)}


def run_engine(path: Path, args, trace, budget: str, policy: str, **kwargs) -> dict[str, object]:
    t0 = time.perf_counter()
    m = load(
        path, expert_memory=budget, policy=policy, device="cpu", slow_tier="mapped", progress=False, **kwargs
    )
    load_s = time.perf_counter() - t0
    try:
        replay = routing_replay(m.model, trace)
        g = measure(
            lambda n: m.generate_text(PROMPT, n, min_new_tokens=n).to_dict(),
            args.warmup_tokens,
            args.new_tokens,
            args.repeats,
            replay,
        )
        link = m.link.describe() if m.link else None
        mem = m.capacity * m.layout.slot_bytes
    finally:
        m.close()
    m = None  # free it before the next configuration loads
    gc.collect()
    drop = ("text", "misses_by_layer", "policy", "device", "requests", "miss_ratio", "steps")
    return {
        "kind": "engine+link" if link else "engine",
        "budget": budget,
        "policy": policy,
        "link": link,
        "slow_tier": "mapped",
        "expert_memory_bytes": mem,
        "load_s": load_s,
        **{k: v for k, v in g.items() if k not in drop},
    }


def accelerate_device_map(path: Path, share: float) -> tuple[dict[str, str], list[int], int]:
    """Every module on "cpu" except the experts modules of the first round((1-share)*L) layers: "disk"."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    experts = [n for n, _ in model.named_modules() if n.endswith(".experts") and ".layers." in n]
    n_off = int((1 - share) * len(experts) + 0.5)  # nearest; ties keep more in RAM (favours the baseline)
    offloaded = set(experts[:n_off])
    dmap: dict[str, str] = {}

    def place(prefix: str, module: torch.nn.Module) -> None:
        if prefix in offloaded:
            dmap[prefix] = "disk"
        elif any(o.startswith(prefix + ".") for o in offloaded) or prefix == "":
            if next(module.parameters(recurse=False), None) is not None:
                raise RuntimeError(f"{prefix} has its own parameters; cannot split it")
            for name, child in module.named_children():
                place(f"{prefix}.{name}" if prefix else name, child)
        else:
            dmap[prefix] = "cpu"

    place("", model)
    return dmap, [experts.index(e) for e in sorted(offloaded, key=experts.index)], len(experts)


def run_accelerate(path: Path, args, trace, share: float, offload_root: Path) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    dmap, off_layers, n_layers = accelerate_device_map(path, share)
    folder = Path(tempfile.mkdtemp(prefix="offload-", dir=offload_root))
    try:
        r = measure_hf(
            lambda: AutoModelForCausalLM.from_pretrained(
                str(path),
                device_map=dmap,
                offload_folder=str(folder),
                experts_implementation="eager",
                dtype=torch.float32,
            ).eval(),
            path,
            args,
            trace,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    resident = 1 - len(off_layers) / n_layers
    return {
        "kind": "accelerate",
        "budget": f"{share * 100:g}%",
        "expert_share_resident": resident,
        "offloaded_expert_layers": off_layers,
        **r,
    }


def expert_costs(path: Path, max_experts: int = 64, reps: int = 5) -> dict[str, object]:
    """Median time to compute one expert for one token, and to copy one from the slow tier (warm)."""
    m = load(path, expert_memory="100%", policy="lru", device="cpu", slow_tier="mapped", progress=False)
    try:
        module = next(mod for mod in m.model.modules() if hasattr(mod, "_expertcache_layer"))
        L, E = m.num_layers, m.num_experts
        keys = [(i % L, (i * 7 + i // L) % E) for i in range(min(max_experts, L * E))]
        keys = list(dict.fromkeys(keys))
        copy = []
        for rep in range(2):  # first pass may read the file; the second is the page-cache copy
            for i, key in enumerate(keys):
                t0 = time.perf_counter()
                m.tier.store.read(key, m.pool.views[i])
                if rep:
                    copy.append(time.perf_counter() - t0)
        hidden = m.config.hidden_size
        x = torch.randn(1, hidden, dtype=m.dtype)
        comp = []
        with torch.inference_mode():
            for rep in range(reps + 1):
                for i in range(len(keys)):
                    t0 = time.perf_counter()
                    _expert_output(module, m.pool.views[i], x)
                    if rep:
                        comp.append(time.perf_counter() - t0)
        nbytes = m.layout.nbytes
    finally:
        m.close()
    return {
        "expert_bytes": nbytes,
        "experts_sampled": len(keys),
        "compute_one_token_s": statistics.median(comp),
        "copy_from_checkpoint_s": statistics.median(copy),
        "copy_bandwidth_bytes_per_s": nbytes / statistics.median(copy),
    }


def emulated_link(path: Path, ratio: float, latency: str) -> tuple[dict[str, object], dict[str, object]]:
    """``load()`` link arguments making one expert's transfer ``ratio`` x its compute for one token.

    Returns the link arguments and the expert costs with the link's figures added.
    """
    costs = expert_costs(path)
    latency_s = parse_duration(latency, "link latency")
    transfer = ratio * costs["compute_one_token_s"]
    if transfer <= latency_s:
        raise SystemExit(f"link latency {latency} exceeds {ratio} x one expert's compute for one token")
    bw = float(f"{costs['expert_bytes'] / (transfer - latency_s):.3g}")
    costs.update(
        link_ratio=ratio,
        link_bandwidth_bytes_per_s=bw,
        link_latency=latency,
        link_transfer_s=latency_s + costs["expert_bytes"] / bw,
    )
    return {"link_bandwidth": bw, "link_latency": latency}, costs


def nice(x: float) -> float:
    """Two significant digits."""
    return float(f"{x:.2g}")


# ------------------------------------------------------------------------------------- main
def replay_trace(path: Path, args) -> tuple[Trace, dict[str, object]]:
    """Synthetic sticky-Zipf routing for a random-weight model (which routes degenerately by itself)."""
    from transformers import AutoTokenizer

    cfg = json.loads((path / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    E = cfg.get("num_local_experts") or cfg["num_experts"]
    K = cfg["num_experts_per_tok"]
    prompt = len(AutoTokenizer.from_pretrained(str(path))(PROMPT).input_ids)
    tokens = prompt + max(args.new_tokens, args.warmup_tokens)
    params = dict(a=1.0, stickiness=0.3, seed=0)
    tr = synthesize("sticky", tokens=tokens, layers=L, experts=E, top_k=K, prompt_len=prompt, **params)
    return tr, {"kind": "replayed synthetic trace (sticky Zipf)", "tokens": tokens, **params}


def bench_model(label: str, path: Path, args, offload_root: Path) -> dict[str, object]:
    info = model_info(path)
    log(f"== {label}: {path} ({info['checkpoint_bytes'] / 1e9:.2f} GB)")
    costs = expert_costs(path)
    bw = nice(costs["expert_bytes"] / (args.link_ratio * costs["compute_one_token_s"]))
    costs.update(link_ratio=args.link_ratio, link_bandwidth_bytes_per_s=bw, link_latency=args.link_latency)
    log(
        f"one expert: {costs['expert_bytes'] / 1e6:.2f} MB, compute (1 token) "
        f"{costs['compute_one_token_s'] * 1e6:.0f} us, "
        f"copy from checkpoint {costs['copy_from_checkpoint_s'] * 1e6:.0f} us; "
        f"emulated link {bw / 1e9:g} GB/s + {args.link_latency}"
    )
    trace, routing = None, {"kind": "the model's own router"}
    if label == "large" and args.large_routing == "replay":
        trace, routing = replay_trace(path, args)
    runs = []
    ref = run_reference(path, args, trace)
    ref["tokens_match_reference"] = True
    log(f"reference            {summary(ref)}")
    runs.append(ref)

    def add(r: dict[str, object], name: str) -> None:
        r["tokens_match_reference"] = r["tokens"] == ref["tokens"]
        r["os_load_avg_1m"] = os.getloadavg()[0]
        log(f"{name:20s} {summary(r)}")
        if not args.keep_tokens:
            r.pop("tokens")
        runs.append(r)

    add(run_engine(path, args, trace, "100%", "lru"), "engine 100% lru")
    for b in args.budgets:
        for p in args.policies:
            add(run_engine(path, args, trace, f"{b:g}%", p), f"engine {b:g}% {p}")
    for b in args.accelerate_budgets:
        add(run_accelerate(path, args, trace, b / 100, offload_root), f"accelerate {b:g}%")
    link = dict(link_bandwidth=bw, link_latency=args.link_latency)
    for b in args.link_budgets:
        for p in args.link_policies:
            add(run_engine(path, args, trace, f"{b:g}%", p, **link), f"link {b:g}% {p}")
    engine_runs = [r for r in runs if r["kind"].startswith("engine")]
    return {
        "label": label,
        **info,
        "routing": routing,
        "expert_costs": costs,
        "reference_tokens": ref["tokens"],
        "all_engine_tokens_match_reference": all(r["tokens_match_reference"] for r in engine_runs),
        "all_repeats_same_tokens": all(r["tokens_same_every_repeat"] for r in runs),
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the demo model (default: embedded)")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "expertcache-bench")
    ap.add_argument("--models", nargs="+", default=["demo", "large"], choices=["demo", "large"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--budgets", type=float, nargs="+", default=[25, 50, 75])
    ap.add_argument("--policies", nargs="+", default=["lru", "lfu", "llru"])
    ap.add_argument("--accelerate-budgets", type=float, nargs="*", default=None, help="default: --budgets")
    ap.add_argument("--link-budgets", type=float, nargs="*", default=None, help="default: --budgets")
    ap.add_argument("--link-policies", nargs="*", default=None, help="default: --policies")
    ap.add_argument("--repeats", type=int, default=3, help="measured generations per configuration")
    ap.add_argument(
        "--large-routing",
        choices=["replay", "model"],
        default="replay",
        help="large model: replay a synthetic sticky-Zipf trace (default) or its own random router",
    )
    ap.add_argument("--link-ratio", type=float, default=3.0, help="one expert's transfer / its compute time")
    ap.add_argument("--link-latency", default="20us")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--keep-tokens", action="store_true", help="store every run's tokens in the JSON")
    ap.add_argument("--wait-idle", action="store_true", help=f"first wait until no {BUSY_PROCESS} runs")
    ap.add_argument("--quick", action="store_true", help="smoke run: small models, few tokens and configs")
    ap.add_argument(
        "--out", type=Path, default=None, help="default bench/results/engine_cpu.json (quick: /tmp)"
    )
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.warmup_tokens = min(args.new_tokens, 8), min(args.warmup_tokens, 2)
        args.budgets, args.policies, args.repeats = [50], ["lru", "llru"], 2
    args.accelerate_budgets = args.budgets if args.accelerate_budgets is None else args.accelerate_budgets
    args.link_budgets = args.budgets if args.link_budgets is None else args.link_budgets
    args.link_policies = args.policies if args.link_policies is None else args.link_policies
    out_path = args.out or (
        Path(tempfile.gettempdir()) / "engine_cpu.quick.json"
        if args.quick
        else ROOT / "bench/results/engine_cpu.json"
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    waited = wait_idle() if args.wait_idle else 0.0
    if "demo" in args.models and not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no demo model there (pass --model DIR)")
    busy = busy_processes()
    if busy:
        log(f"WARNING: {BUSY_PROCESS} is running; timings are disturbed")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    models, build_s = {}, {}
    if "demo" in args.models:
        models["demo"] = args.model
    if "large" in args.models:
        spec = LARGE_QUICK if args.quick else LARGE
        models["large"], build_s["large"] = large_model(args.cache_dir, spec, tokenizer=args.model)
    results = []
    with tempfile.TemporaryDirectory(prefix="expertcache-offload-", dir=args.cache_dir) as offload_root:
        for label, path in models.items():
            results.append(bench_model(label, path, args, Path(offload_root)))
    out = {
        **provenance(),
        "busy_process_at_start": busy,
        "busy_process_at_end": busy_processes(),
        "waited_for_idle_s": waited,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "prompt": PROMPT,
        "new_tokens": args.new_tokens,
        "warmup_tokens": args.warmup_tokens,
        "repeats": args.repeats,
        "method": (
            "greedy, min_new_tokens=max_new_tokens; per configuration: load, one warm-up generation "
            "of the same prompt, then `repeats` measured generations of it (the cache stays warm "
            "from the one before); reported times are medians (every run under *_runs); TTFT = start "
            "to first new token, TPOT = mean gap between later tokens, tokens/s = new tokens / total "
            "time; slow tier = memory-mapped checkpoint (warm page cache); accelerate: whole experts "
            "modules of the first round((1-budget)*L) layers on 'disk' (offload_folder), the rest "
            "'cpu'; large model: routing replayed from a synthetic sticky-Zipf trace through "
            "expertcache.engine.routing (every generation from its first row), same for all runs"
        ),
        "notes": [
            "accelerate's disk-offloaded weights are read with safetensors get_tensor, which here "
            "returns tensors backed by a memory map of the offload folder (no copy; ~0.1 ms for a "
            "117 MB tensor): with a warm page cache an offloaded layer costs little more than a "
            "resident one, and the RAM budget bounds only the process's own memory, not the page cache",
            "the engine's slow tier 'disk' is likewise the page-cached checkpoint; each miss is a "
            "memcpy into a slot (copy_from_checkpoint_s)",
        ],
        "build_s": build_s,
        "wall_s": time.perf_counter() - t_start,
        "models": results,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(out_path, out)
    log(f"wrote {out_path} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
