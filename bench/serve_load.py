"""Load test of ``expertcache serve`` on loopback: many concurrent streaming clients against one at a time.

Starts a server (the embedded model, ``--expert-memory``, CPU) in a subprocess; then an async httpx
driver runs ``--clients`` streaming clients that each send completions back to back for ``--duration``
seconds (prompts: the first 60 characters of held-out standard-library files, ``max_tokens`` 32,
greedy), and afterwards one client alone for ``--single`` seconds. Per request: TTFT (send to first text
chunk), TPOT (mean gap between chunks after the first) and completion tokens from ``usage``; errors and
unfinished streams are counted. The server's resident memory is sampled every second, and its expert
cache's hits and misses are read from ``/metrics`` before and after each phase.

    OMP_NUM_THREADS=1 PYTHONPATH=bench .venv/bin/python bench/serve_load.py [--clients 64] [--duration 600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import psutil  # accelerate's dependency

try:
    import httpx
except ImportError:  # openai >= 3 brings httpx as httpx2
    import httpx2 as httpx
from provenance import ROOT, provenance, write_json

from expertcache.tools.quality import heldout_texts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_counts(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    out = {}
    for line in text.splitlines():
        for name in ("hits", "misses"):
            if line.startswith(f"expertcache_cache_{name}_total "):
                out[name] = float(line.split()[1])
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
    if not done or usage is None or not times:
        return {"error": "stream ended early"}
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"ttft_s": times[0] - start, "tpot_s": statistics.mean(gaps) if gaps else None,
            "tokens": usage["completion_tokens"], "end_s": times[-1] - start}  # fmt: skip


async def phase(
    base: str, clients: int, duration: float, prompts: list[str], tokens: int
) -> dict[str, object]:
    results: list[dict] = []
    stop_at = time.perf_counter() + duration

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            k = i
            while time.perf_counter() < stop_at:
                results.append(await one_request(client, base, prompts[k % len(prompts)], tokens))
                k += clients

    before = cache_counts(base)
    start = time.perf_counter()
    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    wall = time.perf_counter() - start
    after = cache_counts(base)
    ok = [r for r in results if "error" not in r]
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]

    def pct(key: str, q: float) -> float | None:
        vals = sorted(r[key] for r in ok if r.get(key) is not None)
        return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else None

    return {
        "clients": clients, "duration_s": duration, "wall_s": wall, "requests": len(results),
        "completed": len(ok), "errors": len(results) - len(ok),
        "error_kinds": sorted({r["error"] for r in results if "error" in r}),
        "tokens": sum(r["tokens"] for r in ok), "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50_s": pct("ttft_s", 0.5), "ttft_p99_s": pct("ttft_s", 0.99),
        "tpot_p50_s": pct("tpot_s", 0.5), "tpot_p99_s": pct("tpot_s", 0.99),
        "cache_hits": hits, "cache_misses": misses,
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
    }  # fmt: skip


async def sample_memory(pid: int, out: list, stop: asyncio.Event) -> None:
    proc = psutil.Process(pid)
    start = time.perf_counter()
    while not stop.is_set():
        out.append((round(time.perf_counter() - start, 1), proc.memory_info().rss))
        await asyncio.sleep(1)


async def run(args, base: str, pid: int) -> dict[str, object]:
    prompts = [t[:60] for t in heldout_texts(32)]
    memory: list = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_memory(pid, memory, stop))
    loaded = await phase(base, args.clients, args.duration, prompts, args.tokens)
    print(f"{args.clients} clients: {json.dumps(loaded)}", file=sys.stderr, flush=True)
    single = await phase(base, 1, args.single, prompts, args.tokens)
    print(f"1 client: {json.dumps(single)}", file=sys.stderr, flush=True)
    stop.set()
    await sampler
    rss = [m for _, m in memory]
    tenth = max(1, len(rss) // 10)
    return {
        "concurrent": loaded, "one_at_a_time": single,
        "speedup_tokens_per_s": loaded["tokens_per_s"] / single["tokens_per_s"],
        "server_rss_bytes": {
            "start": rss[0], "peak": max(rss), "first_tenth_mean": statistics.mean(rss[:tenth]),
            "last_tenth_mean": statistics.mean(rss[-tenth:]),
            "samples": memory[:: max(1, len(memory) // 120)],
        },
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=600, help="seconds of concurrent load (default 600)")
    p.add_argument("--single", type=float, default=60, help="seconds of one client alone (default 60)")
    p.add_argument("--tokens", type=int, default=32, help="max_tokens per request (default 32)")
    p.add_argument("--expert-memory", default="30%")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_load.json"))
    args = p.parse_args()
    port = free_port()
    queue = str(max(64, args.clients))
    cmd = [sys.executable, "-m", "expertcache.cli", "serve", "--port", str(port), "--device", "cpu",
           "--expert-memory", args.expert_memory, "--max-queue", queue, "--slow-tier", "mapped",
           "--quiet"]  # fmt: skip
    server = subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(f"{base}/health").json().get("status") == "ok":
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        result = asyncio.run(run(args, base, server.pid))
    finally:
        server.terminate()
        server.wait(30)
    result = {
        "provenance": provenance(),
        "server_command": " ".join(cmd[1:]),
        "max_tokens": args.tokens,
        **result,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
