"""Command line: thin wrappers that build the library's objects and print what they return.

This module holds the parser and the simulator-side commands; ``generate`` and ``chat`` are in
``cli/generate.py``, shared helpers in ``cli/util.py``.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

from expertcache import __version__
from expertcache.cache.schedule import ORDERS, check_capacity, min_room
from expertcache.cli import generate as cli_generate
from expertcache.cli import serve as cli_serve
from expertcache.cli.util import (
    beside_plan,
    check_outputs,
    output_option,
    quiet_transformers,
    unseeded_note,
    why,
)
from expertcache.config import CHECKPOINT_DTYPES, RECORDED_STEP, REFERENCE_IMPLEMENTATIONS, SERVE_BATCH_TOKENS
from expertcache.errors import ExpertcacheError, ExpertcacheWarning, command_line
from expertcache.paths import write_output
from expertcache.plugins import load_plugins
from expertcache.policy.registry import (
    POLICIES,
    capacity_reason,
    fixed_capacity,
    min_capacity,
    parse_policy,
    policy_class,
    policy_parameters,
)
from expertcache.sim import fast
from expertcache.sim.planner import METHODS, OBJECTIVES
from expertcache.sim.report import check_plot_path, format_layers, format_table, plot_curves
from expertcache.sim.simulate import DEFAULT_POLICIES, simulate
from expertcache.trace.default import DEFAULT_TRACE, default_trace
from expertcache.trace.stats import step_shape, summary
from expertcache.trace.synth import GENERATORS, synthesize
from expertcache.trace.trace import Trace, load_trace
from expertcache.units import capacity_beyond, capacity_items
from expertcache.workers import thread_environment, usable_cpus

DEFAULT_STEPS = 16  # default capacities: L*E/16, 2*L*E/16, ..., L*E
_SIGNED = re.compile(r"^-[0-9.]")  # a negative value with a unit: -5%, -1ms


class _StoreOnce(argparse._StoreAction):
    """An option that takes a value, given once: argparse would keep the last of two silently (``--policy
    tlfu --policy lru`` ran lru), where other options of the same command repeat (``--miss``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = namespace.__dict__.setdefault("_given_once", {})
        if self.dest in given:
            both = (
                option_string
                if given[self.dest] == option_string
                else f"{given[self.dest]} and {option_string}"
            )
            parser.error(f"argument {both}: given twice: give it once")
        given[self.dest] = option_string
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage problem as one line and exit code 2, and refuses an option that takes
    one value given twice."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message: str) -> None:  # type: ignore[override]
        """One line under the prefix every error of the command line has (``expertcache: error:``), the
        command's help named at its end."""
        self.exit(2, f"expertcache: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """A value that starts with a minus and a digit (``--expert-memory -5%``, ``--link-latency -1ms``)
        is the option's value, as a plain negative number already is, so that it gets a real message."""
        args = list(sys.argv[1:] if args is None else args)
        out: list[str] = []
        for arg in args:
            action = self._option_string_actions.get(out[-1]) if out else None
            takes_one = action is not None and action.nargs is None and action.option_strings
            if takes_one and _SIGNED.match(arg) and not self._negative_number_matcher.match(arg):
                out[-1] = f"{out[-1]}={arg}"
            else:
                out.append(arg)
        return super().parse_known_args(out, namespace)

    def format_help(self) -> str:
        """An option's ``lazy_help`` (a registry that needs torch) is read only when help is shown, so
        that no command pays for that import at its start (the simulator's commands run without torch)."""
        for action in self._actions:
            lazy = getattr(action, "lazy_help", None)
            if lazy is not None:
                action.help = lazy()
        return super().format_help()


def _family_help() -> str:
    from expertcache.engine.families import FAMILIES

    return f"the family (config.json's model_type): {', '.join(FAMILIES)}"


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """Arguments no parser took: named by the innermost command's parser (``trace synth``'s, not
    ``trace``'s), with where a trace goes when it was given the other way."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = None if sub is None else getattr(args, sub.dest, None)
        if chosen not in (sub.choices if sub is not None else {}):
            break
        parser = sub.choices[chosen]
    message = f"unrecognized arguments: {' '.join(extra)}"
    takes_flag = "--trace" in parser._option_string_actions
    if takes_flag and any(e == "default" or e.endswith(".npz") for e in extra if not e.startswith("-")):
        message += f"; {parser.prog} takes its trace as --trace FILE"
    elif "--trace" in extra and not takes_flag:
        message += f"; {parser.prog} takes its trace as its first argument, without --trace"
    parser.error(message)


def main(argv: Sequence[str] | None = None) -> int:
    try:  # the user's own policies, predictors and miss paths (EXPERTCACHE_PLUGINS), before any name is read
        load_plugins()
    except ExpertcacheError as e:
        print(f"expertcache: error: {e}", file=sys.stderr)
        return 2
    parser = _build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0].startswith("-") and words[0] not in ("-h", "--help", "--version"):
        parser.error(f"unknown option {words[0]}: a command comes first (expertcache COMMAND ...)")
    args, extra = parser.parse_known_args(words)
    if extra:  # named by the (sub)command's parser, whose help lists what it takes
        _unrecognized(parser, args, extra)
    # the command is the whole process (the console script, python -m), not main() called from Python:
    # what it loads lives until exit (cli.util.startup_gc)
    args.whole_process = argv is None
    started = {"OMP_NUM_THREADS": "torch", "NUMBA_NUM_THREADS": "numba"}  # each read when its library starts
    for name, value in thread_environment().items():  # a CPU quota's threads (``workers``)
        if started[name] not in sys.modules:
            os.environ[name] = value
    if sys.stdout is None and args.command != "serve":  # started with standard output closed (>&-)
        print("expertcache: error: standard output is closed: the results would be lost (give it a file, "
              "or > /dev/null)", file=sys.stderr)  # fmt: skip
        return 2
    try:
        with command_line():
            _refuse_empty(parser, args, words)
            check_outputs(args)
            code = _run(args)
        if sys.stdout is not None:
            sys.stdout.flush()  # a full disk or a closed pipe under stdout is met here, not at exit
        return code
    except ExpertcacheError as e:
        print(f"expertcache: error: {e}", file=sys.stderr)
        _print_notes(e)
        return 2
    except MemoryError as e:  # an allocation far beyond the machine (a huge synthetic trace, say)
        print("expertcache: error: out of memory: the input asks for more than this machine has",
              file=sys.stderr)  # fmt: skip
        _print_notes(e)
        return 2
    except KeyboardInterrupt:
        print("expertcache: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as Unix tools do
        _drop_stdout()
        return 141
    except OSError as e:  # a write that failed late: a full disk, a quota, standard output on /dev/full
        stdout = _stdout_failed(e)
        where = f"{e.filename}: " if e.filename else "standard output: " if stdout else ""
        print(f"expertcache: error: {where}cannot write: {why(e)}", file=sys.stderr)
        _print_notes(e)
        if stdout:
            _drop_stdout()
        return 2


def _print_notes(e: BaseException) -> None:
    """What a command did about its failure (a trace of the steps before it kept), after the error."""
    for note in getattr(e, "__notes__", ()):
        print(f"expertcache: {note}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    """The command's work, once its options and outputs are checked (a test replaces it)."""
    return args.func(args)


def _drop_stdout() -> None:
    """Standard output to /dev/null: no second error when Python flushes it at exit."""
    if sys.stdout is None:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _stdout_failed(e: OSError) -> bool:
    """Whether ``e`` came from writing standard output (it names no file)."""
    return e.filename is None and e.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG)


# options whose empty value says something (free text), or that refuse it with their own words
_EMPTY_SAYS = {"prompt", "system", "stop", "text", "api_key", "allowed_host", "served_model_name"}


def _refuse_empty(parser: argparse.ArgumentParser, args: argparse.Namespace, words: list[str]) -> None:
    """A value given empty or blank (``--trace ""``, ``--policy " "``, a script's unset variable) is one
    line, exit 2: a default taken in its place would give another run's figures without a word."""
    if not any(not w.strip() for w in words):
        return
    names: dict[str, str] = {}  # each destination as the user wrote it: its option, else the argument

    def walk(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
                continue
            written = [o for o in action.option_strings if o in words]
            longs = [o for o in action.option_strings if o.startswith("--")]
            if written:
                names[action.dest] = written[0]
            else:
                names.setdefault(
                    action.dest, longs[0] if longs else str(action.metavar or action.dest).upper()
                )

    walk(parser)
    for dest, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        if dest not in _EMPTY_SAYS and any(isinstance(v, str) and not v.strip() for v in values):
            raise ExpertcacheError(f"{names.get(dest, dest)} is empty; give a value or leave the option out")


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="expertcache", description="Expert caching for Mixture-of-Experts inference.")
    p.add_argument("--version", action="version", version=f"expertcache {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("sim", help="replay a routing trace through eviction policies")
    s.add_argument("trace", nargs="?", default="default", help="trace .npz (default: the embedded trace)")
    s.add_argument(
        "--policy", nargs="+", action="extend", type=_not_a_trace("--policy"), metavar="NAME[:k=v,...]",
        help="policies: several after one flag, or the flag repeated (default: the usual ones)",
    )  # fmt: skip
    s.add_argument(
        "--capacity",
        nargs="+",
        type=_not_a_trace("--capacity"),
        metavar="N",
        help=f"experts: N [N ...], START:STOP[:STEP], shares of all experts (25%%) or all = 1..L*E "
        f"(default: {DEFAULT_STEPS} even steps)",
    )
    s.add_argument(
        "--order", choices=ORDERS, default="layer",
        help="requests the cache sees: layer (a step's experts of a layer together, as the engine; "
        "default), flat (one expert at a time) or rounds (top-k as k rounds per token)",
    )  # fmt: skip
    s.add_argument("--seed", type=int, help="seed of randomized policies (default 0)")
    s.add_argument(
        "--profile", metavar="TRACE.npz",
        help="usage profile the static policies rank by, as generate's (default: the trace's own use)",
    )  # fmt: skip
    _add_jobs(s, "the replays")
    s.add_argument("--json", action="store_true", help="print one JSON array of results")
    s.add_argument("--plot", metavar="FILE.png", help="write misses against capacity")
    output_option(s, "plot", "plot")
    s.add_argument("--per-layer", action="store_true", help="also print each result's misses per layer")
    s.set_defaults(func=_cmd_sim)

    _add_sweep(sub)

    tm = sub.add_parser("timing", help="replay a trace in virtual time: TTFT, TPOT, stall, prefetching")
    tm.add_argument(
        "--trace", metavar="FILE.npz",
        help="(default: the embedded trace; with --plan, the plan's own where its file is there)",
    )  # fmt: skip
    tm.add_argument(
        "--policy", metavar="NAME[:k=v,...]", help="any policy (default lru; on an engine's trace, its run's)"
    )
    tm.add_argument(
        "--profile", metavar="TRACE.npz",
        help="usage profile for the static policies, as generate's (default: the trace's own use)",
    )  # fmt: skip
    tm.add_argument(
        "--plan", metavar="PLAN.json", help="run a plan (expertcache plan): its policy, budgets, miss path, "
        "predictor and capacity"
    )  # fmt: skip
    _add_budget(tm, "50%")
    tm.add_argument(
        "--prefetch", metavar="NAME", help="predictor, or none (default); 'recorded' "
        "replays the trace's recorded predictions, as do the gate-input predictors"
    )  # fmt: skip
    tm.add_argument("--window", type=int, metavar="K", help="layers ahead (default: the predictor's)")
    tm.add_argument(
        "--prefetch-when", choices=cli_generate.PREFETCH_WHEN,
        help="always (default): predict in every step; pays: only while the governor measures, in virtual "
        "time, that it makes steps shorter",
    )  # fmt: skip
    tm.add_argument(
        "--predictor", metavar="TRACE.npz", help="a recorded trace for token (required) and eam to learn from"
    )
    tm.add_argument(
        "--prefetch-limit",
        type=int,
        metavar="N",
        help="experts prefetched per predicted layer (default top-k)",
    )
    tm.add_argument("--no-chunking", action="store_true", help="move each expert as one chunk")
    tm.add_argument(
        "--chunk-size",
        metavar="SIZE",
        help="bytes per chunk of a prefetch (default: a third of an expert where chunks pay, else whole)",
    )
    tm.add_argument("--miss", metavar="NAME[:k=v,...]", help="what to do on a miss (default fetch)")
    tm.add_argument("--no-preemption", action="store_true", help="keep a layer's unchosen prefetches")
    tm.add_argument("--no-reorder", action="store_true", help="compute experts in the router's order")
    tm.add_argument(
        "--deterministic", action="store_true",
        help="every transfer lands before the cache's next decision, compute waiting for it, as in generate "
        "--deterministic: replays such a run's counts on any link",
    )  # fmt: skip
    _add_host_level(tm)
    _add_costs(tm)
    tm.add_argument("--seed", type=int, help="seed of randomized policies (default 0)")
    tm.add_argument("--json", action="store_true", help="print one JSON object")
    tm.set_defaults(func=_cmd_timing)

    pl = sub.add_parser(
        "plan", help="choose per-layer budgets, miss path and predictor on the timing model; write plan.json"
    )
    pl.add_argument("--trace", default="default", metavar="FILE.npz", help="(default: the embedded trace)")
    pl.add_argument("-o", "--out", metavar="PLAN.json", help="where the plan is written")
    output_option(pl, "out", "plan")
    _add_budget(pl, "50%")
    pl.add_argument(
        "--policy",
        default="lru",
        metavar="NAME",
        help="the policy laid out (one with a -dist form; default lru)",
    )
    pl.add_argument(
        "--method", action="append", choices=METHODS, help=f"a layout to compare (repeat; default "
        f"{', '.join(METHODS[:4])}, and moepic with --miss split)"
    )  # fmt: skip
    pl.add_argument(
        "--miss",
        action="append",
        metavar="NAME[:k=v,...]",
        help="a miss path to compare (repeat; default fetch)",
    )
    pl.add_argument(
        "--prefetch",
        action="append",
        metavar="NAME",
        help="a predictor to compare, or none (repeat; default none)",
    )
    pl.add_argument(
        "--window", type=int, action="append", metavar="K",
        help="layers ahead for the predictors (repeat to compare windows; default: each predictor's)",
    )  # fmt: skip
    pl.add_argument(
        "--predictor", metavar="TRACE.npz", help="a recorded trace for token and eam to learn from"
    )
    pl.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="tpot",
        help="what to choose by: tpot (default) or ttft, a request's own on a batched trace; tpot-p99, "
        "ttft-p99: the requests' 99th percentile; throughput: tokens a second",
    )
    _add_concurrency(pl)
    pl.add_argument(
        "--deterministic", action="store_true",
        help="time every candidate as generate --deterministic runs (each transfer lands before the next "
        "decision), and run the plan so: its counts are then the engine's",
    )  # fmt: skip
    _add_costs(pl)
    pl.add_argument("--seed", type=int, help="seed of randomized policies (default 0)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_jobs(pl, "the candidates' runs")
    _add_host_level(pl, "plan")
    pl.set_defaults(func=_cmd_plan, chunk_size=None, no_chunking=False)

    dr = sub.add_parser(
        "doctor", help="pre-flight: can a cache help this routing at this budget, what to run"
    )
    dr.add_argument("--trace", default="default", metavar="FILE.npz", help="(default: the embedded trace)")
    dr.add_argument(
        "--model", metavar="PATH", help="the model --prompts records from (default: the embedded one)"
    )
    dr.add_argument(
        "--prompts", metavar="FILE", help="record the trace from these prompts instead, one per line"
    )
    dr.add_argument("--max-new-tokens", type=int, metavar="N", help="per prompt when recording (default 32)")
    _add_budget(dr, "25%")
    dr.add_argument(
        "--window-tokens",
        type=int,
        default=16,
        metavar="M",
        help="tokens per window of SRP and SCH (default 16)",
    )
    dr.add_argument("--policy", default="lru", metavar="NAME", help="the policy planned (default lru)")
    dr.add_argument(
        "--miss", action="append", metavar="NAME[:k=v,...]", help="a miss path the plan may use (repeat; "
        "default fetch)"
    )  # fmt: skip
    _add_costs(dr)
    _add_concurrency(dr)
    dr.add_argument(
        "--within", default="1.25", metavar="X",
        help="a budget is enough when its predicted TPOT is within X of every expert resident (default 1.25)",
    )  # fmt: skip
    dr.add_argument("--plot", metavar="FILE.png", help="write the hit-rate curves")
    output_option(dr, "plot", "plot")
    dr.add_argument("--json", action="store_true", help="print one JSON object")
    _add_jobs(dr, "the timing model's runs")
    _add_host_level(dr, "doctor")
    dr.set_defaults(func=_cmd_doctor, chunk_size=None, no_chunking=False)

    pr = sub.add_parser("profile", help="measure this machine's cost triple for a model (for plan --cost)")
    pr.add_argument("--model", metavar="PATH", help="checkpoint folder (default: the embedded model)")
    pr.add_argument("-o", "--out", metavar="PROFILE.json", help="where the profile is written")
    output_option(pr, "out", "profile")
    pr.add_argument("--device", choices=["cpu", "cuda"], help="compute device (default: cuda if present)")
    pr.add_argument("--dtype", help="compute dtype (default: the checkpoint's)")
    pr.add_argument("--slow-tier", choices=cli_generate.SLOW_TIERS, help=cli_generate.SLOW_TIER_HELP)
    pr.add_argument("--steps", type=int, default=16, metavar="N", help="decode steps timed (default 16)")
    pr.add_argument(
        "--fit-overheads", action="store_true",
        help="also fit the engine's own work a transfer (submit_s, on runs at 50%%) and an expert "
        "computed on the host (host_submit_s, on runs computing every expert there), each run against "
        "an all-resident one just before it, the median of three kept (wake_s stays 0)",
    )  # fmt: skip
    pr.add_argument("--device-bandwidth", metavar="RATE", help="declare the host -> device link, e.g. 25GB/s")
    pr.add_argument("--device-latency", metavar="TIME", help="declare its latency per chunk, e.g. 20us")
    pr.add_argument("--device-time", metavar="TIME[,PER_TOKEN]", help="declare one expert's device compute")
    pr.add_argument("--dense-time", metavar="TIME", help="declare the rest of a decode step, per MoE layer")
    pr.add_argument(
        "--device-profile", metavar="FILE.json", help="declare the link and device figures of a profile "
        "measured on the target machine"
    )  # fmt: skip
    pr.add_argument("--json", action="store_true", help="print the profile as JSON")
    pr.set_defaults(func=_cmd_profile)

    t = sub.add_parser("trace", help="inspect or generate routing traces")
    tsub = t.add_subparsers(dest="trace_command", required=True, parser_class=_Parser)
    info = tsub.add_parser("info", help="shape, per-layer entropy and reuse of a trace")
    info.add_argument("file", nargs="?", default="default", help="trace .npz (default: the embedded trace)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_cmd_trace_info)
    syn = tsub.add_parser("synth", help="write a seeded synthetic trace")
    syn.add_argument("--kind", required=True, choices=list(GENERATORS), help="the generator")
    syn.add_argument("-o", "--out", required=True, metavar="FILE.npz", help="where the trace is written")
    output_option(syn, "out", "trace")
    for flag, typ, what in _SYNTH_FLAGS:
        syn.add_argument(flag, type=typ, metavar="N" if typ is int else "X", help=what)
    syn.set_defaults(func=_cmd_trace_synth)
    bat = tsub.add_parser(
        "batch",
        help="a trace's requests served N at a time, as a server batches them (for sim, timing, plan)",
    )
    bat.add_argument("file", nargs="?", default="default", help="trace .npz (default: the embedded trace)")
    bat.add_argument(
        "-c", "--concurrency", type=int, required=True, metavar="N", help="requests running at once"
    )
    bat.add_argument("-o", "--out", required=True, metavar="FILE.npz", help="where the trace is written")
    output_option(bat, "out", "trace")
    bat.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help="requests in all, the trace's replayed in turn (default: the trace's, or 2N if more)",
    )
    bat.add_argument(
        "--batch-tokens", "--max-batch-tokens",
        type=int,
        metavar="N",
        help="tokens a step computes at most, as serve's --max-batch-tokens; prompts join in chunks "
        "(default: no cap)",
    )  # fmt: skip
    bat.add_argument("--stagger", type=int, default=1, metavar="STEPS",
                     help="steps between the clients' first requests (default 1)")  # fmt: skip
    bat.add_argument("--schedule", default="fifo", metavar="{fifo,prompts-first}",
                     help="how a step is laid out, as serve --schedule runs it (default fifo)")  # fmt: skip
    bat.set_defaults(func=_cmd_trace_batch)
    imp = tsub.add_parser("import", help="a routing log (JSON lines, CSV, torch tensors) as a trace")
    imp.add_argument("file", help="the log: .jsonl, .csv, or .pt (tensors: [T, L, K] ids, or per layer)")
    imp.add_argument("-o", "--out", required=True, metavar="FILE.npz", help="where the trace is written")
    output_option(imp, "out", "trace")
    imp.add_argument("--format", choices=["jsonl", "csv", "torch"], help="(default: by the file's suffix)")
    imp.add_argument("--num-experts", type=int, metavar="N", help="experts per layer (default: the log's, "
                     "or the largest id + 1)")  # fmt: skip
    imp.add_argument(
        "--keep-profiling", action="store_true", help="keep a leading profiling run (left out by default)"
    )
    imp.set_defaults(func=_cmd_trace_import)

    for name, what, func in (
        ("policies", "the eviction policies", _cmd_policies),
        ("predictors", "the expert predictors (for --prefetch)", _cmd_predictors),
        ("misses", "the miss paths (for --miss)", _cmd_misses),
    ):
        listing = sub.add_parser(name, help=f"list {what}")
        listing.add_argument("--json", action="store_true", help="print one JSON array, an object a row")
        listing.set_defaults(func=func)

    cli_generate.add_parsers(sub)
    cli_serve.add_parser(sub)

    mdl = sub.add_parser("model", help="inspect a MoE checkpoint or build a random one")
    msub = mdl.add_subparsers(dest="model_command", required=True, parser_class=_Parser)
    mi = msub.add_parser("info", help="family, MoE layers, experts and their bytes")
    mi.add_argument("path", nargs="?", help="checkpoint dir (default: the embedded model)")
    mi.add_argument("--json", action="store_true", help="print one JSON object")
    mi.set_defaults(func=_cmd_model_info)
    ms = msub.add_parser("synth", help="save a random-weight checkpoint of a supported family")
    family = ms.add_argument("--family", required=True, help="a supported family (config.json's model_type)")
    family.lazy_help = _family_help
    ms.add_argument(
        "-o", "--out", required=True, metavar="DIR",
        help="a new or empty folder, or one model synth wrote before (replaced; no other checkpoint is)",
    )  # fmt: skip
    output_option(ms, "out", "checkpoint", folder=True)
    for flag, default, what in (
        ("--hidden", 64, "hidden size"),
        ("--experts", 8, "experts per MoE layer"), ("--top-k", 2, "experts a token uses per layer"),
        ("--intermediate", 64, "an expert's intermediate size"), ("--heads", 4, "attention heads"),
    ):  # fmt: skip
        ms.add_argument(flag, type=int, default=default, metavar="N", help=f"{what} (default {default})")
    ms.add_argument(
        "--layers", type=int, metavar="N",
        help="decoder layers (default 2, or the family's fewest that run: nemotron_h 3, qwen3_next 4)",
    )  # fmt: skip
    ms.add_argument(
        "--dtype", default="float32", choices=CHECKPOINT_DTYPES,
        help="weight dtype (default float32)",
    )  # fmt: skip
    ms.add_argument("--max-shard-size", metavar="SIZE", help="shard the safetensors files, e.g. 500MB")
    ms.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ms.add_argument(
        "--tokenizer", metavar="DIR", help="copy the tokenizer from here (default: embedded model)"
    )
    ms.set_defaults(func=_cmd_model_synth)

    tp = sub.add_parser("train-predictor", help="train ProMoE's learned expert predictor for a model")
    tp.add_argument("--model", metavar="PATH", help="checkpoint dir (default: the embedded model)")
    tp.add_argument("--out", required=True, metavar="DIR", help="where the predictor is written")
    output_option(tp, "out", "predictor", folder=True)
    tp.add_argument(
        "--window", type=int, nargs="+", metavar="K",
        help="layers ahead (default 2, or 1 on a model of 2 MoE layers); several windows: one DIR/window-K/ "
        "each",
    )  # fmt: skip
    tp.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: stdlib sources)")
    tp.add_argument("--epochs", type=int, metavar="N", help="training epochs (default 10)")
    tp.add_argument("--hidden", type=int, metavar="N", help="MLP hidden width (default 128)")
    tp.add_argument("--max-new-tokens", type=int, metavar="N", help="greedy tokens per prompt (default 64)")
    tp.add_argument("--seed", type=int, default=0, help="seed of the split and the training (default 0)")
    tp.add_argument("--json", action="store_true", help="print the training report as one JSON object")
    tp.add_argument("--force", action="store_true", help="replace the predictors --out holds")
    tp.set_defaults(func=_cmd_train_predictor)

    tpol = sub.add_parser("train-policy", help="fit the reuse eviction policy's model on recorded traces")
    tpol.add_argument("traces", nargs="+", metavar="TRACE", help="routing traces (.npz), or default")
    tpol.add_argument("-o", "--out", metavar="FILE.json", help="weights file (default: JSON on stdout)")
    output_option(tpol, "out", "weights file")
    tpol.add_argument(
        "--order",
        action="append",
        choices=ORDERS,
        help="an order to learn from; repeat for several (default: layer and flat)",
    )
    tpol.add_argument("--test", nargs="+", metavar="TRACE", help="held-out traces to score (default: none)")
    tpol.set_defaults(func=_cmd_train_policy)

    q = sub.add_parser(
        "quantize",
        help="write a packed checkpoint (--checkpoint DIR: int8 or int4 experts), or low-precision copies "
        "of a model's experts (for --miss hobbit)",
    )
    q.add_argument("model", nargs="?", help="checkpoint dir (default: the embedded model)")
    q.add_argument(
        "--bits", type=int, nargs="+", default=None, metavar="B",
        help="copies: 8, 4 and/or 2 (default 8 4); --checkpoint: 8 or 4 (default 8)",
    )  # fmt: skip
    q.add_argument(
        "--group", type=int, default=None, metavar="N",
        help="int4 and int2: weights per scale and minimum (or zero), default 64; int8 has one scale a row",
    )  # fmt: skip
    q.add_argument(
        "--checkpoint", metavar="DIR",
        help="write a packed checkpoint here (a new or empty folder): the model with its experts packed, "
        "which generate --model DIR runs",
    )  # fmt: skip
    output_option(q, "checkpoint", "checkpoint", folder=True)
    q.add_argument(
        "--format", choices=("mxfp4", "fp8"), default=None,
        help="with --checkpoint: write another tool's published layout instead of expertcache's int8/int4 "
        "(mxfp4: GPT-OSS's; fp8: DeepSeek-V3's and Qwen3-FP8's, 128x128 block scales), which transformers "
        "reads too",
    )  # fmt: skip
    q.add_argument(
        "--out", metavar="DIR", help="where (default: beside the checkpoint, else the user's cache)"
    )
    output_option(q, "out", "quantised copies", folder=True)
    q.add_argument(
        "--fast", action="store_true", help="int2: plain min-max rounding, without HQQ's optimisation"
    )
    q.add_argument(
        "--json",
        action="store_true",
        help="print the result as JSON: an array of the copies written; with --checkpoint, one object",
    )
    q.set_defaults(func=_cmd_quantize)

    ql = sub.add_parser(
        "quality", help="perplexity and top-1 agreement of a lossy miss path or kernel against the model"
    )
    ql.add_argument("--model", metavar="PATH", help="checkpoint dir (default: the embedded model)")
    ql.add_argument(
        "--miss", default="fetch", metavar="NAME[:k=v,...]",
        help="the miss path measured, e.g. hobbit (default fetch: exact)",
    )  # fmt: skip
    ql.add_argument(
        "--kernel", choices=cli_generate.KERNEL_CHOICES, default="auto",
        help="the experts kernel measured, e.g. compiled (default auto: grouped, exact; packed for a packed "
        "checkpoint)",
    )  # fmt: skip
    ql.add_argument(
        "--quantize-dense", choices=cli_generate.DENSE_FORMATS, metavar="FORMAT",
        help="the dense layers quantised at load, measured: int8 (default: as stored)",
    )  # fmt: skip
    ql.add_argument("--attention", choices=cli_generate.ATTENTION, help=cli_generate.ATTENTION_HELP)
    ql.add_argument(
        "--dtype", help="compute dtype of the model and the reference alike (default: each checkpoint's)"
    )
    ql.add_argument(
        "--reference", choices=["auto", *REFERENCE_IMPLEMENTATIONS], default="auto",
        help="transformers' experts implementation compared against (default auto: the one the kernel is "
        "exact against; grouped_mm for compiled)",
    )  # fmt: skip
    ql.add_argument(
        "--reference-model", metavar="DIR",
        help="the checkpoint the reference runs (default: --model's own; a packed checkpoint: the "
        "full-precision one it was made from, as its config names it)",
    )  # fmt: skip
    ql.add_argument("--expert-memory", default="25%", metavar="X", help="bytes or a share (default 25%%)")
    ql.add_argument("--policy", default="lru", metavar="NAME[:k=v,...]", help="eviction policy (default lru)")
    ql.add_argument(
        "--tokens", type=int, default=2048, metavar="N", help="tokens measured in all (default 2048)"
    )
    ql.add_argument("--text", metavar="FILE", help="a text file to measure on (default: held-out files)")
    ql.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="compute device (default cpu)")
    ql.add_argument(
        "--prefetch",
        default="auto",
        metavar="NAME",
        help="the predictor, or none (default auto: the model's)",
    )
    ql.add_argument(
        "--prefetch-when", choices=cli_generate.PREFETCH_WHEN,
        help="always: predict in every step, a deterministic run (default); pays: as generate runs by "
        "default, only while it measurably pays (the numbers vary from run to run)",
    )  # fmt: skip
    ql.add_argument("--json", action="store_true", help="print one JSON object")
    ql.set_defaults(func=_cmd_quality)

    pa = sub.add_parser("predictor-accuracy", help="ProMoE's ACCURACY_i(k) of predictors on a model's runs")
    pa.add_argument("--model", metavar="PATH", help="checkpoint dir (default: the embedded model)")
    pa.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: the held-out prompts)")
    pa.add_argument(
        "--predictors", nargs="+", default=["next-gate", "learned"], metavar="NAME",
        help="predictor names (default: next-gate learned)",
    )  # fmt: skip
    pa.add_argument(
        "--window",
        type=int,
        nargs="+",
        metavar="K",
        help="layers ahead (default: 1 2 3 4, those the model's MoE layers leave room for; learned: the "
        "windows it was trained for)",
    )
    pa.add_argument(
        "--predictor", metavar="PATH", help="trained predictor dir (learned) or trace (token, eam)"
    )
    pa.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="greedy tokens per prompt (default 64)"
    )
    pa.add_argument("--json", action="store_true", help="print one JSON array of rows")
    pa.set_defaults(func=_cmd_predictor_accuracy)

    st = sub.add_parser(
        "selftest", help="tiny models of every family through the engine against transformers, on this device"
    )
    st.add_argument("--device", choices=["cpu", "cuda"], help="(default: cuda when torch sees a GPU)")
    st.add_argument(
        "--quick",
        action="store_true",
        help="the plain path and one miss path per family (half a minute on 2 CPU cores)",
    )
    st.add_argument(
        "--family", nargs="+", metavar="NAME",
        help="these families only (their own checks and the further ones made of them; default: every one)",
    )  # fmt: skip
    st.add_argument("--json", action="store_true", help="print one JSON object with every check")
    st.set_defaults(func=_cmd_selftest)
    return p


