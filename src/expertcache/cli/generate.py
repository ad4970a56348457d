"""``expertcache generate`` and ``expertcache chat``: text from the offloaded model, as people use it.

Prompts come from ``--prompt`` (``-``: standard input), ``--prompt-file`` or, many at once, ``--prompts``
(one a line, or JSON lines), run in left-padded batches. The text goes to stdout, everything else (the
cache's work, timings, progress) to stderr, so ``generate ... > out.txt`` holds only the text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import sys
import time

from expertcache.cli.util import (
    beside_plan,
    lossy_note,
    output_option,
    quiet_transformers,
    startup_gc,
    unseeded_note,
)
from expertcache.errors import ExpertcacheError
from expertcache.units import format_bytes

PREFETCH_WHEN = ("always", "pays")  # config.WHEN, without importing it at start-up (a test keeps them equal)

HOST_FLAGS = ("host_memory", "host_policy", "host_stage", "host_exclusive")  # a host level's options
SLOW_TIERS = ["host", "disk", "mapped"]  # engine.transfer.SLOW_TIERS (not imported: no torch before checks)
# engine.kernels: AUTO_KERNEL and KERNELS (not imported: no torch before checks; a test checks)
KERNEL_CHOICES = ["auto", "grouped", "eager", "compiled", "packed"]
DENSE_FORMATS = ["int8"]  # engine.dense.DENSE_FORMATS (not imported: no torch before checks; a test checks)
ATTENTION = ["sdpa", "eager", "sdpa_no_cudnn"]  # engine.loader.ATTENTION (the same; a test checks)
ATTENTION_HELP = (
    "transformers' attention implementation: sdpa, eager, or sdpa_no_cudnn (sdpa with cuDNN's backend left "
    "out: on a GPU cuDNN plans every new key length, 33 ms each on an H200), each exact against "
    "transformers loaded with it (default: transformers' default, sdpa or eager where it has none, with "
    "sdpa_no_cudnn in place of sdpa on a GPU; on a CPU in bfloat16 eager decodes faster at long contexts)"
)
SLOW_TIER_HELP = (
    "where experts wait: host memory (default on cuda), the disk (exact reads, nothing left in the page "
    "cache: memory bounded by the budget; default on cpu) or the checkpoint's memory map (mapped: its "
    "pages stay in the page cache)"
)

CHAT_COMMANDS = "/reset (forget the conversation), /stats (the cache's work), /exit (or /quit)"


# ------------------------------------------------------------------------------------ parsers
def add_parsers(sub) -> None:
    g = sub.add_parser("generate", help="generate text with experts offloaded under a memory budget")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt; - reads it from standard input")
    src.add_argument("--prompt-file", metavar="FILE", help="the prompt: a whole file")
    src.add_argument(
        "--prompts", metavar="FILE",
        help="many prompts: one a line (\\n for a newline) or JSON lines "
        "({\"prompt\"|\"messages\", \"id\"}); - reads standard input; results are JSON lines",
    )  # fmt: skip
    g.add_argument("--batch-size", type=int, metavar="N", help="--prompts run N together (default 8)")
    g.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="(default 32)")
    g.add_argument(
        "--stream", action="store_true", help="with --json: a JSON line per token first (text always streams)"
    )
    g.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, timings, cache")
    g.add_argument("--echo", action="store_true", help="print the prompt before the text")
    g.add_argument("--record-trace", metavar="FILE.npz", help="write the run's routing as a trace")
    output_option(g, "record_trace", "trace")
    _add_chat_template(g, "--chat", "apply the tokenizer's chat template to the prompt (a user message)")
    _add_common(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="talk to the model; the cache stays warm between turns")
    c.add_argument("--system", metavar="TEXT", help="a system message first")
    c.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="per reply (default 128)")
    c.add_argument(
        "--record-trace",
        metavar="FILE.npz",
        help="write the conversation's routing as a trace when the chat ends",
    )
    output_option(c, "record_trace", "trace")
    _add_chat_template(c, None, None)
    _add_common(c)
    c.set_defaults(func=cmd_chat)


def _add_chat_template(p, flag: str | None, what: str | None) -> None:
    if flag:
        p.add_argument(flag, action="store_true", help=what)
    p.add_argument(
        "--chat-template", metavar="FILE.jinja", help="a chat template to use (default: the tokenizer's)"
    )


def _add_common(p) -> None:
    add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--quiet", action="store_true", help="no statistics or progress on stderr")


def add_model_args(p) -> None:
    p.add_argument(
        "--model", metavar="PATH|ORG/NAME",
        help="checkpoint folder, or a Hugging Face id in the local cache (default: the embedded model)",
    )  # fmt: skip
    p.add_argument("--download", action="store_true", help="download a Hugging Face id not in the cache")
    p.add_argument(
        "--no-warmup", action="store_true",
        help="at 100%% expert memory, skip the 2-token warm-up generation at load (it takes the first "
        "request's one-time costs); below it on a CPU, the packed and low-precision loops' run at load",
    )  # fmt: skip
    p.add_argument(
        "--expert-memory", metavar="X",
        help="bytes (6GiB, 500MB) or a share of all experts (30%%); default 100%% = no offloading",
    )  # fmt: skip
    p.add_argument("--policy", metavar="NAME[:k=v,...]", help="any online policy (default lru)")
    p.add_argument(
        "--plan", metavar="PLAN.json",
        help="run a plan (expertcache plan): its expert memory, policy and budgets, miss path, predictor",
    )  # fmt: skip
    p.add_argument("--profile", metavar="TRACE.npz", help="usage profile for the static policies")
    p.add_argument(
        "--policy-seed",
        type=int,
        metavar="N",
        help="seed of a randomized policy (random, marking; default 0)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="compute device (default: cuda if present)")
    p.add_argument(
        "--dtype",
        help="compute dtype (default: the checkpoint's); on a CPU with int8 experts and --quantize-dense "
        "int8, float32 decodes faster than bfloat16 (docs/ENGINE.md)",
    )
    p.add_argument("--slow-tier", choices=SLOW_TIERS, help=SLOW_TIER_HELP)
    p.add_argument(
        "--host-memory", metavar="X",
        help="three tiers: a host cache of experts of this size (bytes, or a share of all experts: 30%%) "
        "between the expert memory and the checkpoint on disk, pinned on a GPU (default: none; on a GPU "
        "every expert waits in host memory, on a CPU the disk is below the expert memory)",
    )  # fmt: skip
    p.add_argument(
        "--host-policy", metavar="NAME[:k=v,...]", help="the host cache's eviction policy (default lru)"
    )
    p.add_argument(
        "--host-stage", type=int, default=0, metavar="N",
        help="with --host-memory and a predictor: read up to N more predicted experts a layer into the host "
        "cache early, beyond what the prefetch moves to the expert memory (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--host-exclusive", action="store_true",
        help="with --host-memory: the host cache holds what the expert memory does not (a hit moves up, "
        "the expert memory's victim comes down): more distinct experts in the two memories (default: "
        "inclusive)",
    )  # fmt: skip
    p.add_argument(
        "--kernel", choices=KERNEL_CHOICES, default="auto",
        help="how a layer's experts are computed: grouped (one grouped_mm over the slot pool, exact "
        "against transformers' grouped_mm), eager (one at a time, exact against its eager loop), "
        "compiled (CPU: grouped, with decode steps' experts in compiled loops at the memory's speed; "
        "not bit-equal to transformers), packed (a packed checkpoint's, taken for one); default auto: "
        "grouped where torch has it, packed for a packed checkpoint",
    )  # fmt: skip
    p.add_argument(
        "--quantize-dense", choices=DENSE_FORMATS, metavar="FORMAT",
        help="quantise the dense layers at load (every linear layer but the experts and the routers: "
        "attention, shared experts, dense MLP layers, the output head ...) and compute them packed: int8 "
        "(one scale a row; lossy, opt-in: expertcache quality --quantize-dense int8 says how far; default: "
        "as stored)",
    )  # fmt: skip
    p.add_argument("--attention", choices=ATTENTION, help=ATTENTION_HELP)
    p.add_argument("--link-bandwidth", metavar="RATE", help="emulate a slow-tier link, e.g. 16GB/s")
    p.add_argument(
        "--link-latency", default="0", metavar="TIME", help="per-transfer latency, e.g. 20us (default 0)"
    )
    p.add_argument(
        "--miss", metavar="NAME[:k=v,...]",
        help="what to do on a miss: fetch (default), host, hybrid, placement, ... (expertcache misses)",
    )  # fmt: skip
    p.add_argument(
        "--cost", metavar="FILE.json",
        help="the costs a cost-based miss path (host, hybrid, batch) decides by: a cost model or a profile "
        "(expertcache profile); default: measured at load, which differ from run to run",
    )  # fmt: skip
    add_prefetch_args(p)


def _add_sampling_args(p) -> None:
    p.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="sample at T > 0 (default 0: greedy)"
    )
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling cut-off (default: none)")
    p.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest (default: all)")
    p.add_argument("--seed", type=int, metavar="N", help="sampling seed (default: a fresh one, reported)")
    p.add_argument("--repetition-penalty", type=float, metavar="R", help="e.g. 1.1 (default: none)")
    p.add_argument(
        "--stop", action="append", metavar="TEXT",
        help="end the text at TEXT (repeatable), taken as written: a newline is the shell's $'\\n', not \\n",
    )  # fmt: skip


def add_prefetch_args(p: argparse.ArgumentParser) -> None:
    """Proactive caching switches (engine): predictor, window, chunking, preemption, reordering."""
    p.add_argument(
        "--prefetch", metavar="NAME",
        help="auto (default: the model's predictor, used only while it pays), none, next-gate, window, "
        "adaptive, learned, token, eam (see: expertcache predictors)",
    )  # fmt: skip
    p.add_argument(
        "--prefetch-when", choices=PREFETCH_WHEN,
        help="always: predict in every step; pays: only while measured to make steps shorter (default: "
        "pays for auto, always for a named predictor)",
    )  # fmt: skip
    p.add_argument(
        "--window", type=int, metavar="K", help="predict K layers ahead (default: the predictor's)"
    )
    p.add_argument(
        "--predictor", metavar="PATH",
        help="trained predictor dir (learned) or recorded trace (token, eam); default: the embedded model's",
    )  # fmt: skip
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
        "--chunk-size",
        metavar="SIZE",
        help="bytes per chunk of a prefetch (default: a third of an expert where chunks pay, else whole)",
    )
    p.add_argument("--no-preemption", action="store_true", help="keep a layer's stale prefetches queued")
    p.add_argument(
        "--deterministic", action="store_true",
        help="repeat hits, misses and lossy outputs exactly: transfers land before each decision (no "
        "overlap), prefetching always (not only while it pays)",
    )  # fmt: skip
    p.add_argument(
        "--no-reorder", action="store_true", help="compute experts in routing order, not readiness"
    )


# ------------------------------------------------------------------------------------ building
def _sampling(args):
    from expertcache.config import SamplingConfig

    return SamplingConfig(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        repetition_penalty=args.repetition_penalty, stop=tuple(args.stop or ()),
    )  # fmt: skip


def load_plan(args):
    """``--plan``'s ``Plan``, refused in one line beside the options it sets."""
    from expertcache.plan import Plan

    given = [f for f in ("expert_memory", "policy", "miss", "prefetch", "window") if getattr(args, f, None)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ExpertcacheError(
            f"--plan sets the expert memory, policy, miss path and predictor; leave out {flag}"
        )
    return Plan.load(args.plan)


def _policy_seed(args, cache):
    """``--policy-seed`` in the cache's config (the sampling seed is ``--seed``), with a note where the
    policy draws nothing at random: a seed given there changes nothing, and is not taken in silence."""
    seed = getattr(args, "policy_seed", None)
    if seed is None:
        return cache
    if seed < 0:
        raise ExpertcacheError(f"--policy-seed must be at least 0, got {seed}")
    note = unseeded_note("--policy-seed", seed, [cache.name])
    if note is not None:
        print(note, file=sys.stderr)
    return dataclasses.replace(cache, seed=seed)


def load_model(args, record: bool = True):
    """The offloaded model the options describe; the options are checked before torch is imported.
    ``record``: keep the routing (for ``--record-trace``); a server keeps none (it would grow forever)."""
    from expertcache.config import AUTO, CacheConfig, HostConfig, LinkConfig, MissConfig, PrefetchConfig

    options = {
        "data": args.predictor, "limit": args.prefetch_limit, "chunking": not args.no_chunking,
        "chunk_size": args.chunk_size, "preemption": not args.no_preemption, "reorder": not args.no_reorder,
        "thread": args.predictor_thread, "when": args.prefetch_when, "deterministic": args.deterministic,
    }  # fmt: skip
    plan = None
    if args.plan:
        plan = load_plan(args)
        if (note := beside_plan(args)) is not None:
            print(note, file=sys.stderr)
        cache = plan.cache_config(profile=args.profile)  # a static plan's usage profile
        miss, prefetch = plan.miss_config(), plan.prefetch_config(**options)
        plan.refuse_host([f"--{f.replace('_', '-')}" for f in HOST_FLAGS if getattr(args, f)])
    else:
        cache = CacheConfig(args.policy or "lru", profile=args.profile)
        miss = MissConfig(args.miss or "fetch")
        prefetch = PrefetchConfig(args.prefetch or AUTO, window=args.window, **options)
    cache = _policy_seed(args, cache)
    LinkConfig(args.link_bandwidth, args.link_latency)
    for flag in HOST_FLAGS[1:]:
        if getattr(args, flag) and args.host_memory is None:
            raise ExpertcacheError(
                f"--{flag.replace('_', '-')} needs --host-memory (the host cache it rules)"
            )
    host = HostConfig(
        args.host_memory, args.host_policy or "lru", exclusive=args.host_exclusive, stage=args.host_stage
    )
    costs = None
    if args.cost:
        from expertcache.costs import CostModel
        from expertcache.miss.registry import miss_class

        if not miss_class(miss.name).needs_costs:
            raise ExpertcacheError(
                f"--cost changes nothing here: miss path {miss.name} decides by no costs (host, hybrid and "
                "batch do)"
            )
        CostModel.load(args.cost)  # read and checked before any work; the engine checks its shape and tier
        costs = args.cost
    with startup_gc(getattr(args, "whole_process", False)):  # start-up: see startup_gc
        from expertcache.engine.offloaded import load

        quiet_transformers()
        model = load(
            args.model, **({} if plan else {"expert_memory": args.expert_memory or "100%"}), policy=cache,
            prefetch=prefetch,
            miss=miss, device=args.device, dtype=args.dtype, link_bandwidth=args.link_bandwidth,
            link_latency=args.link_latency, slow_tier=args.slow_tier, download=args.download,
            progress=False if args.quiet else None, record=record, plan=plan, warmup=not args.no_warmup,
            kernel=args.kernel, quantize_dense=args.quantize_dense, host=host if host.enabled else None,
            attention=args.attention, **({"costs": costs} if costs is not None else {}),
        )  # fmt: skip
    for note in model.notes:  # what the engine adjusted, e.g. expert memory capped at all experts
        _err(f"note: {note}", args)
    return model


def _chat_template(model, args) -> None:
    if args.chat_template:
        from expertcache.tools.prompts import read_text

        template = read_text(args.chat_template, "chat template")
        if not template.strip():  # it was taken for none, and the model's tokenizer blamed
            raise ExpertcacheError(f"{args.chat_template}: the chat template is empty")
        model.tokenizer.chat_template = template


def _err(line: str, args) -> None:
    if not args.quiet:
        print(line, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ generate
def cmd_generate(args: argparse.Namespace) -> int:
    from expertcache.tools.prompts import read_prompt_items, read_text

    if args.batch_size is not None and not args.prompts:
        raise ExpertcacheError("--batch-size is for --prompts FILE (many prompts); one prompt runs alone")
    args.batch_size = 8 if args.batch_size is None else args.batch_size
    for flag in ("max_new_tokens", "batch_size"):
        if getattr(args, flag) < 1:
            raise ExpertcacheError(
                f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}"
            )
    if args.stream and not args.json and not args.prompts:
        raise ExpertcacheError(
            "--stream changes only --json's output (a JSON line per token first); text always streams"
        )
    if args.prompts and (args.stream or args.echo):
        raise ExpertcacheError("--stream and --echo are for one prompt; --prompts writes JSON lines")
    if args.chat_template and not args.chat:
        raise ExpertcacheError("--chat-template needs --chat")
    sampling = _sampling(args)
    if args.prompts:
        items = read_prompt_items(args.prompts)
        _check_items(items, args)
    else:
        prompt = args.prompt if args.prompt not in (None, "-") else read_text(args.prompt_file or "-")
        if args.prompt is None or args.prompt == "-":  # a file's or a pipe's last newline ends it, CRLF too
            prompt = prompt.removesuffix("\n").removesuffix("\r")  # (as --prompts reads its lines)
        if not prompt:
            raise ExpertcacheError("the prompt is empty")
        if args.chat:
            prompt = _messages(prompt)
        items = None
    model = load_model(args)
    saved = False
    try:
        _chat_template(model, args)
        if items is None:
            out = _generate_one(model, prompt, args, sampling)
        else:
            if note := lossy_note(model.stats, model.miss.lossy):  # a batch's summary is per batch: once here
                _err(note, args)
            _generate_many(model, items, args, sampling)
        saved = True  # tried once, whatever comes of it
        _save_trace(model, args)
        if items is None:
            _print_one(out, prompt, args)
        return 0
    except KeyboardInterrupt:
        _err("expertcache: interrupted", args)
        if not saved:  # keep what was recorded, said after what stopped it
            _keep_trace(model, args)
        return 130
    except BaseException as exc:
        # the same, said after the error (the command line prints the exception's notes)
        if not saved and (note := _keep_trace(model, args, say=False)):
            exc.add_note(note)
        raise
    finally:
        model.close()


def _keep_trace(model, args, say: bool = True) -> str | None:
    """What a run that failed or was interrupted recorded, written where --record-trace says: the line
    that tells how it went, printed (``say``) or returned for the failure's own message to follow."""
    if not args.record_trace:
        return None
    try:
        model.save_trace(args.record_trace)
        line = f"trace written to {args.record_trace} (the steps before the run stopped)"
    except ExpertcacheError as exc:
        line = f"no trace written: {exc}"
    if say:
        _err(f"expertcache: {line}", args)
    return line if not args.quiet else None


def _save_trace(model, args) -> None:
    if args.record_trace:
        model.save_trace(args.record_trace)
        _err(f"trace written to {args.record_trace}", args)


def _check_items(items, args) -> None:
    """Conversations only with --chat, and well formed: refused before the model loads."""
    from expertcache.engine.generation import check_messages

    for it in items:
        where = f"{args.prompts}:{it.line}"
        if isinstance(it.prompt, list) and not args.chat:
            raise ExpertcacheError(f"{where}: a conversation (messages) needs --chat")
        if isinstance(it.prompt, list):
            check_messages(it.prompt, where)
        elif not it.prompt:
            raise ExpertcacheError(f"{where}: the prompt is empty")


def _messages(text: str) -> str | list:
    """With --chat, a prompt that is a JSON list of messages is a conversation; any other is text."""
    if not text.lstrip().startswith("["):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, list) and all(isinstance(m, dict) for m in value) else text


