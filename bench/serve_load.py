"""Load test of ``expertcache serve`` on loopback: many concurrent streaming clients against one at a time.

Starts a server (the embedded model, ``--expert-memory``, CPU; ``--device cuda``: a GPU, its slow tier
pinned host memory; ``--schedule``: its step scheduling) in a subprocess; then an async httpx driver
runs ``--clients`` streaming clients that each send completions back to back for ``--duration`` seconds
(prompts: the first 60 characters of held-out standard-library files, ``max_tokens`` 32, or each drawn
from ``--tokens A-B`` so that the clients do not end together; greedy), and afterwards one client alone
for ``--single`` seconds. Per request: TTFT (send to first text chunk; its p99 also without each
client's first request, the phase's opening wave), TPOT (mean gap between chunks after the first) and
completion tokens from ``usage``; errors and unfinished streams are counted. The server's resident
memory is sampled every second, and its expert
cache's hits and misses are read from ``/metrics`` before and after each phase.

``--faults`` mixes in hostile clients (issue 27): a ``--bad-share`` of the clients (default 10 %) send,
back to back, one of the requests that used to kill or freeze the server (temperatures of 1e-300 and
1e-45, ``top_k`` beyond the vocabulary up to 2**63, a lone surrogate, a 10 MB prompt, an unknown field, a
foreign Host header, malformed JSON, a stop string of 100 000 characters), each checked for its expected
status; a ``--leave-share`` (default 30 %) stream and hang up after a few chunks. Only the others, the
good clients, count in the latency figures, and every one of their requests must succeed. ``--slowloris
N`` then holds N connections that trickle header bytes (reconnecting when the server closes them) while
one client sends short requests, whose latencies are reported; the server's health is checked at the end.

``--compare CONFIG,...`` (issue "many users, one expert cache") starts one server per config in turn
(an expert memory, or ``MEMORY:POLICY[:MISS]``; ``--model``, ``--dtype``, ``--policy``, ``--miss`` for
all), the order reversed every other round of ``--rounds``; each server gets ``--warm`` seconds of
uncounted load, then each ``--clients`` count (a comma list) for ``--duration`` seconds, then one client
for ``--single`` seconds. The summary gives medians and ranges over rounds, each config's throughput and
TTFT p99 against the last config's in the same round, and each load's TTFT p99 against one client's on
the same server.

    OMP_NUM_THREADS=1 PYTHONPATH=bench .venv/bin/python bench/serve_load.py [--clients 64] [--duration 600]
    OMP_NUM_THREADS=1 PYTHONPATH=bench .venv/bin/python bench/serve_load.py --compare 25%:tlfu:batch,100% \
        --clients 16,64 --duration 60 --single 30 [--model DIR --dtype float32] --out FILE.json
    OMP_NUM_THREADS=1 PYTHONPATH=bench .venv/bin/python bench/serve_load.py --faults --slowloris 2000 \
        --single 0 --out bench/results/serve_faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil  # accelerate's dependency

try:
    import httpx
except ImportError:  # openai >= 3 brings httpx as httpx2
    import httpx2 as httpx
from provenance import provenance, write_json

from expertcache.config import SCHEDULES
from expertcache.tools.quality import heldout_texts


def _prompts(count: int = 32, chars: int = 60) -> list[str]:
    """The first characters of the embedded model's held-out texts (16, stored with it)."""
    return [t[:chars] for t in heldout_texts(count)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_counts(base: str) -> dict[str, float]:
    """The server's expert-cache hits and misses, and its TTFT histogram (``ttft<=LE``: requests whose
    first token came within LE seconds of their submission to the batch, as the server measures it)."""
    text = httpx.get(f"{base}/metrics").text
    out = {}
    for line in text.splitlines():
        for name in ("hits", "misses"):
            if line.startswith(f"expertcache_cache_{name}_total "):
                out[name] = float(line.split()[1])
        if line.startswith("expertcache_ttft_seconds_bucket{"):
            out["ttft<=" + line.split('le="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def server_ttft(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """The server's own TTFT quantiles over a phase (from submission to the batch to the first token,
    without HTTP or the client): the upper bound of the histogram bucket that holds each."""
    keys = [k for k in after if k.startswith("ttft<=")]
    counts = {k.removeprefix("ttft<="): after[k] - before.get(k, 0.0) for k in keys}
    total = counts.get("+Inf", 0.0)
    out = {}
    for q in (0.5, 0.99):
        les = [float(le) for le, n in counts.items() if le != "+Inf" and total and n >= q * total]
        out[f"server_ttft_p{round(q * 100)}_le_s"] = min(les) if les else None
    return out


async def one_request(client: httpx.AsyncClient, base: str, prompt: str, tokens: int) -> dict[str, object]:
    body = {"model": "embedded", "prompt": prompt, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, times, usage, done = time.perf_counter(), [], None, False
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    if done and usage is not None and not times and usage.get("completion_tokens"):
        # every token decoded to nothing: a random model whose vocabulary outgrows its tokenizer's
        return {"error": f"no text in {usage['completion_tokens']} tokens"}
    if not done or usage is None or not times:
        return {"error": "stream ended early"}
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"ttft_s": times[0] - start, "tpot_s": statistics.mean(gaps) if gaps else None,
            "tokens": usage["completion_tokens"], "end_s": times[-1] - start}  # fmt: skip


# the requests that used to kill the generation loop or freeze the server, and what they get now
BAD = [
    ("temperature 1e-300", {"temperature": 1e-300}, 200),
    ("temperature 1e-45", {"temperature": 1e-45}, 200),
    ("top_k 4097", {"temperature": 1.0, "top_k": 4097}, 400),
    ("top_k 100000", {"temperature": 1.0, "top_k": 100000}, 400),
    ("top_k 2**62", {"temperature": 1.0, "top_k": 2**62}, 400),
    ("top_k 2**63", {"temperature": 1.0, "top_k": 2**63}, 400),
    ("lone surrogate", {"prompt": "def f(\ud800):"}, 400),
    ("10 MB prompt", {"prompt": "x" * 10_000_000}, 413),
    ("unknown field", {"response_format": {"type": "json_object"}}, 400),
    ("foreign Host", {"headers": {"host": "rebound.example"}}, 400),
    ("malformed JSON", {"raw": b'{"model": "embedded", "prompt": '}, 400),
    ("100k-character stop", {"stop": [" " * 100_000]}, 400),
]


async def bad_request(client: httpx.AsyncClient, base: str, k: int) -> dict[str, object]:
    name, change, want = BAD[k % len(BAD)]
    change = dict(change)
    headers = {"content-type": "application/json", **change.pop("headers", {})}
    body = change.pop("raw", None)
    if body is None:
        body = json.dumps({"model": "embedded", "prompt": "import os", "max_tokens": 8, **change}).encode()
    r = await client.post(f"{base}/v1/completions", content=body, headers=headers)
    ok = r.status_code == want and (want == 200 or "error" in r.json())
    return {"bad": name, "status": r.status_code, "as_expected": ok}


async def leaving_request(client: httpx.AsyncClient, base: str, prompt: str, tokens: int) -> dict:
    """A stream whose client hangs up after 0-4 chunks."""
    body = {"model": "embedded", "prompt": prompt, "max_tokens": tokens, "stream": True}
    chunks, leave_after = 0, random.randrange(5)
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if chunks > leave_after:
                    break
    return {"left_after_chunks": chunks, "status": r.status_code}


async def phase(
    base: str,
    clients: int,
    duration: float,
    prompts: list[str],
    tokens: tuple[int, int],
    bad_share: float = 0.0,
    leave_share: float = 0.0,
) -> dict[str, object]:
    results: list[dict] = []
    bad: list[dict] = []
    left: list[dict] = []
    n_bad, n_leave = round(clients * bad_share), round(clients * leave_share)

    async def client_loop(i: int, client: httpx.AsyncClient) -> None:
        k = i
        lengths = random.Random(i)  # each client's own seeded draws: the same lengths in every phase
        while time.perf_counter() < stop_at:
            prompt = prompts[k % len(prompts)]
            n = lengths.randint(*tokens)
            if i < n_bad:
                bad.append(await bad_request(client, base, k))
                await asyncio.sleep(0.1)
            elif i < n_bad + n_leave:
                left.append(await leaving_request(client, base, prompt, n))
            else:
                result = await one_request(client, base, prompt, n)
                result["first"] = k == i  # this client's first request: all of them arrive at once
                results.append(result)
            k += clients

    # Every client's connection pool is made before the clock starts: making one takes about 17 ms of this
    # process's one thread (httpx loads its certificates), and made inside the phase, the 63 others' set-up
    # landed in the first requests' TTFT (about 1 s at 64 clients).
    async with contextlib.AsyncExitStack() as stack:
        pools = [await stack.enter_async_context(httpx.AsyncClient(timeout=300)) for _ in range(clients)]
        before = cache_counts(base)
        start = time.perf_counter()
        stop_at = start + duration
        await asyncio.gather(*(client_loop(i, pools[i]) for i in range(clients)))
        wall = time.perf_counter() - start
    after = cache_counts(base)
    ok = [r for r in results if "error" not in r]
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]

    def pct(key: str, q: float, among: list[dict] = ok) -> float | None:
        vals = sorted(r[key] for r in among if r.get(key) is not None)
        return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else None

    faults = {}
    if n_bad or n_leave:
        faults = {
            "bad_clients": n_bad, "leaving_clients": n_leave, "good_clients": clients - n_bad - n_leave,
            "bad_requests": len(bad), "bad_not_as_expected": [b for b in bad if not b["as_expected"]][:20],
            "bad_statuses": {n: sorted({b["status"] for b in bad if b["bad"] == n}) for n, _, _ in BAD},
            "left_streams": len(left),
        }  # fmt: skip
    return {
        **faults,
        "clients": clients, "duration_s": duration, "wall_s": wall, "requests": len(results),
        "completed": len(ok), "errors": len(results) - len(ok),
        "error_kinds": sorted({r["error"] for r in results if "error" in r}),
        "tokens": sum(r["tokens"] for r in ok), "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50_s": pct("ttft_s", 0.5), "ttft_p99_s": pct("ttft_s", 0.99),
        # without each client's first request (the phase's opening wave: every client at once, on a
        # new connection), what a server sees once the load runs
        "ttft_p99_later_s": pct("ttft_s", 0.99, [r for r in ok if not r.get("first")]),
        "tpot_p50_s": pct("tpot_s", 0.5), "tpot_p99_s": pct("tpot_s", 0.99),
        # the mean over requests of each one's TPOT: what the timing model's request TPOT predicts
        "tpot_mean_s": statistics.mean(t) if (t := [r["tpot_s"] for r in ok if r.get("tpot_s")]) else None,
        **server_ttft(before, after),
        "cache_hits": hits, "cache_misses": misses,
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
    }  # fmt: skip


async def slowloris(port: int, connections: int, duration: float, tokens: int) -> dict[str, object]:
    """``connections`` trickling header bytes (reconnecting when closed) while one client sends short
    non-streaming requests back to back: their latencies, and how often the trickles were closed."""
    stop_at = time.perf_counter() + duration
    closed = opened = 0

    async def trickle(i: int) -> None:
        nonlocal closed, opened
        await asyncio.sleep(random.random() * 2)  # spread the connects
        while time.perf_counter() < stop_at:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            opened += 1
            try:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
                while time.perf_counter() < stop_at:
                    await asyncio.sleep(2 + random.random() * 3)
                    writer.write(b"X-a: b\r\n")
                    await writer.drain()
                    if reader.at_eof():
                        break
            except OSError:
                pass
            closed += 1
            writer.close()

    latencies: list[float] = []
    errors: list[str] = []

    async def prompt_client() -> None:
        await asyncio.sleep(5)  # the trickles connected
        async with httpx.AsyncClient(timeout=60) as client:
            while time.perf_counter() < stop_at - 1:
                body = {"model": "embedded", "prompt": "import os", "max_tokens": tokens}
                start = time.perf_counter()
                try:
                    r = await client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}")
                except httpx.HTTPError as exc:
                    errors.append(type(exc).__name__)
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(0.2)

    await asyncio.gather(prompt_client(), *(trickle(i) for i in range(connections)))
    lat = sorted(latencies)
    return {
        "connections": connections, "duration_s": duration, "max_tokens": tokens,
        "requests": len(lat), "errors": errors[:20], "error_count": len(errors),
        "latency_p50_s": lat[len(lat) // 2] if lat else None,
        "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "latency_max_s": lat[-1] if lat else None,
        "within_1s": sum(x <= 1.0 for x in lat), "trickles_opened": opened, "trickles_closed": closed,
    }  # fmt: skip


async def sample_memory(pid: int, out: list, stop: asyncio.Event) -> None:
    proc = psutil.Process(pid)
    start = time.perf_counter()
    while not stop.is_set():
        out.append((round(time.perf_counter() - start, 1), proc.memory_info().rss))
        await asyncio.sleep(1)


async def run(args, base: str, pid: int) -> dict[str, object]:
    prompts = _prompts()
    memory: list = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_memory(pid, memory, stop))
    shares = (args.bad_share, args.leave_share) if args.faults else (0.0, 0.0)
    loaded = await phase(base, args.clients, args.duration, prompts, args.tokens, *shares)
    print(f"{args.clients} clients: {json.dumps(loaded)}", file=sys.stderr, flush=True)
    single = None
    if args.single > 0:
        single = await phase(base, 1, args.single, prompts, args.tokens)
        print(f"1 client: {json.dumps(single)}", file=sys.stderr, flush=True)
    stop.set()
    await sampler
    loris = None
    if args.slowloris:
        loris = await slowloris(int(base.rsplit(":", 1)[1]), args.slowloris, args.slowloris_duration, 8)
        print(f"slowloris: {json.dumps(loris)}", file=sys.stderr, flush=True)
    health = httpx.get(f"{base}/health").status_code
    rss = [m for _, m in memory]
    tenth = max(1, len(rss) // 10)
    return {
        "concurrent": loaded, "one_at_a_time": single, "slowloris": loris, "health_at_end": health,
        "speedup_tokens_per_s": loaded["tokens_per_s"] / single["tokens_per_s"] if single else None,
        "server_rss_bytes": {
            "start": rss[0], "peak": max(rss), "first_tenth_mean": statistics.mean(rss[:tenth]),
            "last_tenth_mean": statistics.mean(rss[-tenth:]),
            "samples": memory[:: max(1, len(memory) // 120)],
        },
    }  # fmt: skip


def server_command(args, port: int, config: str) -> list[str]:
    """The server at ``config``: an expert memory, or ``MEMORY:POLICY[:MISS]`` (else ``--policy``,
    ``--miss``)."""
    memory, policy, miss = (config.split(":", 2) + [None, None])[:3]  # a miss path may have k=v,...
    tier = args.slow_tier or ("mapped" if args.device == "cpu" else "host")  # a GPU's: pinned host memory
    cmd = [sys.executable, "-m", "expertcache.cli", "serve", "--port", str(port), "--device", args.device,
           "--expert-memory", memory, "--max-queue", str(max(64, *args.clients)), "--slow-tier", tier,
           "--served-model-name", "embedded", "--quiet"]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    for flag, value in (
        ("dtype", args.dtype),
        ("policy", policy or args.policy),
        ("miss", miss or args.miss),
        ("schedule", args.schedule),
        ("attention", args.attention),
        ("kernel", args.kernel),
    ):
        if value:
            cmd += [f"--{flag}", value]
    return cmd


def start_server(cmd: list[str], port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health").json().get("status") == "ok":
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # not up yet, or up and still starting its loop (503)
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}: {' '.join(cmd)}")
    server.terminate()
    raise SystemExit(f"the server did not come up in 5 minutes: {' '.join(cmd)}")


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(30)


KEYS = (
    "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "ttft_p99_later_s", "server_ttft_p50_le_s",
    "server_ttft_p99_le_s", "tpot_p50_s", "tpot_p99_s", "hit_ratio",
)  # fmt: skip


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing (a phase that completed no request) or b is 0."""
    return None if a is None or not b else a / b


def spread(values: list[float | None]) -> dict[str, float | None]:
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(got), "min": min(got), "max": max(got)}


async def compare_round(args, base: str, pid: int, prompts: list[str]) -> dict[str, object]:
    """One server's turn: a warm-up, each client count's load, then one client alone."""
    memory: list = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_memory(pid, memory, stop))
    if args.warm > 0:  # the cache and the allocator settle; not counted
        await phase(base, max(args.clients), args.warm, prompts, args.tokens)
    loaded = {}
    for n in args.clients:
        loaded[str(n)] = await phase(base, n, args.duration, prompts, args.tokens)
        print(
            f"  {n} clients: {json.dumps({k: loaded[str(n)][k] for k in KEYS})}", file=sys.stderr, flush=True
        )
    single = await phase(base, 1, args.single, prompts, args.tokens)
    print(f"  1 client: {json.dumps({k: single[k] for k in KEYS})}", file=sys.stderr, flush=True)
    stop.set()
    await sampler
    return {"loaded": loaded, "single": single, "server_rss_peak_bytes": max(m for _, m in memory)}


def compare(args) -> dict[str, object]:
    """Servers at each ``--compare`` config in turn, the order reversed every other round (the machine
    drifts), every round the same load; medians and ranges over rounds, and each config against the
    last (throughput and TTFT p99 ratios per round, paired) and each load's TTFT p99 against one
    client's on the same server."""
    prompts = _prompts()
    runs: dict[str, list[dict]] = {c: [] for c in args.compare}
    commands = {}
    for r in range(args.rounds):
        for config in args.compare if r % 2 == 0 else args.compare[::-1]:
            port = free_port()
            cmd = server_command(args, port, config)
            commands[config] = " ".join(cmd[3:]).replace(f"--port {port} ", "")
            print(f"round {r + 1}/{args.rounds}: {config}", file=sys.stderr, flush=True)
            server = start_server(cmd, port)
            try:
                runs[config].append(
                    asyncio.run(compare_round(args, f"http://127.0.0.1:{port}", server.pid, prompts))
                )
            finally:
                stop_server(server)
    full = args.compare[-1]
    summary = {}
    for config, rounds in runs.items():
        row: dict[str, object] = {"server_command": commands[config]}
        row["single"] = {k: spread([x["single"][k] for x in rounds]) for k in KEYS}
        for n in map(str, args.clients):
            got = {k: spread([x["loaded"][n][k] for x in rounds]) for k in KEYS}
            got["errors"] = sum(x["loaded"][n]["errors"] for x in rounds)
            got["ttft_p99_over_single_ttft_p99"] = spread(
                [ratio(x["loaded"][n]["ttft_p99_s"], x["single"]["ttft_p99_s"]) for x in rounds])  # fmt: skip
            got["ttft_p99_later_over_single_ttft_p99"] = spread(
                [ratio(x["loaded"][n]["ttft_p99_later_s"], x["single"]["ttft_p99_s"])
                 for x in rounds])  # fmt: skip
            got["ttft_p99_over_single_ttft_p50"] = spread(
                [ratio(x["loaded"][n]["ttft_p99_s"], x["single"]["ttft_p50_s"]) for x in rounds])  # fmt: skip
            got["tokens_per_s_over_" + full] = spread(
                [ratio(a["loaded"][n]["tokens_per_s"], b["loaded"][n]["tokens_per_s"])
                 for a, b in zip(rounds, runs[full], strict=True)])  # fmt: skip
            got["ttft_p99_over_" + full] = spread(
                [ratio(a["loaded"][n]["ttft_p99_s"], b["loaded"][n]["ttft_p99_s"])
                 for a, b in zip(rounds, runs[full], strict=True)])  # fmt: skip
            row[f"{n}_clients"] = got
        row["server_rss_peak_bytes"] = max(x["server_rss_peak_bytes"] for x in rounds)
        summary[config] = row
    return {"summary": summary, "rounds": runs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="64", help="concurrent clients; a comma list runs each (default 64)")
    p.add_argument("--duration", type=float, default=600, help="seconds of concurrent load (default 600)")
    p.add_argument("--single", type=float, default=60, help="seconds of one client alone (default 60)")
    p.add_argument("--tokens", default="32", metavar="N or A-B", help="max_tokens per request (default 32), "
                   "or a range A-B: each request's drawn uniformly in it (seeded per client), so that the "
                   "clients do not end together")  # fmt: skip
    p.add_argument("--expert-memory", default="30%")
    p.add_argument("--model", help="a checkpoint folder (default: the embedded model)")
    p.add_argument("--dtype", help="the server's --dtype (default: the checkpoint's)")
    p.add_argument("--device", default="cpu", help="the server's --device (default cpu; cuda: a GPU)")
    p.add_argument("--slow-tier", help="the server's --slow-tier (default: mapped on a CPU, host on a GPU)")
    p.add_argument("--policy", help="the server's --policy (default: its own)")
    p.add_argument("--miss", help="the server's --miss (default: its own)")
    p.add_argument("--schedule", choices=SCHEDULES, help="the server's --schedule (default: its own, fifo)")
    p.add_argument(
        "--attention",
        choices=["sdpa", "eager", "sdpa_no_cudnn"],
        help="the server's --attention (default: the server's own: sdpa, on a GPU sdpa_no_cudnn)",
    )
    p.add_argument(
        "--kernel",
        choices=["auto", "grouped", "eager", "compiled", "packed"],
        help="the server's --kernel (default: its own, auto)",
    )
    p.add_argument("--compare", metavar="CONFIG,...", help="servers at each config (MEM or "
                   "MEM:POLICY[:MISS]) in turn, alternating over --rounds, each against the last "
                   "(e.g. 25%%:lru,25%%:tlfu:batch,100%%); replaces --expert-memory")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="rounds of --compare (default 2)")
    p.add_argument("--warm", type=float, default=10, help="--compare: seconds of uncounted load first")
    p.add_argument("--faults", action="store_true", help="mix in bad and disconnecting clients")
    p.add_argument("--bad-share", type=float, default=0.1, help="share of clients sending bad requests")
    p.add_argument("--leave-share", type=float, default=0.3, help="share of clients that hang up")
    p.add_argument("--slowloris", type=int, default=0, metavar="N", help="then N trickling connections")
    p.add_argument("--slowloris-duration", type=float, default=60.0)
    p.add_argument("--out", help="write the results here as JSON (default: print them to stdout)")
    args = p.parse_args()
    check_args(args)
    lo, hi = args.tokens
    head = {"provenance": provenance(), "max_tokens": lo if lo == hi else f"{lo}-{hi} (uniform, seeded)"}
    if args.compare:
        args.compare = args.compare.split(",")
        result = {**head, **compare(args)}
        if args.out:  # the summary to read, the rounds in the file
            write_json(args.out, result)
            print(json.dumps(result["summary"], indent=1))
            print(f"wrote {args.out}", file=sys.stderr)
        else:
            print(json.dumps(result, indent=1))
        return 0
    args.clients = args.clients[0]
    port = free_port()
    cmd = server_command(argparse.Namespace(**{**vars(args), "clients": [args.clients]}), port,
                         args.expert_memory)  # fmt: skip
    server = start_server(cmd, port)
    try:
        result = asyncio.run(run(args, f"http://127.0.0.1:{port}", server.pid))
    finally:
        stop_server(server)
    result = {**head, "server_command": " ".join(cmd[1:]), **result}
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(json.dumps(result, indent=1))
    return 0


