"""Miss paths on a 24 GB GPU over PCIe 4: projected TPOT and TTFT (timing model only, no GPU needed).

For Mixtral-8x7B and Qwen1.5-MoE-A2.7B, every row of ``PATHS`` (miss path, cache policy, prefetch) is
replayed through ``expertcache.sim.timing.simulate_timing`` and compared with on-demand LRU (``fetch``)
and with the limit ``max(all-resident TPOT, OPT decode misses per decode step x one expert's transfer)``.

Traces. Qwen: the real shared trace ``../shared/traces/qwen15_moe_a27b_chat.npz`` (6 chat requests,
prompt then 128 greedy tokens; read in place; the model is skipped with a note when it is absent).
Mixtral: no real trace is available, so a seeded synthetic sticky-Zipf trace of its shape (32 layers x 8
experts, top-2; 6 requests of 60 prompt + 128 generated tokens; ``MIXTRAL_TRACE``).

Costs (every figure is printed and written to the JSON):

- measured on an H100 machine (``bench/results/cost_triples_h100.json``, ``bench/cost_triples.py``):
  one expert's device compute ``a + b * tokens`` and its host compute (bf16, 16 cores), and the int4
  dequantisation (``dequant_s``, for low-precision paths; gate_up's time x 1.5, as down is half its size);
- declared: the link, PCIe 4.0 x16 pinned (``--link-bandwidth`` 25 GB/s, ``--link-latency`` 10 us per
  chunk, an expert in three chunks as the engine moves it); the fixed parts of the dense time
  (``--dense-fixed``, ``--step-fixed``: kernel launches, of the order of the measured fixed time of one
  small expert call, ~0.09 ms);
- derived: the dense time per layer = dense bytes of a layer (attention, norms, router, and Qwen's shared
  expert) / the effective weight bandwidth + ``--dense-fixed``; the step time = LM-head bytes / that
  bandwidth + ``--step-fixed``. The effective bandwidth defaults to the measured Mixtral expert's bytes /
  its device fixed time a (a batch-1 expert is a weight read, as a batch-1 dense layer is);
- the expert memory: ``--gpu-memory`` (24 GiB) minus the dense weights (bf16, computed from the shapes)
  minus ``--workspace`` (2 GiB: activations, KV cache, allocator slack), in whole experts.

The GPU is modelled as the H100's compute with 24 GB of memory and a PCIe 4 link: a real 24 GB card
(e.g. an RTX 4090, ~1 TB/s) computes resident experts and dense layers about twice as slowly, which
raises the all-resident floor, not the transfer or host terms. The host computes beside the device
(``host_parallel``). The timing model's dense time does not grow with the prompt, so TTFT understates
the prefill's dense work (docs/TIMING.md). The limit bounds paths that move whole experts; paths that
compute on the host or move parts of experts can go below it. ``host wait`` is the compute stream's
wait for the host's experts over all steps (prefill included), per decode step.

Every option and file is checked before any work (each row replayed on the first tokens of each trace),
a bad one refused in one line (exit 2). The results go to ``bench/results/miss_projection.json`` for the
documented run (every option at its default), to the temporary directory for any other (``--quick``:
``miss_projection.quick.json``), or to ``--out FILE``.

    .venv/bin/python bench/miss_projection.py [--quick] [--out bench/results/miss_projection.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from provenance import ROOT, SHARED, OneLineParser, at_least, fail, provenance, results_out, write_json

from expertcache.cache.schedule import build_schedule
from expertcache.costs import CostModel
from expertcache.errors import ExpertcacheError
from expertcache.miss.registry import MISS_PATHS
from expertcache.sim.replay import replay
from expertcache.sim.timing import simulate_timing
from expertcache.trace import Trace, load_trace, synthesize
from expertcache.units import parse_duration, parse_rate, parse_size

BF16 = 2
# the real models' shapes (Hugging Face configs); ffn: one routed expert's intermediate size
SHAPES: dict[str, dict[str, object]] = {
    "mixtral-8x7b": dict(
        layers=32, experts=8, top_k=2, hidden=4096, ffn=14336, vocab=32000, heads=32, kv_heads=8,
        shared_ffn=0, qkv_bias=False,
    ),
    "qwen1.5-moe-a2.7b": dict(
        layers=24, experts=60, top_k=4, hidden=2048, ffn=1408, vocab=151936, heads=16, kv_heads=16,
        shared_ffn=5632, qkv_bias=True,
    ),
}  # fmt: skip
QWEN_TRACE = SHARED / "traces" / "qwen15_moe_a27b_chat.npz"
MIXTRAL_TRACE = dict(a=1.0, stickiness=0.3, sequences=6, prompt_len=60, generated=128)
QUICK_REQUESTS = 2  # --quick: the first requests of each trace
CHECK_TOKENS = 8  # the rows are tried on this many first tokens of each trace before the work

# (label, miss path spec, cache policy, prefetch): one row each; {first} is the model's placement N
# (the first N layers on the host, so that the other layers' experts fit in the expert memory)
PATHS: list[tuple[str, str, str, str]] = [
    ("fetch (on-demand LRU)", "fetch", "lru", "none"),
    ("fetch + eam prefetch", "fetch", "lru", "eam"),
    ("host (Fiddler)", "host", "lru", "none"),
    ("host:fill=1", "host:fill=1", "lru", "none"),
    ("host:fill=1, static set (in-sample profile)", "host:fill=1", "static", "none"),
    ("hybrid (HybriMoE)", "hybrid", "mrs", "none"),
    ("placement, all layers (--cpu-moe)", "placement", "lru", "none"),
    ("placement:first={first} (--n-cpu-moe)", "placement:first={first}", "lru", "none"),
    ("split:theta=0.5 (MoEpic)", "split:theta=0.5", "lcp", "none"),
    ("split:theta=0.5 + eam", "split:theta=0.5", "lcp", "eam"),
    ("split:theta=0.3", "split:theta=0.3", "lcp", "none"),
    ("split:theta=0.3 + eam", "split:theta=0.3", "lcp", "eam"),
    ("hobbit (int4, t1 .6, t2 .9; lossy)", "hobbit", "lru", "none"),
    ("hobbit, policy hobbit (lossy)", "hobbit", "hobbit", "none"),
    ("hobbit int8 (lossy)", "hobbit:bits=8", "lru", "none"),
]
BASELINE = PATHS[0][0]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ model sizes
def dense_params(s: dict[str, object]) -> dict[str, int]:
    """Non-expert parameters: per MoE layer (attention, norms, router, shared expert) and the rest."""
    h, hd = s["hidden"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * hd
    attn = 2 * h * h + 2 * h * kv + (h + 2 * kv if s["qkv_bias"] else 0)  # q, o; k, v; biases
    shared = 3 * h * s["shared_ffn"] + (h if s["shared_ffn"] else 0)  # gate, up, down; its gate
    layer = attn + shared + h * s["experts"] + 2 * h  # router, two norms
    return {"per_layer": layer, "embedding": s["vocab"] * h, "lm_head": s["vocab"] * h + h}


def budget(s: dict[str, object], args) -> dict[str, object]:
    """Expert memory of the GPU: its memory less the dense weights and the workspace, in experts."""
    p = dense_params(s)
    dense = (s["layers"] * p["per_layer"] + p["embedding"] + p["lm_head"]) * BF16
    expert = 3 * s["hidden"] * s["ffn"] * BF16
    memory = args.gpu_memory_bytes - dense - args.workspace_bytes
    total = s["layers"] * s["experts"]
    capacity = min(total, max(0, int(memory // expert)))
    return {
        "gpu_memory_bytes": args.gpu_memory_bytes,
        "workspace_bytes": args.workspace_bytes,
        "dense_params": {**p, "total": dense // BF16},
        "dense_bytes": dense,
        "expert_bytes": expert,
        "expert_memory_bytes": memory,
        "capacity_experts": capacity,
        "total_experts": total,
        "share": capacity / total,
    }


# ------------------------------------------------------------------------------------ costs
def measured(triples: dict[str, object], name: str) -> dict[str, object]:
    shape = triples["shapes"][name]
    int4 = shape["quant"]["int4"]["dequant_gate_up_s"]
    return {
        "expert_bytes": shape["expert_bytes"],
        "device_a_s": shape["device_compute"]["a_s"],
        "device_b_s_per_token": shape["device_compute"]["b_s_per_token"],
        "host_a_s": shape["host_compute"]["a_s"],
        "host_b_s_per_token": shape["host_compute"]["b_s_per_token"],
        "dequant_int4_s": 1.5 * int4,  # gate_up measured; down is half its size
        "h100_link_Bps": shape["link"]["bandwidth_Bps"],  # not used: the projection's link is declared
    }


def cost_model(s: dict[str, object], m: dict[str, object], args) -> tuple[CostModel, dict[str, object]]:
    """The projection's CostModel, and how its dense and step times were derived."""
    p = dense_params(s)
    dense = p["per_layer"] * BF16 / args.weights_bandwidth + args.dense_fixed_s
    step = p["lm_head"] * BF16 / args.weights_bandwidth + args.step_fixed_s
    cost = CostModel(
        dense_s=dense, expert_s=m["device_a_s"], expert_token_s=m["device_b_s_per_token"], step_s=step,
        link_bandwidth=args.link_bandwidth_Bps, link_latency=args.link_latency_s,
        expert_bytes=int(m["expert_bytes"]), host_expert_s=m["host_a_s"],
        host_expert_token_s=m["host_b_s_per_token"], dequant_s=m["dequant_int4_s"], host_parallel=True,
    )  # fmt: skip
    derived = {
        "weights_bandwidth_Bps": args.weights_bandwidth,
        "dense_layer_bytes": p["per_layer"] * BF16,
        "dense_s": dense,
        "lm_head_bytes": p["lm_head"] * BF16,
        "step_s": step,
    }
    return cost, derived


