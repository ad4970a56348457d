"""Memory plentiful on CPU: the engine at 100 % against plain transformers, in one process (issue: models
larger than memory, "at 100 % the engine's TTFT and TPOT are within 10 % of plain transformers").

    PYTHONPATH=bench .venv/bin/python bench/plenty_cpu.py [--model embedded|granite] [--rounds 15]

Fresh processes on a shared VM drift by tens of percent within minutes, more than the difference this
measures. Here the models share one process and one machine state: each round runs one greedy generation
of the same prompt on each (the order rotating from round to round), and the figure is the median over
rounds of each round's ratio to transformers' eager run. Models, every one warmed by a generation first:

- ``transformers eager``: ``from_pretrained(..., experts_implementation="eager")``, the reference the
  engine is exact against (tokens compared at every round);
- ``transformers default``: ``from_pretrained`` as a user calls it (transformers 5's default experts
  implementation, ``grouped_mm`` where it dispatches; its rounding differs, so its tokens may too);
- ``engine 100%``: ``expertcache.load(..., expert_memory="100%", device="cpu")``, every expert in a slot.

``--model granite`` generates (once, cached in the temporary directory) the Granite-shaped checkpoint of
``bench/memory_cpu.py`` with 32 experts (2.4 GiB); the models route by themselves. Results:
``bench/results/plenty_cpu_<model>.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from engine_cpu import log, timed_generate
from provenance import ROOT, provenance, write_json

PROMPT = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\ndef main():"
GRANITE = dict(hidden=1024, layers=24, experts=32, top_k=8, intermediate=512, heads=16, dtype="bfloat16")
EAGER, DEFAULT, ENGINE = "transformers eager", "transformers default", "engine 100%"


def model_path(name: str) -> Path:
    if name == "embedded":
        from expertcache.engine.hub import resolve_model

        return resolve_model(None)
    from expertcache.engine.random_checkpoint import make_checkpoint

    path = Path(tempfile.gettempdir()) / "expertcache-bench" / "granite-plenty-32e"
    if not (path / ".complete").is_file():
        log(f"generating {path}")
        make_checkpoint(path, "granitemoe", max_shard_size="1GB", **GRANITE)
        (path / ".complete").write_text("ok\n")
    return path


def ci95(values: list[float], seed: int = 0, draws: int = 2000) -> tuple[float, float]:
    """A bootstrap 95 % interval of the median."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("embedded", "granite"), default="granite")
    p.add_argument("--rounds", type=int, default=15, help="generations per model, interleaved")
    p.add_argument("--new-tokens", type=int, help="tokens a generation (default: embedded 64, granite 24)")
    p.add_argument("--threads", type=int, help="torch threads (default: one per processor)")
    p.add_argument("--out", type=Path, help="JSON results (default: bench/results/plenty_cpu_<model>.json)")
    args = p.parse_args()
    if args.rounds < 1 or (args.new_tokens is not None and args.new_tokens < 2):
        p.error("--rounds must be at least 1 and --new-tokens at least 2")
    out = args.out or ROOT / "bench" / "results" / f"plenty_cpu_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = args.new_tokens or (64 if args.model == "embedded" else 24)
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    torch.set_num_threads(threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import expertcache

    path = model_path(args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    n_prompt = tok(PROMPT, return_tensors="pt").input_ids.shape[1]
    models, load_s = {}, {}
    for name in (EAGER, DEFAULT, ENGINE):
        t0 = time.perf_counter()
        if name == ENGINE:
            models[name] = expertcache.load(path, expert_memory="100%", device="cpu", progress=False)
        else:
            kw = {"experts_implementation": "eager"} if name == EAGER else {}
            models[name] = AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()
        load_s[name] = time.perf_counter() - t0
    impl = models[DEFAULT].config._experts_implementation

    def generate(name: str, n: int) -> tuple[float, float, list[int]]:
        m = models[name]
        if name == ENGINE:
            g = m.generate_text(PROMPT, max_new_tokens=n, min_new_tokens=n)
            return g.ttft_s, g.tpot_s, list(g.tokens)
        r = timed_generate(m, tok, PROMPT, n)
        return r["ttft_s"], r["tpot_s"], r["output"][0, n_prompt:].tolist()

    for name in models:
        generate(name, 4)
    names = list(models)
    runs: dict[str, list[tuple[float, float, list[int]]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            runs[name].append(generate(name, tokens))
        log(f"round {r + 1}: " + ", ".join(f"{n} {runs[n][-1][1] * 1e3:.1f} ms" for n in names))
    want = runs[EAGER][0][2]
    results = {
        "provenance": provenance(),
        "settings": {**vars(args), "out": str(out), "new_tokens": tokens, "threads": threads},
        "model": {"name": args.model, "prompt_tokens": n_prompt, "default_experts_implementation": impl},
        "models": {},
    }
    for name in names:
        ttft = [t for t, _, _ in runs[name]]
        tpot = [t for _, t, _ in runs[name]]
        row = {
            "load_s": round(load_s[name], 2),
            "ttft_ms": round(statistics.median(ttft) * 1e3, 2),
            "tpot_ms": round(statistics.median(tpot) * 1e3, 2),
            "tpot_runs_ms": [round(t * 1e3, 2) for t in tpot],
            "ttft_runs_ms": [round(t * 1e3, 2) for t in ttft],
            "tokens_equal_eager": all(toks == want for _, _, toks in runs[name]),
        }
        if name != EAGER:
            for what, i in (("tpot", 1), ("ttft", 0)):
                ratios = [a[i] / b[i] for a, b in zip(runs[name], runs[EAGER], strict=True)]
                lo, hi = ci95(ratios)
                row[f"{what}_vs_eager"] = {
                    "median": round(statistics.median(ratios), 3),
                    "ci95": [round(lo, 3), round(hi, 3)],
                }
        if name == ENGINE:
            ratios = [a[1] / b[1] for a, b in zip(runs[name], runs[DEFAULT], strict=True)]
            lo, hi = ci95(ratios)
            row["tpot_vs_default"] = {
                "median": round(statistics.median(ratios), 3),
                "ci95": [round(lo, 3), round(hi, 3)],
            }
        results["models"][name] = row
        log(f"{name}: {row}")
    write_json(out, results)
    if not results["models"][ENGINE]["tokens_equal_eager"]:
        print("the engine's tokens differ from transformers' eager run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
