"""The simulator's timing model against the CPU engine with an emulated link.

1. Calibrate a ``CostModel`` on the engine with every expert resident and no link: one expert's
   compute for 1..32 tokens (fitted to a + b * tokens), the decode step time, and from it the dense
   time per layer (decode TPOT minus the experts' share, spread over the layers; the per-step time is
   folded into it). The link is the emulated one: bandwidth set so that one expert's transfer takes
   ``--link-ratio`` times one expert's compute for one token, ``--link-latency`` per chunk. Two engine
   overheads no other term covers are fitted on ONE configuration (``--fit-on``, predictor none):
   ``submit_s``, the compute thread's time per transfer it issues (bookkeeping, the hand-off to the
   worker thread, contention on the interpreter lock), and ``wake_s``, the delay between a transfer
   landing and the blocked compute thread running again (thread wake-up, the sleep's overshoot).
2. For each budget and predictor, run the engine (fresh load, greedy, ``--new-tokens``) with that
   link, record its trace (routing and, for gate-based predictors, what it predicted), and measure
   TPOT and decode stall per token (medians over ``--repeats`` loads).
3. Replay each recorded trace through ``simulate_timing`` with the same policy, capacity, predictor
   (recorded predictions for gate-based ones), window and switches, and compare.

    .venv/bin/python bench/validate_timing.py [--quick] [--out bench/results/validate_timing.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from provenance import at_least, fail, provenance, results_out, write_json

from expertcache.config import PrefetchConfig
from expertcache.costs import CostModel, fit_linear
from expertcache.engine import load
from expertcache.engine.parts import expert_output as _expert_output
from expertcache.engine.routing import replay_routing
from expertcache.sim.timing import simulate_timing

# miss paths validated, with prefetch off (hobbit needs 'expertcache quantize' of the model first)
MISS_PATHS = ("fetch", "host", "hybrid", "placement:first=2", "split:theta=0.5,buffer=4", "hobbit")

PROMPT = (
    "import json\n"
    "from pathlib import Path\n\n\n"
    "def read_config(path):\n"
    '    """Read a JSON configuration file and return it as a dictionary."""\n'
)


class _Replay:
    """Every generation of a random-weight model routes by the same synthetic trace (``--replay``)."""

    trace = None

    @classmethod
    def around(cls, model):
        return replay_routing(model.model, cls.trace) if cls.trace is not None else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def generate(model, new_tokens: int):
    with _Replay.around(model):
        return model.generate_text(PROMPT, max_new_tokens=new_tokens)


def expert_samples(model, counts=(1, 2, 4, 8, 16, 32), reps: int = 200) -> list[tuple[int, float]]:
    """(tokens, seconds) of one expert's compute, the median of ``reps`` calls per count."""
    modules = [m for m in model.model.modules() if hasattr(m, "_expertcache_layer")]
    module, views = modules[0], model.pool.views[0]
    hidden = model.config.hidden_size
    out = []
    with torch.inference_mode():
        for n in counts:
            x = torch.randn(n, hidden, dtype=model.dtype)
            for _ in range(20):
                _expert_output(module, views, x)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                _expert_output(module, views, x)
                times.append(time.perf_counter() - t)
            out.append((n, statistics.median(times)))
    return out


def host_samples(model, counts=(1, 4, 16), reps: int = 100) -> list[tuple[int, float]]:
    """(tokens, seconds) of one expert computed on the host from the slow tier, as the host path does
    (with the disk tier, reading the expert from the mapped checkpoint first)."""
    modules = [m for m in model.model.modules() if hasattr(m, "_expertcache_layer")]
    module, hidden, out = modules[0], model.config.hidden_size, []
    with torch.inference_mode():
        for n in counts:
            x = torch.randn(n, hidden, dtype=model.dtype)
            times = []
            for i in range(reps):
                t = time.perf_counter()
                _expert_output(module, model.tier.host_views((0, i % model.num_experts)), x)
                times.append(time.perf_counter() - t)
            out.append((n, statistics.median(times)))
    return out


def dequant_seconds(model, miss: str, full_s: float) -> float:
    """The hobbit path's extra device time for one low-precision expert, as ``expertcache profile``
    measures it: HQQ's expansion of its copy, or what the packed kernels take beyond a full expert's
    ``full_s`` (none when they are faster; int8 and int4 copies are packed and never expanded)."""
    from expertcache.miss.registry import make_miss
    from expertcache.tools.profile import low_precision_costs

    spec = make_miss(miss, model.miss.ctx).parts()[1]
    module = next(m for m in model.model.modules() if getattr(m, "_expertcache_layer", None) == 0)
    got = low_precision_costs(model, module, full_s).get(f"int{spec.bits}", {})
    if "dequant_s" not in got:
        why = got.get("skipped", f"build them with 'expertcache quantize --bits {spec.bits}'")
        raise SystemExit(f"validate_timing: no int{spec.bits} copies of group 64 were measured: {why}")
    return got["dequant_s"]