# ------------------------------------------------------------------------------------ traces
def hobbit_weights(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Top-2 gate weights [T, L, 2] for a synthetic trace: HOBBIT reports that its thresholds (0.6, 0.9)
    split Mixtral's expert uses about 67/30/3% into full, low precision and skipped; with the top-1
    always full, the second expert's importance (the top-1's weight w) must fall <= 0.6 for 34% of the
    tokens, in (0.6, 0.9] for 60%, above 0.9 for 6%. w is drawn uniformly within those three bands."""
    rng = np.random.default_rng(seed)
    band = rng.choice(3, size=shape[:2], p=[0.34, 0.60, 0.06])
    lo, hi = np.array([0.5, 0.6, 0.9])[band], np.array([0.6, 0.9, 1.0])[band]
    w = lo + (hi - lo) * rng.random(shape[:2])
    return np.stack([w, 1.0 - w], axis=-1).astype(np.float32)


def first_requests(trace: Trace, n: int) -> Trace:
    """The rows of the trace's first ``n`` requests (requests are contiguous)."""
    later = np.flatnonzero(trace.seq_id >= n)
    stop = int(later[0]) if len(later) else trace.num_tokens
    rows = ("experts", "weights", "seq_id", "is_prefill", "token_id", "step_id", "predicted")
    cut = {f: getattr(trace, f)[:stop] for f in rows if getattr(trace, f) is not None}
    return dataclasses.replace(trace, **cut)