def _cmd_sim(args: argparse.Namespace) -> int:
    if args.plot:  # before the replays, not after (check_outputs: that it can be written)
        check_plot_path(args.plot)
    with fast.plain_pages():  # reading a large trace too
        trace = _trace(args.trace)
    keys = trace.num_layers * trace.num_experts
    step = max(1, keys // DEFAULT_STEPS)
    start = step * -(-min_room(args.order, trace.top_k) // step)  # the default range's first that fits
    caps = _capacities(args.capacity or [f"{start}:{keys}:{step}"], trace, args.order)
    ran = trace.meta.get("capacity") if str(trace.meta.get("miss", "fetch")) == "fetch" else None
    if not args.capacity and isinstance(ran, int) and start <= ran <= keys and ran not in caps:
        caps = sorted([*caps, ran])  # an engine's run (a server's): its own budget among the rows
        print(f"note: with the recorded run's own capacity, {ran} experts, among the rows (--capacity sets "
              "them)", file=sys.stderr)  # fmt: skip
    from expertcache.trace.batch import is_batched

    policies = asked = _distinct_policies(args.policy) or DEFAULT_POLICIES
    if not args.policy and is_batched(trace):  # steps of many requests: the policy made for them too
        policies = asked = (*DEFAULT_POLICIES, "tlfu")
        print("note: steps of several requests: the default policies and tlfu (token-weighted, made for "
              "them)", file=sys.stderr)  # fmt: skip
    _check_jobs(args)
    for c in caps:
        check_capacity(c, args.order, trace.top_k)
    policies = _note_skipped(
        policies, caps, trace.num_layers, min_room(args.order, trace.top_k), bool(args.policy)
    )
    seed = _seed(args, policies)
    with warnings.catch_warnings():  # the note below says it, with the command to run
        warnings.simplefilter("ignore", ExpertcacheWarning)
        results = simulate(
            trace, policies, caps, args.order, seed, len(caps) > 1, args.jobs, profile=args.profile
        )
    # once the replays ran: a policy refused is then the one line
    _note_replays(trace, args.trace, bool(args.profile), asked, seed)
    if args.json:
        if args.per_layer:
            print("note: --per-layer changes nothing with --json: its objects always hold the layers",
                  file=sys.stderr)  # fmt: skip
        print(json.dumps([r.to_dict() for r in results]), flush=True)
    else:
        print(format_table(results))
        if args.per_layer:
            print("\n" + format_layers(results))
        sys.stdout.flush()
    if args.plot:  # after the results: a plot that fails to write loses nothing
        name = "embedded default trace" if args.trace == "default" else args.trace
        plot_curves(results, args.plot, f"{name}: misses against capacity ({args.order} order)")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _note_replays(trace, name: str, profiled: bool = False, policies=None, seed: int | None = None) -> None:
    """A run that prefetched, or served misses by another path, or ranked a static policy by a profile
    not given, counted what these replays do not: say how to replay it."""
    from expertcache.sim.simulate import replay_notes

    for note in replay_notes(trace, name, profiled, policies, seed):
        print(f"note: {note}", file=sys.stderr)


def _add_sweep(sub) -> None:
    sw = sub.add_parser(
        "sweep", help="a grid of traces x policies x capacities x orders (x timing cells) as one table"
    )
    sw.add_argument(
        "grid", nargs="?", metavar="GRID.yaml", help="a grid file (.yaml or .toml; flags override)"
    )
    many = {"nargs": "+", "action": "extend"}
    sw.add_argument("--trace", **many, metavar="FILE.npz", help="traces, or default (the embedded one)")
    sw.add_argument("--policy", **many, metavar="NAME[:k=v,...]", help="policies (default: as sim)")
    sw.add_argument(
        "--capacity", **many, metavar="N",
        help="experts (24), ranges (8:96:8), shares of all experts (25%%) or all (default: 16 even steps)",
    )  # fmt: skip
    sw.add_argument("--order", **many, choices=ORDERS, help="layer, flat, rounds (default layer)")
    sw.add_argument("--seed", **many, type=int, help="seeds of randomized policies (default 0)")
    sw.add_argument("--timing", action="store_true", help="add timing-model cells (any flag below does)")
    sw.add_argument("--miss", **many, metavar="NAME[:k=v,...]", help="miss paths (timing; default fetch)")
    sw.add_argument("--prefetch", **many, metavar="NAME", help="predictors, or none (timing; default none)")
    sw.add_argument("--window", **many, type=int, metavar="K", help="layers ahead (timing; default: each "
                    "predictor's)")  # fmt: skip
    sw.add_argument("--link-bandwidth", **many, metavar="RATE", help="e.g. 16GB/s (timing; default 25GB/s)")
    sw.add_argument(
        "--link-latency", **many, metavar="TIME", help="per chunk, e.g. 5us (timing; default 20us)"
    )
    sw.add_argument("--cost", metavar="FILE.json", help="cost model or profile of the timing cells")
    sw.add_argument("--predictor", metavar="TRACE.npz", help="a recorded trace for token and eam (timing)")
    where = sw.add_mutually_exclusive_group()
    where.add_argument("-o", "--out", metavar="FILE", help="results file: .csv, .json or .parquet (default: "
                       "CSV on stdout)")  # fmt: skip
    output_option(sw, "out", "results")
    where.add_argument("--json", action="store_true", help="print one JSON array of rows instead of CSV")
    again = sw.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="skip the cells --out already holds")
    again.add_argument("--force", action="store_true", help="replace an existing --out")
    sw.add_argument(
        "--jobs", type=int, metavar="N",
        help=f"local processes (default: every CPU this process may use, {usable_cpus()} here; not with "
        "--ray)",
    )  # fmt: skip
    sw.add_argument(
        "--ray", nargs="?", const="", metavar="ADDRESS",
        help="run on Ray: a cluster's address, or none for a local Ray (pip install 'expertcache[cluster]')",
    )  # fmt: skip
    sw.add_argument("--plot", metavar="DIR", help="write miss-ratio curves and ratio-to-OPT heat maps here")
    output_option(sw, "plot", "plots", folder=True)
    sw.add_argument("--quiet", action="store_true", help="no progress bar and no notes, only the summary")
    sw.set_defaults(func=_cmd_sweep)
    for action in sw._actions:  # a grid file after a list flag (or --ray) is not one of its values
        if action.option_strings and (action.nargs == "+" or action.dest == "ray"):
            action.type = _not_a_grid(action.option_strings[-1], action.type or str)


def _not_a_trace(flag: str):
    """A list flag's value type (policies, capacities) that refuses a trace given after the flag's values,
    saying where it goes."""

    def value(text: str) -> str:
        looks = text == "default" or Path(text).suffix.lower() in (".npz", ".csv", ".jsonl", ".parquet")
        if looks and ":" not in text:  # a policy's parameters may name a file (static:profile=...)
            raise argparse.ArgumentTypeError(f"{text} looks like a trace: give it first, before {flag}")
        return text

    value.__name__ = "policy"
    return value


def _not_a_grid(flag: str, convert):
    """A flag's value type that refuses a grid file's name, saying where the grid file goes."""

    def value(text: str):
        if Path(text).suffix.lower() in (".yaml", ".yml", ".toml"):
            raise argparse.ArgumentTypeError(f"{text} looks like a grid file: give it first, before {flag}")
        return convert(text)

    value.__name__ = convert.__name__  # argparse's "invalid int value" names the type
    return value


def _cmd_sweep(args: argparse.Namespace) -> int:
    from expertcache.tools.sweep import Grid, sweep
    from expertcache.tools.sweep_table import to_json, write_csv

    _check_jobs(args)
    if args.ray is not None and args.jobs is not None:
        raise ExpertcacheError("--jobs sets local processes; with --ray the cluster's CPUs run the cells")
    grid = Grid.load(args.grid) if args.grid else Grid()
    timing_flags = {
        name: getattr(args, name)
        for name in ("miss", "prefetch", "window", "link_bandwidth", "link_latency", "cost", "predictor")
        if getattr(args, name) is not None
    }
    timing = None
    if args.timing or timing_flags:
        from expertcache.tools.sweep import Timing

        timing = replace(grid.timing or Timing(), **timing_flags)
    rows = sweep(
        grid, out=args.out, resume=args.resume, force=args.force,
        jobs=1 if args.ray is not None else usable_cpus() if args.jobs is None else args.jobs,
        ray=args.ray, plot=args.plot,
        progress=not args.quiet and sys.stderr.isatty(), quiet=args.quiet,
        traces=args.trace, policies=args.policy, capacities=args.capacity, orders=args.order,
        seeds=args.seed, timing=timing,
    )  # fmt: skip
    if args.json:
        print(to_json(rows), flush=True)
    elif not args.out:
        write_csv(rows, list(rows[0]), sys.stdout)
        sys.stdout.flush()
    return 0


_SYNTH_FLAGS = (  # (flag, type, help); a kind that does not take a flag refuses it
    ("--tokens", int, "tokens (default: the kind's)"),
    ("--layers", int, "MoE layers (default: the kind's)"),
    ("--experts", int, "experts per layer (default: the kind's)"),
    ("--top-k", int, "experts a token uses per layer (default 2; cyclic and partition: 1)"),
    ("--seed", int, "random seed (default 0)"),
    ("--a", float, "zipf, sticky: Zipf exponent, p_j ~ 1/(j+b)^a (default 1)"),
    ("--b", float, "zipf, sticky: Zipf offset (default 0)"),
    ("--stickiness", float, "sticky: chance a layer repeats the previous token's experts (default 0.5)"),
    ("--sequences", int, "requests the tokens are split into (default 1)"),
    ("--prompt-len", int, "prefill tokens at the start of each request (default 0)"),
    ("--layer", int, "partition: the layer that cycles through all experts (default 0)"),
)

_TIMING_COST_FLAGS = (
    ("--link-bandwidth", "RATE", "e.g. 16GB/s (default 25GB/s)"),
    ("--link-latency", "TIME", "per chunk, e.g. 5us (default 20us)"),
    (
        "--dense-time",
        "TIME[,TIME...]",
        "attention, norms, router: one for all layers, or one per layer (default 0.25ms)",
    ),
    ("--expert-time", "TIME[,PER_TOKEN]", "one expert's compute: fixed, and per token (default 0.35ms,2us)"),
    (
        "--step-time",
        "TIME",
        "per forward step: embeddings, LM head (default 0.5ms); 'recorded': what a recorded run's own clock "
        "says its steps took beyond the model (doctor's default on such a trace)",
    ),
    ("--host-time", "TIME[,PER_TOKEN]", "an expert on the host: fixed, and per token (default 5.06ms,63us)"),
    ("--dequant-time", "TIME", "device time to expand a low-precision copy (default 0)"),
    ("--expert-bytes", "SIZE", "bytes of one expert (default 336MiB)"),
    ("--wake-time", "TIME", "compute resumes this long after a transfer it waited for (default 0)"),
    ("--issue-time", "TIME", "compute time spent issuing one transfer (default 0)"),
    (
        "--host-issue-time",
        "TIME",
        "compute time the engine spends on each expert computed on the host beyond its computation: its "
        "tokens handed over, its output placed (default 0)",
    ),
    (
        "--disk-time",
        "TIME",
        "with --host-memory or --host-capacity: reading one expert from the disk, a host-level miss "
        "(default 0)",
    ),
    (
        "--demote-time",
        "TIME",
        "with an exclusive host level (plan and doctor weigh one themselves): the compute thread's copy "
        "of the cache's victim down into it (a CPU's; default 0)",
    ),
)


def _notes_after_checks(command):
    """``command`` with its notes on stderr held until it has run: a value refused anywhere in it (a
    capacity, a host level below its policy's least) is then its one line, not the last of several notes
    about a replay that never ran (a new user's ``timing --capacity 0`` printed two notes, then the error)."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        import contextlib
        import io

        held = io.StringIO()
        with contextlib.redirect_stderr(held):
            code = command(args)
        sys.stderr.write(held.getvalue())  # an error raised above leaves them unsaid
        return code

    return run


@_notes_after_checks
def _cmd_timing(args: argparse.Namespace) -> int:
    from expertcache.config import CacheConfig, MissConfig, PrefetchConfig
    from expertcache.costs import CostModel
    from expertcache.plan import Plan
    from expertcache.sim.timing import format_timing, simulate_timing

    _check_cost_flags(args)
    plan = None
    if args.plan:
        given = [
            f
            for f in ("policy", "miss", "prefetch", "window", "capacity", "expert_memory")
            if getattr(args, f)
        ]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ExpertcacheError(
                f"--plan sets the policy, miss path, predictor and capacity; leave out {flag}"
            )
        plan = Plan.load(args.plan)
    served = None
    if args.trace is None and plan is not None and plan.trace_file() is None:
        served = plan.served_trace()  # the plan's trace of requests served N at a time, made again
    if served is not None:
        print(f"note: replaying the plan's trace: {_batched_how(plan.batched())} (--trace gives another)",
              file=sys.stderr)  # fmt: skip
    elif args.trace is None and plan is not None and plan.trace_file() is not None:
        args.trace = plan.trace_file()  # the plan's prediction, on the plan's trace
        if Path(args.trace).resolve() != DEFAULT_TRACE.resolve():
            print(f"note: replaying the plan's trace {args.trace} (--trace gives another)", file=sys.stderr)
    elif args.trace is None and plan is not None and plan.source.get("trace"):
        made = plan.batched()
        what = plan.source["trace"] if made is None else f"{made['trace']} (to serve its requests as planned)"
        print(f"note: the plan's trace {what} is not there: replaying the embedded one "
              "(--trace gives another)", file=sys.stderr)  # fmt: skip
    trace = served if served is not None else _trace(args.trace or "default")
    if plan is not None:
        plan.check_model(trace.num_layers, trace.num_experts, trace.top_k, f"trace {trace.source}")
        made_on, tokens = str(plan.source.get("trace", "")), plan.source.get("tokens")
        served_n = re.search(r" x(\d+)$", made_on)  # the plan's trace served N at a time (trace.batch)
        replayed = trace.meta.get("concurrency")
        other_n = (int(served_n.group(1)) if served_n else None) != (
            None if replayed is None else int(replayed)
        )
        digest = plan.source.get("digest")  # the routing itself, steps too (a plan before it: its tokens)
        if digest is not None:
            other = digest != trace.digest()
        else:
            other = other_n or tokens not in (None, trace.num_tokens)
        if other:  # another workload than the plan's
            made = plan.batched()
            how = (
                f"; it served {made['trace']}'s requests as `expertcache trace batch {_batch_args(made)}` "
                "serves them: replay that (-o F, then --trace F)"
                + (", or leave out --trace" if Path(made["trace"]).is_file() else "")
                if made is not None
                else f"; it served its trace {served_n.group(1)} at a time: replay that (expertcache trace "
                f"batch TRACE --concurrency {served_n.group(1)} -o F, then --trace F)"
                if served_n
                else ""
            )
            print(
                f"note: the plan was made on {made_on} ({tokens} tokens); this replays {trace.source} "
                f"({trace.num_tokens} tokens), so these figures are not the plan's prediction{how}",
                file=sys.stderr,
            )
        plan.refuse_host(_given(args, "host_memory", "host_capacity", "host_policy", "host_exclusive"))
    options = {
        "data": args.predictor,
        "limit": args.prefetch_limit,
        "chunking": not args.no_chunking,
        "chunk_size": args.chunk_size,
        "preemption": not args.no_preemption,
        "reorder": not args.no_reorder,
        "when": args.prefetch_when,
        "deterministic": args.deterministic,
    }
    if plan is not None:
        if (note := beside_plan(args)) is not None:
            print(note, file=sys.stderr)
        prefetch, miss = plan.prefetch_config(**options), plan.miss_config()
        cache = plan.cache_config(profile=args.profile)
    else:
        prefetch = PrefetchConfig(args.prefetch or "none", window=args.window, **options)
        cache = CacheConfig(args.policy or _run_policy(args, trace) or "lru", profile=args.profile)
        miss = MissConfig(args.miss or _run_miss(trace) or "fetch")
    _check_profile(args, trace)
    planned = plan.source.get("cost") if plan is not None and not args.cost else None
    from expertcache.sim.timing import recorded_costs, replay_differences

    # a run's replay, at its own budget or another, is priced as its miss path decided: its costs are the
    # base of everything below (an expert memory in bytes counts its experts, a chunk size cuts them)
    own = recorded_costs(trace) if planned is None and not args.cost else None
    base = own if own is not None else CostModel.from_dict(planned) if planned else None
    cost = _cost_from_args(args, prefetch, base, trace)
    _check_miss(miss, trace, cost)  # its values refused in one line, before any note of the replay
    _say_step_time(args)
    if own is not None:
        _say_run_costs(args, trace)
    if plan is not None:
        capacity = plan.capacity
    elif args.capacity is None and not args.expert_memory and "capacities" in trace.meta:
        capacity = _run_capacity(trace, miss, cost) or _capacity(args, cost, trace)
    else:
        capacity = _capacity(args, cost, trace)
        if args.capacity is None:  # the memory itself, which a path of several parts splits in bytes
            capacity = args.expert_memory or args.default_expert_memory
    if plan is None:
        seeded = replace(cache, seed=args.seed or 0)  # the seed the replay draws with (set below)
        for note in replay_differences(trace, seeded, prefetch, miss=miss, cost=cost):
            print(f"note: {note}", file=sys.stderr)
    predictor_data = args.predictor
    if predictor_data is None and plan is not None and plan.predictor_trace() is not None:
        predictor_data = plan.predictor_trace()  # what the plan's predictor learned from
        if not Path(predictor_data).is_file():
            raise ExpertcacheError(
                f"the plan's predictor {plan.prefetch} was planned learning from {predictor_data}, which is "
                "not there: give the trace as --predictor TRACE.npz"
            )
        print(f"note: prefetch {plan.prefetch} learns from {predictor_data}, the trace it was planned with "
              "(--predictor gives another)", file=sys.stderr)  # fmt: skip
        changed = plan.predictor_trace_changed()
        if changed is not None:
            print(f"note: {changed}, so these figures are not the plan's prediction", file=sys.stderr)
    predictor_trace = _predictor_trace(predictor_data, [prefetch.predictor])
    if plan is not None and plan.host_capacity is not None:  # the plan's host level, at its capacity
        from expertcache.config import HostConfig

        host_capacity = plan.host_capacity
        host = HostConfig(None, plan.host_policy, exclusive=plan.host_exclusive, stage=args.host_stage)
    else:
        host, host_capacity = _host_level(args), args.host_capacity
        recorded = trace.meta.get("host_capacity")
        if recorded is not None and host is None and host_capacity is None:  # the run had a host level
            from expertcache.sim.timing import host_level_replay

            how = host_level_replay(trace.meta, trace.top_k, prefetch.predictor != "none")[0]
            print(f"note: the run had a host level of {recorded} experts, which this replay leaves out: "
                  f"{how} replays it", file=sys.stderr)  # fmt: skip
        if host_capacity is not None and host.exclusive and host_capacity >= 1:
            # its memory in experts, as plan and doctor read it: capped at all experts, less the reserve
            from expertcache.cache.tiers import exclusive_reserve, level_experts

            reserve = exclusive_reserve(trace.top_k)
            total = trace.num_layers * trace.num_experts
            if host_capacity > total:  # as an inclusive level's, and the engine's, are said
                print(f"note: a host level of {host_capacity} experts is more than all {total}; capped at "
                      f"{total}", file=sys.stderr)  # fmt: skip
            held = level_experts(min(host_capacity, total), True, trace.top_k)
            if 1 <= held < trace.top_k:  # the policy's own message would name the held experts alone
                raise ExpertcacheError(
                    f"--host-capacity {host_capacity} with --host-exclusive: an exclusive level keeps "
                    f"{reserve} experts of its memory for its hits in flight (a layer's top-k), which leaves "
                    f"it {held}, fewer than the top-{trace.top_k} a layer needs; give at least "
                    f"{trace.top_k + reserve}"
                )
            if held < 1:
                raise ExpertcacheError(
                    f"--host-capacity {host_capacity} with --host-exclusive: an exclusive level keeps "
                    f"{reserve} experts of its memory for its hits in flight (a layer's top-k), which leaves "
                    f"it none; give at least {trace.top_k + reserve}"
                )
            host_capacity = held
    if args.demote_time and not (host is not None and host.exclusive):
        if plan is not None and plan.host_capacity is not None:  # its level is the plan's: not to change
            raise ExpertcacheError(
                f"--demote-time is an exclusive host level's cost, and the plan's host level "
                f"({plan.host_policy}, {plan.host_capacity} experts) is inclusive: leave out --demote-time"
            )
        raise ExpertcacheError("--demote-time is an exclusive host level's cost: give --host-exclusive")
    cache = replace(cache, seed=_seed(args, [cache.policy, host.policy if host is not None else None]))
    cost, link_notes = _profile_links(args, host, cost)
    result = simulate_timing(
        trace, capacity, cache=cache, prefetch=prefetch, miss=miss, cost=cost,
        predictor_trace=predictor_trace, host=host, host_capacity=host_capacity,
    )  # fmt: skip
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    for flag, count, what in (  # a cost no expert of the run paid: said, not taken in silence
        ("host_time", "host_computed", "no expert was computed on the host"),
        ("dequant_time", "low_precision", "no low-precision copy was used (hobbit uses them)"),
    ):
        if getattr(args, flag) and not result.cache.get(count):
            print(f"note: --{flag.replace('_', '-')} changes nothing here: {what} (miss {result.miss})",
                  file=sys.stderr)  # fmt: skip
    for note in link_notes:
        print(note, file=sys.stderr)
    if args.json:
        said = getattr(args, "step_time_from", None)
        print(json.dumps({"trace": trace.source, **result.to_dict(), "step_time": said}))
    else:
        print(f"trace      {trace.source}: T={trace.num_tokens} L={trace.num_layers} E={trace.num_experts} "
              f"K={trace.top_k}")  # fmt: skip
        if plan is not None:
            whose = "--cost" if args.cost else "the plan's" if planned else "the defaults (the plan has none)"
            print(f"plan       {args.plan}: {plan.describe()}; costs: {whose}")
        print(format_timing(result))
    return 0


def _check_miss(miss, trace: Trace, cost) -> None:
    """The miss path built on the trace's shape with the replay's costs: a value it refuses
    (``batch:fill=2``) raises here, before the notes of the replay."""
    from expertcache.miss.base import MissContext
    from expertcache.miss.registry import miss_class

    ctx = MissContext(trace.num_layers, trace.num_experts, trace.top_k, costs=cost)
    miss_class(miss.name)(ctx, **miss.params)


def _run_own(trace: Trace, key: str, default: str, lookup, what: str, flag: str) -> str | None:
    """``timing``'s ``key`` (policy, miss path) for an engine's trace given none: the run's own, as the
    engine describes it, said in a note; None for another trace, a run under ``default``, or one this
    process does not have (``lookup`` refuses it: a plugin not loaded, and the replay's note names the
    run's)."""
    ran = trace.meta.get(key) if "capacities" in trace.meta else None
    if ran is None or str(ran) == default:
        return None
    try:
        lookup(str(ran))
    except ExpertcacheError:
        return None
    print(f"note: under the recorded run's own {what} {ran} ({flag} sets another)", file=sys.stderr)
    return str(ran)


def _run_policy(args: argparse.Namespace, trace: Trace) -> str | None:
    """The run's own policy (``_run_own``), as its cache is taken, and the seed it drew with."""
    from expertcache.policy.registry import policy_class

    ran = _run_own(trace, "policy", "lru", lambda s: policy_class(parse_policy(s)[0]), "policy", "--policy")
    drew = trace.meta.get("policy_seed")
    if ran is not None and drew is not None and args.seed is None:
        args.seed = int(drew)
    return ran


def _run_miss(trace: Trace) -> str | None:
    """The run's own miss path (``_run_own``): a user's plain ``timing --trace RUN.npz`` of a ``split``
    run replayed ``fetch``, and its counts were not the run's."""
    from expertcache.miss.registry import miss_class, parse_miss

    return _run_own(trace, "miss", "fetch", lambda s: miss_class(parse_miss(s)[0]), "miss path", "--miss")


def _run_capacity(trace: Trace, miss, cost) -> int | str | None:
    """``timing``'s capacity for an engine's trace given none: the run's own cache parts under its own
    miss path (exact), else its expert memory in experts (both said); None where the trace records
    neither (the default then)."""
    from expertcache.sim.timing import RECORDED, recorded_capacities

    try:
        _, parts = recorded_capacities(trace, miss, cost)
    except ExpertcacheError:
        memory = trace.meta.get("memory")
        if isinstance(memory, int) and not isinstance(memory, bool) and memory >= 1:
            print(f"note: at the recorded run's expert memory, {memory} whole experts (--capacity sets "
                  "another; the engine splits its budget in bytes among another miss path's parts, which "
                  "may give a part a slot more)", file=sys.stderr)  # fmt: skip
            return memory
        return None
    held = ", ".join(f"{name} {n}" for name, n in parts.items())
    print(f"note: at the recorded run's own cache ({held}; --capacity sets another)", file=sys.stderr)
    return RECORDED


def _say_run_costs(args: argparse.Namespace, trace: Trace) -> None:
    """The note of a replay priced by the costs its recorded run decided by (``sim.timing.recorded_costs``:
    a cost-based miss path's, measured at its load or given to it), on stderr."""
    flags = [f for f, *_ in _TIMING_COST_FLAGS if getattr(args, f[2:].replace("-", "_"), None)]
    over = f", {' '.join(flags)} given over them" if flags else ""
    measured = trace.meta.get("costs_measured", True)
    how = "measured at its load" if measured else "given to it"
    # the load measures what the path decides by (an expert, a transfer, the host), not the rest of a step
    rest = "" if not measured or args.dense_time or args.step_time else (
        "; its dense and step times are not among them: the defaults, a GPU's 0.25 ms a layer and "
        "0.5 ms a step (a profile of this machine, --cost, or --dense-time and --step-time give them), "
        "so its counts are the run's and its times are not"
    )  # fmt: skip
    said = f"note: priced by the costs the run decided by ({how}{over}; --cost gives others){rest}"
    print(said, file=sys.stderr)


def _run_costs(args: argparse.Namespace, trace: Trace):
    """``doctor``'s and ``plan``'s base costs on an engine's trace given no ``--cost``: the costs its run
    decided by, as ``timing`` prices its replay (a new user's doctor and timing priced one served trace
    at 32.6 and 13.3 ms a token), or None."""
    from expertcache.sim.timing import recorded_costs

    return None if args.cost else recorded_costs(trace)


def _cost_from_args(args: argparse.Namespace, prefetch=None, base=None, trace=None):
    """The cost model of ``timing``, ``plan`` and ``doctor``: ``--cost`` (or ``base``: a plan's) overridden
    by the cost flags. Without either, on a ``trace`` the engine recorded: the default costs with the
    run's expert size (a byte budget counts the run's experts), said in a note."""
    from expertcache.costs import CostModel

    asked = args.step_time == RECORDED_STEP
    if asked:  # what the clock lacks, before any note on the costs
        from expertcache.sim.timing import check_clock

        if trace is None:
            raise ExpertcacheError("--step-time recorded is what a recorded trace's clock says: give --trace")
        check_clock(trace)
    recorded = None if trace is None else trace.meta.get("expert_bytes")
    if recorded and not args.cost and base is None and args.expert_bytes is None:
        from expertcache.sim.timing import run_link, run_weight_bits, said_link

        link = run_link(trace.meta)  # the run's emulated link, where it had one (--link-* given over it)
        base = CostModel(expert_bytes=int(recorded), **link, **run_weight_bits(trace.meta))
        print(
            f"note: priced by the default costs (a Mixtral-8x7B expert's times, over PCIe 4 to a GPU) with "
            f"the run's experts of {int(recorded) / 2**10:.1f} KiB (the trace's expert_bytes)"
            f"{said_link(link)}: a profile of this machine and model (expertcache profile, then --cost) "
            "prices the run",
            file=sys.stderr,
        )

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
        "step_s": None if args.step_time == RECORDED_STEP else args.step_time,
        "expert_bytes": args.expert_bytes,
        "chunk_bytes": prefetch.chunk_bytes if prefetch is not None else None,
        "wake_s": args.wake_time,
        "submit_s": args.issue_time,
        "host_submit_s": args.host_issue_time,
        "dequant_s": args.dequant_time,
        "disk_read_s": getattr(args, "disk_time", None),
        "demote_s": getattr(args, "demote_time", None),
    }
    base = CostModel.load(args.cost) if args.cost else base
    cost = CostModel.from_dict({k: v for k, v in fields.items() if v is not None}, base)
    if prefetch is not None and not prefetch.chunking:
        cost = CostModel.from_dict({"chunk_bytes": None}, cost)
    if asked or (getattr(args, "clock_by_default", False) and args.step_time is None):
        cost = _recorded_step(args, cost, trace, asked)
    return cost


def _recorded_step(args: argparse.Namespace, cost, trace: Trace, asked: bool):
    """``cost`` with its ``step_s`` what ``trace``'s clock says its run spent a step beyond the model
    (``sim.timing.recorded_step_s``); its figures and note kept in ``args.step_time_from`` for the command
    to say (``doctor`` among its notes and in its JSON, ``timing`` on stderr and in its JSON). ``asked``
    (``--step-time recorded``): a trace that cannot give it is the error; else (doctor's default) a trace
    without a clock is left as it is, and one whose run cannot be replayed is said in a note, as one whose
    steps the default costs price at under half their time (the clock would hold the run's own misses)."""
    import dataclasses

    from expertcache.sim.timing import recorded_step_s

    if not asked and trace.step_start_s is None:
        return cost
    try:
        step, got = recorded_step_s(trace, cost)
    except ExpertcacheError as exc:
        if asked:
            raise
        args.step_time_from = {"note": f"the trace's clock is not used ({exc}); the step time is the costs'"}
        return cost
    replayed = got["replayed_decode_step_s"] or 0.0
    from expertcache.costs import CostModel

    default = CostModel()
    defaults = all(getattr(cost, f) == getattr(default, f) for f in ("link_bandwidth", "expert_s", "dense_s"))
    if defaults and got["recorded_decode_step_s"] > 2 * replayed:
        # the defaults price a miss as a GPU's: the run's own misses (a disk's, a CPU's) land in the step
        # time, which every budget then pays alike, so a budget's own cost is lost (a new user's doctor on a
        # CPU server's trace said 12.5 % was within 1.25x of all resident, where 25 % had run 3.1x slower)
        times = got["recorded_decode_step_s"] / max(replayed, 1e-12)
        why = (
            f"the run's steps took {times:.2g}x its replay's under the default costs (a GPU's), so a step "
            "time from its clock would hold what its misses cost on the machine that ran it, charged to "
            "every budget alike: a profile of that machine (expertcache profile, then --cost PROFILE.json) "
            "prices its misses by budget"
        )
        if not asked:  # doctor's default: its figures stay the cost model's own, said
            said = f"the trace's clock is not used: {why} (--step-time recorded takes it)"
            args.step_time_from = {"note": said}
            return cost
        got["note"] += f"; {why}"
    got["note"] += " (--step-time gives another)"
    args.step_time_from = got
    return dataclasses.replace(cost, step_s=step)


def _say_step_time(args: argparse.Namespace) -> None:
    """Where ``--step-time recorded`` took the step time from (``_recorded_step``), on stderr."""
    said = getattr(args, "step_time_from", None)
    if said is not None:
        print(f"note: {said['note']}", file=sys.stderr)


def _cost_sets_step(path: str | None) -> bool:
    """Whether a ``--cost`` file states a step time of its own (a cost model's ``step_s``; a profile
    measures none: its 0 is the rest of a step counted in ``dense_s``)."""
    if not path:
        return False
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return False  # CostModel.load says what is wrong with it
    return isinstance(data, dict) and "cost" not in data and "step_s" in data


def _cmd_profile(args: argparse.Namespace) -> int:
    from expertcache.tools.profile import declared_fields, format_profile, profile

    if args.steps < 2:
        raise ExpertcacheError(f"--steps must be at least 2, got {args.steps}")
    declared = declared_fields(
        args.device_bandwidth, args.device_latency, args.device_time, args.dense_time, args.device_profile
    )
    shape = None
    if args.device_profile:
        from expertcache.costs import CostModel

        _, shape = CostModel.load_profile(args.device_profile)
    quiet_transformers()
    data = profile(
        args.model, device=args.device, dtype=args.dtype, slow_tier=args.slow_tier, declared=declared,
        steps=args.steps, device_profile_shape=shape, fit_overheads=args.fit_overheads,
    )  # fmt: skip
    if data["how"]["unsteady"]:
        from expertcache.tools.profile import unsteady_line

        print(f"note: {unsteady_line(data)}", file=sys.stderr)
    print(json.dumps(data) if args.json else format_profile(data), flush=True)  # kept if -o cannot be written
    if args.out:
        write_output(args.out, json.dumps(data, indent=1) + "\n", "profile")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from expertcache.sim.doctor import diagnose, format_diagnosis, plot_diagnosis, within_factor

    # a recorded run's clock prices its steps (``_recorded_step``): not the doctor's own recording (one
    # sequence at a time, not warmed up), nor where a cost model states its own step time
    args.clock_by_default = not args.prompts and not _cost_sets_step(args.cost)

    _check_cost_flags(args)
    _check_jobs(args)
    if args.plot:
        check_plot_path(args.plot)
    if args.model and not args.prompts:
        raise ExpertcacheError("--model records a trace from --prompts FILE: give them too, or a --trace")
    if args.max_new_tokens is not None and not args.prompts:  # not taken in silence
        raise ExpertcacheError("--max-new-tokens is for recording a trace (--prompts, with --model or not)")
    if args.window_tokens < 1:
        raise ExpertcacheError(f"--window-tokens must be at least 1, got {args.window_tokens}")
    args.within = within_factor(args.within)  # before a trace is recorded or batched
    _check_concurrency(args)
    if args.prompts:  # recorded from --model, or the embedded model
        if args.trace != "default":
            raise ExpertcacheError("give --trace or --prompts (recorded from --model), not both")
        trace = _record_trace(args.model, args.prompts, args.max_new_tokens or 32, args.window_tokens)
    else:
        trace = _trace(args.trace)
    _check_profile(args, trace)
    own = _run_costs(args, trace)
    cost = _cost_from_args(args, base=own, trace=trace)
    if own is not None:
        _say_run_costs(args, trace)
    capacity = _capacity(args, cost, trace)  # the budget checked before the requests are batched
    trace = _served(trace, args)
    host = _host_level(args)
    cost, link_notes = _profile_links(args, host, cost)
    report = diagnose(
        trace, capacity, cost, window_tokens=args.window_tokens, policy=args.policy,
        misses=tuple(dict.fromkeys(args.miss or ["fetch"])), host=host,
        host_capacity=args.host_capacity, jobs=args.jobs, within=args.within,
    )  # fmt: skip
    _note_free_reads(host, cost)  # after: a host size it cannot run is the one line
    for note in link_notes:
        print(note, file=sys.stderr)
    said = getattr(args, "step_time_from", None)
    if said is not None:  # where its step time came from, among its notes and in its JSON
        report["notes"].insert(0, said["note"])
        report["step_time"] = said
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    if args.plot:
        plot_diagnosis(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    print(json.dumps(report) if args.json else format_diagnosis(report))
    return 0


def _record_trace(model: str, prompts: str, max_new_tokens: int, window: int | None = None) -> Trace:
    """The routing of ``model`` over the prompts of a file (every expert resident, greedy). ``window``
    (doctor's): a sequence must have that many tokens, checked before generating."""
    from expertcache.tools.prompts import read_prompt_items

    items = read_prompt_items(prompts)
    if max_new_tokens < 1:
        raise ExpertcacheError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    quiet_transformers()
    from expertcache.engine.offloaded import load

    with load(model, "100%", progress=False, warmup=False) as m:
        texts = [item.prompt for item in items if not isinstance(item.prompt, list)]
        longest = max((len(m.tokenizer(t)["input_ids"]) for t in texts), default=None)
        short = window is not None and longest is not None and longest + max_new_tokens < window
        if short and len(texts) == len(items):  # (a chat prompt's template adds tokens: not judged here)
            raise ExpertcacheError(
                f"the longest prompt ({longest} tokens) and --max-new-tokens {max_new_tokens} make "
                f"{longest + max_new_tokens} tokens, fewer than --window-tokens {window}: give more new "
                "tokens, longer prompts or a smaller window"
            )
        for item in items:
            m.generate_text(item.prompt, max_new_tokens, chat=isinstance(item.prompt, list))
        from expertcache.engine.hub import model_label

        # named in the reports as what it is, not "<memory>"
        return replace(m.trace(), source=f"{model_label(m.path)} on {prompts}")


def _check_profile(args: argparse.Namespace, trace: Trace) -> None:
    """A ``--cost`` profile measured for another model's shape is refused, and one of a packed model
    for a miss path that needs low-precision copies."""
    from expertcache.costs import CostModel, check_low_precision, check_shape, size_note

    if args.cost:
        cost, shape = CostModel.load_profile(args.cost)
        check_shape(args.cost, shape, trace)
        note = size_note(args.cost, cost, trace)
        if note is not None:
            print(f"note: {note}", file=sys.stderr)
        given = getattr(args, "miss", None)
        misses = given if isinstance(given, list) else [given or "fetch"]
        check_low_precision(args.cost, shape, misses)


def _cmd_plan(args: argparse.Namespace) -> int:
    from expertcache.config import PrefetchConfig
    from expertcache.costs import profile_tier
    from expertcache.sim.planner import format_plan, make_plan

    _check_cost_flags(args)
    _check_concurrency(args)
    _check_jobs(args)
    if args.out:
        for given in (args.trace, getattr(args, "profile", None), args.predictor, args.cost):
            if given is not None:
                _not_the_input(args.out, given)
    raw = _trace(args.trace)
    _check_profile(args, raw)
    own = _run_costs(args, raw)
    cost = _cost_from_args(args, base=own, trace=raw)
    _say_step_time(args)
    if own is not None:
        _say_run_costs(args, raw)
    capacity = _capacity(args, cost, raw)  # the budget checked before the requests are batched
    trace = _served(raw, args)
    windows = list(dict.fromkeys(args.window or [None]))
    if args.window and all(p == "none" for p in args.prefetch or ["none"]):  # as timing refuses it
        raise ExpertcacheError("--window sets the layers ahead of a predictor, and none is compared "
                               "(--prefetch NAME)")  # fmt: skip
    prefetches = [
        PrefetchConfig(p, window=w, data=None if p == "none" else args.predictor)
        for p in dict.fromkeys(args.prefetch or ["none"])
        for w in ([None] if p == "none" else windows)
    ]
    predictor_trace = _predictor_trace(args.predictor, [p.predictor for p in prefetches])
    host = _host_level(args)
    hosts = {} if host is None else {"host": host, "host_capacity": args.host_capacity}
    if args.host_policy:
        hosts["host_policies"] = list(dict.fromkeys(args.host_policy))
    seed = _seed(args, [args.policy, *(hosts.get("host_policies") or [])])
    cost, link_notes = _profile_links(args, host, cost)
    plan = make_plan(
        trace, capacity, cost, policy=args.policy, misses=list(dict.fromkeys(args.miss or ["fetch"])),
        prefetches=prefetches, methods=list(dict.fromkeys(args.method)) if args.method else None,
        objective=args.objective, seed=seed, predictor_trace=predictor_trace, jobs=args.jobs, **hosts,
        slow_tier=profile_tier(args.cost) if args.cost else None, deterministic=args.deterministic,
    )  # fmt: skip
    for note in link_notes:  # free host-level reads: among the plan's notes, from its runs
        print(note, file=sys.stderr)
    for note in plan.source.get("notes", []):
        print(f"note: {note}", file=sys.stderr)
    if policy_class(parse_policy(args.policy)[0]).needs_profile:  # it ranks by usage, which the plan lacks
        print(f"note: a {args.policy} plan runs with its usage profile: generate --plan PLAN --profile "
              "TRACE.npz (a trace like the one planned on)", file=sys.stderr)  # fmt: skip
    shown = json.dumps(plan.to_dict()) if args.json else format_plan(plan)
    print(shown, flush=True)  # first: the plan is kept if its file cannot be written
    if args.out:
        plan.save(args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _distinct_policies(specs: Sequence[str] | None) -> list[str]:
    """``--policy`` given more than once, each spelling of one policy and its parameters compared once
    (``lru`` and ``lru:`` gave two equal rows), with a note."""
    seen: dict[tuple, str] = {}
    for spec in specs or ():
        name, params = parse_policy(spec)
        key = (name, tuple(sorted((k, repr(v)) for k, v in params.items())))
        if key in seen:
            print(f"note: --policy {spec} is --policy {seen[key]} again: compared once", file=sys.stderr)
        else:
            seen[key] = spec
    return list(seen.values())


def _seed(args: argparse.Namespace, policies: Sequence[str | None]) -> int:
    """``--seed`` (default 0), with a note where no policy of the run draws at random: a seed given
    there changes nothing, and is not taken in silence."""
    if args.seed is None:
        return 0
    if args.seed < 0:  # the one line, before any note about it
        raise ExpertcacheError(f"--seed must be at least 0, got {args.seed}")
    note = unseeded_note("--seed", args.seed, list(dict.fromkeys(parse_policy(p)[0] for p in policies if p)))
    if note is not None:
        print(note, file=sys.stderr)
    return args.seed


def _given(args: argparse.Namespace, *dests: str) -> list[str]:
    """The options of ``dests`` the command line gave, as flags (``--host-memory``)."""
    return [f"--{d.replace('_', '-')}" for d in dests if getattr(args, d)]


def _experts_count(text: str, memory: str = "--host-memory") -> int:
    """``--host-capacity`` (``--capacity``): a whole number of experts (a share or a size is ``memory``'s)."""
    try:
        return int(text)
    except ValueError:
        meant = f"{memory} {text}" if text.strip().endswith(("%", "B")) else memory  # a share or a size
        share = re.fullmatch(r"\s*([0-9.]+)\s*%\s*", text)
        if share is not None and _over_whole(share.group(1)):  # its own refusal: no more than 100 %
            meant = f"{memory}, a share of at most 100 %"
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of experts (a share or a size of memory: {meant})"
        ) from None


def _over_whole(number: str) -> bool:
    """Whether a share's number (``"200"`` of ``"200%"``) is beyond 100 (one that does not parse: no)."""
    try:
        return float(number) > 100
    except ValueError:
        return False


def _profile_links(args: argparse.Namespace, host, cost):
    """``timing``, ``plan`` and ``doctor`` with ``--cost PROFILE.json``: what a profile measured that a host
    level or ``--expert-bytes`` changes the meaning of. Returns the costs to run with and the notes to say
    once the run is done. A CPU's profile of a tier it reads (disk, mapped) measured the link as that read;
    with a host level the link is the copy from the host cache into the expert memory, which the same
    profile measured as its copy down (``demote_s``, one expert copied in memory): priced at that."""
    if not args.cost:
        return cost, []
    from expertcache.costs import PROFILE_FORMAT, CostModel, read_tier_link

    try:
        profile = json.loads(Path(args.cost).read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return cost, []  # CostModel.load has read it already, or said why it could not
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        return cost, []  # a plain cost file: its figures are what they say
    tier, how = read_tier_link(profile), profile.get("how") or {}
    measured = profile.get("measured") if isinstance(profile.get("measured"), list) else []
    notes = []
    if host is not None and tier is not None and not args.link_bandwidth:
        if not cost.host_parallel and cost.demote_s > 0 and "demote_s" in measured:  # a CPU's copy
            rate = cost.expert_bytes / cost.demote_s
            cost = CostModel.from_dict({"link_bandwidth": rate, "link_latency": 0.0}, cost)
            notes.append(
                f"note: {args.cost} measured the link reading the {tier} tier ({how.get('link')}); with a "
                f"host level the link is the copy from the host cache into the expert memory, priced at its "
                f"copy of one expert in memory ({cost.demote_s * 1e6:.0f} us: {rate / 1e9:.3g} GB/s; "
                "--link-bandwidth gives another)"
            )
        else:
            notes.append(
                f"note: {args.cost} measured the link reading the {tier} tier ({how.get('link')}); with a "
                "host level the link is the copy from the host cache into the expert memory, and a host hit "
                "pays that read here: give --link-bandwidth for the copy (expertcache profile --slow-tier "
                "host measures it)"
            )
    if args.expert_bytes and "disk_read_s" in measured and getattr(args, "disk_time", None) is None:
        notes.append(
            f"note: --expert-bytes rescales the link's time, not the disk read {args.cost} measured for its "
            "experts: give --disk-time for experts of this size"
        )
    return cost, notes


def _note_free_reads(host, cost) -> None:
    """``plan`` and ``doctor``, as ``timing`` does: a host level whose misses cost no time."""
    if host is not None and not cost.disk_read_s:
        print(
            "note: the cost model's disk_read_s is 0 (give --disk-time, or a profile of the disk tier): the "
            "host level's misses cost no time",
            file=sys.stderr,
        )


def _check_cost_flags(args: argparse.Namespace) -> None:
    """Each cost flag's value has its unit, in a message that names the flag (``--link-latency '20'
    needs a unit: 20us, 20ms or 20s``); the cost model converts them afterwards."""
    from expertcache.units import parse_duration, parse_rate, parse_size

    parsers = {"RATE": parse_rate, "SIZE": parse_size}
    for flag, meta, _ in (*_TIMING_COST_FLAGS, ("--chunk-size", "SIZE", "")):
        value = getattr(args, flag[2:].replace("-", "_"))
        if flag == "--step-time" and value == RECORDED_STEP:  # what the trace's clock says (_recorded_step)
            continue
        for piece in [] if value is None else value.split(","):
            if not (meta == "RATE" and piece.strip().lower() in ("inf", "infinity")):
                try:
                    got = parsers.get(meta, parse_duration)(piece, flag)
                except ExpertcacheError as exc:
                    if flag != "--step-time":
                        raise
                    raise ExpertcacheError(f"{exc}, or '{RECORDED_STEP}' (a recorded run's clock)") from None
                if meta == "SIZE" and got < 1:  # the cost model's own message named its field, not the flag
                    raise ExpertcacheError(f"{flag} must be at least 1 byte, got {value!r}")


def _add_jobs(p: argparse.ArgumentParser, what: str) -> None:
    cpus = usable_cpus()
    p.add_argument(
        "--jobs", type=int, default=cpus, metavar="N",
        help=f"processes for {what}, side by side (default: every CPU this process may use, {cpus} here; the "
        "same result with any number)",
    )  # fmt: skip


def _check_jobs(args: argparse.Namespace) -> None:
    """``--jobs`` of sim, sweep, plan and doctor: at least 1 where given (sweep's default is None)."""
    if args.jobs is not None and args.jobs < 1:
        raise ExpertcacheError(f"--jobs must be at least 1, got {args.jobs}")


def _add_concurrency(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--concurrency", type=int, metavar="N", help="serve the trace's requests N at a time first, as "
        "'trace batch' does (what a server with N users asks of the cache; default: as recorded)"
    )  # fmt: skip
    p.add_argument(
        "--schedule", metavar="{fifo,prompts-first}",
        help="with --concurrency: how a step is laid out, as serve --schedule runs it (default fifo)",
    )  # fmt: skip
    p.add_argument(
        "--max-batch-tokens", type=int, metavar="N",
        help="with --concurrency: tokens a step computes at most, prompts joining in chunks, as serve "
        f"--max-batch-tokens (default {SERVE_BATCH_TOKENS}, serve's, or N if more)",
    )  # fmt: skip


def _check_concurrency(args: argparse.Namespace) -> None:
    if args.concurrency is not None and args.concurrency < 1:
        raise ExpertcacheError(f"--concurrency must be at least 1 request at a time, got {args.concurrency}")
    for flag in ("schedule", "max_batch_tokens"):
        if getattr(args, flag) is not None and args.concurrency is None:
            raise ExpertcacheError(
                f"--{flag.replace('_', '-')} lays out the steps of --concurrency N: give --concurrency"
            )
    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        raise ExpertcacheError(
            f"--max-batch-tokens must be at least 1 token a step, got {args.max_batch_tokens}"
        )
    if args.max_batch_tokens is not None and args.max_batch_tokens < args.concurrency:
        raise ExpertcacheError(
            f"--max-batch-tokens {args.max_batch_tokens} is below --concurrency {args.concurrency}: the "
            "simulated server's step holds every running request's next token"
        )


def _predictor_trace(given: str | None, predictors: list[str]) -> Trace | None:
    """``--predictor`` in the simulator's commands: a recorded trace, for a predictor that reads one
    (token, eam); one line where none of ``predictors`` does, or where it is a directory (a trained
    predictor, which runs in the engine only)."""
    if given is None:
        return None
    from expertcache.predict.registry import trace_readers

    if Path(given).is_dir():
        raise ExpertcacheError(
            f"--predictor {given} is a directory: the simulator's predictors learn from a recorded trace "
            "(.npz); a trained predictor runs in the engine (generate --prefetch learned --predictor DIR)"
        )
    if not trace_readers(predictors):
        raise ExpertcacheError(
            f"--predictor {given}: prefetch {', '.join(dict.fromkeys(predictors))} reads no recorded trace "
            "(token and eam do)"
        )
    return _trace(given)  # ``default`` too, as every other trace option takes it


def _batch_args(made: dict) -> str:
    """``trace batch``'s arguments that make a plan's trace of requests served N at a time again."""
    out = f"{made['trace']} --concurrency {made['concurrency']} --requests {made['requests']}"
    out += f" --batch-tokens {made['batch_tokens']}" if made["batch_tokens"] is not None else ""
    out += f" --stagger {made['stagger']}" if made["stagger"] != 1 else ""
    return out + (f" --schedule {made['schedule']}" if made["schedule"] != "fifo" else "")


def _batched_how(made: dict) -> str:
    """A plan's trace of requests served N at a time, in words."""
    how = f"{made['trace']}'s requests served {made['concurrency']} at a time ({made['schedule']}"
    how += f", steps of at most {made['batch_tokens']} tokens" if made["batch_tokens"] is not None else ""
    return how + ")"


def _served(trace: Trace, args: argparse.Namespace) -> Trace:
    """The trace, or its requests served ``--concurrency`` at a time (``trace.batch.batch_requests``)."""
    if args.concurrency is None:
        return trace
    from expertcache.trace.batch import batch_requests

    cap = args.max_batch_tokens or max(SERVE_BATCH_TOKENS, args.concurrency)
    served = batch_requests(trace, args.concurrency, batch_tokens=cap, schedule=args.schedule or "fifo")
    how = f" ({args.schedule})" if args.schedule not in (None, "fifo") else ""
    how += f", steps of at most {cap} tokens"
    print(
        f"served {trace.source}'s requests {args.concurrency} at a time{how}: {served.num_tokens} tokens in "
        f"{len(set(served.step_id.tolist()))} steps",
        file=sys.stderr,
    )
    return served


def _add_host_level(p: argparse.ArgumentParser, mode: str = "timing") -> None:
    """``--host-memory``, ``--host-policy``, ``--host-exclusive``, ``--host-stage``: a host level below the
    cache. ``plan``: policies to choose among, and no exclusive flag (it compares inclusive and exclusive
    levels itself) nor staging; ``doctor``: one policy, on demand (it reports inclusive and exclusive
    both)."""
    p.add_argument(
        "--host-memory", metavar="X", help="three tiers: a host cache of this many bytes (8GiB) or this "
        "share of all experts (30%%) between the cache and the disk (a miss of it reads --disk-time first)",
    )  # fmt: skip
    p.add_argument(
        "--host-capacity", type=_experts_count, metavar="N",
        help="the host cache's memory in experts, not bytes (an exclusive one holds N less its reserve for "
        "hits in flight, a layer's top-k, as with --host-memory; "
        "a run's stats give host_capacity and host_reserve)",
    )  # fmt: skip
    if mode == "plan":
        p.add_argument(
            "--host-policy", nargs="+", metavar="NAME",
            help="the host cache's policies to choose among (default: lru lfu fifo lcp lfu-dist lru-dist; "
            "a -dist one only where the host cache holds a layer's top-k in every layer)",
        )  # fmt: skip
    else:
        p.add_argument(
            "--host-policy", metavar="NAME[:k=v,...]", help="the host cache's policy (default lru)"
        )
    if mode != "timing":  # asked for anyway: refused in one line that says why (``_host_level``)
        p.add_argument("--host-exclusive", action="store_true", help=argparse.SUPPRESS)
        p.add_argument("--host-stage", type=int, default=0, help=argparse.SUPPRESS)
        p.set_defaults(host_mode=mode)
        return
    p.add_argument(
        "--host-stage", type=int, default=0, metavar="N",
        help="with a predictor: read up to N more predicted experts a layer into the host cache early "
        "(default 0)",
    )  # fmt: skip
    p.add_argument(
        "--host-exclusive", action="store_true",
        help="the host cache holds what the device's does not: a hit moves up, a device victim comes down",
    )  # fmt: skip


def _host_level(args: argparse.Namespace):
    """The ``HostConfig`` of ``--host-memory`` / ``--host-capacity`` and their options, or None."""
    from expertcache.config import HostConfig

    mode = getattr(args, "host_mode", "timing")
    if mode != "timing" and (args.host_exclusive or args.host_stage):
        flag = "--host-exclusive" if args.host_exclusive else "--host-stage"
        raise ExpertcacheError(
            f"{mode} weighs an inclusive and an exclusive host level itself and reports both (leave out "
            f"{flag}; 'expertcache timing' replays one level of your choice)"
            if args.host_exclusive
            else f"{mode} does not weigh staging (leave out {flag}; 'expertcache timing --host-stage N' "
            "replays it)"
        )
    given = args.host_memory is not None or args.host_capacity is not None
    if not given:
        for flag in ("host_policy", "host_exclusive", "host_stage", "disk_time", "demote_time"):
            if getattr(args, flag):  # (an empty value never comes here: _refuse_empty)
                raise ExpertcacheError(f"--{flag.replace('_', '-')} needs --host-memory or --host-capacity")
        return None
    if args.host_memory is not None and args.host_capacity is not None:
        raise ExpertcacheError("give --host-memory or --host-capacity, not both")
    policies = args.host_policy if isinstance(args.host_policy, list) else [args.host_policy or "lru"]
    for policy in policies:  # each checked here, in one line
        HostConfig(args.host_memory, policy, exclusive=args.host_exclusive, stage=args.host_stage)
    return HostConfig(args.host_memory, policies[0], exclusive=args.host_exclusive, stage=args.host_stage)


def _add_budget(p: argparse.ArgumentParser, default: str) -> None:
    """``--capacity`` or ``--expert-memory`` (``default`` when neither is given), as ``_capacity`` reads."""
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--capacity", type=partial(_experts_count, memory="--expert-memory"), metavar="N",
        help="experts the cache holds (at least 1)",
    )  # fmt: skip
    shown = default.replace("%", "%%")  # argparse formats help with %
    size.add_argument(
        "--expert-memory", metavar="X", help=f"bytes (6GiB) or a share of all experts (default {shown})"
    )
    p.set_defaults(default_expert_memory=default)


def _add_costs(p: argparse.ArgumentParser) -> None:
    """``--cost`` (a cost model or a profile) and the cost flags that override it."""
    p.add_argument("--cost", metavar="FILE.json", help="cost model or profile (the flags below override it)")
    for flag, meta, what in _TIMING_COST_FLAGS:
        p.add_argument(flag, metavar=meta, help=what)


def _capacity(args: argparse.Namespace, cost, trace: Trace) -> int:
    """Experts the cache holds: ``--capacity``, or ``--expert-memory`` (or the command's default) in
    whole experts of the cost model's size."""
    if args.capacity is not None:  # 0 is a capacity, and refused, not the default
        return args.capacity
    memory = args.expert_memory or args.default_expert_memory
    return _timing_capacity(memory, cost.expert_bytes, trace.num_layers * trace.num_experts)


def _timing_capacity(memory: str, expert_bytes: int, total: int) -> int:
    """Experts the cache of ``timing`` holds for ``--expert-memory``; a note when it holds them all."""
    from expertcache.units import capacity_for, format_bytes, parse_size

    capacity = capacity_for(memory, expert_bytes, total)
    if capacity < 1 and memory.strip().endswith("%"):
        raise ExpertcacheError(f"--expert-memory {memory} of {total} experts is less than one whole expert")
    if capacity < 1:
        raise ExpertcacheError(
            f"--expert-memory {memory} holds no expert of {format_bytes(expert_bytes)} (the cost model's "
            "expert size: see --expert-bytes or --cost)"
        )
    if not memory.strip().endswith("%") and parse_size(memory) > total * expert_bytes:
        print(
            f"note: --expert-memory {memory} is more than all {total} experts take; capped at "
            f"{format_bytes(total * expert_bytes)} (100%: no offloading)",
            file=sys.stderr,
        )
    return capacity


def _note_skipped(
    policies: Sequence[str], caps: list[int], num_layers: int, min_room: int, named: bool = True
) -> list[str]:
    """Say which capacities a -dist policy could not run with: a layer's budget below its group, or
    a capacity other than the sum of the budgets it was given. A policy that can run at none of them is
    an error where the user ``named`` it, and left out with a note where it came with the defaults.
    -> the policies to run."""
    kept = []
    for spec in policies:
        name, params = parse_policy(spec)
        low = min_capacity(name, num_layers, params, min_room)
        fixed = fixed_capacity(name, params)
        why = capacity_reason(name, params, min_room)
        skipped = [c for c in caps if c < low or fixed not in (None, c)]
        if skipped and len(skipped) == len(caps):
            need = f"capacity {fixed}" if fixed is not None else f"capacity >= {low}"
            if named:
                raise ExpertcacheError(f"{name} needs {need} ({why})")
            print(f"note: {name} (a default policy) left out: it needs {need} ({why})", file=sys.stderr)
            continue
        if skipped:
            where = f"other than {fixed}" if fixed is not None else f"< {low}"
            print(f"note: {name} left out at capacities {where} ({why})", file=sys.stderr)
        kept.append(spec)
    return kept


def _capacities(items: Sequence[str], trace: Trace, order: str) -> list[int]:
    """``sim --capacity``: items of ``units.capacity_items``' grammar, ``all`` from the least the layer
    order allows; one capacity above all experts is capped, with a note, and one below top-k (in layer
    order) refused, said in experts where it was a share; a range's capacities outside those bounds are
    left out, with a note."""
    total = trace.num_layers * trace.num_experts
    room = min_room(order, trace.top_k)
    why = f"in layer order a token's {trace.top_k} experts of a layer must be resident together"
    caps: list[int] = []
    notes: list[str] = []  # said once some capacity is left to run
    for item in items:
        got = capacity_items(item, total, room)
        if any(isinstance(n, str) for n in got):
            raise ExpertcacheError(f"capacity {item!r} is below one expert of {total}")
        if ":" not in str(item) and str(item) != "all":  # one capacity: a count or a share
            n = got[0]
            if n > total:
                print(
                    f"note: a cache of {n} experts is more than all {total}; capped at {total}",
                    file=sys.stderr,
                )
                got = [total]
            elif n < room:
                said = "" if str(item) == str(n) else f" ({n} expert{'s' if n != 1 else ''} of {total})"
                raise ExpertcacheError(f"capacity {item}{said} is below top-k {trace.top_k}: {why}")
        else:  # a range (or all): what it holds beyond the trace's bounds is left out, and said
            out = [n for n in got if not room <= n <= total]
            if out:
                bound = f"below top-k {trace.top_k}" if out[0] < room else f"above all {total} experts"
                notes.append(f"note: capacity {item}: left out {', '.join(map(str, out))} ({bound})")
            beyond = capacity_beyond(item, total)  # capacity_items cut the range there
            if beyond is not None:
                notes.append(f"note: capacity {item}: left out {beyond} (above all {total} experts)")
            got = [n for n in got if room <= n <= total]
        caps += got
    if not caps:  # the one line (what each range left out is all of it)
        raise ExpertcacheError(
            f"capacity {' '.join(items)} selects no capacity of the trace's {total} experts"
        )
    for note in notes:
        print(note, file=sys.stderr)
    return list(dict.fromkeys(caps))


def _trace(name: str) -> Trace:
    """A trace file, or ``default``: the embedded trace (as ``sim``, ``timing`` and ``trace info`` take)."""
    if name == "default" and Path(name).exists():  # the name wins, and a file so named is not read in silence
        print("note: 'default' is the embedded trace, not the file ./default here (give ./default for that)",
              file=sys.stderr)  # fmt: skip
    return default_trace() if name == "default" else load_trace(name)


def _cmd_trace_info(args: argparse.Namespace) -> int:
    trace = _trace(args.file)
    info = summary(trace)
    run = _recorded_run(trace.meta)  # a trace the engine recorded: how its run was laid out
    if run:
        info["recorded"] = run
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"trace       {info['source']}")
    print(f"shape       T={info['tokens']} tokens, L={info['layers']} layers, E={info['experts']} experts, "
          f"K={info['top_k']}")  # fmt: skip
    prefill = info["prefill_tokens"]  # None: the trace does not say which tokens are the prompt's
    pad = f", and {info['padding_tokens']} rows of left padding" if info["padding_tokens"] else ""
    prefill = "-" if prefill is None else prefill
    print(f"sequences   {info['sequences'] or '-'} (prefill tokens: {prefill}{pad})")
    print(f"unknown     {info['unknown_entries']} entries")
    if run:
        print(f"recorded    {_describe_recorded(run)}")
    if info["step_shape"] is not None:
        st = info["step_shape"]
        print(f"steps       {st['steps']} forward steps of {st['mean_step_tokens']:.1f} tokens on average "
              f"(at most {st['max_step_tokens']}); a layer needs {st['mean_step_experts']:.1f} distinct "
              "experts a step")  # fmt: skip
        if "mean_step_requests" in st:
            print(f"requests    {st['mean_step_requests']:.1f} served together a step on average (at most "
                  f"{st['max_step_requests']})")  # fmt: skip
    if info["step_walls"] is not None:
        print(f"wall        {_describe_walls(info['step_walls'])}")

    def num(v: float | None, width: int) -> str:  # a layer without known entries: "-"
        return f"{'-':>{width}}" if v is None else f"{v:{width}.3f}"

    print(f"entropy     mean {num(info['mean_entropy_bits'], 0)} bits of {info['max_entropy_bits']:.3f}")
    reuse = num(info["mean_reuse"], 0)
    print(f"reuse       mean {reuse} of a token's experts were used by the previous token")
    print("layer  entropy  reuse")
    for layer, (h, r) in enumerate(zip(info["entropy_bits"], info["reuse"], strict=True)):
        print(f"{layer:5d}  {num(h, 7)}  {num(r, 5)}")
    if any(h is None for h in info["entropy_bits"]):
        print("-: a layer without a known expert (the trace's -1 entries)", file=sys.stderr)
    return 0


def _describe_walls(walls: dict) -> str:
    """A recorded run's own step times, as ``trace info`` prints them (``trace.stats.step_walls``)."""
    ms = lambda v: "-" if v is None else f"{v * 1e3:.3g} ms"  # noqa: E731
    said = [
        f"{walls[phase]['steps']} {phase} step{'s' if walls[phase]['steps'] != 1 else ''}: forward "
        f"{ms(walls[phase]['forward_median_s'])}, whole step {ms(walls[phase]['whole_median_s'])} (medians)"
        for phase in ("decode", "prefill")
        if walls[phase]["steps"]
    ]
    return f"{walls['steps']} steps over {walls['seconds']:.3g} s, the run's own clock; " + "; ".join(said)


# what the engine writes into a trace it records (``OffloadedModel.trace``, a server's layout), in order
_RECORDED = ("model", "device", "memory", "capacity", "policy", "policy_seed", "miss", "capacities",
             "costs_measured", "predictor", "window", "prefetch_limit", "deterministic", "host_capacity",
             "host_policy", "host_exclusive", "host_stage", "served_batch_tokens", "served_schedule",
             "profile")  # fmt: skip


def _recorded_run(meta: dict) -> dict:
    """The run a trace the engine recorded comes from (its meta: plain values, the capacities parsed);
    empty for a trace of another kind."""
    if "policy" not in meta or "capacity" not in meta:
        return {}
    run = {k: meta[k] for k in _RECORDED if k in meta}
    if isinstance(run.get("capacities"), str):
        try:
            run["capacities"] = json.loads(run["capacities"])
        except ValueError:
            pass
    return run


def _describe_recorded(run: dict) -> str:
    where = f"{run.get('model', 'a model')}" + (f" on {run['device']}" if "device" in run else "")
    parts = [where, f"{run['capacity']} experts cached"]
    caps = run.get("capacities")
    if isinstance(caps, dict) and len(caps) > 1:
        parts[-1] += " (" + ", ".join(f"{p} {n}" for p, n in caps.items()) + ")"
    parts += [f"policy {run['policy']}", f"miss {run.get('miss', 'fetch')}"]
    if "predictor" in run:
        pf = f"prefetch {run['predictor']} (window {run.get('window')}"
        pf += f", limit {run['prefetch_limit']}" if "prefetch_limit" in run else ""
        parts.append(pf + (", deterministic)" if run.get("deterministic") else ")"))
    else:
        parts.append("no prefetch")
    if "host_capacity" in run:
        kind = "exclusive" if run.get("host_exclusive") else "inclusive"
        parts.append(f"host level {run['host_capacity']} experts ({run.get('host_policy')}, {kind})")
    if "served_batch_tokens" in run:
        parts.append(
            f"served in steps of at most {run['served_batch_tokens']} tokens, {run.get('served_schedule')}"
        )
    return ", ".join(parts)


def _cmd_trace_synth(args: argparse.Namespace) -> int:
    names = ("tokens", "layers", "experts", "top_k", "seed", "a", "b", "stickiness", "sequences",
             "prompt_len", "layer")  # fmt: skip
    params = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    trace = synthesize(args.kind, **params)
    trace.save(args.out)
    print(f"wrote {args.out}: {args.kind} trace, T={trace.num_tokens} L={trace.num_layers} "
          f"E={trace.num_experts} K={trace.top_k}", file=sys.stderr)  # fmt: skip
    return 0


def _not_the_input(out: str, given: str) -> None:
    """One line where the output would overwrite the input it is made from."""
    if given != "default" and Path(given).exists() and Path(out).resolve() == Path(given).resolve():
        raise ExpertcacheError(f"-o {out} is the input itself: writing it would destroy what it is made from")


def _cmd_trace_batch(args: argparse.Namespace) -> int:
    from expertcache.trace.batch import batch_requests

    _not_the_input(args.out, args.file)
    trace = batch_requests(
        _trace(args.file), args.concurrency, args.requests, args.batch_tokens, args.stagger, args.schedule
    )
    trace.save(args.out)
    shape = step_shape(trace)
    achieved = ""
    if "mean_step_requests" in shape:  # ramp-up, drain and the step's token cap run fewer than asked
        mean, most = shape["mean_step_requests"], shape["max_step_requests"]
        achieved = f" (achieved: {mean:.1f} a step on average, {most} at most)"
    n = trace.meta["batched_requests"]
    print(f"wrote {args.out}: {n} request{'s' * (n != 1)}, {args.concurrency} at a time"
          f"{achieved}: {shape['steps']} steps of {shape['mean_step_tokens']:.1f} tokens on average, "
          f"{shape['mean_step_experts']:.1f} of {trace.num_experts} experts a layer a step",
          file=sys.stderr)  # fmt: skip
    return 0


def _cmd_trace_import(args: argparse.Namespace) -> int:
    from expertcache.trace.importers import import_trace

    if args.num_experts is not None and args.num_experts < 1:
        raise ExpertcacheError(f"--num-experts must be at least 1, got {args.num_experts}")
    _not_the_input(args.out, args.file)
    fmt = args.format or ("torch" if Path(args.file).suffix.lower() in (".pt", ".pth") else None)
    if fmt == "torch":
        from expertcache.tools.trace_import import import_torch

        trace, notes = import_torch(args.file, args.num_experts), []
    else:
        trace, notes = import_trace(args.file, fmt, args.num_experts, skip_profiling=not args.keep_profiling)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    trace.save(args.out)
    seqs = 1 if trace.seq_id is None else int(trace.seq_id.max()) + 1
    unknown = int((trace.experts < 0).sum())
    print(
        f"wrote {args.out}: T={trace.num_tokens} L={trace.num_layers} E={trace.num_experts} K={trace.top_k}, "
        f"{seqs} request(s), {unknown} unknown entries",
        file=sys.stderr,
    )
    return 0


def _doc_line(*docs: str | None) -> str:
    """The first line of the first of ``docs`` with any text (a policy, miss path or predictor added
    without a docstring is listed without one, not a traceback)."""
    for doc in docs:
        if doc and doc.strip():
            return doc.strip().splitlines()[0]
    return "(no description: the class and its module have no docstring)"


def _module_doc(cls) -> str | None:
    return getattr(sys.modules.get(cls.__module__), "__doc__", None)


def _listed(cls) -> str:
    """A policy's or miss path's line: the package's own by their module's docstring (one module each),
    a user's (``plugins``: several in one module, perhaps) by their class's first."""
    if cls.__module__.startswith("expertcache."):
        return _doc_line(_module_doc(cls), cls.__doc__)
    return _doc_line(cls.__doc__, _module_doc(cls))


def _listing(args: argparse.Namespace, rows: list[dict[str, object]], line) -> int:
    """A listing's rows, as text lines (``line(row)``) or, with ``--json``, one JSON array."""
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            print(line(row))
    return 0


def _cmd_policies(args: argparse.Namespace) -> int:
    width = max(13, *map(len, POLICIES))  # a plugin's long name keeps the columns (it shifted its row)
    rows = []
    for name in POLICIES:
        cls = policy_class(name)
        split = None
        if isinstance(POLICIES[name], partial):  # a -dist form: one inner policy per layer
            split = cls.name
        rows.append({"name": name, "kind": "offline" if cls.offline else "online", "split_of": split,
                     "parameters": policy_parameters(name), "description": _listed(cls),
                     "own": cls.__module__.startswith("expertcache.")})  # fmt: skip

    def line(r: dict) -> str:  # a -dist line names its inner policy where a user's may not
        split = (
            ""
            if r["split_of"] is None
            else "per-layer split of " + ("" if r["own"] else f"{r['split_of']}: ")
        )
        return f"{r['name']:{width}s} {r['kind']:7s} {split}{r['description']}"

    return _listing(args, rows, line)


def _cmd_misses(args: argparse.Namespace) -> int:
    from expertcache.miss.registry import MISS_PATHS, parameters

    width = max(10, *map(len, MISS_PATHS))
    rows = []
    for name, cls in MISS_PATHS.items():
        doc = _listed(cls)
        if cls.__module__.endswith(".base"):
            doc = "fetch the whole expert at full precision (the default)."
        rows.append({"name": name, "kind": "lossy" if cls.lossy else "exact", "parameters": parameters(cls),
                     "description": doc})  # fmt: skip

    def line(r: dict) -> str:
        params = ",".join(r["parameters"])
        return f"{r['name']:{width}s} {r['kind']:6s} {r['description']}" + (f" [{params}]" if params else "")

    return _listing(args, rows, line)


def _cmd_predictors(args: argparse.Namespace) -> int:
    from expertcache.predict.registry import PREDICTORS

    width = max(10, *map(len, PREDICTORS))
    rows = [
        {"name": name, "runs_in": "sim" if cls.sim_only else "engine" if cls.needs_model else "both",
         "default_window": cls.default_window, "reads": cls.reads,
         "description": _doc_line(cls.__doc__, _module_doc(cls))}
        for name, cls in PREDICTORS.items()
    ]  # fmt: skip

    def line(r: dict) -> str:
        return f"{r['name']:{width}s} {r['runs_in']:6s} window {r['default_window']}  {r['description']}"

    _listing(args, rows, line)
    if not args.json:
        print(
            "(engine-only predictors are replayed by 'expertcache timing' from a trace recorded with "
            "'generate --prefetch NAME --record-trace FILE')"
        )
    return 0


def _cmd_model_info(args: argparse.Namespace) -> int:
    from expertcache.engine.offloaded import model_info

    quiet_transformers()
    info = model_info(args.path)
    if args.json:
        print(json.dumps(info))
        return 0
    for key, value in info.items():
        print(f"{key:24s} {value}")
    return 0


def _cmd_model_synth(args: argparse.Namespace) -> int:
    from expertcache.engine.random_checkpoint import make_checkpoint
    from expertcache.units import parse_size

    shard = None if args.max_shard_size is None else int(parse_size(args.max_shard_size, "--max-shard-size"))
    if shard == 0:  # it wrote one file, as without the option
        raise ExpertcacheError(f"--max-shard-size {args.max_shard_size}: a shard holds more than 0 bytes")

    quiet_transformers()
    if args.layers is None:
        from expertcache.engine.families import FAMILIES

        args.layers = max(2, FAMILIES[args.family].min_layers) if args.family in FAMILIES else 2
    for name, least in (("hidden", 1), ("layers", 1), ("experts", 1), ("top_k", 1), ("intermediate", 1),
                        ("heads", 1), ("seed", 0)):  # fmt: skip
        if getattr(args, name) < least:
            raise ExpertcacheError(f"--{name.replace('_', '-')} must be at least {least}")
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
        max_shard_size=shard,
        seed=args.seed,
        tokenizer=args.tokenizer,
    )
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _cmd_train_policy(args: argparse.Namespace) -> int:
    from expertcache.tools.train_policy import format_report, train_policy, write_weights

    traces = [_trace(t) for t in args.traces]
    test = [_trace(t) for t in args.test or ()]
    report = train_policy(traces, args.traces, tuple(dict.fromkeys(args.order or ("layer", "flat"))),
                          test, args.test or ())  # fmt: skip
    if args.out:
        try:
            write_weights(report, args.out)
        except OSError as e:
            raise ExpertcacheError(f"{args.out}: cannot write the weights file: {e.strerror or e}") from None
        print(format_report(report))
        print(f"weights written to {args.out}; use --policy reuse:weights={args.out}", file=sys.stderr)
    else:
        print(format_report(report), file=sys.stderr)
        print(json.dumps(report))
    return 0