def calibrate(path, args) -> tuple[CostModel, dict[str, object]]:
    with load(path, expert_memory="100%", progress=False, record=False, slow_tier=args.slow_tier) as model:
        samples = expert_samples(model)
        hosts = host_samples(model)
        hobbit = [m for m in args.miss if m.startswith("hobbit")]
        dequant = dequant_seconds(model, hobbit[0], samples[0][1]) if hobbit else 0.0
        generate(model, 8)  # warm-up
        tpots = [generate(model, args.new_tokens).tpot_s for _ in range(3)]
        L, K, nbytes = model.num_layers, model.top_k, model.layout.nbytes
        bits = 8 * model.layout.slot_bytes // model.layout.slot_numel
    base = CostModel.from_measurements(0.0, samples, 0.0, float("inf"), 0.0, nbytes)
    tpot = statistics.median(tpots)
    one = base.expert(1)
    dense = max(0.0, (tpot - L * K * one) / L)
    transfer = args.link_ratio * one
    latency = args.link_latency_s
    bandwidth = nbytes / max(transfer - latency, 1e-9)
    cost = CostModel.from_measurements(
        dense, samples, 0.0, bandwidth, latency, nbytes, None if args.no_chunking else "auto"
    )
    ha, hb = fit_linear(hosts)
    # one processor: the host's experts run inline, after the device's
    cost = replace(cost, host_expert_s=ha, host_expert_token_s=hb, host_parallel=False, dequant_s=dequant,
                   weight_bits=bits)  # fmt: skip
    calib = {"tpot_resident_s": tpot, "expert_samples": samples, "expert_1_s": one, "host_samples": hosts,
             "dequant_s": dequant}  # fmt: skip
    return cost, calib


def fit_overheads(eng: dict, trace, args, cost: CostModel, capacity: int) -> tuple[CostModel, dict]:
    """The engine's two overheads the link and compute terms do not cover, fitted on one configuration:
    ``submit_s`` (compute time per transfer issued) and ``wake_s`` (per wait that blocked). The sim's
    decode TPOT and stall per token are linear in both, so two finite differences and a 2 x 2 solve
    match them to the engine's; the other configurations then test the model."""
    import numpy as np

    def at(submit: float, wake: float) -> np.ndarray:
        r = run_sim(trace, args, replace(cost, submit_s=submit, wake_s=wake), capacity, None, None)
        return np.array([r["tpot_s"], r["decode_stall_per_token_s"]])

    d = 50e-6
    base = at(0.0, 0.0)
    jac = np.column_stack([(at(d, 0.0) - base) / d, (at(0.0, d) - base) / d])
    target = np.array([eng["tpot_s"], eng["decode_stall_per_token_s"]])
    submit, wake = (max(0.0, float(v)) for v in np.linalg.lstsq(jac, target - base, rcond=None)[0])
    fitted = replace(cost, submit_s=submit, wake_s=wake)
    check = at(submit, wake).tolist()
    return fitted, {"submit_s": submit, "wake_s": wake, "fit_on": args.fit_on, "check": check}


