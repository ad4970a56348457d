"""doctor's budget ladder against the server it advises (issue 31, part 4).

``expertcache doctor`` on a batched trace times a ladder of budgets (12.5, 25, 50, 75 % of the experts and
the one given), each under the better of the paths it may use, against every expert resident, and names
the smallest budget whose request TPOT is within ``--within`` of all resident. This bench checks those
figures against the server they advise, on this machine, with an emulated link standing for a slow one:

1. ``expertcache profile --device cpu --slow-tier mapped --fit-overheads``: this machine's costs for the
   model, with the engine's own work a transfer (``submit_s``) and a host-computed expert
   (``host_submit_s``) fitted on runs; and the same profile without those two (``plain``).
2. A server at 100 % records its routing (``--record-trace``) under the load: ``--clients`` streaming
   clients, lengths drawn in ``--tokens``, for ``--record`` seconds (``serve_load.py``'s clients).
3. ``expertcache doctor --trace THAT --cost PROFILE --link-bandwidth B --link-latency L --json``, for each
   of the two profiles: the ladder (a row per budget: its policy and miss path, the predicted request
   TPOT, and that against all resident).
4. For each rung of either ladder (the two may choose different paths), a server at its budget, policy
   and miss path with the same emulated link (``serve --link-bandwidth B --link-latency L``), ``--warm``
   seconds of uncounted load, then the same load for ``--duration`` seconds: each request's TPOT (the
   mean gap between its chunks after the first), their mean over requests (what the ladder predicts),
   tokens a second and hits. The rungs alternate in order every other round of ``--rounds``.
5. The summary, per profile: each rung's measured TPOT against the 100 % server's (a ratio, and a
   difference, paired within a round; median and range over rounds) beside the ladder's prediction, and
   whether the budget the doctor names is within ``--within`` of all resident as served; and the default
   path (``lru``, ``fetch``) at each budget, served and predicted (``timing``), beside the ladder's choice
   (``--no-fetch`` leaves it out).

    PYTHONPATH=bench .venv/bin/python bench/ladder_served.py [--clients 4] [--link-bandwidth 1GB/s] \\
        [--rounds 2] [--out bench/results/ladder_served.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import at_least, fail, provenance, results_out, write_json
from serve_load import _prompts, free_port, phase, server_command, start_server, stop_server, token_range

from expertcache.errors import ExpertcacheError, command_line
from expertcache.sim.doctor import within_factor
from expertcache.units import parse_duration, parse_rate

COST_BASED = ("host", "hybrid", "batch")  # miss paths that decide by costs (take --cost)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "expertcache.cli", *args]


def run(cmd: list[str]) -> str:
    """A command of the CLI; its stdout. A failure ends the bench with its last line."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        fail("ladder_served.py", f"{' '.join(cmd[3:])} failed (exit {out.returncode}): {last}")
    return out.stdout


def server(args, port: int, cost: Path | None, memory: str, policy: str | None, miss: str | None,
           record: Path | None = None):  # fmt: skip
    """serve_load.py's server at ``memory:policy:miss``, on the mapped tier, with the emulated link."""
    on = argparse.Namespace(slow_tier="mapped", device="cpu", clients=[args.clients], model=args.model,
                            dtype=args.dtype, policy=None, miss=None, schedule=None, attention=None,
                            kernel=None)  # fmt: skip
    cmd = server_command(on, port, ":".join([memory, policy or "", miss or ""]).rstrip(":"))
    cmd += ["--link-bandwidth", args.link_bandwidth, "--link-latency", args.link_latency]
    if cost is not None:  # a cost-based path decides by the profile its ladder was timed with
        cmd += ["--cost", str(cost)]
    if record is not None:
        cmd += ["--record-trace", str(record)]
    return cmd


async def load(args, base: str, prompts: list[str], seconds: float) -> dict:
    if args.warm > 0:  # the cache settles; not counted
        await phase(base, args.clients, args.warm, prompts, args.tokens)
    return await phase(base, args.clients, seconds, prompts, args.tokens)


def served(
    args, cost, memory: str, policy: str | None, miss: str | None, prompts, record: Path | None = None
):
    port = free_port()
    cmd = server(args, port, cost, memory, policy, miss, record)
    proc = start_server(cmd, port)
    try:
        got = asyncio.run(
            load(args, f"http://127.0.0.1:{port}", prompts, args.record if record else args.duration)
        )
    finally:
        stop_server(proc)
    got["server_command"] = " ".join(cmd[3:]).replace(f"--port {port} ", "")
    return got


def share_text(share: float) -> str:
    return f"{share * 100:g}%"


def spread(values: list[float]) -> dict[str, float | None]:
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(got), "min": min(got), "max": max(got)}