def _notes_only(json_out: bool):
    """A tool's log: every line on stderr, or (``--json``) its notes alone, not its progress."""

    def log(line: str) -> None:
        if not json_out or line.startswith("note:"):
            print(line, file=sys.stderr, flush=True)

    return log


def _cmd_train_predictor(args: argparse.Namespace) -> int:
    from expertcache.tools.train_predictor import format_report, train_predictor

    quiet_transformers()
    names = ("epochs", "hidden", "max_new_tokens")
    opts = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    windows = list(dict.fromkeys(args.window or [None]))  # each once: one window is written into --out itself
    report = train_predictor(
        args.model,
        args.out,
        args.prompts,
        windows[0] if len(windows) == 1 else windows,
        seed=args.seed,
        log=_notes_only(args.json),  # --json: stderr keeps the notes (below skip prediction), not progress
        progress=not args.json and sys.stderr.isatty(),
        force=args.force,
        **opts,
    )
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    from expertcache.tools.quantize import quantize_model

    quiet_transformers()
    if args.checkpoint is not None:
        return _write_packed(args)
    if args.format is not None:
        raise ExpertcacheError(f"--format {args.format} writes a checkpoint: give --checkpoint DIR")
    bits = list(dict.fromkeys(args.bits or [8, 4]))  # each precision once
    if args.group is not None and bits == [8]:
        raise ExpertcacheError("int8 copies have one scale per row: --group applies to int4 and int2 only")
    records = quantize_model(
        args.model, bits, 64 if args.group is None else args.group, args.out,
        optimize=not args.fast,
        log=None if args.json else lambda line: print(line, file=sys.stderr, flush=True),
    )  # fmt: skip
    if args.json:
        print(json.dumps(records))
    else:
        for r in records:
            share = r["bytes_per_expert"] / r["full_bytes_per_expert"]
            grouping = "one scale a row" if r["bits"] == 8 else f"group {r['group']}"
            print(f"int{r['bits']} ({grouping}): {r['path']} ({r['bytes_per_expert']} bytes per "
                  f"expert, {share:.1%} of the full one)")  # fmt: skip
    if args.out is not None:
        from expertcache.engine.hub import DEFAULT_MODEL, resolve_model
        from expertcache.engine.quantized import candidates

        model = resolve_model(args.model)
        places = candidates(model)
        if model.resolve() == DEFAULT_MODEL.resolve():  # the installed package is no place to put files
            places = places[1:]
        if Path(args.out).resolve() not in [Path(c).resolve() for c in places]:  # else the engine finds them
            where = " or ".join(str(c) for c in places)
            print(f"note: the engine looks for copies in {where}, not in {args.out}: move the files there "
                  "to use them (--out is for building them elsewhere)", file=sys.stderr)  # fmt: skip
    return 0


