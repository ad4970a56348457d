"""The command line as a user runs it: outputs, files, and one-line errors with exit code 2."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_fixtures import exit_code

from expertcache.cli import main
from expertcache.errors import ExpertcacheError
from expertcache.policy import POLICIES
from expertcache.trace import Trace, load_trace, synthesize
from expertcache.trace.default import default_trace
from expertcache.trace.stats import summary


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "t.npz"
    synthesize("sticky", tokens=300, layers=4, experts=8, top_k=2, seed=1, sequences=3, prompt_len=10).save(
        path
    )
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_sim_json_has_the_documented_fields(capsys, trace_file):
    code, out, _ = run(
        capsys,
        "sim",
        str(trace_file),
        "--policy",
        "lru",
        "--policy",
        "opt",
        "--capacity",
        "4",
        "16",
        "--json",
    )
    assert code == 0
    rows = json.loads(out)
    assert [(r["policy"], r["capacity"]) for r in rows] == [("lru", 4), ("lru", 16), ("opt", 4), ("opt", 16)]
    for r in rows:
        assert {"policy", "capacity", "order", "requests", "misses", "hits", "miss_ratio"} <= r.keys()
        assert r["order"] == "layer"
        assert r["hits"] + r["misses"] == r["requests"]
        assert r["miss_ratio"] == pytest.approx(r["misses"] / r["requests"])
        assert sum(r["layers"]["misses"]) == r["misses"]
        assert r["phases"]["prefill"]["misses"] + r["phases"]["decode"]["misses"] == r["misses"]
        assert r["opt_misses"] <= r["misses"]
    opt = {r["capacity"]: r["misses"] for r in rows if r["policy"] == "opt"}
    assert all(r["opt_misses"] == opt[r["capacity"]] for r in rows)


def test_sim_table_and_plot(capsys, trace_file, tmp_path):
    plot = tmp_path / "mrc.png"
    code, out, _ = run(
        capsys, "sim", str(trace_file), "--policy", "llru", "--capacity", "2:32:2", "--plot", str(plot)
    )
    assert code == 0
    assert "llru" in out and "miss ratio" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_per_layer_table(capsys, trace_file):
    code, out, _ = run(capsys, "sim", str(trace_file), "--policy", "lru", "--capacity", "8", "--per-layer")
    assert code == 0
    assert "lru at capacity 8 (layer order)" in out
    layer_rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [int(r[0]) for r in layer_rows] == [0, 1, 2, 3]
    code, js, _ = run(capsys, "sim", str(trace_file), "--policy", "lru", "--capacity", "8", "--json")
    (row,) = json.loads(js)
    assert [int(r[2]) for r in layer_rows] == row["layers"]["misses"]


def test_sim_capacity_all_and_orders(capsys, trace_file):
    for order, low in (("layer", 2), ("flat", 1), ("rounds", 1)):
        code, out, _ = run(
            capsys, "sim", str(trace_file), "--policy", "lru", "--capacity", "all", "--order", order, "--json"
        )
        assert code == 0
        caps = [r["capacity"] for r in json.loads(out)]
        assert caps == list(range(low, 4 * 8 + 1))


def test_sim_capacity_shares(capsys, trace_file):
    code, out, _ = run(
        capsys, "sim", str(trace_file), "--policy", "lru", "--capacity", "25%", "50%", "8", "--json"
    )
    assert code == 0 and [r["capacity"] for r in json.loads(out)] == [
        8,
        16,
    ]  # of 4 x 8 experts; duplicates once
    for bad, why in (
        ("0%", "a share is in"),
        ("101%", "a share is in"),
        ("1%", "below one expert"),
        ("a%", "not a share"),
        ("4%", "capacity 4% (1 expert of 32) is below top-k 2"),  # the share said in experts
    ):
        code, _, err = run(capsys, "sim", str(trace_file), "--policy", "lru", "--capacity", bad)
        assert code == 2 and why in err and len(err.strip().splitlines()) == 1


def test_sim_s_default_capacities_start_at_top_k_and_a_range_s_lower_ones_are_left_out_and_said(
    capsys, tmp_path
):
    """On a trace of 2 layers x 10 experts, top-2, the default range began at 1 and the run was refused."""
    path = tmp_path / "small.npz"
    synthesize("uniform", tokens=100, layers=2, experts=10, top_k=2, seed=0).save(path)
    code, out, _ = run(capsys, "sim", str(path), "--policy", "lru", "--json")
    assert code == 0 and [r["capacity"] for r in json.loads(out)] == list(range(2, 21))
    code, out, err = run(capsys, "sim", str(path), "--policy", "lru", "--capacity", "1:9:4", "--json")
    assert code == 0 and [r["capacity"] for r in json.loads(out)] == [5, 9]
    assert "note: capacity 1:9:4: left out 1 (below top-k 2)" in err
    code, out, err = run(capsys, "sim", str(path), "--policy", "lru", "--capacity", "14:30:3", "--json")
    assert code == 0 and [r["capacity"] for r in json.loads(out)] == [14, 17, 20]  # 23-29 unsaid
    assert "note: capacity 14:30:3: left out 23:29:3 (above all 20 experts)" in err
    code, _, err = run(capsys, "sim", str(path), "--policy", "lru", "--capacity", "21:30")
    assert (
        code == 2
        and err == "expertcache: error: capacity 21:30 selects no capacity of the trace's 20 experts\n"
    )


def test_sim_dist_policy_skips_capacities_below_its_minimum(capsys, trace_file):
    argv = ["sim", str(trace_file), "--policy", "lru-dist", "--json", "--capacity"]
    code, out, err = run(capsys, *argv, "2", "4", "8")
    assert code == 0
    assert [r["capacity"] for r in json.loads(out)] == [8]  # 4 layers x top-2 in layer order
    assert "lru-dist left out at capacities < 8" in err
    code, out, err = run(capsys, *argv, "4", "8", "--order", "flat")
    assert code == 0
    assert [r["capacity"] for r in json.loads(out)] == [4, 8]
    assert err == ""


def test_sim_default_policies_leave_out_a_dist_policy_that_cannot_run(capsys, trace_file):
    """Named, lru-dist below its minimum is an error (above); come with the defaults, it is left out."""
    code, out, err = run(capsys, "sim", str(trace_file), "--json", "--capacity", "4")
    assert code == 0, err
    policies = [r["policy"] for r in json.loads(out)]
    assert "lru-dist" not in policies and "lru" in policies
    assert "note: lru-dist (a default policy) left out: it needs capacity >= 8" in err


def test_sim_takes_several_policies_after_one_flag_or_the_flag_repeated(capsys, trace_file):
    results = []
    for argv in (["--policy", "lru", "lfu"], ["--policy", "lru", "--policy", "lfu"]):
        code, out, err = run(capsys, "sim", str(trace_file), *argv, "--capacity", "8", "--json")
        assert code == 0, err
        results.append(json.loads(out))
    assert [r["policy"] for r in results[0]] == ["lru", "lfu"] and results[0] == results[1]


def test_sim_policy_parameters(capsys, trace_file):
    code, out, _ = run(
        capsys,
        "sim",
        str(trace_file),
        "--policy",
        "lcp:rho=0.5,omega=16",
        "--policy",
        "lru-dist:budgets=2/2/2/2",
        "--capacity",
        "8",
        "--json",
    )
    assert code == 0
    rows = json.loads(out)
    assert rows[0]["params"] == {"rho": 0.5, "omega": 16}
    assert rows[1]["params"] == {"budgets": [2, 2, 2, 2]}


def test_sim_default_trace_runs(capsys):
    code, out, _ = run(capsys, "sim", "--policy", "lru", "--capacity", "24", "--json")
    assert code == 0
    (row,) = json.loads(out)  # the embedded model's recorded routing: 5192 tokens x 6 layers x top-2
    assert row["requests"] > 20_000 and 0 < row["misses"] < row["requests"]


def test_trace_synth_then_info(capsys, tmp_path):
    path = tmp_path / "z.npz"
    code, out, err = run(
        capsys,
        "trace",
        "synth",
        "--kind",
        "zipf",
        "--tokens",
        "500",
        "--layers",
        "3",
        "--experts",
        "6",
        "--top-k",
        "2",
        "--a",
        "1.5",
        "--seed",
        "3",
        "-o",
        str(path),
    )
    assert code == 0 and "wrote" in err and not out  # the file is the result; the line, a note
    t = load_trace(path)
    assert t.experts.shape == (500, 3, 2) and t.num_experts == 6
    code, out, _ = run(capsys, "trace", "info", str(path))
    assert code == 0 and "T=500" in out and "entropy" in out
    bare = tmp_path / "bare.npz"
    Trace(load_trace(path).experts, 6).save(bare)  # no phases: the trace does not say (it said 0)
    assert "sequences   - (prefill tokens: -)" in run(capsys, "trace", "info", str(bare))[1]
    code, out, _ = run(capsys, "trace", "info", str(path), "--json")
    info = json.loads(out)
    assert info["tokens"] == 500 and len(info["entropy_bits"]) == 3
    assert all(0 < h <= np.log2(6) + 1e-9 for h in info["entropy_bits"])


def test_trace_info_default_is_the_embedded_trace(capsys):
    code, out, err = run(capsys, "trace", "info", "default", "--json")
    assert code == 0, err
    info = json.loads(out)  # the embedded trace was recorded by the engine at 100 %: its run said too
    assert info.pop("recorded") == {"model": "embedded", "capacity": 96, "policy": "lru"}
    assert info == summary(default_trace())


def test_sim_checks_the_plot_path_before_the_replays(capsys, trace_file, tmp_path, monkeypatch):
    import expertcache.cli as cli

    def no_replays(*args, **kwargs):
        raise AssertionError("replayed before the plot path was checked")

    monkeypatch.setattr(cli, "simulate", no_replays)
    code, out, err = run(capsys, "sim", str(trace_file), "--plot", str(tmp_path / "missing" / "p.png"))
    assert code == 2 and out == ""
    assert err.strip() == f"expertcache: error: {tmp_path / 'missing' / 'p.png'}: cannot write the plot: " \
        f"directory {tmp_path / 'missing'} does not exist"  # fmt: skip


def test_sim_prints_its_results_before_the_plot(capsys, trace_file, tmp_path, monkeypatch):
    import expertcache.cli as cli

    def fails(*args, **kwargs):
        raise ExpertcacheError("disk full")

    monkeypatch.setattr(cli, "plot_curves", fails)
    code, out, err = run(capsys, "sim", str(trace_file), "--capacity", "8", "--plot", str(tmp_path / "p.png"))
    assert code == 2 and "miss ratio" in out and err == "expertcache: error: disk full\n"


def test_sim_dist_budgets_run_only_at_their_sum(capsys, trace_file):
    argv = ["sim", str(trace_file), "--policy", "lru-dist:budgets=2/2/2/4", "--policy", "lru", "--json"]
    code, out, err = run(capsys, *argv, "--capacity", "8", "10", "12")
    assert code == 0
    rows = [(r["policy"], r["capacity"]) for r in json.loads(out)]
    assert rows == [("lru-dist", 10), ("lru", 8), ("lru", 10), ("lru", 12)]
    assert err == "note: lru-dist left out at capacities other than 10 (its budgets sum to 10)\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--expert-memory", "-5%"], "expert memory '-5%' must be a share in (0%, 100%]"),
        (["--expert-memory", "-5GiB"], "expert memory '-5GiB' must be a non-negative size"),
        (["--link-latency", "-1ms"], "--link-latency '-1ms' must be a non-negative duration"),
        (["--expert-bytes", "-5MB"], "--expert-bytes '-5MB' must be a non-negative size"),
        (["--capacity", "-3"], "capacity must be at least 1 expert, got -3"),  # as argparse already did
    ],
)
def test_a_negative_value_with_a_unit_is_the_options_value(capsys, argv, message):
    """argparse takes ``-5%`` for an option ("expected one argument"); it is the value, and refused."""
    code, out, err = run(capsys, "timing", *argv)
    assert code == 2 and out == ""
    assert err == f"expertcache: error: {message}\n"


def _options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, action) for every argument of every command and subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif action.dest != "help":
            yield path, action


def test_every_option_has_help_and_shows_its_default():
    from expertcache.cli import _build_parser

    options = list(_options(_build_parser()))
    assert len(options) > 100
    for path, action in options:
        where = f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
        assert action.help, f"{where} has no help"
        if action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in action.help, f"{where}: help does not show the default {action.default!r}"


def test_help_texts_that_users_read_first():
    from expertcache.cli import _build_parser

    helps = {(" ".join(p), a.option_strings[0] if a.option_strings else a.dest): a.help
             for p, a in _options(_build_parser())}  # fmt: skip
    assert "default 32" in helps["generate", "--max-new-tokens"]
    assert "100%% = no offloading" in helps["generate", "--expert-memory"]
    assert helps["timing", "--predictor"] == "a recorded trace for token (required) and eam to learn from"
    assert "flat" in helps["sim", "--order"] and "default" in helps["sim", "--order"]
    assert "default" in helps["trace info", "file"]


def test_policies_lists_every_registered_name(capsys):
    code, out, _ = run(capsys, "policies")
    assert code == 0
    listed = [line.split()[0] for line in out.splitlines()]
    assert listed == list(POLICIES)
    # a plugin's long name keeps the columns (its row was shifted: a trial)
    import expertcache as ec
    from expertcache.policy.lru import LRU

    long = type("Long", (LRU,), {"name": "users-a-rather-long-policy"})
    try:
        ec.register_policy(long)
        code, out, _ = run(capsys, "policies")
        kinds = {
            line.index(" online ") if " online " in line else line.index(" offline ")
            for line in out.splitlines()
        }
        assert code == 0 and len(kinds) == 1
    finally:
        POLICIES.pop("users-a-rather-long-policy", None)
        POLICIES.pop("users-a-rather-long-policy-dist", None)


def test_timing_refuses_a_bad_value_in_one_line_before_any_note(tmp_path, capsys):
    """A new user's `timing --trace run.npz --capacity 0` printed two notes on the replay, then the error;
    `--capacity 200%` suggested `--expert-memory 200%`, which is refused too."""
    import expertcache as ec

    with ec.load(expert_memory="30%", prefetch="none", progress=False) as model:
        model.generate_text("def f(x):", 4)
        model.save_trace(tmp_path / "run.npz")
    run_file = str(tmp_path / "run.npz")
    for argv, said in (
        (["--capacity", "0"], "capacity must be at least 1 expert, got 0"),
        (["--host-capacity", "0"], "--host-capacity: a whole number of experts, 1 or more, got 0"),
        (["--host-capacity", "1"], "the host level holds 1 expert(s)"),
    ):
        code, _, err = run(capsys, "timing", "--trace", run_file, *argv)
        assert code == 2 and err.startswith(f"expertcache: error: {said}") and err.count("\n") == 1, err
    code, _, err = run(capsys, "timing", "--trace", run_file)  # the notes, where it runs
    assert code == 0 and "note: priced by the default costs" in err
    with pytest.raises(SystemExit) as exited:  # argparse's refusal of the value's type
        main(["timing", "--capacity", "200%"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--expert-memory, a share of at most 100 %" in err


BAD_INPUTS = [
    (
        ["model", "synth", "--family", "mixtral", "-o", "{out}", "--max-shard-size", "0MB"],
        "more than 0 bytes",
    ),
    (  # the default top-k beyond the experts given: it said "top_k must be in 1..1, got 2"
        ["model", "synth", "--family", "mixtral", "-o", "{out}", "--experts", "1"],
        "--top-k 2 needs at least 2 experts a layer, and --experts is 1",
    ),
    (["model", "synth", "--family", "mixtral", "-o", "{out}", "--hidden", "36"], "--hidden 36 over --heads"),
    (["sim", "{missing}"], "no such trace file"),
    (["sim", "{trace}", "--bogus"], "unrecognized arguments: --bogus (see expertcache sim --help)"),
    (["--bogus"], "unknown option --bogus: a command comes first"),
    # the innermost command's help, and where a trace goes when it was given the other way
    (
        ["trace", "synth", "--kind", "zipf", "-o", "{out}", "--force"],
        "unrecognized arguments: --force (see expertcache trace synth",
    ),
    (
        ["timing", "{trace}"],
        "; expertcache timing takes its trace as --trace FILE (see expertcache timing --help)",
    ),
    (["sim", "--trace", "{trace}"], "expertcache sim takes its trace as its first argument, without --trace"),
    (["sweep", "{trace}"], "is a trace: give it as --trace"),
    (["sim", "--policy", "lru", "{trace}"], "looks like a trace: give it first, before --policy"),
    (["sim", "--capacity", "25%", "{trace}"], "looks like a trace: give it first, before --capacity"),
    (["sim", "{junk}"], "not a readable .npz"),
    (["sim", "/dev/null"], "/dev/null: not a regular file"),  # it was "no such trace file"
    (
        ["timing", "--capacity", "25%"],
        "is not a whole number of experts (a share or a size of memory: --expert-memory 25%)",
    ),
    (["sim", "--policy", "lru", "--capacity", "24", "--seed", "-3"], "--seed must be at least 0, got -3"),
    (
        ["timing", "--capacity", "24", "--expert-bytes", "0"],
        "--expert-bytes must be at least 1 byte, got '0'",
    ),
    (["trace", "synth", "--kind", "zipf", "-o", "{out}", "--top-k", "100"], "--top-k must be in 1..8"),
    (
        ["trace", "synth", "--kind", "zipf", "-o", "{out}", "--stickiness", "0.5"],
        "does not take --stickiness; it takes --tokens, --layers, --experts, --top-k",
    ),
    (["sim", "{trace}", "--capacity", "0"], "a capacity is at least 1 expert"),
    (["sim", "{trace}", "--capacity", "1"], "below top-k 2"),
    (["sim", "{trace}", "--policy", "nope"], "unknown policy 'nope'"),
    (["sim", "{trace}", "--policy", "lcp:bogus=1"], "does not take bogus"),
    (["sim", "{trace}", "--policy", "lcp:rho=2"], "rho must be in (0, 1)"),
    (["sim", "{trace}", "--policy", "lru-dist", "--capacity", "3"], "lru-dist needs capacity >= 8"),
    (
        ["sim", "{trace}", "--policy", "lru-dist:budgets=1/1/2/4", "--capacity", "8"],
        "layer 0 gets 1 slot(s), below top-k 2",
    ),
    (["sim", "{trace}", "--policy", "lru-dist", "--capacity", "2", "4"], "needs capacity >= 8"),
    (
        ["sim", "{trace}", "--policy", "lru-dist:budgets=2/2/2/2", "--capacity", "10"],
        "lru-dist needs capacity 8 (its budgets sum to 8)",  # not a capacity of 10 with 8 used
    ),
    (
        ["sim", "{trace}", "--policy", "lru-dist:budgets=4/4/4/4", "--capacity", "8"],
        "lru-dist needs capacity 16 (its budgets sum to 16)",
    ),
    (
        ["sim", "{trace}", "--policy", "static:profile=run.npz"],
        "the usage profile is not a policy parameter; give it as --policy static --profile TRACE.npz",
    ),
    (["sim", "{trace}", "--plot", "/nonexistent/dir/p.png"], "directory /nonexistent/dir does not exist"),
    (["sim", "{trace}", "--plot", "{out}.docx"], "cannot write a .docx plot; use .png, .svg or .pdf"),
    # matplotlib took the format from the temporary file's name, after the replays (doctor: a traceback)
    (["sim", "{trace}", "--plot", "{noext}"], "a plot's file name ends in its format: .png, .svg or .pdf"),
    (["doctor", "--trace", "{trace}", "--plot", "{noext}"], "a plot's file name ends in its format"),
    (["sim", "{trace}", "--capacity", "-3"], "capacity '-3': a capacity is at least 1 expert"),
    (["trace", "info", "{missing}", "--json"], "no such trace file"),
    (["sim", "{trace}", "--capacity", "abc"], "is not experts (24), a range"),
    (["sim", "{trace}", "--order", "sideways"], "invalid choice"),
    (["trace", "info", "{missing}"], "no such trace file"),
    (["trace", "info", "{badshape}"], "must have 3 dimensions"),
    (["trace", "synth", "--kind", "zipf", "--experts", "0", "-o", "{out}"], "experts must be at least 1"),
    (["trace", "synth", "--kind", "cyclic", "--a", "1", "-o", "{out}"], "does not take --a"),
    (["trace", "synth", "--kind", "zipf", "-o", "/nonexistent/dir/x.npz"], "cannot write the trace"),
    (["frobnicate"], "invalid choice"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, trace_file, argv, message):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"this is not a zip file")
    badshape = tmp_path / "bad.npz"
    np.savez(badshape, experts=np.zeros((3, 4), dtype=np.int16), num_experts=np.int32(4))
    paths = {
        "missing": tmp_path / "missing.npz",
        "junk": junk,
        "trace": trace_file,
        "badshape": badshape,
        "out": tmp_path / "o.npz",
        "noext": tmp_path / "plot",
    }
    argv = [a.format(**paths) for a in argv]
    code = exit_code(argv)
    _, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0]
    assert "Traceback" not in err


def test_console_script_exit_code_and_single_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "expertcache.cli", "sim", str(tmp_path / "nope.npz")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"expertcache: error: {tmp_path / 'nope.npz'}: no such trace file"
    assert proc.stdout == ""


def test_sim_jobs_give_identical_results(capsys, trace_file):
    argv = [
        "sim",
        str(trace_file),
        "--policy",
        "marking",
        "--policy",
        "llru",
        "--capacity",
        "2:20:3",
        "--json",
    ]
    _, one, _ = run(capsys, *argv, "--jobs", "1")
    _, two, _ = run(capsys, *argv, "--jobs", "2")
    assert json.loads(one) == json.loads(two)
    assert len(json.loads(one)) == 2 * 7


def test_every_command_prints_its_help(capsys):
    """argparse formats help texts with %: a stray % is a traceback on --help, found only by asking."""
    import argparse

    from expertcache.cli import _build_parser

    def commands(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield [*prefix, name]
                    yield from commands(sub, [*prefix, name])

    for argv in commands(_build_parser(), []):
        with pytest.raises(SystemExit) as done:
            main([*argv, "--help"])
        assert done.value.code == 0, argv
        assert "usage: expertcache" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# Every output is checked before the work, and a late write failure is one line too
# ------------------------------------------------------------------------------------------------
OUTPUT_ARGV = {
    ("sim", "plot"): ["sim", "--plot", "{bad}.png"],
    ("plan", "out"): ["plan", "-o", "{bad}.json"],
    ("doctor", "plot"): ["doctor", "--plot", "{bad}.png"],
    ("profile", "out"): ["profile", "-o", "{bad}.json"],
    ("trace synth", "out"): ["trace", "synth", "--kind", "zipf", "-o", "{bad}.npz"],
    ("trace import", "out"): ["trace", "import", "log.jsonl", "-o", "{bad}.npz"],
    ("trace batch", "out"): ["trace", "batch", "-c", "4", "-o", "{bad}.npz"],
    ("serve", "record_trace"): ["serve", "--port", "1", "--record-trace", "{bad}.npz"],
    ("model synth", "out"): ["model", "synth", "--family", "mixtral", "-o", "{bad}"],
    ("train-predictor", "out"): ["train-predictor", "--out", "{bad}"],
    ("train-policy", "out"): ["train-policy", "default", "-o", "{bad}.json"],
    ("quantize", "out"): ["quantize", "--out", "{bad}"],
    ("quantize", "checkpoint"): ["quantize", "--bits", "8", "--checkpoint", "{bad}"],
    ("sweep", "out"): ["sweep", "--out", "{bad}.csv"],
    ("sweep", "plot"): ["sweep", "--plot", "{bad}"],
    ("generate", "record_trace"): ["generate", "--prompt", "x", "--record-trace", "{bad}.npz"],
    ("chat", "record_trace"): ["chat", "--record-trace", "{bad}.npz"],
}


def _output_options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict:
    """(command, dest) -> folder? of every option marked as an output (cli.util.output_option)."""
    found = {(" ".join(path), dest): folder for dest, _, folder in parser.get_default("outputs") or ()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_output_options(sub, (*path, name)))
    return found


def test_every_output_option_is_walked():
    """A command that gains an output option gains a row above (and so the test below)."""
    from expertcache.cli import _build_parser

    assert set(_output_options(_build_parser())) == set(OUTPUT_ARGV)


@pytest.mark.parametrize("key", sorted(OUTPUT_ARGV), ids=" ".join)
def test_an_unwritable_output_is_one_line_before_any_work(key, capsys, tmp_path, monkeypatch):
    """/proc refuses new files even to root (whom permission bits let write anywhere: profile -o
    /proc/p.json failed with a traceback after 22 s of measuring); a path under a file; a file, or a
    folder, in a folder that does not exist (a folder output is made, not its missing parents: quantize
    --checkpoint /nonexistent/q made /nonexistent)."""
    import expertcache.cli as cli

    monkeypatch.setattr(cli, "_run", lambda args: pytest.fail("the work started before the check"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bads = ["/proc/expertcache-out", str(blocker / "out"), str(tmp_path / "no" / "out")]
    for bad in bads:
        argv = [a.replace("{bad}", bad) for a in OUTPUT_ARGV[key]]
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "cannot write the" in err, (argv, err)


def test_the_python_api_makes_an_output_folder_not_a_chain_of_missing_ones(tmp_path):
    """The command line refused nope/x/y while make_checkpoint, train_predictor and quantize_model
    made every missing folder of it."""
    from expertcache.engine.random_checkpoint import make_checkpoint
    from expertcache.tools.quantize import quantize_model
    from expertcache.tools.train_predictor import train_predictor

    chain = tmp_path / "nope" / "x"
    for call in (
        lambda: make_checkpoint(chain / "ckpt"),
        lambda: train_predictor(None, chain / "tp"),
        lambda: quantize_model(None, bits=[4], out=chain / "q", progress=False),
    ):
        with pytest.raises(ExpertcacheError, match=f"directory {re.escape(str(chain))} does not exist"):
            call()
        assert not (tmp_path / "nope").exists()


def test_a_writable_output_is_checked_without_a_trace(tmp_path, monkeypatch):
    """The check opens the file for appending and removes it again: nothing is left, nothing lost."""
    import expertcache.cli as cli

    monkeypatch.setattr(cli, "_run", lambda args: 0)
    fresh, kept = tmp_path / "new.json", tmp_path / "old.json"
    kept.write_text("precious")
    assert main(["plan", "-o", str(fresh)]) == 0 and not fresh.exists()
    assert main(["plan", "-o", str(kept)]) == 0 and kept.read_text() == "precious"
    assert main(["model", "synth", "--family", "mixtral", "-o", str(tmp_path / "m")]) == 0
    assert list(tmp_path.iterdir()) == [kept]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_full_standard_output_is_one_line():
    """quality ... > /dev/full ended in a traceback: a write that fails late is one line, exit 2."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "expertcache", "trace", "info", "default"], stdout=full,
            stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == "expertcache: error: standard output: cannot write: no space left on device\n"