def model_trace(name: str, s: dict[str, object], args) -> tuple[Trace | None, str]:
    requests = QUICK_REQUESTS if args.quick else None
    if name == "mixtral-8x7b":
        t = MIXTRAL_TRACE
        n = requests or t["sequences"]
        tr = synthesize(
            "sticky", tokens=n * (t["prompt_len"] + t["generated"]), layers=s["layers"],
            experts=s["experts"], top_k=s["top_k"], a=t["a"], stickiness=t["stickiness"],
            seed=args.mixtral_seed, sequences=n, prompt_len=t["prompt_len"],
        )  # fmt: skip
        tr = dataclasses.replace(tr, weights=hobbit_weights(tr.experts.shape, args.mixtral_seed))
        return tr, (
            f"synthetic sticky Zipf (no real Mixtral trace is available): a={t['a']}, stickiness "
            f"{t['stickiness']}, seed {args.mixtral_seed}, {n} requests of {t['prompt_len']} prompt + "
            f"{t['generated']} generated tokens; gate weights drawn to match HOBBIT's reported split for "
            f"Mixtral (top-1 weight <= 0.6: 34%, (0.6, 0.9]: 60%, > 0.9: 6%)"
        )
    if not args.qwen_trace.is_file():
        return None, f"{args.qwen_trace} not found"
    tr = load_trace(args.qwen_trace)
    where = f"real: {args.qwen_trace}"
    if requests:
        tr, where = first_requests(tr, requests), f"{where} (first {requests} requests)"
    return tr, where


