"""Command line: thin wrappers that build the library's objects and print what they return."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from expertcache import __version__
from expertcache.cache.schedule import ORDERS, check_capacity, min_room
from expertcache.errors import ExpertcacheError
from expertcache.policy.registry import POLICIES, min_capacity, parse_policy, policy_class
from expertcache.sim.report import format_layers, format_table, plot_curves
from expertcache.sim.simulate import DEFAULT_POLICIES, simulate
from expertcache.trace.default import default_trace
from expertcache.trace.stats import summary
from expertcache.trace.synth import GENERATORS, synthesize
from expertcache.trace.trace import Trace, load_trace

DEFAULT_STEPS = 16  # default capacities: L*E/16, 2*L*E/16, ..., L*E


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage problem as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ExpertcacheError as e:
        print(f"expertcache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("expertcache: interrupted", file=sys.stderr)
        return 130


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="expertcache", description="Expert caching for Mixture-of-Experts inference.")
    p.add_argument("--version", action="version", version=f"expertcache {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("sim", help="replay a routing trace through eviction policies")
    s.add_argument("trace", nargs="?", default="default", help="trace .npz (default: the embedded trace)")
    s.add_argument("--policy", action="append", metavar="NAME[:k=v,...]", help="repeatable")
    s.add_argument(
        "--capacity",
        nargs="+",
        metavar="N",
        help=f"experts: N [N ...], START:STOP[:STEP] or all = 1..L*E (default: {DEFAULT_STEPS} even steps)",
    )
    s.add_argument("--order", choices=ORDERS, default="layer")
    s.add_argument("--seed", type=int, default=0, help="seed of randomized policies")
    s.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="processes for replays (default: all CPUs)"
    )
    s.add_argument("--json", action="store_true", help="print one JSON array of results")
    s.add_argument("--plot", metavar="FILE.png", help="write misses against capacity")
    s.add_argument("--per-layer", action="store_true", help="also print each result's misses per layer")
    s.set_defaults(func=_cmd_sim)

    tm = sub.add_parser("timing", help="replay a trace in virtual time: TTFT, TPOT, stall, prefetching")
    tm.add_argument("--trace", default="default", metavar="FILE.npz", help="(default: the embedded trace)")
    tm.add_argument("--policy", default="lru", metavar="NAME[:k=v,...]", help="any policy (default lru)")
    size = tm.add_mutually_exclusive_group()
    size.add_argument("--capacity", type=int, metavar="N", help="experts the cache holds")
    size.add_argument(
        "--expert-memory", metavar="X", help="bytes (6GiB) or a share of all experts (default 50%%)"
    )
    tm.add_argument(
        "--prefetch", default="none", metavar="NAME", help="predictor, or none (default); 'recorded' "
        "replays the trace's recorded predictions, as do the gate-input predictors"
    )  # fmt: skip
    tm.add_argument("--window", type=int, metavar="K", help="layers ahead (default: the predictor's)")
    tm.add_argument(
        "--predictor", metavar="TRACE.npz", help="a recorded trace token (required) and eam learn from"
    )
    tm.add_argument(
        "--prefetch-limit",
        type=int,
        metavar="N",
        help="experts prefetched per predicted layer (default top-k)",
    )
    tm.add_argument("--no-chunking", action="store_true", help="move each expert as one chunk")
    tm.add_argument(
        "--chunk-size", metavar="SIZE", help="bytes per transfer chunk (default: a third of an expert)"
    )
    tm.add_argument(
        "--miss", default="fetch", metavar="NAME[:k=v,...]", help="what to do on a miss (default fetch)"
    )
    tm.add_argument("--no-preemption", action="store_true", help="keep a layer's unchosen prefetches")
    tm.add_argument("--no-reorder", action="store_true", help="compute experts in the router's order")
    tm.add_argument("--cost", metavar="FILE.json", help="cost model (the flags below override it)")
    for flag, meta, what in _TIMING_COST_FLAGS:
        tm.add_argument(flag, metavar=meta, help=what)
    tm.add_argument("--seed", type=int, default=0, help="seed of randomized policies and predictors")
    tm.add_argument("--json", action="store_true", help="print one JSON object")
    tm.set_defaults(func=_cmd_timing)

    t = sub.add_parser("trace", help="inspect or generate routing traces")
    tsub = t.add_subparsers(dest="trace_command", required=True, parser_class=_Parser)
    info = tsub.add_parser("info", help="shape, per-layer entropy and reuse of a trace")
    info.add_argument("file")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=_cmd_trace_info)
    syn = tsub.add_parser("synth", help="write a seeded synthetic trace")
    syn.add_argument("--kind", required=True, choices=list(GENERATORS))
    syn.add_argument("-o", "--out", required=True, metavar="FILE.npz")
    for flag, typ in (
        ("--tokens", int), ("--layers", int), ("--experts", int), ("--top-k", int), ("--seed", int),
        ("--a", float), ("--b", float), ("--stickiness", float), ("--sequences", int),
        ("--prompt-len", int), ("--layer", int),
    ):  # fmt: skip
        syn.add_argument(flag, type=typ)
    syn.set_defaults(func=_cmd_trace_synth)

    pol = sub.add_parser("policies", help="list the eviction policies")
    pol.set_defaults(func=_cmd_policies)
    prd = sub.add_parser("predictors", help="list the expert predictors (for --prefetch)")
    prd.set_defaults(func=_cmd_predictors)
    mis = sub.add_parser("misses", help="list the miss paths (for --miss)")
    mis.set_defaults(func=_cmd_misses)

    g = sub.add_parser("generate", help="generate text with experts offloaded under a memory budget")
    g.add_argument(
        "--model", metavar="PATH", help="Hugging Face MoE checkpoint dir (default: the embedded model)"
    )
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    g.add_argument(
        "--expert-memory",
        default="100%",
        metavar="X",
        help="bytes (6GiB, 500MB) or a share of all experts (30%%)",
    )
    g.add_argument(
        "--policy", default="lru", metavar="NAME[:k=v,...]", help="any online policy (default lru)"
    )
    g.add_argument("--profile", metavar="TRACE.npz", help="usage profile for the static policies")
    g.add_argument("--device", choices=["cpu", "cuda"], help="compute device (default: cuda if present)")
    g.add_argument("--dtype", help="compute dtype (default: the checkpoint's)")
    g.add_argument("--slow-tier", choices=["host", "disk"], help="where experts wait (default: host on cuda)")
    g.add_argument("--link-bandwidth", metavar="RATE", help="emulate a slow-tier link, e.g. 16GB/s")
    g.add_argument("--link-latency", default="0", metavar="TIME", help="per-transfer latency, e.g. 20us")
    g.add_argument(
        "--stream", action="store_true", help="print tokens as they come (with --json: one line each)"
    )
    g.add_argument(
        "--json", action="store_true", help="print one JSON object with tokens, text, timings, cache"
    )
    g.add_argument("--record-trace", metavar="FILE.npz", help="write the run's routing as a trace")
    g.add_argument(
        "--miss",
        default="fetch",
        metavar="NAME[:k=v,...]",
        help="what to do on a miss: fetch (default), host, hybrid, placement, ... (expertcache misses)",
    )
    _add_prefetch_args(g)
    g.set_defaults(func=_cmd_generate)

    mdl = sub.add_parser("model", help="inspect a MoE checkpoint or build a random one")
    msub = mdl.add_subparsers(dest="model_command", required=True, parser_class=_Parser)
    mi = msub.add_parser("info", help="family, MoE layers, experts and their bytes")
    mi.add_argument("path", nargs="?", help="checkpoint dir (default: the embedded model)")
    mi.add_argument("--json", action="store_true")
    mi.set_defaults(func=_cmd_model_info)
    ms = msub.add_parser("synth", help="save a random-weight checkpoint of a supported family")
    ms.add_argument("--family", required=True, help="mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, ...")
    ms.add_argument("-o", "--out", required=True, metavar="DIR")
    for flag, default in (("--hidden", 64), ("--layers", 2), ("--experts", 8), ("--top-k", 2)):
        ms.add_argument(flag, type=int, default=default)
    ms.add_argument("--intermediate", type=int, default=64)
    ms.add_argument("--heads", type=int, default=4)
    ms.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ms.add_argument("--max-shard-size", metavar="SIZE", help="shard the safetensors files, e.g. 500MB")
    ms.add_argument("--seed", type=int, default=0)
    ms.add_argument(
        "--tokenizer", metavar="DIR", help="copy the tokenizer from here (default: embedded model)"
    )
    ms.set_defaults(func=_cmd_model_synth)

    tp = sub.add_parser("train-predictor", help="train ProMoE's learned expert predictor for a model")
    tp.add_argument("--model", metavar="PATH", help="checkpoint dir (default: the embedded model)")
    tp.add_argument("--out", required=True, metavar="DIR", help="where the predictor is written")
    tp.add_argument(
        "--window", type=int, nargs="+", default=[2], metavar="K",
        help="layers ahead (default 2); several windows: one DIR/window-K/ each",
    )  # fmt: skip
    tp.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: stdlib sources)")
    tp.add_argument("--epochs", type=int, metavar="N", help="training epochs (default 10)")
    tp.add_argument("--hidden", type=int, metavar="N", help="MLP hidden width (default 128)")
    tp.add_argument("--max-new-tokens", type=int, metavar="N", help="greedy tokens per prompt (default 64)")
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--json", action="store_true", help="print the training report as one JSON object")
    tp.set_defaults(func=_cmd_train_predictor)

    q = sub.add_parser("quantize", help="write low-precision copies of a model's experts (for --miss hobbit)")
    q.add_argument("model", nargs="?", help="checkpoint dir (default: the embedded model)")
    q.add_argument(
        "--bits", type=int, nargs="+", default=[8, 4], metavar="B", help="8, 4 and/or 2 (default 8 4)"
    )
    q.add_argument(
        "--group", type=int, default=64, metavar="N", help="weights per scale and zero (default 64)"
    )
    q.add_argument(
        "--out", metavar="DIR", help="where (default: beside the checkpoint, else the user's cache)"
    )
    q.add_argument("--fast", action="store_true", help="plain min-max rounding, without HQQ's optimisation")
    q.add_argument("--json", action="store_true", help="print one JSON array of the files written")
    q.set_defaults(func=_cmd_quantize)

    ql = sub.add_parser(
        "quality", help="perplexity and top-1 agreement of a lossy miss path against the model"
    )
    ql.add_argument("--model", metavar="PATH", help="checkpoint dir (default: the embedded model)")
    ql.add_argument(
        "--miss", required=True, metavar="NAME[:k=v,...]", help="the miss path measured, e.g. hobbit"
    )
    ql.add_argument("--expert-memory", default="25%", metavar="X", help="bytes or a share (default 25%%)")
    ql.add_argument("--policy", default="lru", metavar="NAME[:k=v,...]")
    ql.add_argument(
        "--tokens", type=int, default=2048, metavar="N", help="tokens measured in all (default 2048)"
    )
    ql.add_argument("--text", metavar="FILE", help="a text file to measure on (default: held-out files)")
    ql.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ql.add_argument("--json", action="store_true", help="print one JSON object")
    ql.set_defaults(func=_cmd_quality)

    pa = sub.add_parser("predictor-accuracy", help="ProMoE's ACCURACY_i(k) of predictors on a model's runs")
    pa.add_argument("--model", metavar="PATH", help="checkpoint dir (default: the embedded model)")
    pa.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: the held-out prompts)")
    pa.add_argument(
        "--predictors", nargs="+", default=["next-gate", "learned"], metavar="NAME",
        help="predictor names (default: next-gate learned)",
    )  # fmt: skip
    pa.add_argument("--window", type=int, nargs="+", default=[1, 2, 3, 4], metavar="K")
    pa.add_argument(
        "--predictor", metavar="PATH", help="trained predictor dir (learned) or trace (token, eam)"
    )
    pa.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    pa.add_argument("--json", action="store_true")
    pa.set_defaults(func=_cmd_predictor_accuracy)
    return p


def _cmd_sim(args: argparse.Namespace) -> int:
    trace = default_trace() if args.trace == "default" else load_trace(args.trace)
    keys = trace.num_layers * trace.num_experts
    step = max(1, keys // DEFAULT_STEPS)
    caps = _capacities(args.capacity or [f"{step}:{keys}:{step}"], trace, args.order)
    policies = args.policy or DEFAULT_POLICIES
    if args.jobs < 1:
        raise ExpertcacheError(f"--jobs must be at least 1, got {args.jobs}")
    for c in caps:
        check_capacity(c, args.order, trace.top_k)
    _note_skipped(policies, caps, trace.num_layers, min_room(args.order, trace.top_k))
    results = simulate(trace, policies, caps, args.order, args.seed, len(caps) > 1, args.jobs)
    if args.plot:
        name = "embedded default trace" if args.trace == "default" else args.trace
        plot_curves(results, args.plot, f"{name}: misses against capacity ({args.order} order)")
    if args.json:
        print(json.dumps([r.to_dict() for r in results]))
    else:
        print(format_table(results))
        if args.per_layer:
            print("\n" + format_layers(results))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


_TIMING_COST_FLAGS = (
    ("--link-bandwidth", "RATE", "e.g. 16GB/s (default 25GB/s)"),
    ("--link-latency", "TIME", "per chunk, e.g. 20us"),
    ("--dense-time", "TIME[,TIME...]", "per layer: attention, norms, router (one, or one per layer)"),
    ("--expert-time", "TIME[,PER_TOKEN]", "one expert's compute: fixed, and per token (e.g. 0.35ms,2us)"),
    ("--step-time", "TIME", "per forward step: embeddings, LM head"),
    ("--host-time", "TIME[,PER_TOKEN]", "one expert computed on the host: fixed, and per token"),
    ("--dequant-time", "TIME", "device time to expand a low-precision copy (default 0)"),
    ("--expert-bytes", "SIZE", "bytes of one expert, e.g. 336MiB"),
    ("--wake-time", "TIME", "compute resumes this long after a transfer it waited for (default 0)"),
    ("--issue-time", "TIME", "compute time spent issuing one transfer (default 0)"),
)


def _cmd_timing(args: argparse.Namespace) -> int:
    from expertcache.config import CacheConfig, MissConfig, PrefetchConfig
    from expertcache.costs import CostModel
    from expertcache.sim.timing import format_timing, simulate_timing
    from expertcache.units import capacity_for

    trace = default_trace() if args.trace == "default" else load_trace(args.trace)
    prefetch = PrefetchConfig(
        args.prefetch,
        window=args.window,
        data=args.predictor,
        limit=args.prefetch_limit,
        chunking=not args.no_chunking,
        chunk_size=args.chunk_size,
        preemption=not args.no_preemption,
        reorder=not args.no_reorder,
    )
    cache, miss = CacheConfig(args.policy, seed=args.seed), MissConfig(args.miss)
    split = {k: v.split(",") for k in ("dense_time", "expert_time", "host_time") if (v := getattr(args, k))}
    for flag in ("expert_time", "host_time"):
        if len(split.get(flag, ())) > 2:
            given = getattr(args, flag)
            raise ExpertcacheError(f"--{flag.replace('_', '-')} {given!r} is TIME or TIME,PER_TOKEN")
    fields = {
        "link_bandwidth": args.link_bandwidth,
        "link_latency": args.link_latency,
        "dense_s": split["dense_time"] if len(split.get("dense_time", ())) > 1 else args.dense_time,
        "expert_s": split["expert_time"][0] if "expert_time" in split else None,
        "expert_token_s": split["expert_time"][1] if len(split.get("expert_time", ())) == 2 else None,
        "host_expert_s": split["host_time"][0] if "host_time" in split else None,
        "host_expert_token_s": split["host_time"][1] if len(split.get("host_time", ())) == 2 else None,
        "step_s": args.step_time,
        "expert_bytes": args.expert_bytes,
        "chunk_bytes": prefetch.chunk_bytes,
        "wake_s": args.wake_time,
        "submit_s": args.issue_time,
        "dequant_s": args.dequant_time,
    }
    base = CostModel.load(args.cost) if args.cost else None
    cost = CostModel.from_dict({k: v for k, v in fields.items() if v is not None}, base)
    if not prefetch.chunking:
        cost = CostModel.from_dict({"chunk_bytes": None}, cost)
    total = trace.num_layers * trace.num_experts
    capacity = args.capacity or capacity_for(args.expert_memory or "50%", cost.expert_bytes, total)
    predictor_trace = load_trace(args.predictor) if args.predictor else None
    result = simulate_timing(
        trace, capacity, cache=cache, prefetch=prefetch, miss=miss, cost=cost, predictor_trace=predictor_trace
    )
    if args.json:
        print(json.dumps({"trace": trace.source, **result.to_dict()}))
    else:
        print(f"trace      {trace.source}: T={trace.num_tokens} L={trace.num_layers} E={trace.num_experts} "
              f"K={trace.top_k}")  # fmt: skip
        print(format_timing(result))
    return 0


def _note_skipped(policies: Sequence[str], caps: list[int], num_layers: int, min_room: int) -> None:
    """Say which capacities a -dist policy could not run with (a layer's budget below its group)."""
    for spec in policies:
        name, params = parse_policy(spec)
        low = min_capacity(name, num_layers, params, min_room)
        skipped = [c for c in caps if c < low]
        if skipped and len(skipped) == len(caps):
            raise ExpertcacheError(f"{name} needs capacity >= {low} (each layer needs {min_room} slot(s))")
        if skipped:
            print(
                f"note: {name} left out at capacities < {low} (each layer needs {min_room} slot(s))",
                file=sys.stderr,
            )


def _capacities(items: Sequence[str], trace: Trace, order: str) -> list[int]:
    total = trace.num_layers * trace.num_experts
    if list(items) == ["all"]:
        return list(range(min_room(order, trace.top_k), total + 1))
    caps: list[int] = []
    for item in items:
        parts = item.split(":")
        try:
            nums = [int(x) for x in parts]
        except ValueError:
            raise ExpertcacheError(f"capacity {item!r} is not an integer, START:STOP[:STEP] or all") from None
        if len(nums) == 1:
            caps.append(nums[0])
        elif len(nums) in (2, 3) and (len(nums) == 2 or nums[2] > 0):
            start, stop = nums[0], min(nums[1], total)
            caps += range(start, stop + 1, nums[2] if len(nums) == 3 else 1)
        else:
            raise ExpertcacheError(f"capacity range {item!r} must be START:STOP[:STEP] with STEP > 0")
    if not caps:
        raise ExpertcacheError(f"capacity {' '.join(items)} selects no capacity")
    return list(dict.fromkeys(caps))


def _cmd_trace_info(args: argparse.Namespace) -> int:
    info = summary(load_trace(args.file))
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"trace       {info['source']}")
    print(f"shape       T={info['tokens']} tokens, L={info['layers']} layers, E={info['experts']} experts, "
          f"K={info['top_k']}")  # fmt: skip
    print(f"sequences   {info['sequences'] or '-'} (prefill tokens: {info['prefill_tokens'] or 0})")
    print(f"unknown     {info['unknown_entries']} entries")
    print(f"entropy     mean {info['mean_entropy_bits']:.3f} bits of {info['max_entropy_bits']:.3f}")
    print(f"reuse       mean {info['mean_reuse']:.3f} of a token's experts were used by the previous token")
    print("layer  entropy  reuse")
    for layer, (h, r) in enumerate(zip(info["entropy_bits"], info["reuse"], strict=True)):
        print(f"{layer:5d}  {h:7.3f}  {r:5.3f}")
    return 0