def _generate_one(model, prompt, args, sampling) -> dict:
    streamer = None
    if args.echo and not args.json:  # what the model saw: with --chat, the conversation through the template
        if args.chat:
            from expertcache.engine.generation import render

            print(render(model.tokenizer, prompt, True), end="", flush=True)
        else:
            print(prompt, end="", flush=True)
    if args.stream and args.json:
        streamer = _JsonLines(model.tokenizer)
    elif not args.json:  # text streams as it comes
        streamer = _text_out(model.tokenizer, sampling.stop)
    g = model.generate_text(
        prompt, max_new_tokens=args.max_new_tokens, streamer=streamer, sampling=sampling, chat=args.chat
    )
    out = g.to_dict()
    if args.record_trace:
        out["trace"] = args.record_trace
    return out


def _print_one(out: dict, prompt, args) -> None:
    if args.json:  # after the token lines when streaming
        print(json.dumps({"prompt": prompt, **out} if args.echo else out))
        return
    _err(summary(out), args)  # the text has streamed


def _check_lengths(model, items, args) -> None:
    """Every prompt renders and fits the model's context with its new tokens: checked before batch 0."""
    from expertcache.engine.generation import render

    limit = getattr(model.config, "max_position_embeddings", None)
    for it in items:
        where = f"{args.prompts}:{it.line}"
        text = render(model.tokenizer, it.prompt, args.chat, where)
        n = len(model.tokenizer(text, add_special_tokens=not args.chat).input_ids)
        if limit is not None and n + args.max_new_tokens > limit:
            raise ExpertcacheError(
                f"{where}: prompt of {n} tokens + {args.max_new_tokens} new tokens exceeds the model's "
                f"context of {limit}"
            )