def run_engine(path, args, cost: CostModel, budget: str, predictor: str | None, window, miss: str = "fetch"):
    runs = []
    for _ in range(args.repeats):
        with load(
            path,
            expert_memory=budget,
            policy=args.policy,
            progress=False,
            link_bandwidth=cost.link_bandwidth,
            link_latency=cost.link_latency,
            prefetch=predictor or "none",
            window=window,
            chunking=not args.no_chunking,
            miss=miss,
            costs=cost,  # the simulator's own costs: the same decisions in both
            slow_tier=args.slow_tier,
        ) as model:
            gen = generate(model, args.new_tokens)
            decode_steps = len(gen.tokens) - 1
            runs.append(
                {
                    "tpot_s": gen.tpot_s,
                    "ttft_s": gen.ttft_s,
                    "decode_stall_per_token_s": gen.stats["decode_stall_s"] / decode_steps,
                    "stall_s": gen.stats["stall_s"],
                    "misses": gen.stats["misses"],
                    "capacity": model.capacity,
                    "trace": model.trace(),
                    "goodpred": model.stats["goodpred"],
                }
            )
    keys = ("tpot_s", "ttft_s", "decode_stall_per_token_s", "stall_s", "misses", "goodpred")
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    # the run whose TPOT is the median gives the trace the simulator replays
    pick = sorted(runs, key=lambda r: r["tpot_s"])[len(runs) // 2]
    return med, pick["trace"], pick["capacity"], [{k: r[k] for k in keys} for r in runs]


def run_sim(trace, args, cost, capacity, predictor, window, miss: str = "fetch"):
    prefetch = PrefetchConfig(predictor, window=window)
    caps = json.loads(trace.meta["capacities"])  # the engine's own parts
    res = simulate_timing(
        trace, capacity, cache=args.policy, prefetch=prefetch, cost=cost, miss=miss, capacities=caps
    )
    decode_steps = max(1, int((trace.is_prefill == 0).sum()))
    return {
        "tpot_s": res.tpot_s,
        "ttft_s": res.ttft_s,
        "decode_stall_per_token_s": res.stall_by_phase[0] / decode_steps,
        "stall_s": res.stall_s,
        "misses": res.misses,
        "goodpred": res.cache.get("goodpred"),
    }


def _check(ap, args) -> None:
    """Every budget, miss path and predictor named, checked as the engine will read them: one line, exit 2."""
    from expertcache.config import MissConfig
    from expertcache.errors import ExpertcacheError
    from expertcache.units import parse_share

    try:
        for budget in {*args.budgets, *args.miss_budgets, args.fit_on}:
            if not str(budget).endswith("%") or not 0 < parse_share(budget, "budget") <= 100:
                raise ExpertcacheError(f"budget {budget!r}: a share of all experts in (0%, 100%]")
        for miss in args.miss:
            MissConfig(miss)
        for name in args.predictors:
            PrefetchConfig("none" if name == "none" else name)
    except ExpertcacheError as exc:
        fail(ap.prog, str(exc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--budgets", nargs="+", default=["25%", "50%", "75%"])
    ap.add_argument("--predictors", nargs="+", default=["none", "next-gate", "window", "learned"])
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--new-tokens", type=at_least(2), default=64)
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--link-ratio", type=float, default=3.0)
    ap.add_argument("--link-latency-us", type=float, default=5.0)
    ap.add_argument("--no-chunking", action="store_true")
    ap.add_argument("--fit-on", default="50%", help="budget (predictor none) the overheads are fitted on")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--miss", nargs="+", default=list(MISS_PATHS), help="validated at --miss-budgets")
    ap.add_argument("--miss-budgets", nargs="+", default=["25%", "50%"])
    ap.add_argument(
        "--slow-tier", choices=["disk", "mapped", "host"], default="mapped",
        help="where experts wait (host: in RAM, so host compute reads no file)",
    )  # fmt: skip
    ap.add_argument(
        "--replay", action="store_true", help="route by a synthetic sticky-Zipf trace (random-weight models)"
    )
    ap.add_argument("--out", type=Path, help="default bench/results/validate_timing.json (else: temp dir)")
    args = ap.parse_args()
    args.out = results_out(ap, args, "validate_timing.json", at_least=("repeats",))
    args.link_latency_s = args.link_latency_us * 1e-6
    if args.quick:
        args.budgets, args.predictors, args.new_tokens, args.repeats = ["50%"], ["none", "next-gate"], 16, 1
        args.miss_budgets = ["25%"]
    torch.set_num_threads(1)
    if args.replay:
        from engine_cpu import replay_trace

        args.warmup_tokens = 8
        _Replay.trace, _ = replay_trace(Path(args.model), args)
    _check(ap, args)  # before the calibration: a bad miss path or budget ended in a traceback after it
    cost, calib = calibrate(args.model, args)
    eng0, trace0, cap0, _ = run_engine(args.model, args, cost, args.fit_on, None, None)
    cost, fit = fit_overheads(eng0, trace0, args, cost, cap0)
    calib["fit"] = fit
    print(cost.describe(), flush=True)
    rows = []
    configs = [(b, n, "fetch") for b in args.budgets for n in args.predictors]
    configs += [(b, "none", m) for b in args.miss_budgets for m in args.miss if m != "fetch"]
    for budget, name, miss in configs:
        predictor = None if name == "none" else name
        window = 2 if name in ("window", "learned") else None
        eng, trace, capacity, runs = run_engine(args.model, args, cost, budget, predictor, window, miss)
        sim = run_sim(trace, args, cost, capacity, predictor, window, miss)
        err = {
            k: (sim[k] - eng[k]) / eng[k] if eng[k] else None
            for k in ("tpot_s", "decode_stall_per_token_s", "stall_s")
        }
        row = {"budget": budget, "predictor": name, "miss": miss, "capacity": capacity, "engine": eng,
                   "sim": sim}  # fmt: skip
        # the configuration the overheads were fitted on, in a run of its own: the fit's run (eng0) is not
        # this one (it was labelled "fitted on this run": its error held the run-to-run noise too)
        row["fit_configuration"] = budget == args.fit_on and name == "none" and miss == "fetch"
        if row["fit_configuration"]:
            row["fit_run"] = eng0
        row.update(error=err, runs=runs)
        rows.append(row)
        e_stall, s_stall = eng["decode_stall_per_token_s"], sim["decode_stall_per_token_s"]
        off = {k: "n/a" if v is None else f"{v:+.1%}" for k, v in err.items()}  # n/a: the engine's was 0
        print(
            f"{budget:>4} {name:10} {miss:24} TPOT engine {eng['tpot_s'] * 1e3:6.2f} "
            f"sim {sim['tpot_s'] * 1e3:6.2f} ({off['tpot_s']}) | decode stall/token engine "
            f"{e_stall * 1e3:6.3f} sim {s_stall * 1e3:6.3f} ({off['decode_stall_per_token_s']})"
            f" | misses {eng['misses']:.0f} / {sim['misses']}"
            + (
                f" (the configuration the overheads were fitted on, run again: the fit's own run took "
                f"{eng0['tpot_s'] * 1e3:.2f} ms a token)"
                if row["fit_configuration"]
                else ""
            ),
            flush=True,
        )
    out = {
        "provenance": provenance(),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "cost": cost.to_dict(),
        "calibration": calib,
        "rows": rows,
    }
    write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