def _write_packed(args: argparse.Namespace) -> int:
    for flag, given in (("--out", args.out), ("--fast", args.fast)):
        if given:
            raise ExpertcacheError(
                f"{flag} is for the hobbit copies; --checkpoint DIR is where a packed one goes"
            )
    if args.format is not None:
        from expertcache.tools.published import write_published

        for flag, given in (("--bits", args.bits), ("--group", args.group)):
            if given is not None:
                raise ExpertcacheError(f"--format {args.format} has its own blocks and scales: drop {flag}")
        record = write_published(
            args.model, args.format, args.checkpoint,
            log=None if args.json else lambda line: print(line, file=sys.stderr, flush=True),
        )  # fmt: skip
    else:
        record = _write_own(args)
    record["path"] = str(Path(record["path"]).resolve())  # as the copies' records give theirs
    if args.json:
        print(json.dumps(record))
    else:
        share = record["bytes_per_expert"] / record["full_bytes_per_expert"]
        from expertcache.engine.offloaded import has_tokenizer

        out = Path(record["path"])
        run = (
            f"run it with: expertcache generate --model {out}"
            if has_tokenizer(out)
            else "it has no tokenizer, as the model had none: save one into it to run it"
        )
        print(f"{record['format']} checkpoint: {out} ({record['bytes_per_expert']} bytes per expert, "
              f"{share:.1%} of the full one; {run})")  # fmt: skip
    return 0


