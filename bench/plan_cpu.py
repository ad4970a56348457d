"""The planner measured by the engine: plans against the single settings they compared, on the CPU with an
emulated link.

For each model (the embedded one, and a generated 16-layer x 32-expert Mixtral-shaped one with random
weights, ``engine_cpu.LARGE``):

1. a training trace: for the embedded model, recorded on training prompts (the first 60 characters of
   ``--train`` standard-library files, 48 new tokens each, every expert resident); for the random-weight
   model, whose own router routes degenerately, a synthetic sticky-Zipf trace (seed 0), and the engine's
   routers then follow another draw of it (seed 1, ``engine.routing.replay_routing``) on the held-out
   prompts, as ``bench/engine_cpu.py`` does;
2. the machine is profiled (``expertcache profile``'s ``profile()``: expert and dense compute measured
   here) with the emulated link declared (one expert's transfer = ``--link-ratio`` x its compute for one
   token, as ``bench/miss_paths_cpu.py``);
3. at each budget the planner compares its layouts (shared, uniform, knapsack, fate) with the miss paths
   ``fetch`` and ``host``, and MoEpic's configuration of ``split``, and chooses one;
4. the engine runs every compared setting on held-out prompts (the embedded model's held-out files,
   ``tools.quality.heldout_texts``), ``--repeats`` fresh loads, one warm-up generation each, then each
   prompt for ``--new-tokens``; TPOT is the mean over prompts, median over repeats.

Reported per budget: each setting's measured and predicted TPOT (the prediction from the training trace,
the one the planner chose by), the chosen plan's, the best measured single setting, uniform on-demand
LRU's (``lru-dist`` uniform, fetch) and its stall share. The targets (issue: planner): the plan is never
slower than the best single setting it compared, and is at least 20 % faster than uniform on-demand LRU
where that setting's stall is at least a third of its TPOT.

    OMP_NUM_THREADS=1 PYTHONPATH=bench .venv/bin/python bench/plan_cpu.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engine_cpu import LARGE, LARGE_QUICK, emulated_link, large_model
from provenance import ROOT, provenance, write_json

from expertcache.config import CacheConfig, MissConfig, PrefetchConfig
from expertcache.costs import CostModel
from expertcache.engine import load
from expertcache.engine.offloaded import DEFAULT_MODEL
from expertcache.engine.routing import replay_routing
from expertcache.sim.planner import make_plan
from expertcache.tools.profile import profile
from expertcache.tools.quality import heldout_texts
from expertcache.trace import synthesize
from expertcache.units import parse_duration


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train_prompts(count: int) -> list[str]:
    """First 60 characters of standard-library files not among the held-out ones."""
    import sysconfig

    held = set(heldout_texts())
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.glob("*.py")):
        text = f.read_text(errors="replace")[:60]
        if len(text) == 60 and text not in held and not any(text in h for h in held):
            out.append(text)
        if len(out) == count:
            break
    return out


def record(path: Path, prompts: list[str], tokens: int):
    with load(path, "100%", device="cpu", slow_tier="host", progress=False) as m:
        for p in prompts:
            m.generate_text(p, tokens, min_new_tokens=tokens)
        return m.trace()


def run_setting(path: Path, cand: dict, link: dict, prompts: list[str], args, routing=None) -> dict:
    """The engine's TPOT for one compared setting: median over repeats of the mean over prompts."""
    policy = "lru"
    if cand["budgets"] is not None:
        policy = f"lru-dist:budgets={'/'.join(map(str, cand['budgets']))}"
    tpots, stalls = [], []
    for _ in range(args.repeats):
        with load(
            path, device="cpu", slow_tier="host", progress=False, policy=CacheConfig(policy),
            miss=MissConfig(cand["miss"]), prefetch=PrefetchConfig("none"), **link,
        ) as m:  # fmt: skip
            replay = None if routing is None else replay_routing(m, routing, wrap=True)
            m.generate_text(prompts[0], 8)  # warm-up
            per, st = [], []
            for p in prompts:
                g = m.generate_text(p, args.new_tokens, min_new_tokens=args.new_tokens)
                per.append(g.tpot_s)
                st.append(g.stats.get("decode_stall_s", 0.0) / max(1, len(g.tokens) - 1))
            tpots.append(statistics.mean(per))
            stalls.append(statistics.mean(st))
            if replay is not None:
                replay.remove()
    return {
        "tpot_s": statistics.median(tpots),
        "tpot_runs_s": tpots,
        "stall_per_token_s": statistics.median(stalls),
    }