def _generate_many(model, items, args, sampling) -> None:
    from expertcache.engine.offloaded import batch_seed

    _check_lengths(model, items, args)
    if not sampling.greedy:  # one seed for the run, said: batch b samples with seed + b
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbelow(2**31))
        more = "; batch b draws with seed + b" if len(items) > args.batch_size else ""
        _err(f"sampled with seed {sampling.seed} (--seed {sampling.seed} repeats the run{more})", args)
    done, start = 0, time.perf_counter()
    for b in range(0, len(items), args.batch_size):
        batch = items[b : b + args.batch_size]
        results = model.generate_text(
            [it.prompt for it in batch], max_new_tokens=args.max_new_tokens,
            sampling=batch_seed(sampling, b // args.batch_size), chat=args.chat, batch_size=len(batch),
        )  # fmt: skip
        for it, g in zip(batch, results, strict=True):
            row = {"id": it.id, "batch": b // args.batch_size, **g.to_dict()}
            if args.record_trace:  # as a single generation's JSON names it
                row["trace"] = args.record_trace
            print(json.dumps(row), flush=True)
        done += len(batch)
        r = results[0]
        host = (  # three tiers: the host level's part of the batch's misses
            f" | host level hits {r.stats['host_hits']}, misses {r.stats['host_misses']}"
            if "host_requests" in r.stats else ""
        )  # fmt: skip
        tpot = "-" if r.to_dict()["tpot_s"] is None else f"{r.tpot_s * 1e3:.1f} ms"
        _err(f"batch {b // args.batch_size}: {len(batch)} prompt(s), {sum(len(g.tokens) for g in results)} "
             f"new tokens in {r.total_s:.2f} s ({r.tokens_per_s:.1f} tok/s) | TTFT {r.ttft_s * 1e3:.1f} ms | "
             f"TPOT {tpot} | hits {r.stats['hits']} | misses {r.stats['misses']}{host} | moved "
             f"{r.stats['bytes_transferred'] / 2**20:.1f} MiB | stall {r.stats['stall_s'] * 1e3:.1f} ms | "
             f"{done}/{len(items)} prompts done", args)  # fmt: skip
    _err(f"{len(items)} prompts in {time.perf_counter() - start:.1f} s", args)


def _held(out: dict) -> str:
    """What the cache holds: whole experts of all, or (a miss path of other parts: split segments,
    low-precision copies) the expert memory, in whole experts, and each part's slots in it."""
    parts = out.get("parts") or {}
    if set(parts) <= {"full"}:
        return f"{out['capacity_experts']}/{out['total_experts']} experts"
    slots = " + ".join(f"{name} {sum(p['slots']) if isinstance(p['slots'], list) else p['slots']}"
                       for name, p in parts.items())  # fmt: skip
    return f"{out['memory_experts']}/{out['total_experts']} experts' memory as {slots} slots"


def summary(out: dict) -> str:
    """The cache's work and the timings of one generation, for stderr."""
    lines = [
        f"---\n{out['prompt_tokens']} prompt + {out['new_tokens']} new tokens ({out['finish_reason']}) | "
        f"TTFT {out['ttft_s'] * 1e3:.1f} ms | "
        + ("TPOT - (one new token) | " if out["tpot_s"] is None else f"TPOT {out['tpot_s'] * 1e3:.1f} ms | ")
        + f"{out['tokens_per_s']:.1f} tok/s"
        + "".join(f" | {out[k]} {k}" for k in ("kernel", "attention") if out.get(k)),
        f"cache {_held(out)} ({out['policy']}, {out['device']}"
        f"{'' if out['miss'] == 'fetch' else ', miss ' + str(out['miss'])}) | hits {out['hits']} | "
        f"misses {out['misses']} | "
        f"moved {out['bytes_transferred'] / 2**20:.1f} MiB | stall {out['stall_s'] * 1e3:.1f} ms"
        + (f" | {out['preloaded_experts']} read at load" if out.get("preloaded_experts") else ""),
    ]
    if "host_requests" in out:  # three tiers (``cache.tiers``)
        req, missed = out["host_requests"], out["host_misses"]
        share = f" ({missed / req:.0%})" if req else ""
        more = "".join(
            f" | {word} {out[key]}"
            for word, key in (("evicted", "host_evicted"), ("bypassed", "host_bypassed"),
                              ("staged", "host_staged"), ("demoted", "host_demoted"),
                              ("returned", "host_returned"), ("dropped", "host_dropped"),
                              ("waits for a slot", "host_slot_waits"))
            if out.get(key)
        )  # the order of timing's line  # fmt: skip
        lines.append(
            f"host level {out['host_capacity']} experts ({out['host_policy']}"
            f"{', exclusive' if out.get('host_exclusive') else ''}, "
            f"{format_bytes(out['host_memory_bytes'])}, over the {out['host_over']}) | {req} requests | hits "
            f"{out['host_hits']} | misses {missed}{share}{more} | disk reads {out['disk_reads']} in "
            f"{out['disk_read_s'] * 1e3:.1f} ms"
        )
    mem = out.get("memory") or {}
    if mem.get("rss") is not None:
        b, cached, shmem = format_bytes, mem.get("page_cache"), mem.get("rss_shmem") or 0
        shared = f", {b(shmem)} shared" if shmem >= 2**20 else ""  # a checkpoint on tmpfs, say
        lines.append(
            f"memory: resident {b(mem['rss'])} ({b(mem['rss_anon'])} anonymous, {b(mem['rss_file'])} mapped "
            f"files with the libraries{shared}) | expert slots {b(out['expert_memory_bytes'])} | "
            + (f"host cache {b(out['host_memory_bytes'])} | " if "host_memory_bytes" in out else "")
            + f"slow tier {out['slow_tier']}"
            + ("" if cached is None else f" | checkpoint cached {b(cached)}")
        )
    gov = out.get("prefetch_governor") or {}
    if out["prefetch"] != "none" and gov.get("state") != "idle":
        from expertcache.cache.governor import describe

        when = f" | {describe(gov)}" if gov else ""
        lines.append(
            f"prefetch {out['prefetch']}, window {out['window']}{when} | issued {out['prefetch_issued']} | "
            f"used {out['prefetch_used']} ({out['prefetch_late']} late) | "
            + (f"evicted before use {out['prefetch_evicted']} | " if out.get("prefetch_evicted") else "")
            + f"cancelled {out['prefetch_cancelled']}"
        )
    did = miss_work(out)
    if did:
        lines.append(f"miss path {out['miss']}: {did}")
    if out.get("kernel") == "compiled":  # engine.kernels: the one kernel not bit-equal to transformers
        lines.append("kernel compiled: decode steps' experts in compiled loops, not bit-equal to "
                     "transformers (expertcache quality --kernel compiled says how far; --kernel grouped "
                     "is exact)")  # fmt: skip
    if out.get("kernel") == "packed" and out.get("experts_as_stored"):  # a published format's checkpoint
        made = (f"; expertcache quantize made it from {out['made_from']}, which it stands for with a loss "
                f"(expertcache quality --model {out.get('model') or 'DIR'}"
                f"{'' if out.get('dtype_own', True) else ' --dtype ' + out['dtype']} says how far)"
                if out.get("made_from") else "")  # fmt: skip
        lines.append(f"experts read as the checkpoint stores them ({out.get('expert_format')}): its "
                     "weights exactly, summed in float32 (transformers' dequantised forward within "
                     f"rounding){made}")  # fmt: skip
    elif out.get("kernel") == "packed":  # engine.packed: a packed checkpoint, lossy against its source
        dtype = "" if out.get("dtype_own", True) else f" --dtype {out['dtype']}"  # measured as it ran
        lines.append(f"experts packed ({out.get('expert_format')}): quantised, not the full-precision "
                     f"model's outputs (expertcache quality --model {out.get('model') or 'DIR'}{dtype} says "
                     "how far)")  # fmt: skip
    varies = out.get("varies_by")
    if varies:
        fixes = [] if out.get("deterministic") else ["--deterministic"]  # what each of them needs
        fixes += ["--cost PROFILE.json"] if any("measured at load" in v for v in varies) else []
        verb = "repeats" if len(fixes) == 1 else "repeat"
        lines.append(f"not repeatable: follows {', '.join(varies)} ({' and '.join(fixes)} {verb} the run)")
    elif out.get("deterministic"):
        lines.append("repeatable (--deterministic): transfers landed before each decision")
    if out.get("seed") is not None:
        lines.append(f"sampled with seed {out['seed']} (--seed {out['seed']} repeats it)")
    return "\n".join(lines)


def miss_work(out: dict) -> str:
    """What the miss path did besides fetching whole experts, one phrase each: computed on the host, at
    low precision, skipped, filled, transfers of each part (split experts' segments); empty when every
    miss was a whole fetch."""
    words = []
    for key, what in (("host_computed", "expert uses computed on the host"),
                      ("low_precision", "expert uses at low precision (lossy)"),
                      ("skipped", "expert uses skipped (lossy)"),
                      ("filled", "experts moved into the cache after host compute")):  # fmt: skip
        if out.get(key):
            words.append(f"{out[key]} {what}")
    if out.get("host_computed") and not out.get("hits") and not out.get("bytes_transferred"):
        slots = out.get("capacity_experts")
        if slots:  # a cost-based path that judged every miss cheaper on the host, and nothing fills the cache
            miss = str(out.get("miss") or "")  # as described: host, or batch:buffer=4,fill=0
            name, _, params = miss.partition(":")
            unfilled = miss == "host" or (name == "batch" and "fill=0" in params.split(","))
            fill = f" ({name}:fill=1 moves experts in after computing)" if unfilled else ""
            words.append(f"the cache's {slots} slots stayed empty{fill}")
    parts, ahead = out.get("part_misses") or {}, out.get("part_prefetches") or {}
    fills, reused = out.get("part_fills") or {}, out.get("part_reused") or {}
    named = {**parts, **ahead, **reused}
    if len(named) > 1 or (named and "full" not in named):  # split experts, low-precision copies, a buffer
        demand = ", ".join(f"{p} {n}" for p, n in parts.items()) or "none"
        words.append(f"transfers by part on demand: {demand}")
        # prefetches and fills move parts too: with demand, what moved (a cancelled prefetch moved nothing)
        dropped = out.get("part_cancelled") or {}
        moved_ahead = {p: n - dropped.get(p, 0) for p, n in ahead.items() if n > dropped.get(p, 0)}
        for what, counts in (("prefetched", moved_ahead), ("filled", fills)):
            if counts:
                words.append(f"{what}: " + ", ".join(f"{p} {n}" for p, n in counts.items()))
        if dropped:
            words.append("prefetches cancelled: " + ", ".join(f"{p} {n}" for p, n in dropped.items()))
        if reused:  # a missed expert whose part was there already: no transfer
            words.append("missed and found in: " + ", ".join(f"{p} {n}" for p, n in reused.items()))
    return ", ".join(words)


def _text_out(tokenizer, stop: tuple[str, ...] = ()):
    """A generate() streamer printing the new text to stdout as it comes, ending with a newline; text
    that may begin a stop string is held back until it is known not to, and nothing from a stop on is
    printed, so what streams is exactly the result's text."""
    from transformers import TextStreamer

    from expertcache.engine.generation import StopFinder

    class TextOut(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.text, self.shown, self.stopped, self.finder = "", 0, False, StopFinder(stop)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            shown = ""
            if not self.stopped:
                self.text += text
                found, held = self.finder.feed(self.text)
                end = found if found is not None else len(self.text) - (0 if stream_end else held)
                shown, self.shown, self.stopped = self.text[self.shown : end], end, found is not None
            print(shown, end="\n" if stream_end else "", flush=True)

    return TextOut()


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


# ------------------------------------------------------------------------------------ chat
def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on standard input, a turn a line (a line ending in \\ goes on); replies stream to
    stdout. The model stays loaded, so the cache is warm from one turn to the next."""
    if args.max_new_tokens < 1:
        raise ExpertcacheError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.system is not None and not args.system.strip():  # as an empty --prompt is (it was taken as none)
        raise ExpertcacheError("--system is empty: give the system message, or leave the option out")
    if sys.stdin is None:  # started with it closed (<&-): no turn to read, said before the model loads
        raise ExpertcacheError("standard input is closed: chat reads its turns from it, a line each")
    sampling = _sampling(args)
    # a long chat keeps no routing it is not asked for
    model = load_model(args, record=bool(args.record_trace))
    saved = False
    try:
        _chat_template(model, args)
        from expertcache.engine.generation import render
        from expertcache.engine.hub import model_label

        system = [{"role": "system", "content": args.system}] if args.system else []
        # a template, before input; and the tokens it takes around a turn of one token
        frame = render(model.tokenizer, system + [{"role": "user", "content": "hi"}], True)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None:  # every turn would fail: said once, now
            taken = len(model.tokenizer(frame, add_special_tokens=False).input_ids)
            if args.max_new_tokens + taken > limit:
                raise ExpertcacheError(
                    f"--max-new-tokens {args.max_new_tokens} leaves no room for a turn in the model's "
                    f"context of {limit} tokens (a one-word turn takes {taken} with the template"
                    + (" and --system" if system else "")
                    + f"): give at most {max(1, limit - taken)}"
                )
        if sampling.temperature and sampling.seed is None:  # one seed for the whole conversation, reported
            import secrets

            sampling = dataclasses.replace(sampling, seed=secrets.randbelow(2**31))
            seed = sampling.seed
            _err(f"sampling with seed {seed} (--seed {seed} repeats the conversation)", args)
        tty = sys.stdin.isatty()
        total = model.num_layers * model.num_experts
        _err(f"chat with {model_label(model.path)} ({model.capacity}/{total} experts cached); "
             f"commands: {CHAT_COMMANDS}", args)  # fmt: skip
        if note := lossy_note(model.stats, model.miss.lossy):  # as serve says it: not the model's outputs
            _err(note, args)
        _chat_loop(model, args, sampling, system, tty)
        saved = True
        _chat_trace(model, args)
    except KeyboardInterrupt:  # at the prompt, or a second one in a reply: the chat ends, as any command
        print(file=sys.stderr)
        _err("expertcache: interrupted", args)
        saved = True
        _chat_trace(model, args)  # the conversation so far: Ctrl-C at the prompt is how a chat ends
        return 130
    except BaseException as exc:
        if not saved and (note := _keep_trace(model, args, say=False)):
            exc.add_note(note)
        raise
    finally:
        model.close()
    return 0


def _chat_trace(model, args) -> None:
    """The conversation's routing, written where --record-trace says (nothing said of a chat without a
    turn: no trace, and why)."""
    if not args.record_trace:
        return
    if not model.driver.recorder.steps:
        _err(f"no trace written to {args.record_trace}: the chat ended before any turn", args)
        return
    _save_trace(model, args)


def _chat_loop(model, args, sampling, system: list, tty: bool) -> None:
    history: list[dict[str, str]] = []
    ended = [False]  # the end of input was read (a terminal's Ctrl-D after a pending turn ends the chat too)
    while (line := _read_turn(tty, ended)) is not None:
        command = line.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            history = []
            _err("(conversation forgotten; the cache stays warm)", args)
            continue
        if command.startswith("/") and " " not in command and command != "/stats":  # a mistyped command
            # said even with --quiet; not "error:", as the chat goes on (and ends with 0)
            print(f"expertcache: unknown command {command}, not sent to the model; commands: {CHAT_COMMANDS}",
                  file=sys.stderr)  # fmt: skip
            continue
        if command == "/stats":
            s = model.stats
            print(f"hits {s['hits']} | misses {s['misses']} | moved {s['bytes_transferred'] / 2**20:.1f} MiB",
                  file=sys.stderr)  # fmt: skip
            continue
        if not command:
            continue
        halt = _CtrlC()
        try:  # the turns dropped to fit this one are dropped only once it is answered
            turns, dropped = _fit(model, system, [*history, {"role": "user", "content": line}], args)
            with halt:
                g = model.generate_text(
                    system + turns, max_new_tokens=args.max_new_tokens, sampling=sampling, chat=True,
                    streamer=_text_out(model.tokenizer, sampling.stop), stopping_criteria=[halt],
                )  # fmt: skip
        except ExpertcacheError as exc:  # this turn only: the conversation and the warm cache go on
            print(f"turn dropped: {exc} (the conversation goes on without it)", file=sys.stderr)
            continue
        sys.stdout.flush()
        if dropped:
            _err(f"({dropped // 2} oldest exchange(s) dropped: the conversation was longer than the model's "
                 "context)", args)  # fmt: skip
        history = [*turns, {"role": "assistant", "content": g.text}]
        stopped = " (stopped by Ctrl-C; the conversation goes on, Ctrl-C at the prompt ends it)"
        stopped = stopped if halt.asked else ""
        _err(f"[{len(g.tokens)} tokens, {g.tokens_per_s:.1f} tok/s, hits {g.stats['hits']}, "
             f"misses {g.stats['misses']}]{stopped}", args)  # fmt: skip


class _CtrlC:
    """Ctrl-C during a chat reply: the reply stops after the token being made (a stopping criterion), is
    kept as it is, and the conversation goes on; a second Ctrl-C in the same reply interrupts at once.
    The handler is installed only while the reply is generated (at the prompt Ctrl-C ends the chat)."""

    def __init__(self) -> None:
        self.asked = False
        self._before = None

    def __enter__(self) -> _CtrlC:
        import signal

        self._before = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        signal.signal(signal.SIGINT, self._before)

    def _on_signal(self, signum, frame) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        return torch.full((input_ids.shape[0],), self.asked, dtype=torch.bool, device=input_ids.device)


def _read_turn(tty: bool, ended: list[bool] | None = None) -> str | None:
    """One turn from standard input (None at its end); a line ending in a backslash goes on. ``ended``
    (one flag): set at the end of input, after which no more is read (a terminal's Ctrl-D is not
    lasting: read again, it would wait for more)."""
    ended = [False] if ended is None else ended
    if ended[0]:
        return None
    parts: list[str] = []
    while True:
        if tty:  # the prompt goes to stderr: stdout holds only the replies
            print("> " if not parts else ". ", end="", file=sys.stderr, flush=True)
        raw = sys.stdin.buffer.readline() if hasattr(sys.stdin, "buffer") else sys.stdin.readline().encode()
        if raw == b"":
            ended[0] = True
            return "\n".join(parts) if parts else None
        line = raw.decode("utf-8", errors="replace")  # a stray byte is not worth ending the conversation
        line = line.rstrip("\n").removesuffix("\r")  # a Windows line end too
        if not line.endswith("\\"):
            return "\n".join([*parts, line])
        parts.append(line[:-1])


def _fit(model, system: list, history: list, args) -> tuple[list, int]:
    """The history, oldest turns dropped until the conversation and a reply fit the model's context.
    -> (the history kept, how many of its messages were dropped)"""
    from expertcache.engine.generation import render

    limit = getattr(model.config, "max_position_embeddings", None)
    kept = history
    while limit is not None:
        text = render(model.tokenizer, system + kept, True)
        n = len(model.tokenizer(text, add_special_tokens=False).input_ids)
        if n + args.max_new_tokens <= limit or len(kept) <= 1:
            break
        kept = kept[2:] if len(kept) > 2 else kept[1:]
    return kept, len(history) - len(kept)