def refuse(message: str) -> None:
    """Bad input: one line and exit code 2, before any server starts."""
    print(f"serve_load.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_args(args: argparse.Namespace) -> None:
    """Every option's value checked before the run (a run is minutes long; its results are not lost to
    an output path that cannot be written); ``--clients`` becomes a list of counts."""
    try:
        args.clients = [int(n) for n in args.clients.split(",")]
    except ValueError:
        refuse(f"--clients {args.clients!r}: a number of clients, or a comma list of them (16,64)")
    if min(args.clients) < 1:
        refuse(f"--clients {','.join(map(str, args.clients))}: each count at least 1")
    for name, least, strict in (("duration", 0, True), ("single", 0, False), ("warm", 0, False),
                                ("slowloris_duration", 0, True)):  # fmt: skip
        value = getattr(args, name)
        if not math.isfinite(value) or value < least or (strict and value == least):
            refuse(f"--{name.replace('_', '-')} {value}: seconds, {'more than' if strict else 'at least'} 0")
    if args.rounds < 1:
        refuse(f"--rounds {args.rounds}: at least 1")
    tokens = token_range(args.tokens)
    if tokens is None:
        refuse(f"--tokens {args.tokens!r}: max_tokens, at least 1, or a range A-B with 1 <= A <= B (16-48)")
    args.tokens = tokens
    if args.slowloris < 0:
        refuse(f"--slowloris {args.slowloris}: a number of connections, 0 or more")
    for name in ("bad_share", "leave_share"):
        if not 0 <= getattr(args, name) <= 1:
            refuse(f"--{name.replace('_', '-')} {getattr(args, name)}: a share between 0 and 1")
    if args.bad_share + args.leave_share > 1:
        refuse(f"--bad-share {args.bad_share} and --leave-share {args.leave_share} add up to more than 1")
    if args.compare is None and len(args.clients) > 1:
        refuse(f"--clients {','.join(map(str, args.clients))}: a list of counts needs --compare")
    for config in args.compare.split(",") if args.compare is not None else [args.expert_memory]:
        check_config(config, args)
    if args.out:
        out = Path(args.out)
        parent = out.resolve().parent
        if out.is_dir() or not parent.is_dir() or not os.access(out if out.exists() else parent, os.W_OK):
            refuse(f"--out {args.out}: cannot write a file there")


def token_range(text: str) -> tuple[int, int] | None:
    """``--tokens``: N or A-B (1 <= A <= B) as (A, B), N as (N, N); None for anything else."""
    try:
        ends = [int(n) for n in text.split("-")] if text.count("-") <= 1 else []
    except ValueError:
        return None
    if len(ends) not in (1, 2) or min(ends) < 1 or ends[0] > ends[-1]:
        return None
    return ends[0], ends[-1]


def check_config(config: str, args: argparse.Namespace) -> None:
    """A server's config (``MEMORY[:POLICY[:MISS]]``) checked as the server would check it, so that a
    bad one is refused before the first round, not after it."""
    from expertcache.config import CacheConfig, MissConfig
    from expertcache.errors import ExpertcacheError
    from expertcache.units import parse_size

    memory, policy, miss = (config.split(":", 2) + [None, None])[:3]  # a miss path may have k=v,...
    where = f"--compare {config!r}" if args.compare is not None else f"--expert-memory {config!r}"
    try:
        if not memory.strip():
            raise ExpertcacheError("an empty config")
        if memory.strip().endswith("%"):
            share = float(memory.strip()[:-1])
            if not 0 < share <= 100:
                raise ExpertcacheError(f"{memory} is not a share in (0%, 100%]")
        else:
            parse_size(memory, "expert memory")
        CacheConfig(policy or args.policy or "lru")
        MissConfig(miss or args.miss or "fetch")
    except (ExpertcacheError, ValueError) as exc:
        refuse(f"{where}: {str(exc).splitlines()[0]}")


if __name__ == "__main__":
    sys.exit(main())