def _cmd_trace_synth(args: argparse.Namespace) -> int:
    names = ("tokens", "layers", "experts", "top_k", "seed", "a", "b", "stickiness", "sequences",
             "prompt_len", "layer")  # fmt: skip
    params = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    trace = synthesize(args.kind, **params)
    trace.save(args.out)
    print(f"wrote {args.out}: {args.kind} trace, T={trace.num_tokens} L={trace.num_layers} "
          f"E={trace.num_experts} K={trace.top_k}")  # fmt: skip
    return 0


def _cmd_policies(args: argparse.Namespace) -> int:
    for name in POLICIES:
        cls = policy_class(name)
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        kind = "offline" if cls.offline else "online"
        print(f"{name:13s} {kind:7s} {'per-layer split of ' if name.endswith('-dist') else ''}{doc}")
    return 0


def _cmd_misses(args: argparse.Namespace) -> int:
    from expertcache.miss.registry import MISS_PATHS, parameters

    for name, cls in MISS_PATHS.items():
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        if cls.__module__.endswith(".base"):
            doc = "fetch the whole expert at full precision (the default)."
        kind = "lossy" if cls.lossy else "exact"
        params = ",".join(parameters(cls))
        print(f"{name:10s} {kind:6s} {doc}" + (f" [{params}]" if params else ""))
    return 0


