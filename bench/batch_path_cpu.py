"""The miss paths' own work under a batch on a CPU: ``generate_text`` of a batch of prompts at budgets and
paths (default: ``lru``/``fetch`` and ``tlfu``/``batch`` at 75 % and 25 %, and 100 %), each step's wall
time, against the same batch at 100 %.

The embedded model, float32, greedy, the ``mapped`` slow tier (as the server runs it), no link: a miss is
a copy from the page cache, so what a path costs beyond 100 % is the engine's own work a layer (the
cache's decisions, the copies, the grouped calls). Each round runs every configuration once, after a
warm-up, in a fresh process; ``--baseline DIR`` (another checkout's root, e.g. a ``git worktree`` of an
earlier commit) runs the same configurations from that checkout's ``src/`` in a process of its own right
after each round's, so the two trees alternate under the same load. Every configuration's tokens are
checked against 100 %'s (``exact``). ``--texts held-out``: the prompts are the model's held-out texts,
distinct as a server's clients' are (the default's numbered sentences route much alike: few misses).

    OMP_NUM_THREADS=1 PYTHONPATH=bench .venv/bin/python bench/batch_path_cpu.py [--prompts 4 16] \\
        [--rounds 5] [--baseline DIR] [--link 1GB/s+20us] [--cost PROFILE.json] [--texts held-out] \\
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from provenance import ROOT, at_least, fail, provenance, results_out, write_json

SPECS = ("100%:lru:fetch", "75%:lru:fetch", "75%:tlfu:batch", "25%:lru:fetch", "25%:tlfu:batch")


def worker(
    prompts: int, tokens: int, specs: list[str], link: str, cost: str, texts: str
) -> dict[str, object]:
    """One round in this process: each configuration's seconds a step, tokens, hits and misses."""
    import torch

    import expertcache as ec
    from expertcache.tools.quality import heldout_texts

    if not Path(ec.__file__).resolve().is_relative_to(Path.cwd().resolve()):
        raise SystemExit(f"expertcache imported from {ec.__file__}, not from this checkout ({Path.cwd()})")
    torch.set_num_threads(1)
    if texts == "held-out":  # the first 60 characters of the held-out texts, as serve_load.py's clients send
        texts = [t[:60] for t in heldout_texts(prompts)]
    else:
        texts = [f"The story number {i} begins with a quiet morning and" for i in range(prompts)]
    out = {}
    for spec in specs:
        budget, policy, miss = spec.split(":")
        kw = {}
        if link:
            kw["link_bandwidth"], kw["link_latency"] = link.split("+")
        if cost and miss in ("host", "hybrid", "batch"):  # the paths that decide by costs
            kw["costs"] = cost
        with ec.load(expert_memory=budget, policy=policy, miss=miss, slow_tier="mapped", device="cpu",
                     progress=False, **kw) as m:  # fmt: skip
            m.generate_text(texts, max_new_tokens=4, batch_size=prompts)  # warm-up
            before = m.stats
            start = time.perf_counter()
            got = m.generate_text(texts, max_new_tokens=tokens, batch_size=prompts, min_new_tokens=tokens)
            wall = time.perf_counter() - start
            after = m.stats
        out[spec] = {
            "step_s": wall / tokens,
            "tokens": [g.tokens for g in got],
            "hits": after["hits"] - before["hits"],
            "misses": after["misses"] - before["misses"],
        }
    return out


def run_round(
    tree: Path, prompts: int, tokens: int, specs: list[str], link: str, cost: str, texts: str
) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(ROOT / "bench")])}
    cmd = [sys.executable, __file__, "--worker", str(prompts), str(tokens), ",".join(specs), link, cost]
    cmd.append(texts)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"batch_path_cpu: a round in {tree} failed: {tail}")
    return json.loads(done.stdout)


