"""Proactive caching on CPU with an emulated link: prefetch, preemption, reordering, chunking (ablation).

The issue's target: with the emulated link at a PCIe-like ratio (moving one expert takes as long as
computing 2-4 experts for one token), at 25% and 50% of expert memory, on the demo model and on the
larger generated model, prefetch + preemption + reordering cut the decode stall by at least half and
TPOT by at least 30% against on-demand LRU, with identical output tokens.

Per model x budget, policy lru, the link set so that ``latency + expert_bytes / bandwidth`` =
``--link-ratio`` x the measured compute time of one expert for one token (``engine_cpu.expert_costs``):

- ``on-demand``: no prefetch, no chunking, no preemption, no reordering (the baseline);
- ``chunking only`` and ``reorder only``: one technique, no prefetch;
- per predictor P, the cumulative ablation ``+prefetch`` (P), ``+preemption``, ``+reorder`` (the
  issue's combination) and ``+chunking`` (all four); a predictor marked ``@combo`` runs ``+reorder`` only;
- ``all-resident``: 100% of the experts, no link (the floor: no transfer at all).

Predictors. Demo model (its own trained router): ``learned`` (window 2; ``window`` when ``learned`` is
not available) and ``next-gate``. Large model (random weights, routing replayed from a synthetic sticky
Zipf trace, as in ``engine_cpu``): gate-based predictors call the model's own random routers, which say
nothing about the replayed routing, so the main predictor is ``eam``, warm-started with request EAMs of
held-out rows of the same generator (same seed, so the same per-layer popularity: the same "model";
rows disjoint from the replayed ones: other requests); the controls ``eam-seed1`` (warm start from the
generator with seed 1, i.e. a different popularity order) and ``next-gate`` (random routers) run once.
The EAM collection is reset to its warm start before every generation, so no measured run learns
from an earlier run of the same (replayed) request.

Slow tier ``host`` by default (every expert in RAM, a transfer is one memcpy per tensor): the emulated
link then sets the transfer time, and the transfer thread holds the GIL as little as it can (with
``disk``, each transfer also runs safetensors and slicing code in that thread, which on the demo model
takes longer than the emulated transfer itself). ``--limits``: each predictor runs with the engine's
default prefetch limit (experts prefetched per predicted layer: top_k) and with the engine's former
default, max(top_k, capacity // layers) (``share``, set on the engine's ``ExpertCache`` after loading,
as it depends on the capacity).

Everything else as in ``engine_cpu``: one warm-up generation, then ``--repeats`` measured ones of the
same prompt (the cache stays warm from the one before), medians; every run's tokens are compared with
the reference's (transformers eager, every weight resident), and the script exits with status 1 when
any differ (after writing the JSON).

    OMP_NUM_THREADS=1 .venv/bin/python bench/prefetch_cpu.py [--quick] [--wait-idle] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from engine_cpu import (
    LARGE,
    LARGE_QUICK,
    PROMPT,
    emulated_link,
    large_model,
    log,
    measure,
    model_info,
    replay_trace,
    routing_replay,
    run_reference,
)
from provenance import ROOT, provenance, write_json

from expertcache.engine import load
from expertcache.engine.offloaded import DEFAULT_MODEL
from expertcache.errors import ExpertcacheError
from expertcache.trace import Trace, synthesize

# name -> (uses the predictor, chunking, preemption, reorder)
ABLATION = {
    "+prefetch": (True, False, False, False),
    "+preemption": (True, False, True, False),
    "+reorder": (True, False, True, True),  # the combination
    "+chunking": (True, True, True, True),
}
BASELINES = {
    "on-demand": (False, False, False, False),
    "chunking only": (False, True, False, False),
    "reorder only": (False, False, False, True),
}
COMBO = "+reorder"
STEPS = ("on-demand", *ABLATION)
DEFAULT_PREDICTORS = ["demo=learned,next-gate", "large=eam,eam-seed1@combo,next-gate@combo"]
WARM_REQUESTS = 8  # requests in the EAM warm-start traces


# ------------------------------------------------------------------------------------ idleness
def _cpu_ticks() -> dict[int, tuple[int, str]]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(d)] = (int(fields[11]) + int(fields[12]), cmd)
    return out


def busy_others(sample_s: float = 3.0, min_share: float = 0.05) -> list[str]:
    """Other processes using at least ``min_share`` of a CPU over ``sample_s``, or any pytest /
    python training process (whatever its share): 'pid cpu% command' lines."""
    hz = os.sysconf("SC_CLK_TCK")
    me = {os.getpid(), os.getppid()}
    a = _cpu_ticks()
    time.sleep(sample_s)
    b = _cpu_ticks()
    busy = []
    for pid, (ticks, cmd) in b.items():
        if pid in me or not cmd:
            continue
        share = (ticks - a.get(pid, (ticks, ""))[0]) / hz / sample_s
        named = "python" in cmd and ("pytest" in cmd or "train" in cmd)
        if share >= min_share or named:
            busy.append(f"{pid} {share * 100:.0f}% {cmd[:120]}")
    return busy


def wait_idle(max_wait_s: float, poll_s: float = 30.0, load_max: float = 0.3) -> dict[str, object]:
    """Poll until the 1-minute load average is below ``load_max`` and no other process is busy."""
    start = time.time()
    while True:
        load1 = os.getloadavg()[0]
        others = busy_others()
        if load1 < load_max and not others:
            return {"idle": True, "waited_s": time.time() - start, "load_avg_1m": load1, "busy": []}
        if time.time() - start >= max_wait_s:
            return {"idle": False, "waited_s": time.time() - start, "load_avg_1m": load1, "busy": others}
        log(f"busy (load {load1:.2f}; {len(others)} other process(es): {'; '.join(others)[:300]}); waiting")
        time.sleep(poll_s)


# ------------------------------------------------------------------------------------ traces
def eam_warm_trace(spec: dict[str, object], replayed: int, seed: int, held_out: bool) -> Trace:
    """``WARM_REQUESTS`` requests of ``replayed`` tokens each of the replay's generator (sticky Zipf).

    held_out: the same seed as the replayed trace (the per-layer popularity order is the generator's
    first draw, so it is the same) and the rows after the first ``replayed`` ones (other requests);
    else a generator of another seed (another popularity order)."""
    n = WARM_REQUESTS + (1 if held_out else 0)
    tr = synthesize("sticky", tokens=n * replayed, seed=seed, **spec)
    ex = tr.experts[replayed:] if held_out else tr.experts
    seq = (np.arange(len(ex)) // replayed).astype(np.int32)
    return Trace(experts=ex, num_experts=tr.num_experts, seq_id=seq, meta={"warm_start": True})


# ------------------------------------------------------------------------------------ one config
def _counters(m) -> dict[str, float]:
    s = p = m.cache.stats
    t, w = m.transport, m.worker
    return {
        "misses": int(s.misses.sum()),
        "decode_misses": int(s.misses[0].sum()),
        "prefill_misses": int(s.misses[1].sum()),
        "requests": int(s.requests.sum()),
        "decode_requests": int(s.requests[0].sum()),
        "stall_s": t.stall_s,
        "decode_stall_s": t.stall_by_phase[0],
        "prefill_stall_s": t.stall_by_phase[1],
        "prefetch_issued": int(p.issued.sum()),
        "prefetch_used": int(p.used.sum()),
        "prefetch_late": int(p.late.sum()),
        "prefetch_cancelled": int(p.cancelled.sum()),
        "prefetch_skipped": int(p.skipped_prefetches.sum()),
        "pred_actual": int(p.actual.sum()),
        "pred_correct": int(p.correct.sum()),
        "pred_in_time": int(p.in_time.sum()),
        "link_busy_s": w.busy_s,
        "bytes_moved": w.bytes_moved,
    }


PER_RUN = (
    "tpot_s", "ttft_s", "tokens_per_s", "total_s", "stall_s", "decode_stall_s", "prefill_stall_s",
    "decode_stall_per_step_s", "misses", "decode_misses", "prefill_misses", "prefetch_issued",
    "prefetch_used", "prefetch_late", "prefetch_cancelled", "prefetch_skipped", "accuracy", "fetchrate",
    "goodpred", "experts_moved", "link_s_per_expert", "non_stall_tpot_s", "decode_requests",
    "decode_hit_ratio",
)  # fmt: skip


def run_config(
    path: Path, args, trace, ref_tokens, budget: str, name: str, limit: str = "engine", **kw
) -> dict[str, object]:
    """Load, warm up, measure; medians of every per-run figure, every run kept. ``limit``: experts
    prefetched per predicted layer at most: "engine" (load's default), "share" (max(top_k,
    capacity // layers)), "k" (top_k) or a number."""
    if limit not in ("engine", "share"):
        kw["prefetch_limit"] = None if limit == "k" else int(limit)
    t0 = time.perf_counter()
    m = load(
        path, expert_memory=budget, policy="lru", device="cpu", slow_tier=args.slow_tier, progress=False, **kw
    )
    load_s = time.perf_counter() - t0
    engine_limit = m.cache.limit
    if limit == "k":
        m.cache.limit = m.top_k
    elif limit == "share":  # depends on the capacity: set on the cache after loading
        m.cache.limit = max(m.top_k, m.capacity // m.num_layers)
    eam_state = copy.deepcopy(m.predictor.model) if m.prefetch == "eam" else None
    runs: list[dict[str, object]] = []
    try:
        replay = routing_replay(m.model, trace)

        def generate(n: int) -> dict[str, object]:
            if eam_state is not None:  # no learning from an earlier run of the same request
                m.predictor.model = copy.deepcopy(eam_state)
            before = _counters(m)
            g = m.generate_text(PROMPT, n, min_new_tokens=n).to_dict()
            after = _counters(m)
            d = {k: after[k] - before[k] for k in after}
            steps = max(1, len(g["tokens"]) - 1)
            moved = d["bytes_moved"] / m.layout.nbytes
            r = {
                "tokens": g["tokens"],
                **{k: g[k] for k in ("tpot_s", "ttft_s", "tokens_per_s", "total_s")},
                **{k: v for k, v in d.items() if not k.startswith("pred_")},
                "decode_stall_per_step_s": d["decode_stall_s"] / steps,
                "non_stall_tpot_s": g["tpot_s"] - d["decode_stall_s"] / steps,
                "accuracy": d["pred_correct"] / d["pred_actual"] if d["pred_actual"] else None,
                "fetchrate": d["pred_in_time"] / d["pred_correct"] if d["pred_correct"] else None,
                "goodpred": d["pred_in_time"] / d["pred_actual"] if d["pred_actual"] else None,
                "experts_moved": moved,
                "decode_hit_ratio": 1 - d["decode_misses"] / d["decode_requests"]
                if d["decode_requests"]
                else None,
                "link_s_per_expert": d["link_busy_s"] / moved if moved else None,
            }
            runs.append(r)
            return r

        measure(generate, args.warmup_tokens, args.new_tokens, args.repeats, replay)
        cfg = {
            **m.prefetch_config,
            "capacity_experts": m.capacity,
            "link": m.link.describe() if m.link else None,
            "slow_tier": m.tier.name,
            "prefetch_limit": m.cache.limit,
            "engine_prefetch_limit": engine_limit,
        }
    finally:
        m.close()
    m = None
    gc.collect()
    measured = runs[1:]
    out: dict[str, object] = {"config": name, "budget": budget, "policy": "lru", **cfg, "load_s": load_s}
    for k in PER_RUN:
        values = [r[k] for r in measured if r[k] is not None]
        out[k] = statistics.median(values) if values else None
        out[k + "_runs"] = [r[k] for r in measured]
    # warm-up first (a prefix of the reference's tokens), then the measured runs
    out["tokens_match_reference_runs"] = [r["tokens"] == ref_tokens[: len(r["tokens"])] for r in runs]
    out["tokens_match_reference"] = all(out["tokens_match_reference_runs"]) and all(
        len(r["tokens"]) == len(ref_tokens) for r in measured
    )
    out["os_load_avg_1m"] = os.getloadavg()[0]
    return out


def line(r: dict[str, object]) -> str:
    pf = ""
    if r.get("prefetch") not in (None, "none"):
        acc = r["accuracy"]
        pf = (
            f"  pf {r['prefetch_issued']}/{r['prefetch_used']}/{r['prefetch_late']}/{r['prefetch_cancelled']}"
            f" acc {acc if acc is None else round(acc, 2)} good {r['goodpred'] and round(r['goodpred'], 2)}"
        )
    return (
        f"TPOT {r['tpot_s'] * 1e3:7.2f} ms  stall/step {r['decode_stall_per_step_s'] * 1e3:6.2f} ms  "
        f"misses {r['misses']:5d}{pf}  match={r['tokens_match_reference']}"
    )


# ------------------------------------------------------------------------------------ analysis
def reductions(rows: dict[str, dict[str, object]], base: dict[str, object]) -> dict[str, object]:
    """Reduction of decode stall and TPOT of each config against ``base``, and each ablation step's
    increment (in points of the baseline)."""
    s0, t0 = base["decode_stall_per_step_s"], base["tpot_s"]
    out: dict[str, object] = {}
    prev = base
    for name, r in rows.items():
        s, t = r["decode_stall_per_step_s"], r["tpot_s"]
        out[name] = {
            "stall_reduction": 1 - s / s0 if s0 else None,
            "tpot_reduction": 1 - t / t0,
        }
        if name in ABLATION:
            out[name]["stall_step"] = (prev["decode_stall_per_step_s"] - s) / s0 if s0 else None
            out[name]["tpot_step"] = (prev["tpot_s"] - t) / t0
            prev = r
    return out


def bench_model(label: str, path: Path, args, predictors: list[str]) -> dict[str, object]:
    info = model_info(path)
    log(f"== {label}: {path} ({info['checkpoint_bytes'] / 1e9:.2f} GB)")
    _, costs = emulated_link(path, args.link_ratio, args.link_latency)
    bw = costs["link_bandwidth_bytes_per_s"]
    log(
        f"one expert: {costs['expert_bytes'] / 1e6:.2f} MB, compute (1 token) "
        f"{costs['compute_one_token_s'] * 1e6:.0f} us, copy {costs['copy_from_checkpoint_s'] * 1e6:.0f} us; "
        f"link {bw / 1e9:.3g} GB/s + {args.link_latency} = {costs['link_transfer_s'] * 1e6:.0f} us per expert"
    )
    trace, routing, spec = None, {"kind": "the model's own router"}, None
    if label == "large":
        trace, routing = replay_trace(path, args)
        spec = dict(
            layers=trace.num_layers, experts=trace.num_experts, top_k=trace.top_k,
            a=routing["a"], stickiness=routing["stickiness"],
        )  # fmt: skip
    top_k = int(info["config"]["num_experts_per_tok"])
    ref = run_reference(path, args, trace)
    ref_tokens = ref.pop("tokens")
    log(f"reference            TPOT {ref['tpot_s'] * 1e3:7.2f} ms")
    link = dict(link_bandwidth=bw, link_latency=args.link_latency)
    runs: list[dict[str, object]] = []
    predictor_notes: dict[str, str] = {}

    def add(r: dict[str, object], tag: str) -> dict[str, object]:
        log(f"{tag:34s} {line(r)}")
        runs.append(r)
        return r

    def predictor_kwargs(pname: str) -> tuple[dict[str, object], str]:
        """load() arguments for a predictor name of this benchmark, and the name actually used."""
        if pname == "learned":
            if "learned" in predictor_notes:
                ok = not predictor_notes["learned"].startswith("fell back")
                return (
                    (dict(prefetch="learned", window=2), "learned")
                    if ok
                    else (dict(prefetch="window", window=2), "window")
                )
            try:  # registered and usable? (another helper may still be finishing it)
                load(
                    path, expert_memory="100%", device="cpu", progress=False, prefetch="learned", window=2
                ).close()
                from expertcache.predict.learned import resolve_directory

                meta = json.loads((resolve_directory(None, 2) / "predictor.json").read_text())
                predictor_notes["learned"] = (
                    f"the embedded model's shipped window-2 predictor; validation: {meta.get('validation')}"
                )
                return dict(prefetch="learned", window=2), "learned"
            except ExpertcacheError as exc:
                predictor_notes["learned"] = f"fell back to window (k=2): {exc}"
                log(f"learned is not available ({exc}); using window k=2")
                return dict(prefetch="window", window=2), "window"
        if pname in ("eam", "eam-seed1"):
            if trace is None:
                return dict(prefetch="eam"), pname
            held = pname == "eam"
            warm = eam_warm_trace(
                spec, trace.num_tokens, seed=routing["seed"] + (0 if held else 1), held_out=held
            )
            return dict(prefetch="eam", predictor=warm), pname
        return dict(prefetch=pname), pname

    add(run_config(path, args, trace, ref_tokens, "100%", "all-resident"), "all-resident (100%, no link)")
    budgets = {}
    for b in args.budgets:
        budget = f"{b:g}%"
        rows: dict[str, dict[str, object]] = {}
        for name, (_, chunk, pre, reo) in BASELINES.items():
            r = run_config(
                path, args, trace, ref_tokens, budget, name,
                chunking=chunk, preemption=pre, reorder=reo, **link,
            )  # fmt: skip
            rows[name] = add(r, f"{budget} {name}")
        per_predictor = {}
        for spec_name, lim in [(p, lim) for lim in args.limits for p in predictors]:
            pname, _, mode = spec_name.partition("@")
            kw, used = predictor_kwargs(pname)
            limit = lim
            if lim == "share":
                used = f"{used} limit=C/L"
            elif lim != "engine":
                used = f"{used} limit={top_k if lim == 'k' else int(lim)}"
            steps = {COMBO: ABLATION[COMBO]} if mode == "combo" else ABLATION
            prow: dict[str, dict[str, object]] = {}
            for name, (_, chunk, pre, reo) in steps.items():
                r = run_config(
                    path, args, trace, ref_tokens, budget, name, limit=limit,
                    chunking=chunk, preemption=pre, reorder=reo, **link, **kw,
                )  # fmt: skip
                r["predictor"] = used
                prow[name] = add(r, f"{budget} {used} {name}")
            per_predictor[used] = {
                "requested": pname,
                "prefetch_limit": prow[COMBO]["prefetch_limit"],
                "full_ablation": mode != "combo",
                "reductions": reductions(prow, rows["on-demand"]),
            }
        base = rows["on-demand"]
        bound = base["decode_stall_per_step_s"] / base["tpot_s"]
        budgets[budget] = {
            "baselines": {k: reductions({k: v}, base)[k] for k, v in rows.items() if k != "on-demand"},
            "predictors": per_predictor,
            "stall_share_of_on_demand_tpot": bound,
            "tpot_reduction_bound": bound,
        }
    return {
        "label": label,
        **info,
        "routing": routing,
        "expert_costs": costs,
        "reference": ref,
        "predictor_notes": predictor_notes,
        "all_tokens_match_reference": all(r["tokens_match_reference"] for r in runs),
        "analysis": budgets,
        "runs": runs,
    }


def targets(models: list[dict[str, object]]) -> list[dict[str, object]]:
    """The issue's targets for the combination (+reorder) and all four (+chunking), per predictor."""
    out = []
    for mdl in models:
        for budget, a in mdl["analysis"].items():
            for pred, p in a["predictors"].items():
                for cfg in (COMBO, "+chunking"):
                    red = p["reductions"].get(cfg)
                    if red is None:
                        continue
                    runs = [
                        r for r in mdl["runs"]
                        if r["budget"] == budget and r.get("predictor") == pred and r["config"] == cfg
                    ]  # fmt: skip
                    s, t = red["stall_reduction"], red["tpot_reduction"]
                    out.append({
                        "model": mdl["label"], "budget": budget, "predictor": pred, "config": cfg,
                        "stall_reduction": s, "tpot_reduction": t,
                        "tpot_reduction_bound": a["tpot_reduction_bound"],
                        "stall_met": s is not None and s >= 0.5, "tpot_met": t >= 0.3,
                        "tokens_match": all(r["tokens_match_reference"] for r in runs),
                    })  # fmt: skip
    return out


# ------------------------------------------------------------------------------------ main
def parse_predictors(specs: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in specs:
        model, eq, names = s.partition("=")
        if not eq or model not in ("demo", "large"):
            raise SystemExit(f"--predictors: expected demo=NAME[,NAME...] or large=..., got {s!r}")
        out[model] = [n for n in names.split(",") if n]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the demo model (default: embedded)")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "expertcache-bench")
    ap.add_argument("--models", nargs="+", default=["demo", "large"], choices=["demo", "large"])
    ap.add_argument("--budgets", type=float, nargs="+", default=[25, 50])
    ap.add_argument(
        "--predictors",
        nargs="+",
        default=DEFAULT_PREDICTORS,
        help="per model, e.g. demo=learned,next-gate large=eam,next-gate@combo (@combo: only "
        f"{COMBO}; eam-seed1: eam warm-started from another seed's trace)",
    )
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-ratio", type=float, default=3.0, help="one expert's transfer / its compute")
    ap.add_argument("--link-latency", default="5us")
    ap.add_argument(
        "--slow-tier",
        choices=["host", "disk", "mapped"],
        default="host",
        help="host (default): every expert in RAM, a transfer is one memcpy per tensor; mapped: the "
        "memory-mapped checkpoint (more Python per transfer, in the transfer thread); disk: exact reads "
        "from the file, pages dropped",
    )
    ap.add_argument(
        "--limits",
        nargs="+",
        default=["engine", "share"],
        help="prefetch limits (experts per predicted layer) to run each predictor with: engine (the "
        "engine's default, top_k), share (max(top_k, capacity // layers), the former default), k "
        "(top_k) or a number",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the transfer thread "
                    "gets the other core)")  # fmt: skip
    ap.add_argument("--wait-idle", action="store_true", help="first wait for an idle machine (load < 0.3)")
    ap.add_argument("--max-wait", type=float, default=2400, help="seconds --wait-idle waits at most")
    ap.add_argument("--quick", action="store_true", help="smoke run: small large model, few tokens")
    ap.add_argument(
        "--out", type=Path, default=None, help="default bench/results/prefetch_cpu.json (quick: /tmp)"
    )
    args = ap.parse_args()
    predictors = parse_predictors(args.predictors)
    if args.quick:
        args.new_tokens, args.warmup_tokens, args.repeats = min(args.new_tokens, 8), 2, 1
    args.large_routing = "replay"
    out_path = args.out or (
        Path(tempfile.gettempdir()) / "prefetch_cpu.quick.json"
        if args.quick
        else ROOT / "bench/results/prefetch_cpu.json"
    )
    torch.set_num_threads(args.threads)
    idle = wait_idle(args.max_wait) if args.wait_idle else None
    if idle is not None and not idle["idle"]:
        log(f"WARNING: still busy after {idle['waited_s']:.0f} s; running anyway (timings disturbed)")
    busy_start = busy_others()
    prov = provenance()  # the code as it is when the run starts
    t_start = time.perf_counter()
    models, build_s = {}, {}
    if "demo" in args.models:
        models["demo"] = args.model
    if "large" in args.models:
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        spec = LARGE_QUICK if args.quick else LARGE
        models["large"], build_s["large"] = large_model(args.cache_dir, spec, tokenizer=args.model)
    results = [bench_model(label, path, args, predictors.get(label, [])) for label, path in models.items()]
    out = {
        **prov,
        "idle_wait": idle,
        "busy_at_start": busy_start,
        "busy_at_end": busy_others(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "prompt": PROMPT,
        "new_tokens": args.new_tokens,
        "warmup_tokens": args.warmup_tokens,
        "repeats": args.repeats,
        "link_ratio": args.link_ratio,
        "link_latency": args.link_latency,
        "slow_tier": args.slow_tier,
        "method": (
            f"policy lru, slow tier = {args.slow_tier} behind an emulated serial link "
            "(latency + bytes / bandwidth = link_ratio x one expert's compute for one token); per "
            "configuration: load, one warm-up generation, then `repeats` measured generations of the "
            "same prompt (cache warm from the one before; eam's collection reset to its warm start "
            "before each); medians; TPOT = mean gap between new tokens; decode stall per step = "
            "decode_stall_s / (new tokens - 1); reductions against on-demand at the same budget; an "
            "ablation step's increment is (previous - this) / on-demand; tpot_reduction_bound = "
            "on-demand's decode stall per step / its TPOT (the TPOT cut if stall went to zero at no cost); "
            "prefetch_limit 'limit=C/L' = max(top_k, capacity // layers), set on the cache after load"
        ),
        "build_s": build_s,
        "wall_s": time.perf_counter() - t_start,
        "models": results,
    }
    out["targets"] = targets(results)
    out["all_tokens_match_reference"] = all(m["all_tokens_match_reference"] for m in results)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(out_path, out)
    log(f"wrote {out_path} ({out['wall_s']:.0f} s)")
    for t in out["targets"]:
        log(
            f"{t['model']:5s} {t['budget']:>4s} {t['predictor']:10s} {t['config']:10s} "
            f"cut: stall {(t['stall_reduction'] or 0) * 100:+6.1f}% TPOT {t['tpot_reduction'] * 100:+6.1f}% "
            f"(bound {t['tpot_reduction_bound'] * 100:.0f}%) met: stall {t['stall_met']} "
            f"tpot {t['tpot_met']} tokens {t['tokens_match']}"
        )
    if not out["all_tokens_match_reference"]:
        log("ERROR: some run's tokens differ from the reference's")
        sys.exit(1)


if __name__ == "__main__":
    main()