def _cmd_predictors(args: argparse.Namespace) -> int:
    from expertcache.predict.registry import PREDICTORS

    for name, cls in PREDICTORS.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        where = "sim" if cls.sim_only else "engine" if cls.needs_model else "both"
        print(f"{name:10s} {where:6s} window {cls.default_window}  {doc}")
    print(
        "(engine-only predictors are replayed by 'expertcache timing' from a trace recorded with "
        "'generate --prefetch NAME --record-trace FILE')"
    )
    return 0


def _add_prefetch_args(p: argparse.ArgumentParser) -> None:
    """Proactive caching switches (engine): predictor, window, chunking, preemption, reordering."""
    p.add_argument(
        "--prefetch",
        default="none",
        metavar="NAME",
        help="predictor for prefetching: none, next-gate, window, learned, token, eam (default none)",
    )
    p.add_argument(
        "--window", type=int, metavar="K", help="predict K layers ahead (default: the predictor's)"
    )
    p.add_argument(
        "--predictor",
        metavar="PATH",
        help="trained predictor dir (learned) or recorded trace (token, eam); default: the embedded model's",
    )
    p.add_argument(
        "--prefetch-limit",
        type=int,
        metavar="N",
        help="experts prefetched per predicted layer (default top-k)",
    )
    p.add_argument(
        "--predictor-thread", action="store_true", help="run the predictor beside inference, not inline"
    )
    p.add_argument("--no-chunking", action="store_true", help="move each expert in one piece")
    p.add_argument(
        "--chunk-size", metavar="SIZE", help="bytes per transfer chunk (default: a third of an expert)"
    )
    p.add_argument("--no-preemption", action="store_true", help="keep a layer's stale prefetches queued")
    p.add_argument(
        "--no-reorder", action="store_true", help="compute experts in routing order, not readiness"
    )