def _write_own(args: argparse.Namespace) -> dict:
    from expertcache.tools.quantize import write_checkpoint

    bits = args.bits or [8]
    if len(bits) != 1:
        raise ExpertcacheError(f"--checkpoint writes one format: give one --bits (8 or 4), got {bits}")
    return write_checkpoint(
        args.model, bits[0], args.checkpoint, args.group,
        log=None if args.json else lambda line: print(line, file=sys.stderr, flush=True),
    )  # fmt: skip


def _cmd_quality(args: argparse.Namespace) -> int:
    from expertcache.config import MissConfig, PrefetchConfig
    from expertcache.tools.quality import format_quality, measure

    quiet_transformers()
    MissConfig(args.miss)  # a bad spec is refused before anything loads
    PrefetchConfig(args.prefetch, when=args.prefetch_when)  # a when without a predictor too
    texts = None
    if args.text:
        try:
            texts = [Path(args.text).read_text(encoding="utf-8-sig")]
        except (OSError, UnicodeDecodeError) as exc:
            raise ExpertcacheError(f"{args.text}: cannot read the text ({exc})") from None
        if not texts[0].strip():
            raise ExpertcacheError(f"--text {args.text}: the file holds no text to measure on")
    r = measure(
        args.model, args.miss, args.expert_memory, args.policy, texts, args.tokens, args.device,
        progress=not args.json, prefetch=args.prefetch, prefetch_when=args.prefetch_when or "always",
        kernel=args.kernel,
        reference_implementation=None if args.reference == "auto" else args.reference,
        reference_model=args.reference_model, quantize_dense=args.quantize_dense, attention=args.attention,
        dtype=args.dtype,
    )  # fmt: skip
    print(json.dumps(r) if args.json else format_quality(r))
    return 0