def bench_model(label: str, path: Path, args) -> dict:
    routing = None
    if label == "demo":
        log(f"{label}: recording the training trace")
        trace = record(path, train_prompts(args.train), 48)
    else:
        cfg = json.loads((path / "config.json").read_text())
        shape = dict(
            layers=cfg["num_hidden_layers"],
            experts=cfg["num_local_experts"],
            top_k=cfg["num_experts_per_tok"],
        )
        sticky = dict(tokens=2000, a=1.0, stickiness=0.3, sequences=8, prompt_len=12, **shape)
        trace = synthesize("sticky", seed=0, **sticky)
        routing = synthesize("sticky", seed=1, **sticky)
    link_args, costs = emulated_link(path, args.link_ratio, args.link_latency)
    log(f"{label}: link {link_args}")
    declared = {
        "link_bandwidth": link_args["link_bandwidth"],
        "link_latency": parse_duration(args.link_latency),
    }
    prof = profile(path, device="cpu", slow_tier="host", declared=declared)
    cost = CostModel.from_dict(prof["cost"])
    prompts = [t[:60] for t in heldout_texts()][: args.prompts]
    L, E = trace.num_layers, trace.num_experts
    rows = []
    for share in args.budgets:
        capacity = max(trace.top_k, round(L * E * share / 100))
        plan = make_plan(trace, capacity, cost, misses=("fetch", "host", "split"))  # split: moepic
        log(f"{label} {share}%: {capacity} experts, chose {plan.describe()}")
        measured = []
        for cand in plan.candidates:
            budget_bytes = capacity * prof["model"]["expert_bytes"]
            r = run_setting(path, cand, {**link_args, "expert_memory": budget_bytes}, prompts, args, routing)
            chosen = (cand["method"], cand["miss"], cand["budgets"]) == (
                plan.method, plan.miss, None if plan.budgets is None else list(plan.budgets)
            )  # fmt: skip
            setting = {k: cand[k] for k in ("method", "miss", "budgets")}
            measured.append({**setting, "predicted_tpot_s": cand["tpot_s"], "chosen": chosen, **r})
            log(f"  {cand['method']:9} {cand['miss'][:30]:30} measured {r['tpot_s'] * 1e3:8.3f} ms, "
                f"predicted {cand['tpot_s'] * 1e3:8.3f} ms{'  <- plan' if chosen else ''}")  # fmt: skip
        plan_row = next(m for m in measured if m["chosen"])
        best = min(measured, key=lambda m: m["tpot_s"])
        base = next((m for m in measured if m["method"] == "uniform" and m["miss"] == "fetch"), None)
        rows.append({
            "share_percent": share, "capacity_experts": capacity, "plan": plan.describe(),
            "settings": measured,
            "plan_tpot_s": plan_row["tpot_s"], "best_tpot_s": best["tpot_s"],
            "best": f"{best['method']} {best['miss']}",
            "plan_vs_best": plan_row["tpot_s"] / best["tpot_s"],
            "uniform_lru_tpot_s": None if base is None else base["tpot_s"],
            "uniform_lru_stall_share": None if base is None else base["stall_per_token_s"] / base["tpot_s"],
            "speedup_vs_uniform_lru": None if base is None else base["tpot_s"] / plan_row["tpot_s"],
            "plan_prediction_error": plan_row["predicted_tpot_s"] / plan_row["tpot_s"] - 1,
        })  # fmt: skip
    return {"model": label, "path": str(path), "layers": L, "experts": E, "top_k": trace.top_k,
            "link": link_args, "profile": prof, "budgets": rows}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["demo", "large"], choices=["demo", "large"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[10, 25, 50])
    ap.add_argument("--train", type=int, default=8, help="training prompts (default 8)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts (default 4)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-ratio", type=float, default=3.0)
    ap.add_argument("--link-latency", default="20us")
    ap.add_argument("--quick", action="store_true", help="small generated model, one repeat")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "expertcache-bench")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_cpu.json")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 1
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for label in args.models:
        if label == "demo":
            path = Path(DEFAULT_MODEL)
        else:
            path, _ = large_model(
                args.cache_dir, LARGE_QUICK if args.quick else LARGE, tokenizer=Path(DEFAULT_MODEL)
            )
        results.append(bench_model(label, path, args))
    write_json(args.out, {**provenance(), "results": results})
    for r in results:
        for b in r["budgets"]:
            err = 100 * b["plan_prediction_error"]
            print(
                f"{r['model']:5} {b['share_percent']:4g}%  plan {b['plan_tpot_s'] * 1e3:8.3f} ms "
                f"({b['plan']}) | best {b['best_tpot_s'] * 1e3:8.3f} ms ({b['best']}) | plan/best "
                f"{b['plan_vs_best']:.3f} | vs uniform LRU {b['speedup_vs_uniform_lru'] or 0:.2f}x "
                f"(stall share {b['uniform_lru_stall_share'] or 0:.2f}) | prediction error {err:+.1f} %"
            )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