def test_trace_info_alone_takes_the_embedded_trace(capsys):
    """As sim, timing and doctor do (it needed a file argument)."""
    code, out, _ = run(capsys, "trace", "info", "--json")
    assert code == 0 and {k: v for k, v in json.loads(out).items() if k != "recorded"} == summary(
        default_trace()
    )


def test_a_closed_standard_output_is_one_line():
    """``expertcache ... >&-``: Python starts with ``sys.stdout`` None, and the flush at the end was a
    traceback; the command is refused before any work instead."""
    done = subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "expertcache", "trace", "info"],
        stderr=subprocess.PIPE, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("expertcache: error: standard output is closed")
    assert len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", "-"], "cannot read the prompt from -; give a file"),
        (["generate", "--prompts", "-"], "cannot read the prompts from -; give a file"),
        (["chat"], "chat reads its turns from it, a line each"),
        (["chat", "--system", " "], None),
    ],
)
def test_a_closed_standard_input_is_one_line(argv, message):
    """``<&-``: ``sys.stdin`` is None, and reading a prompt from it (or chat's first turn) was a
    traceback (a new user's trial)."""
    done = subprocess.run(
        ["sh", "-c", 'exec "$@" <&-', "sh", sys.executable, "-m", "expertcache", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = f"standard input is closed: {message}" if message else "--system is empty: give the system message"
    assert done.returncode == 2 and done.stderr.startswith(f"expertcache: error: {said}")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_file_that_cannot_be_written_late_is_named_and_the_results_still_print(tmp_path):
    """``plan -o FILE`` on a full disk said "standard output" and left an empty FILE; it names the file,
    and the plan it computed is on standard output all the same."""
    done = subprocess.run(
        [sys.executable, "-m", "expertcache", "plan", "--capacity", "24", "-o", "/dev/full"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "expertcache: error: /dev/full: cannot write plan (No space left on device)"
    )
    assert "chosen:" in done.stdout


def test_a_chunking_option_with_nothing_prefetched_is_said_to_change_nothing(capsys):
    """Only prefetched experts move in chunks: ``timing --chunk-size`` without a predictor ran every
    transfer whole and said nothing, while its cost line priced an expert in chunks."""
    code, out, err = run(capsys, "timing", "--capacity", "24", "--chunk-size", "1MiB", "--json")
    chunked = json.loads(out)
    assert code == 0 and "note: --chunk-size changes nothing here" in err
    code, out, err = run(capsys, "timing", "--capacity", "24", "--json")
    assert code == 0 and "changes nothing" not in err
    whole = json.loads(out)
    assert chunked["tpot_s"] == whole["tpot_s"] and chunked["transfers"] == whole["transfers"]
    code, out, err = run(capsys, "timing", "--capacity", "24", "--no-chunking")
    assert code == 0 and "note: --no-chunking changes nothing here" in err
    assert "in 1 chunk" in out


def test_download_of_the_embedded_model_is_refused(capsys):
    code, _, err = run(capsys, "generate", "--prompt", "x", "--download")
    assert code == 2 and "a download needs a Hugging Face id" in err and len(err.strip().splitlines()) == 1


def test_a_named_predictor_with_every_expert_resident_is_said_to_have_nothing_to_move(capsys):
    two = ("generate", "--prompt", "x", "--max-new-tokens", "2")
    code, _, err = run(capsys, *two, "--prefetch", "next-gate")
    assert code == 0 and "prefetch next-gate has nothing to move" in err
    code, _, err = run(capsys, *two)  # auto: the engine's choice
    assert code == 0 and "nothing to move" not in err
    code, _, err = run(capsys, *two, "--window", "2", "--prefetch-limit", "3")  # taken in silence before
    assert code == 0 and "--window, --prefetch-limit have nothing to move" in err
    code, _, err = run(capsys, *two, "--window", "2", "--expert-memory", "50%")
    assert code == 0 and "nothing to move" not in err


def test_budgets_for_too_few_layers_are_named_as_such(capsys):
    """``lru-dist:budgets=1/2/3`` on 6 layers said "needs capacity 6 (its budgets sum to 6)"."""
    code, _, err = run(capsys, "sim", "--policy", "lru-dist:budgets=1/2/3", "--capacity", "24")
    assert code == 2 and err.strip() == "expertcache: error: lru-dist: 3 budgets given for 6 layers"


def test_a_seed_where_no_policy_draws_at_random_is_said_to_change_nothing(capsys):
    """``--seed`` seeds only random and marking (and their -dist forms); given with LRU it was taken in
    silence. The seed still reaches a policy that draws: two seeds, two different runs."""
    code, out, err = run(capsys, "sim", "--policy", "lru", "--capacity", "24", "--seed", "3", "--json")
    assert code == 0 and "note: --seed 3 changes nothing here: lru draws nothing at random" in err
    code, seeded, err = run(capsys, "sim", "--policy", "random", "--capacity", "24", "--seed", "3", "--json")
    assert code == 0 and "--seed" not in err
    code, other, err = run(capsys, "sim", "--policy", "random", "--capacity", "24", "--json")
    assert code == 0 and "--seed" not in err
    assert json.loads(seeded)[0]["misses"] != json.loads(other)[0]["misses"]
    code, out, err = run(capsys, "timing", "--capacity", "24", "--seed", "1", "--host-capacity", "60")
    assert code == 0 and "note: --seed 1 changes nothing here: lru draws nothing at random" in err
    host = ("--host-capacity", "60", "--host-policy", "random")
    code, out, err = run(capsys, "timing", "--capacity", "24", "--seed", "1", *host)
    assert code == 0 and "--seed 1 changes nothing" not in err  # the host level's policy draws
    code, out, err = run(capsys, "plan", "--capacity", "24", "--method", "shared", "--seed", "2")
    assert code == 0 and "note: --seed 2 changes nothing here: lru draws nothing at random" in err


def test_options_that_change_nothing_are_refused_or_said(capsys, tmp_path):
    """A new user's trial found these accepted and ignored: plan --window without a predictor, doctor
    --max-new-tokens without a model to record, quality --prefetch-when without a predictor, quantize
    --fast without int2, sim --per-layer with --json."""
    for argv, words in (
        (["plan", "--capacity", "24", "--window", "2"], "--window sets the layers ahead of a predictor"),
        (["plan", "--capacity", "24", "--window", "0"], "--window sets the layers ahead of a predictor"),
        (["doctor", "--max-new-tokens", "5"], "--max-new-tokens is for recording a trace"),
        (
            ["quality", "--prefetch", "none", "--prefetch-when", "pays"],
            "prefetch when 'pays' needs a predictor",
        ),
        (["quantize", "--fast", "--bits", "8", "--out", str(tmp_path)], "--fast is int2's"),
    ):
        code, _, err = run(capsys, *argv)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    code, out, err = run(capsys, "sim", "--policy", "lru", "--capacity", "24", "--json", "--per-layer")
    assert code == 0 and "note: --per-layer changes nothing with --json" in err
    assert len(json.loads(out)[0]["layers"]["misses"]) == 6 and "split_groups" in json.loads(out)[0]


def test_a_cost_no_expert_paid_is_said_to_change_nothing(capsys):
    code, _, err = run(capsys, "timing", "--capacity", "24", "--host-time", "1ms", "--dequant-time", "1ms")
    assert code == 0 and "note: --host-time changes nothing here: no expert was computed on the host" in err
    assert "note: --dequant-time changes nothing here: no low-precision copy was used" in err
    code, _, err = run(capsys, "timing", "--capacity", "24", "--host-time", "1ms", "--miss", "host")
    assert code == 0 and "--host-time changes nothing" not in err


def test_doctor_names_why_a_policy_with_parameters_is_refused(capsys):
    """``doctor --policy lcp:rho=0.5`` said "unknown policy 'lcp:rho=0.5'; choose from ..., lcp, ..."."""
    for spec in ("lcp:rho=0.5", "lru-dist:budgets=4/4/4/4/4/4"):
        code, _, err = run(capsys, "doctor", "--policy", spec)
        assert code == 2 and "unknown policy" not in err
        assert f"a policy with a -dist form and no parameters, not '{spec}'" in err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["timing", "--capacity", "24", "--trace", ""], "--trace"),
        (["timing", "--expert-memory", " "], "--expert-memory"),
        (["timing", "--capacity", "24", "--miss", ""], "--miss"),
        (["plan", "--cost", ""], "--cost"),
        (["doctor", "--expert-memory", ""], "--expert-memory"),
        (["sweep", "--policy", "lru", "--capacity", "24", "--cost", ""], "--cost"),
        (["sim", ""], "TRACE"),
        (["sim", "--policy", "lru", ""], "--policy"),  # the empty word is a policy there
    ],
)
def test_an_empty_value_is_refused_not_replaced_by_the_default(argv, flag, capsys):
    """`timing --trace ""` replayed the embedded trace, `--expert-memory ""` ran at the default budget,
    `--cost ""` priced by the default model, all at exit 0 (a script's unset variable, say)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"expertcache: error: {flag} is empty; give a value or leave the option out"]


def test_the_listings_take_a_class_without_a_docstring(capsys, monkeypatch):
    """A policy added as POLICIES.md says, in a module without a docstring, broke `expertcache policies`
    with an IndexError traceback."""
    import types

    from expertcache.policy.lru import LRU
    from expertcache.policy.registry import POLICIES

    module = types.ModuleType("users_policy")  # no docstring
    bare = type("Bare", (LRU,), {"__module__": "users_policy", "__doc__": None, "name": "bare"})
    monkeypatch.setitem(sys.modules, "users_policy", module)
    monkeypatch.setitem(POLICIES, "bare", bare)
    code, out, err = run(capsys, "policies")
    assert code == 0 and err == ""
    assert [line for line in out.splitlines() if line.startswith("bare ")] == [
        "bare          online  (no description: the class and its module have no docstring)"
    ]
    bare.__doc__ = "The user's own LRU.\n\nMore."
    code, out, _ = run(capsys, "policies")
    assert "bare          online  The user's own LRU." in out.splitlines()


def test_predictor_accuracy_lists_the_predictors_it_scores(capsys):
    """A new user's trial: its list of choices named oracle, which it then refused (it needs the future)."""
    code, _, err = run(capsys, "predictor-accuracy", "--predictors", "bogus")
    assert code == 2 and err.rstrip().endswith("choose from next-gate, window, adaptive, learned, token, eam")