def main() -> int:
    p = argparse.ArgumentParser(prog="ladder_served.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint folder (default: the embedded model)")
    p.add_argument("--dtype", help="the server's --dtype (default: the checkpoint's)")
    p.add_argument("--clients", type=at_least(1), default=4, help="concurrent streaming clients (default 4)")
    p.add_argument("--tokens", default="16-48", help="max_tokens of a request, N or A-B (default 16-48)")
    p.add_argument("--link-bandwidth", default="1GB/s", help="the emulated link's (default 1GB/s)")
    p.add_argument("--link-latency", default="20us", help="the emulated link's, per transfer (default 20us)")
    p.add_argument("--within", default="1.25", help="doctor's --within (default 1.25)")
    p.add_argument("--record", type=at_least(1.0, float), default=30.0, help="seconds recorded (default 30)")
    p.add_argument("--warm", type=at_least(0.0, float), default=5.0, help="uncounted seconds a server (5)")
    p.add_argument("--duration", type=at_least(1.0, float), default=30.0, help="counted seconds (30)")
    p.add_argument("--rounds", type=at_least(1), default=2, help="rounds over the rungs (default 2)")
    p.add_argument("--no-fetch", dest="fetch", action="store_false", help="leave out lru/fetch, the default "
                   "path, served and predicted at each budget beside the ladder's choice")  # fmt: skip
    p.add_argument(
        "--keep",
        metavar="DIR",
        help="keep the profile and the served trace in DIR (default: removed at the end)",
    )
    p.add_argument("--out", help="results JSON (default bench/results/ladder_served.json for the "
                   "documented run, else the temporary folder)")  # fmt: skip
    args = p.parse_args()
    tokens = token_range(args.tokens)
    if tokens is None:
        fail(p.prog, f"--tokens {args.tokens!r}: max_tokens, at least 1, or a range A-B with 1 <= A <= B")
    try:  # every value checked before the minutes of work, named by its flag
        with command_line():
            parse_rate(args.link_bandwidth, "--link-bandwidth")
            parse_duration(args.link_latency, "--link-latency")
            within = within_factor(args.within)
    except ExpertcacheError as exc:
        fail(p.prog, str(exc))
    out = results_out(p, args, "ladder_served.json")
    args.tokens = tokens
    prompts = _prompts()
    if args.keep and not Path(args.keep).is_dir():
        fail(p.prog, f"--keep {args.keep}: not a folder")
    work = Path(tempfile.mkdtemp(prefix="ladder_served_", dir=args.keep))
    model = ["--model", args.model] if args.model else []
    dtype = ["--dtype", args.dtype] if args.dtype else []
    link = ["--link-bandwidth", args.link_bandwidth, "--link-latency", args.link_latency]

    print("profiling the model on this machine (--fit-overheads)", file=sys.stderr, flush=True)
    fitted = work / "profile_fitted.json"
    run(cli("profile", "--device", "cpu", "--slow-tier", "mapped", "--fit-overheads", "-o", str(fitted),
            *model, *dtype))  # fmt: skip
    profiles = {"plain": work / "profile_plain.json", "fitted": fitted}
    data = json.loads(fitted.read_text())  # the same measurements without the engine's fitted overheads
    plain = {**data, "cost": {**data["cost"], "submit_s": 0.0, "host_submit_s": 0.0},
             "measured": [f for f in data["measured"] if f not in ("submit_s", "host_submit_s")],
             "how": {**data["how"], "fit": None}}  # fmt: skip
    profiles["plain"].write_text(json.dumps(plain))
    print(f"recording {args.record:g} s of {args.clients} clients at 100 %", file=sys.stderr, flush=True)
    trace = work / "served.npz"
    recorded = served(args, None, "100%", None, None, prompts, record=trace)
    if not trace.exists():
        fail(p.prog, f"the server recorded no trace at {trace}")
    ladders, commands = {}, {}
    for name, profile in profiles.items():
        cmd = cli(
            "doctor", "--trace", str(trace), "--cost", str(profile), *link, "--within", args.within, "--json"
        )
        commands[name] = " ".join(cmd[3:]).replace(str(work), "WORK")
        ladders[name] = json.loads(run(cmd))["budgets"]
        print(
            f"the {name} profile's ladder: {json.dumps(ladders[name]['rows'])}", file=sys.stderr, flush=True
        )

    def config(name: str, row) -> tuple[str | None, str, str | None, str | None]:
        """A server of a rung: a cost-based path with its ladder's profile (--cost), any other alike."""
        costed = (row["miss"] or "fetch").split(":")[0] in COST_BASED
        return name if costed else None, share_text(row["share"]), row["policy"], row["miss"]

    def label(c) -> str:
        return " ".join(x for x in c[1:] if x) + (f" (--cost {c[0]} profile)" if c[0] else "")

    configs = list(dict.fromkeys(config(n, r) for n, ladder in ladders.items() for r in ladder["rows"]))
    shares = [share_text(r["share"]) for r in ladders["plain"]["rows"] if r["share"] < 1]
    if args.fetch:  # the default path beside the ladder's choice, at each budget: served and predicted
        configs += [(None, share, "lru", "fetch") for share in shares]
    predicted_fetch: dict[str, dict[str, float]] = {name: {} for name in profiles}
    for name, profile in profiles.items():
        for share in shares if args.fetch else ():
            # the step time the doctor's ladder takes from the trace's clock
            cmd = cli("timing", "--trace", str(trace), "--cost", str(profile), *link, "--expert-memory",
                      share, "--policy", "lru", "--miss", "fetch", "--step-time", "recorded",
                      "--json")  # fmt: skip
            got = json.loads(run(cmd))
            predicted_fetch[name][share] = (got["tpot_requests"] or {}).get("mean_s") or got["tpot_s"]
    runs: dict[str, list[dict]] = {label(c): [] for c in configs}
    for r in range(args.rounds):
        for c in configs if r % 2 == 0 else configs[::-1]:
            print(f"round {r + 1}/{args.rounds}: {label(c)}", file=sys.stderr, flush=True)
            got = served(args, profiles[c[0]] if c[0] else None, *c[1:], prompts)
            runs[label(c)].append(got)
            print(f"  tpot mean {got['tpot_mean_s']}, {got['tokens_per_s']:.1f} tok/s, "
                  f"hits {got['hit_ratio']}", file=sys.stderr, flush=True)  # fmt: skip
    full = label((None, "100%", None, None))
    summary: dict[str, object] = {}
    for name, ladder in ladders.items():
        rows = []
        for row in ladder["rows"]:
            mine = runs[label(config(name, row))]
            measured = [a["tpot_mean_s"] / b["tpot_mean_s"] for a, b in zip(mine, runs[full], strict=True)]
            extra = [a["tpot_mean_s"] - b["tpot_mean_s"] for a, b in zip(mine, runs[full], strict=True)]
            rows.append({
                "budget": share_text(row["share"]), "capacity": row["capacity"], "policy": row["policy"],
                "miss": row["miss"], "predicted_tpot_s": row["tpot_s"],
                "predicted_vs_resident": row["vs_resident"],
                "predicted_extra_s": row["tpot_s"] - ladder["rows"][-1]["tpot_s"],
                "served_tpot_s": spread([x["tpot_mean_s"] for x in mine]),
                "served_vs_resident": spread(measured), "served_extra_s": spread(extra),
                "served_tokens_per_s": spread([x["tokens_per_s"] for x in mine]),
                "served_hit_ratio": spread([x["hit_ratio"] for x in mine]),
                "requests": [x["completed"] for x in mine], "errors": sum(x["errors"] for x in mine),
            })  # fmt: skip
        enough = ladder["enough"]
        verdict = None
        if enough is not None:
            got = next(x for x in rows if x["budget"] == share_text(enough["share"]))["served_vs_resident"][
                "median"
            ]
            verdict = {"budget": share_text(enough["share"]), "served_vs_resident": got,
                       "within": got is not None and got <= within}  # fmt: skip
        fetch = []
        for share in shares if args.fetch else ():
            mine = runs[label((None, share, "lru", "fetch"))]
            resident = ladder["rows"][-1]["tpot_s"]
            fetch.append({
                "budget": share, "policy": "lru", "miss": "fetch",
                "predicted_tpot_s": predicted_fetch[name][share],
                "predicted_vs_resident": predicted_fetch[name][share] / resident,
                "served_tpot_s": spread([x["tpot_mean_s"] for x in mine]),
                "served_vs_resident": spread(
                    [a["tpot_mean_s"] / b["tpot_mean_s"] for a, b in zip(mine, runs[full], strict=True)]),
                "served_hit_ratio": spread([x["hit_ratio"] for x in mine]),
            })  # fmt: skip
        summary[name] = {"doctor_command": commands[name], "rows": rows, "doctor_names": verdict,
                         "lru_fetch": fetch}  # fmt: skip
    fit = data["how"]["fit"]
    result = {
        "provenance": provenance(), "clients": args.clients, "tokens": args.tokens,
        "link": {"bandwidth": args.link_bandwidth, "latency": args.link_latency},
        "recorded": {k: recorded[k] for k in ("requests", "tokens", "tokens_per_s", "tpot_mean_s")},
        "fitted": {"submit_s": fit["submit_s"], "host_submit_s": fit["host_submit_s"]} if fit else None,
        "profile": data, "ladders": ladders, "summary": summary, "rounds": runs,
    }  # fmt: skip
    write_json(out, result)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    if args.keep:
        print(f"kept the profile and the served trace in {work}", file=sys.stderr)
    else:
        for f in work.iterdir():
            f.unlink()
        os.rmdir(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
