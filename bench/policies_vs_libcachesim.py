"""Every online eviction policy of expertcache against every policy of libCacheSim and OPT, on real routing.

Per trace, order (flat and layer) and capacity (10/25/50/75 % of all experts): the misses of each of our
online policies (the registry's, without the -dist forms), of each libCacheSim policy (fed the same
requests in the same order as objects of size 1: exact for flat order; in layer order libCacheSim sees
the groups one request after another and pins nothing, which only helps it), and OPT's. Ratios are to
OPT's misses (our OPT, which in layer order keeps a group resident together).

``reuse`` (learned reuse prediction) runs three ways, so train and test figures stay apart:
- ``reuse``: the shipped weights, trained on the embedded model's trace only. On the Qwen trace this is
  a held-out (leave-one-trace-out) figure; on the embedded trace it is a training figure.
- ``reuse@self``: weights trained on the whole trace it then runs on (a training figure).
- leave-one-request-out folds on the Qwen trace (6 requests): for each request, weights trained on the
  other five, then every policy replays that request alone (cache empty at its start); the folds'
  misses are summed per policy and compared with OPT's sum. ``reuse@fold`` is the held-out figure.

Then the engine: the embedded model, ``--expert-memory 25%``, the emulated link (``--link-bandwidth``,
``--link-latency``), LRU against the best of ours on the embedded trace (flat order), the same prompts,
tokens compared (they must be equal: eviction never changes outputs), median TPOT over prompts and
repeats. And each policy's replay time: the Python reference, and what the simulator runs (compiled
where a kernel exists and pays).

The options (the link's rate and latency as the engine reads them), the engine's command and libCacheSim
are checked before any work, a bad one refused in one line (exit 2).

    PYTHONPATH=bench .venv/bin/python bench/policies_vs_libcachesim.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from provenance import SHARED, OneLineParser, at_least, fail, provenance, results_out, write_json
from sim_vs_libcachesim import write_oracle_general

from expertcache.cache.schedule import build_schedule
from expertcache.config import LinkConfig
from expertcache.errors import ExpertcacheError
from expertcache.policy import POLICIES
from expertcache.policy.registry import policy_class
from expertcache.sim.curves import run_policy
from expertcache.sim.replay import replay
from expertcache.tools.train_policy import train_policy, write_weights
from expertcache.trace import Trace, load_trace
from expertcache.trace.default import default_trace
from expertcache.units import parse_duration, parse_rate

QWEN = SHARED / "traces" / "qwen15_moe_a27b_chat.npz"
SHARES = (0.10, 0.25, 0.50, 0.75)
ORDERS = ("flat", "layer")
LCS = ["ARC", "Cacheus", "Clock", "Clock2QPlus", "ClockPro", "FIFO", "GDSF", "GLCache",
       "Hyperbolic", "LFU", "LHD", "LIRS", "LRB", "LRU", "LRUProb", "LeCaR", "MQ", "Random",
       "S3FIFO", "SLRU", "Sieve", "ThreeLCache", "TwoQ", "WTinyLFU"]  # fmt: skip
# Left out: FlashProb, a two-tier (RAM + flash) cache that aborts the process below a few objects, and
# LFUDA, which in libcachesim 0.3.5 never returns on the embedded trace at 25-75 % (killed after 30 s).
OURS = [n for n in POLICIES if not n.endswith("-dist") and not policy_class(n).offline
        and not policy_class(n).needs_profile]  # fmt: skip
PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:", "for i in range(10):", "def parse(text):\n    "]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


LCS_SCRIPT = """
import json, sys, libcachesim as lcs
name, path, caps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {}
for cap in caps:
    reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
    try:
        out[cap] = getattr(lcs, name)(cap).process_trace(reader)[0]
    except Exception:  # a capacity the policy cannot take (S3FIFO's small queue below one object)
        pass