def _prefetch_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {
        "prefetch": args.prefetch.strip().lower(),
        "window": args.window,
        "predictor": args.predictor,
        "chunking": not args.no_chunking,
        "chunk_size": args.chunk_size,
        "preemption": not args.no_preemption,
        "reorder": not args.no_reorder,
        "prefetch_limit": args.prefetch_limit,
        "predictor_thread": args.predictor_thread,
    }


def _cmd_generate(args: argparse.Namespace) -> int:
    from expertcache.engine.offloaded import load  # torch and transformers only for this command

    _quiet_transformers()

    if args.max_new_tokens < 1:
        raise ExpertcacheError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.record_trace:
        _check_writable(args.record_trace)
    model = load(
        args.model,
        expert_memory=args.expert_memory,
        policy=args.policy,
        device=args.device,
        dtype=args.dtype,
        link_bandwidth=args.link_bandwidth,
        link_latency=args.link_latency,
        slow_tier=args.slow_tier,
        profile=args.profile,
        miss=args.miss,
        **_prefetch_kwargs(args),
    )
    try:
        streamer = None
        if args.stream and args.json:
            streamer = _JsonLines(model.tokenizer)
        elif not args.json:
            from transformers import TextStreamer

            streamer = TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
        result = model.generate_text(args.prompt, max_new_tokens=args.max_new_tokens, streamer=streamer)
        if args.record_trace:
            model.save_trace(args.record_trace)
    finally:
        model.close()
    out = result.to_dict()
    if args.record_trace:
        out["trace"] = args.record_trace
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"\n---\n{out['prompt_tokens']} prompt + {out['new_tokens']} new tokens | "
        f"TTFT {out['ttft_s'] * 1e3:.1f} ms | TPOT {out['tpot_s'] * 1e3:.1f} ms | "
        f"{out['tokens_per_s']:.1f} tok/s\n"
        f"cache {out['capacity_experts']}/{out['total_experts']} experts "
        f"({out['policy']}, {out['device']}) | "
        f"hits {out['hits']} | misses {out['misses']} | "
        f"moved {out['bytes_transferred'] / 2**20:.1f} MiB | stall {out['stall_s'] * 1e3:.1f} ms"
        + (
            f"\nprefetch {out['prefetch']} (window {out['window']}) | issued {out['prefetch_issued']} | "
            f"used {out['prefetch_used']} ({out['prefetch_late']} late) | "
            f"cancelled {out['prefetch_cancelled']}"
            if out["prefetch"] != "none"
            else ""
        )
        + (f"\ntrace written to {args.record_trace}" if args.record_trace else "")
    )
    return 0