def _cmd_predictor_accuracy(args: argparse.Namespace) -> int:
    from expertcache.predict.registry import predictor_class
    from expertcache.tools.predictor_accuracy import evaluate_model, format_accuracy
    from expertcache.tools.train_predictor import read_prompts

    quiet_transformers()
    names = [n.strip().lower() for n in args.predictors]
    from expertcache.predict.registry import PREDICTORS

    for name in names:
        if name not in PREDICTORS:  # the ones this command scores: those that run on the model alone
            scored = [n for n in PREDICTORS if not PREDICTORS[n].sim_only]
            raise ExpertcacheError(f"unknown predictor {name!r}; choose from {', '.join(scored)}")
        if predictor_class(name).sim_only:
            raise ExpertcacheError(f"predictor {name} needs the future; it is exact by definition")
    if args.window is not None and min(args.window) < 1:
        raise ExpertcacheError(f"--window must be at least 1, got {min(args.window)}")
    if args.max_new_tokens < 2:  # the first new token comes from the prompt's forward: no decode step
        raise ExpertcacheError(
            f"--max-new-tokens must be at least 2 (accuracy is counted over decode steps), got "
            f"{args.max_new_tokens}"
        )
    trace = None
    if args.predictor and Path(args.predictor).suffix == ".npz":
        from expertcache.predict.registry import trace_readers

        if not trace_readers(names):
            raise ExpertcacheError(
                f"--predictor {args.predictor}: {', '.join(dict.fromkeys(names))} reads no recorded trace "
                "(token and eam do)"
            )
        trace = load_trace(args.predictor)
    elif args.predictor and "learned" not in names:
        raise ExpertcacheError(
            f"--predictor {args.predictor}: a trained predictor is read by learned, which --predictors "
            f"does not name ({', '.join(dict.fromkeys(names))})"
        )
    rows = evaluate_model(
        args.model,
        read_prompts(args.prompts) if args.prompts else None,
        names=names,
        windows=args.window,
        max_new_tokens=args.max_new_tokens,
        learned_path=args.predictor if trace is None else None,
        trace=trace,
        progress=not args.json and sys.stderr.isatty(),
    )
    print(json.dumps(rows) if args.json else format_accuracy(rows))
    return 0


def _cmd_selftest(args: argparse.Namespace) -> int:
    from expertcache.tools.selftest import selftest

    quiet_transformers()
    log = None if args.json else lambda line: print(line, file=sys.stderr, flush=True)
    report = selftest(args.device, quick=args.quick, families=args.family, log=log)
    print(json.dumps(report.to_dict()) if args.json else report.summary(), flush=True)
    if report.device_lost:  # freeing the dead GPU's memory at exit would abort with a C++ trace
        sys.stderr.flush()
        os._exit(1)
    return 0 if report.ok else 1  # a failing check is a result, not bad input (2)