def main() -> int:
    if len(sys.argv) == 8 and sys.argv[1] == "--worker":
        print(json.dumps(worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), *sys.argv[5:])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=at_least(1), nargs="+", default=[4, 16], help="batch sizes")
    p.add_argument("--tokens", type=at_least(2), default=32, help="new tokens a prompt (default 32)")
    p.add_argument("--specs", default=",".join(SPECS), help="BUDGET:POLICY:MISS,... (the first: the base)")
    p.add_argument("--rounds", type=at_least(1), default=5)
    p.add_argument(
        "--link", default="", help="an emulated link, BANDWIDTH+LATENCY (as 1GB/s+20us; default none)"
    )
    p.add_argument(
        "--cost", type=Path, help="a profile (expertcache profile) for the paths that decide by costs"
    )
    p.add_argument(
        "--texts",
        choices=("story", "held-out"),
        default="story",
        help="the prompts: one sentence numbered "
        "per prompt (default; their routing much alike), or the model's held-out texts (distinct, as "
        "serve_load.py's clients send them)",
    )
    p.add_argument("--baseline", type=Path, help="another checkout's root, run alternately with this one")
    p.add_argument("--out", help="results file (default: bench/results/batch_path_cpu.json, documented run)")
    args = p.parse_args()
    specs = args.specs.split(",")
    if any(len(s.split(":")) != 3 for s in specs):
        fail(p.prog, f"--specs {args.specs}: each BUDGET:POLICY:MISS, as 25%:tlfu:batch")
    if args.link:
        from expertcache.errors import ExpertcacheError
        from expertcache.units import parse_duration, parse_rate

        try:
            bandwidth, latency = args.link.split("+")
            parse_rate(bandwidth, "--link bandwidth"), parse_duration(latency, "--link latency")
        except ValueError:
            fail(p.prog, f"--link {args.link}: BANDWIDTH+LATENCY, as 1GB/s+20us")
        except ExpertcacheError as exc:
            fail(p.prog, f"--link {args.link}: {exc}")
    if args.cost is not None and not args.cost.is_file():
        fail(p.prog, f"--cost {args.cost}: no such file")
    if args.baseline is not None and not (args.baseline / "src" / "expertcache").is_dir():
        fail(p.prog, f"--baseline {args.baseline}: not a checkout of expertcache (no src/expertcache)")
    args.out = str(results_out(p, args, "batch_path_cpu.json", at_least=("rounds",), modes=("baseline",)))
    cost = str(args.cost.resolve()) if args.cost else ""
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    rows = []
    for n in args.prompts:
        runs = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(run_round(tree, n, args.tokens, specs, args.link, cost, args.texts))
                print(f"{n} prompts, round {r + 1}, {name}: done", file=sys.stderr, flush=True)
        for name, got in runs.items():
            base = specs[0]
            for spec in specs:
                steps = [g[spec]["step_s"] for g in got]
                ratios = [g[spec]["step_s"] / g[base]["step_s"] for g in got]
                exact = all(g[spec]["tokens"] == g[base]["tokens"] for g in got)
                rows.append({
                    "tree": name, "prompts": n, "spec": spec,
                    "step_ms": 1e3 * statistics.median(steps),
                    "step_ms_range": [1e3 * min(steps), 1e3 * max(steps)],
                    "vs_base": statistics.median(ratios), "vs_base_range": [min(ratios), max(ratios)],
                    "hits": got[0][spec]["hits"], "misses": got[0][spec]["misses"], "exact": exact,
                })  # fmt: skip
                r_ = rows[-1]
                print(f"{name:8s} {n:2d} prompts {spec:16s} {r_['step_ms']:6.2f} ms a step "
                      f"[{r_['step_ms_range'][0]:.2f}-{r_['step_ms_range'][1]:.2f}]  x{r_['vs_base']:.2f} "
                      f"[{r_['vs_base_range'][0]:.2f}-{r_['vs_base_range'][1]:.2f}]  hits {r_['hits']} "
                      f"misses {r_['misses']}  exact {exact}")  # fmt: skip
    baseline = None
    if args.baseline is not None:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.baseline, capture_output=True, text=True)
        baseline = head.stdout.strip() or None
    result = {"provenance": provenance(), "baseline_commit": baseline, "tokens": args.tokens,
              "rounds": args.rounds, "link": args.link or None, "texts": args.texts,
              "rows": rows}  # fmt: skip
    write_json(Path(args.out), result)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