# ------------------------------------------------------------------------------------ runs
def limit(trace: Trace, cost: CostModel, capacity: int) -> dict[str, object]:
    """All-resident compute (free transfers, every expert fits) and OPT's decode transfers."""
    L, E = trace.num_layers, trace.num_experts
    free = dataclasses.replace(cost, link_bandwidth=math.inf, link_latency=0.0)
    res = simulate_timing(trace, L * E, cost=free)
    opt = replay(build_schedule(trace, "layer"), "opt", capacity)
    decode_steps = res.steps[0]
    opt_dec = int(opt.layer_misses[0].sum())
    transfer = opt_dec / decode_steps * cost.transfer_s
    return {
        "resident_tpot_s": res.tpot_s,
        "resident_ttft_s": res.ttft_s,
        "opt_decode_misses": opt_dec,
        "opt_prefill_misses": int(opt.layer_misses[1].sum()),
        "decode_steps": decode_steps,
        "expert_transfer_s": cost.transfer_s,
        "transfer_s_per_token": transfer,
        "limit_tpot_s": max(res.tpot_s, transfer),
        "serial_tpot_s": res.tpot_s + transfer,
    }


def run_path(trace: Trace, cost: CostModel, capacity: int, miss: str, policy: str, prefetch: str) -> dict:
    t0 = time.perf_counter()
    r = simulate_timing(trace, capacity, cache=policy, prefetch=prefetch, miss=miss, cost=cost)
    out = {k: v for k, v in r.to_dict().items() if k != "cost" and not k.endswith("_by_layer")}
    decode = max(1, r.steps[0])
    out.update(
        misses_by_layer=r.cache["misses_by_layer"],
        decode_stall_per_token_s=r.stall_by_phase[0] / decode,
        host_wait_per_token_s=r.host_wait_s / decode,
        sim_wall_s=time.perf_counter() - t0,
    )
    return out