print(json.dumps(out))
"""


def lcs_misses(keys: np.ndarray, capacities: list[int], tmp: Path) -> dict[str, dict[int, int]]:
    """libCacheSim's misses per policy and capacity on these requests. Each policy runs in a process of
    its own: after some policies (GLCache's training threads), another one in the same process can hang."""
    path = tmp / "requests.oracleGeneral"
    write_oracle_general(keys.astype(np.int64), path)
    out: dict[str, dict[int, int]] = {}
    for name in LCS:
        ratios = _lcs_run(name, path, capacities)
        if ratios is None:  # one capacity may abort or hang the process: each on its own
            parts = [_lcs_run(name, path, [c]) for c in capacities]
            ratios = {k: v for part in parts if part for k, v in part.items()}
        out[name] = {c: round(ratios[str(c)] * len(keys)) for c in capacities if str(c) in ratios}
        if len(out[name]) < len(capacities):
            gone = sorted(set(capacities) - set(out[name]))
            log(f"libCacheSim {name}: no result at capacities {gone} of {len(keys)} requests (error or hang)")
    return out


def _lcs_run(name: str, path: Path, capacities: list[int]) -> dict[str, float] | None:
    cmd = [sys.executable, "-c", LCS_SCRIPT, name, str(path), json.dumps(capacities)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def sub_trace(tr: Trace, rows: np.ndarray) -> Trace:
    pick = {
        f: getattr(tr, f)[rows] for f in ("weights", "seq_id", "is_prefill") if getattr(tr, f) is not None
    }
    return Trace(experts=tr.experts[rows], num_experts=tr.num_experts, **pick)


def misses_table(tr: Trace, order: str, caps: list[int], weights: dict[str, Path], tmp: Path) -> dict:
    """{policy: {capacity: misses}} for ours (and reuse with each weights file), libCacheSim's, OPT."""
    s = build_schedule(tr, order)
    opt = run_policy(s, "opt", caps)
    rows: dict[str, dict[int, int]] = {"opt": {c: r.misses for c, r in zip(caps, opt, strict=True)}}
    for name in OURS:
        rows[name] = {c: replay(s, name, c).misses for c in caps}
    for label, path in weights.items():
        rows[label] = {c: replay(s, "reuse", c, weights=str(path)).misses for c in caps}
    rows.update({f"lcs:{k}": v for k, v in lcs_misses(s.req_key, caps, tmp).items()})
    return rows


def summarize(rows: dict[str, dict[int, int]], caps: list[int], held_out: str) -> list[dict]:
    out = []
    for share, c in zip(SHARES, caps, strict=True):
        opt = rows["opt"][c]
        ours = {k: v[c] / opt for k, v in rows.items() if not k.startswith("lcs:") and k != "opt"}
        theirs = {k[4:]: v[c] / opt for k, v in rows.items() if k.startswith("lcs:") and c in v}
        online = {k: v for k, v in ours.items() if "@self" not in k}  # a training figure is not a result
        best, lbest = min(online, key=online.get), min(theirs, key=theirs.get)
        out.append({
            "share": share, "capacity": c, "opt_misses": opt,
            "best_ours": best, "best_ours_ratio": online[best],
            "best_libcachesim": lbest, "best_libcachesim_ratio": theirs[lbest],
            "held_out": held_out, "held_out_ratio": ours[held_out], "lru_ratio": ours["lru"],
            "beats_libcachesim": online[best] < theirs[lbest], "ours": ours, "libcachesim": theirs,
        })  # fmt: skip
    return out


def evaluate(name: str, tr: Trace, tmp: Path, quick: bool) -> dict:
    K = tr.num_layers * tr.num_experts
    caps = [max(1, int(K * s)) for s in SHARES]
    result: dict[str, object] = {"trace": name, "tokens": tr.num_tokens, "keys": K}
    self_w = tmp / f"{name}-self.json"
    write_weights(train_policy([tr], [name]), self_w)
    for order in ORDERS:
        t0 = time.perf_counter()
        rows = misses_table(tr, order, caps, {"reuse@self": self_w}, tmp)
        result[f"whole_{order}"] = summarize(rows, caps, "reuse")
        log(f"{name} {order}: whole trace in {time.perf_counter() - t0:.0f} s")
    seqs = np.unique(tr.seq_id) if tr.seq_id is not None else np.zeros(0)
    if len(seqs) >= 2 and name == "qwen" and not quick:  # the real trace: train and test stay apart
        folds = {order: {} for order in ORDERS}
        for s in seqs.tolist():
            test, train = np.flatnonzero(tr.seq_id == s), np.flatnonzero(tr.seq_id != s)
            w = tmp / f"{name}-fold{s}.json"
            write_weights(train_policy([sub_trace(tr, train)], [f"{name} without request {s}"]), w)
            for order in ORDERS:
                rows = misses_table(sub_trace(tr, test), order, caps, {"reuse@fold": w}, tmp)
                for k, v in rows.items():
                    acc = folds[order].setdefault(k, dict.fromkeys(caps, 0))
                    for c in list(acc):  # a capacity a policy refused on one fold leaves the sum
                        if c in v:
                            acc[c] += v[c]
                        else:
                            del acc[c]
            log(f"{name}: fold {s} done")
        for order in ORDERS:
            result[f"folds_{order}"] = summarize(folds[order], caps, "reuse@fold")
    return result


def engine_exe() -> Path:
    """The command line the engine runs through (this interpreter's ``expertcache``)."""
    return Path(sys.executable).parent / "expertcache"


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the engine run and libCacheSim need, checked before the minutes of evaluation they come after:
    the link as the engine reads it (``generate``'s ``LinkConfig``), the engine's command, libCacheSim."""
    try:
        parse_rate(args.link_bandwidth, "--link-bandwidth")
        parse_duration(args.link_latency, "--link-latency")
        LinkConfig(args.link_bandwidth, args.link_latency)  # and a rate too slow to be the one meant
    except ExpertcacheError as exc:
        fail(ap.prog, str(exc))
    if not args.quick and not engine_exe().is_file():
        fail(ap.prog, f"{engine_exe()} not found: the engine run needs expertcache installed (or --quick)")
    if importlib.util.find_spec("libcachesim") is None:
        fail(ap.prog, "libcachesim is not installed in this environment (the comparison runs its policies)")


def engine_tpot(policies: list[str], repeats: int, bandwidth: str, latency: str, tmp: Path) -> dict:
    """Median TPOT per policy on the embedded model at 25 % with the emulated link; tokens must agree."""
    exe = str(engine_exe())
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(p.replace("\n", "\\n") for p in PROMPTS) + "\n")
    out: dict[str, object] = {}
    tokens: dict[str, list] = {}
    for policy in policies:
        tpots, misses = [], []
        for _ in range(repeats):
            cmd = [exe, "generate", "--prompts", str(prompts), "--batch-size", "1", "--max-new-tokens", "32",
                   "--expert-memory", "25%", "--policy", policy, "--link-bandwidth", bandwidth,
                   "--link-latency", latency, "--device", "cpu", "--slow-tier", "mapped",
                   "--quiet"]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
            tpots += [r["tpot_s"] for r in runs]
            misses.append(sum(r["misses"] for r in runs))
            tokens.setdefault(policy, [r["tokens"] for r in runs])
        out[policy] = {"tpot_s": statistics.median(tpots), "misses": statistics.median(misses)}
        log(f"engine {policy}: TPOT {out[policy]['tpot_s'] * 1e3:.2f} ms, misses {out[policy]['misses']}")
    first = next(iter(tokens.values()))
    out["tokens_equal"] = all(t == first for t in tokens.values())
    out["link"] = {"bandwidth": bandwidth, "latency": latency, "expert_memory": "25%"}
    return out


def replay_cost(tr: Trace) -> dict[str, dict[str, float]]:
    """Seconds per policy (flat order, 25 %), best of 3: ``python``, the reference replay through the
    policy object; ``simulator``, what ``expertcache sim`` runs (``run_policy``: compiled where the
    policy has a kernel and it pays, after one untimed run that loads it)."""
    s = build_schedule(tr, "flat")
    s.groups, s.group_scores, s.req_score  # noqa: B018 (built once, outside the timing)
    cap = tr.num_layers * tr.num_experts // 4
    out: dict[str, dict[str, float]] = {}
    for name in OURS:
        out[name] = {}
        paths = {
            "python": lambda n=name: replay(s, n, cap),
            "simulator": lambda n=name: run_policy(s, n, [cap]),
        }
        for path, run in paths.items():
            run()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            out[name][path] = min(times)
    return out


def main() -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="no folds, no engine run")
    ap.add_argument("--repeats", type=at_least(1), default=3, help="engine runs per policy (default 3)")
    ap.add_argument("--link-bandwidth", default="2GB/s")
    ap.add_argument("--link-latency", default="50us")
    ap.add_argument(
        "--out",
        type=Path,
        help="default bench/results/policies_vs_libcachesim.json (other runs: the temp dir)",
    )
    args = ap.parse_args()
    check_args(ap, args)
    args.out = results_out(ap, args, "policies_vs_libcachesim.json", at_least=("repeats",))
    traces = {"embedded": default_trace()}
    if QWEN.is_file():
        traces["qwen"] = load_trace(QWEN)
    else:
        log(f"{QWEN} not found: the Qwen rows are left out")
    with tempfile.TemporaryDirectory() as tmp:
        results = [evaluate(name, tr, Path(tmp), args.quick) for name, tr in traces.items()]
        costs = {name: replay_cost(tr) for name, tr in traces.items()}
        engine = None
        if not args.quick:
            emb = next(r for r in results if r["trace"] == "embedded")
            best = next(row["best_ours"] for row in emb["whole_flat"] if row["share"] == 0.25)
            engine = engine_tpot(list(dict.fromkeys(["lru", best, "reuse"])), args.repeats,
                                 args.link_bandwidth, args.link_latency, Path(tmp))  # fmt: skip
    for r in results:
        for part in [k for k in r if k.startswith(("whole_", "folds_"))]:
            print(f"\n{r['trace']} {part.replace('_', ' ')}")
            # reuse was trained on the embedded trace itself: a training figure there, held out elsewhere
            reuse = "held-out reuse" if r["trace"] != "embedded" else "reuse (trained)"
            print(f"{'share':>6} {'best ours':>22} {'best libCacheSim':>24} {reuse:>16} {'lru':>7}")
            for row in r[part]:
                print(f"{row['share']:>6.0%} {row['best_ours']:>14} {row['best_ours_ratio']:6.3f}x "
                      f"{row['best_libcachesim']:>16} {row['best_libcachesim_ratio']:6.3f}x "
                      f"{row['held_out_ratio']:15.3f}x {row['lru_ratio']:6.3f}x")  # fmt: skip
    for name, c in costs.items():
        for path in ("python", "simulator"):
            line = ", ".join(f"{k} {v[path]:.3f}" for k, v in c.items())
            print(f"\nreplay seconds ({name}, flat, 25 %, {path}): {line}")
    if engine:
        runs = {k: v for k, v in engine.items() if isinstance(v, dict) and "tpot_s" in v}
        tpot = ", ".join(f"{k} TPOT {v['tpot_s'] * 1e3:.2f} ms" for k, v in runs.items())
        link = f"{args.link_bandwidth}, {args.link_latency}"
        print(f"\nengine (embedded model, 25 %, {link}): {tpot}; tokens equal: {engine['tokens_equal']}")
    write_json(args.out, {**provenance(), "traces": results, "replay_seconds": costs, "engine": engine})
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if engine is None or engine["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