def _quiet_transformers() -> None:
    """One line per problem: transformers' advice and progress bars stay out of the output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _cmd_model_info(args: argparse.Namespace) -> int:
    from expertcache.engine.offloaded import model_info

    _quiet_transformers()
    info = model_info(args.path)
    if args.json:
        print(json.dumps(info))
        return 0
    for key, value in info.items():
        print(f"{key:24s} {value}")
    return 0


def _cmd_model_synth(args: argparse.Namespace) -> int:
    from expertcache.engine.random_checkpoint import make_checkpoint

    _quiet_transformers()
    for name in ("hidden", "layers", "experts", "top_k", "intermediate", "heads"):
        if getattr(args, name) < 1:
            raise ExpertcacheError(f"--{name.replace('_', '-')} must be at least 1")
    out = make_checkpoint(
        args.out,
        args.family,
        hidden=args.hidden,
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        intermediate=args.intermediate,
        heads=args.heads,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        seed=args.seed,
        tokenizer=args.tokenizer,
    )
    print(f"wrote {out}")
    return 0


def _cmd_train_predictor(args: argparse.Namespace) -> int:
    from expertcache.tools.train_predictor import format_report, train_predictor

    _quiet_transformers()
    names = ("epochs", "hidden", "max_new_tokens")
    opts = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    report = train_predictor(
        args.model,
        args.out,
        args.prompts,
        args.window[0] if len(args.window) == 1 else args.window,
        seed=args.seed,
        log=None if args.json else lambda line: print(line, file=sys.stderr),
        **opts,
    )
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    from expertcache.tools.quantize import quantize_model

    _quiet_transformers()
    records = quantize_model(
        args.model, args.bits, args.group, args.out, optimize=not args.fast,
        log=None if args.json else lambda line: print(line, file=sys.stderr, flush=True),
    )  # fmt: skip
    if args.json:
        print(json.dumps(records))
    else:
        for r in records:
            share = r["bytes_per_expert"] / r["full_bytes_per_expert"]
            print(f"int{r['bits']} (group {r['group']}): {r['path']} ({r['bytes_per_expert']} bytes per "
                  f"expert, {share:.1%} of the full one)")  # fmt: skip
    return 0


def _cmd_quality(args: argparse.Namespace) -> int:
    from expertcache.config import MissConfig
    from expertcache.tools.quality import format_quality, measure

    _quiet_transformers()
    MissConfig(args.miss)  # a bad spec is refused before anything loads
    texts = None
    if args.text:
        try:
            texts = [Path(args.text).read_text(encoding="utf-8")]
        except (OSError, UnicodeDecodeError) as exc:
            raise ExpertcacheError(f"{args.text}: cannot read the text ({exc})") from None
    r = measure(
        args.model, args.miss, args.expert_memory, args.policy, texts, args.tokens, args.device,
        progress=not args.json,
    )  # fmt: skip
    print(json.dumps(r) if args.json else format_quality(r))
    return 0


def _cmd_predictor_accuracy(args: argparse.Namespace) -> int:
    from expertcache.predict.registry import predictor_class
    from expertcache.tools.predictor_accuracy import evaluate_model, format_accuracy
    from expertcache.tools.train_predictor import read_prompts

    _quiet_transformers()
    names = [n.strip().lower() for n in args.predictors]
    for name in names:
        if predictor_class(name).sim_only:
            raise ExpertcacheError(f"predictor {name} needs the future; it is exact by definition")
    if min(args.window) < 1 or args.max_new_tokens < 1:
        raise ExpertcacheError("--window and --max-new-tokens must be at least 1")
    trace = None
    if args.predictor and Path(args.predictor).suffix == ".npz":
        trace = load_trace(args.predictor)
    rows = evaluate_model(
        args.model,
        read_prompts(args.prompts) if args.prompts else None,
        names=names,
        windows=args.window,
        max_new_tokens=args.max_new_tokens,
        learned_path=args.predictor if trace is None else None,
        trace=trace,
    )
    print(json.dumps(rows) if args.json else format_accuracy(rows))
    return 0


class _JsonLines:
    """Streams one JSON line per generated token: {"token": id, "text": piece}."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self._prompt = tokenizer, True

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
            return
        for tok in value.reshape(-1).tolist():
            print(json.dumps({"token": tok, "text": self.tokenizer.decode([tok])}), flush=True)

    def end(self) -> None:
        pass


def _check_writable(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ExpertcacheError(f"{path}: directory {parent} does not exist")
    if os.path.isdir(path):
        raise ExpertcacheError(f"{path}: is a directory")


if __name__ == "__main__":
    sys.exit(main())