def placement_first(b: dict[str, object], s: dict[str, object]) -> int:
    """llama.cpp's --n-cpu-moe N: the first N layers on the host, the others' experts all fit."""
    return min(s["layers"] - 1, max(1, s["layers"] - b["capacity_experts"] // s["experts"]))


def bench_model(name: str, triples: dict, args, save) -> dict[str, object] | None:
    s = SHAPES[name]
    trace, source = model_trace(name, s, args)
    if trace is None:
        log(f"{name}: skipped ({source})")
        return {"model": name, "skipped": source}
    b = budget(s, args)
    m = measured(triples, name)
    if m["expert_bytes"] != b["expert_bytes"]:
        raise SystemExit(
            f"{name}: expert bytes {b['expert_bytes']} differ from the measured {m['expert_bytes']}"
        )
    cost, derived = cost_model(s, m, args)
    cap, first = b["capacity_experts"], placement_first(b, s)
    log(f"{name}: {source}; {trace.num_tokens} tokens; capacity {cap}/{b['total_experts']} experts")
    out = {
        "model": name, "shape": s, "trace": source, "tokens": trace.num_tokens, "budget": b,
        "measured_h100": m, "derived": derived, "cost": cost.to_dict(), "cost_line": cost.describe(),
        "placement_first": first, "limit": limit(trace, cost, cap), "rows": [],
    }  # fmt: skip
    for label, miss, policy, prefetch in PATHS:
        label, miss = label.format(first=first), miss.format(first=first)
        if miss.partition(":")[0] not in MISS_PATHS:
            log(f"{name}: {label}: skipped (miss path not registered)")
            out["rows"].append({"label": label, "miss_spec": miss, "not_run": "miss path not registered"})
            continue
        r = run_path(trace, cost, cap, miss, policy, prefetch)
        out["rows"].append({"label": label, "miss_spec": miss, "prefetch_spec": prefetch, **r})
        save(out)
        log(
            f"{name}: {label:44s} TPOT {r['tpot_s'] * 1e3:8.2f} ms  TTFT {r['ttft_s'] * 1e3:8.1f} ms"
            f"  ({r['sim_wall_s']:.1f} s)"
        )
    return out


# ------------------------------------------------------------------------------------ output
def ms(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x * 1e3:.{digits}f}"


def table(mdl: dict[str, object]) -> str:
    rows = [r for r in mdl["rows"] if "not_run" not in r]
    base = next(r["tpot_s"] for r in rows if r["label"] == BASELINE)
    lim = mdl["limit"]
    head = (
        "| path | TPOT ms | vs fetch | TTFT ms | decode stall ms/token | host wait ms/token* | misses % "
        "| TPOT / limit |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['label']} | {ms(r['tpot_s'])} | {base / r['tpot_s']:.2f}x | {ms(r['ttft_s'], 1)} | "
            f"{ms(r['decode_stall_per_token_s'])} | {ms(r['host_wait_per_token_s'])} | "
            f"{r['miss_ratio'] * 100:.1f} | {r['tpot_s'] / lim['limit_tpot_s']:.2f} |"
        )
    lines.append(
        f"| all-resident (compute only) | {ms(lim['resident_tpot_s'])} | "
        f"{base / lim['resident_tpot_s']:.2f}x | {ms(lim['resident_ttft_s'], 1)} | 0 | 0 | - | - |"
    )
    lines.append(
        f"| **limit** max(resident, OPT {lim['opt_decode_misses'] / lim['decode_steps']:.2f} misses/token x "
        f"{ms(lim['expert_transfer_s'])} ms) | {ms(lim['limit_tpot_s'])} | {base / lim['limit_tpot_s']:.2f}x"
        " | - | - | - | - | 1.00 |"
    )
    lines += [
        f"| {r['label']} (not run: {r['not_run']}) |" + " - |" * 7 for r in mdl["rows"] if "not_run" in r
    ]
    lines.append(
        "\n\\* the compute stream's wait for host experts over all steps, prefill's included, per decode "
        "step (the timing model does not split it by phase). misses %: of the primary part (whole experts; "
        "split: top segments), all phases."
    )
    return "\n".join(lines)


def header(mdl: dict[str, object]) -> str:
    b, d = mdl["budget"], mdl["derived"]
    return (
        f"### {mdl['model']}\n\n"
        f"trace: {mdl['trace']} ({mdl['tokens']} tokens)  \n"
        f"expert memory: {b['gpu_memory_bytes'] / 2**30:.0f} GiB - dense {b['dense_bytes'] / 2**30:.2f} GiB "
        f"({b['dense_params']['total'] / 1e9:.2f}B params, bf16) - workspace "
        f"{b['workspace_bytes'] / 2**30:.1f} GiB = {b['expert_memory_bytes'] / 2**30:.2f} GiB = "
        f"**{b['capacity_experts']} of {b['total_experts']} experts ({b['share'] * 100:.1f}%)** of "
        f"{b['expert_bytes'] / 2**20:.1f} MiB  \n"
        f"dense {d['dense_s'] * 1e3:.3f} ms/layer ({d['dense_layer_bytes'] / 1e6:.1f} MB / "
        f"{d['weights_bandwidth_Bps'] / 1e12:.2f} TB/s + fixed), step {d['step_s'] * 1e3:.3f} ms "
        f"(LM head {d['lm_head_bytes'] / 1e6:.0f} MB + fixed); placement N = {mdl['placement_first']}  \n"
        f"cost: {mdl['cost_line']}\n"
    )


def add_machine_args(ap: argparse.ArgumentParser) -> None:
    """The projected machine's options (shared with ``bench/plan_projection.py``)."""
    ap.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--costs", type=Path, default=ROOT / "bench/results/cost_triples_h100.json",
                    help="measured cost triples (device and host compute)")  # fmt: skip
    ap.add_argument("--qwen-trace", type=Path, default=QWEN_TRACE)
    ap.add_argument("--mixtral-seed", type=at_least(0), default=0)
    ap.add_argument("--gpu-memory", default="24GiB")
    ap.add_argument("--workspace", default="2GiB", help="activations, KV cache, allocator slack")
    ap.add_argument("--link-bandwidth", default="25GB/s", help="declared: PCIe 4.0 x16, pinned")
    ap.add_argument("--link-latency", default="10us", help="declared: per chunk (a third of an expert)")
    ap.add_argument("--weights-bandwidth", default=None,
                    help="effective bytes/s of a batch-1 weight read (default: the measured Mixtral "
                    "expert's bytes / its device fixed time)")  # fmt: skip
    ap.add_argument("--dense-fixed", default="0.1ms", help="declared: per layer, beyond its weight read")
    ap.add_argument("--step-fixed", default="0.1ms", help="declared: per step, beyond the LM head's read")
    ap.add_argument("--quick", action="store_true", help=f"the first {QUICK_REQUESTS} requests of each trace")


def resolve_machine_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Parse the machine's figures into ``args`` (bytes, seconds) and check them, the cost triples, the
    Qwen trace and each model's expert memory, before any work: a bad one is refused in one line naming
    it (exit 2). -> the measured cost triples."""
    try:
        args.gpu_memory_bytes = int(parse_size(args.gpu_memory, "--gpu-memory"))
        args.workspace_bytes = int(parse_size(args.workspace, "--workspace"))
        args.link_bandwidth_Bps = parse_rate(args.link_bandwidth, "--link-bandwidth")
        args.link_latency_s = parse_duration(args.link_latency, "--link-latency")
        args.dense_fixed_s = parse_duration(args.dense_fixed, "--dense-fixed")
        args.step_fixed_s = parse_duration(args.step_fixed, "--step-fixed")
        if args.weights_bandwidth is not None:
            args.weights_bandwidth = parse_rate(args.weights_bandwidth, "--weights-bandwidth")
    except ExpertcacheError as exc:
        fail(ap.prog, str(exc))
    triples = read_costs(ap, args)
    if args.weights_bandwidth is None:
        mx = measured(triples, "mixtral-8x7b")
        args.weights_bandwidth = mx["expert_bytes"] / mx["device_a_s"]
    check_qwen_trace(ap, args)
    for name in args.models:
        s, b = SHAPES[name], budget(SHAPES[name], args)
        if b["capacity_experts"] < s["top_k"]:  # the planner and every miss path need a layer's top-k
            fail(ap.prog, f"--gpu-memory {args.gpu_memory} less {name}'s dense weights "
                 f"({b['dense_bytes'] / 2**30:.2f} GiB) and --workspace {args.workspace} holds "
                 f"{b['capacity_experts']} of its experts; it needs at least top-k {s['top_k']}")  # fmt: skip
        try:
            cost_model(s, measured(triples, name), args)
        except ExpertcacheError as exc:
            fail(ap.prog, f"{name}'s cost model: {exc}")
    return triples


def read_costs(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The cost triples of ``--costs``, with the figures of every model run (and of Mixtral, whose
    expert gives the default weight bandwidth); else one line (exit 2)."""
    where = f"--costs {args.costs}"
    if not args.costs.is_file():
        fail(ap.prog, f"{where}: {'a folder' if args.costs.is_dir() else 'no such file'}")
    try:
        triples = json.loads(args.costs.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        fail(ap.prog, f"{where}: not a JSON file of cost triples ({exc})")
    names = [*args.models, *(["mixtral-8x7b"] if args.weights_bandwidth is None else [])]
    for name in dict.fromkeys(names):
        try:
            m = measured(triples, name)
            triples["provenance"]["date"], triples["provenance"]["git"]["commit"]  # noqa: B018 (recorded)
            times = [v for k, v in m.items() if k.endswith(("_s", "_per_token"))]
            positive = m["device_a_s"] > 0 and all(t >= 0 for t in times)
        except (KeyError, TypeError, IndexError) as exc:
            fail(ap.prog, f"{where}: not cost triples with {name}'s figures (missing or bad {exc}; "
                 "bench/cost_triples.py writes them)")  # fmt: skip
        expert = budget(SHAPES[name], args)["expert_bytes"]
        if m["expert_bytes"] != expert:
            fail(ap.prog, f"{where}: {name}'s expert is {m['expert_bytes']} bytes, {expert} by its shape")
        if not positive:
            fail(ap.prog, f"{where}: {name}'s compute times are not positive")
    return triples


def check_qwen_trace(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A ``--qwen-trace`` given must be a trace of Qwen1.5-MoE's shape; the default one, absent (no shared
    data beside this checkout), skips the model with a note, as documented."""
    if "qwen1.5-moe-a2.7b" not in args.models:
        return
    path = args.qwen_trace
    if not path.is_file() and path == ap.get_default("qwen_trace"):
        return
    try:
        tr = load_trace(path)
    except ExpertcacheError as exc:
        fail(ap.prog, f"--qwen-trace: {exc}")
    s = SHAPES["qwen1.5-moe-a2.7b"]
    have, want = (tr.num_layers, tr.num_experts, tr.top_k), (s["layers"], s["experts"], s["top_k"])
    if have != want:
        fail(ap.prog, "--qwen-trace {}: {} layers x {} experts, top-{}; Qwen1.5-MoE's is {} x {}, top-{}"
             .format(path, *have, *want))  # fmt: skip


def check_paths(ap: argparse.ArgumentParser, args: argparse.Namespace, triples: dict) -> None:
    """Every row of ``PATHS`` and the limit's OPT, replayed on the first ``CHECK_TOKENS`` tokens of each
    model's trace (well under a second): a row the machine cannot run (an expert memory too small for a
    split path's top parts, say) is refused in one line before the work, not after the other rows'
    minutes."""
    for name in args.models:
        s = SHAPES[name]
        trace, _ = model_trace(name, s, args)
        if trace is None:  # skipped, said when the work starts
            continue
        rows = ("experts", "weights", "seq_id", "is_prefill", "token_id", "step_id", "predicted")
        cut = {f: getattr(trace, f)[:CHECK_TOKENS] for f in rows if getattr(trace, f) is not None}
        head = dataclasses.replace(trace, **cut)
        b = budget(s, args)
        cost, _ = cost_model(s, measured(triples, name), args)
        cap, first = b["capacity_experts"], placement_first(b, s)
        label = "the limit (OPT)"
        try:
            replay(build_schedule(head, "layer"), "opt", cap)
            for label, miss, policy, prefetch in PATHS:
                label, miss = label.format(first=first), miss.format(first=first)
                if miss.partition(":")[0] in MISS_PATHS:
                    simulate_timing(head, cap, cache=policy, prefetch=prefetch, miss=miss, cost=cost)
        except ExpertcacheError as exc:
            memory = f"{b['expert_memory_bytes'] / 2**30:.2f} GiB"
            fail(ap.prog, f"{name} with {cap} experts in {memory} of expert memory (--gpu-memory "
                 f"{args.gpu_memory}, --workspace {args.workspace}): {label}: {exc}")  # fmt: skip


def main() -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    add_machine_args(ap)
    ap.add_argument(
        "--out", type=Path, default=None,
        help="default bench/results/miss_projection.json (documented run; other runs: the temp dir)",
    )  # fmt: skip
    args = ap.parse_args()
    given = argparse.Namespace(**vars(args))  # as parsed: what decides whether this is the documented run
    triples = resolve_machine_args(ap, args)
    check_paths(ap, args, triples)
    name = "miss_projection.quick.json" if args.quick else "miss_projection.json"
    out_path = results_out(ap, given, name)
    body: dict[str, object] = {
        **provenance(),
        "cost_triples": {
            "file": str(args.costs.relative_to(ROOT) if args.costs.is_relative_to(ROOT) else args.costs),
            "date": triples["provenance"]["date"],
            "commit": triples["provenance"]["git"]["commit"],
            "gpu": triples.get("gpu"),
            "host_threads": triples.get("host_threads"),
        },
        "figures": {
            "measured (H100 machine)": "device compute a + b*n, host compute a + b*n (bf16, 16 cores), "
            "int4 dequantisation",
            "declared": f"link {args.link_bandwidth} + {args.link_latency}/chunk (PCIe 4.0 x16 pinned); "
            f"dense fixed {args.dense_fixed}/layer; step fixed {args.step_fixed}; workspace {args.workspace}",
            "derived": "dense/step weight reads at the effective weight bandwidth; expert memory from "
            "the shapes",
        },
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "paths": [list(p) for p in PATHS],
        "models": [],
    }
    t_start = time.perf_counter()

    def save(partial: dict[str, object] | None = None) -> None:
        models = [*body["models"], *([partial] if partial is not None else [])]
        write_json(out_path, {**body, "models": models, "wall_s": time.perf_counter() - t_start})

    for name in args.models:
        body["models"].append(bench_model(name, triples, args, save))
        save()
    log(f"wrote {out_path} ({time.perf_counter() - t_start:.0f} s)")
    for mdl in body["models"]:
        if "skipped" in mdl:
            print(f"### {mdl['model']}\n\nskipped: {mdl['skipped']}\n")
            continue
        print(header(mdl))
        print(table(mdl) + "\n")


if __name__ == "__main__":
    main()