def test_a_policy_given_twice_is_compared_once_with_a_note(capsys, trace_file):
    """``--policy lru --policy lru:`` printed two equal rows."""
    code, out, err = run(capsys, "sim", str(trace_file), "--policy", "lru", "--policy", "lru:", "--policy",
                         "lcp:rho=0.5", "--policy", "lcp:rho=0.50", "--capacity", "8", "--json")  # fmt: skip
    assert code == 0, err
    assert [r["policy"] for r in json.loads(out)] == ["lru", "lcp"]
    assert "note: --policy lru: is --policy lru again: compared once" in err
    assert "note: --policy lcp:rho=0.50 is --policy lcp:rho=0.5 again" in err


@pytest.mark.parametrize(
    ("command", "first"), [("policies", "lru"), ("misses", "fetch"), ("predictors", "next-gate")]
)
def test_the_listings_print_json_too(capsys, command, first):
    """``policies``, ``misses`` and ``predictors`` were text alone, where every other report has --json (a
    new user's trial); the JSON holds the same rows as the text."""
    assert main([command]) == 0
    text = capsys.readouterr().out
    assert main([command, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["name"] == first and all(r["description"] for r in rows)
    names = [line.split()[0] for line in text.splitlines() if not line.startswith("(")]
    assert names == [r["name"] for r in rows]
    if command == "policies":
        dist = next(r for r in rows if r["name"] == "lru-dist")
        assert dist["split_of"] == "lru" and dist["parameters"][0] == "budgets"
    if command == "misses":
        assert next(r for r in rows if r["name"] == "hobbit")["kind"] == "lossy"
