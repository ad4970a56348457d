"""``expertcache sweep``: grids from flags and files, rows equal to the simulator's, resumable results
files, local processes and Ray alike, timing cells, plots, and one-line errors with exit code 2."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import expertcache
from expertcache.cli import main
from expertcache.sim.timing import simulate_timing
from expertcache.tools import sweep as sweep_module
from expertcache.tools.sweep import Grid, Timing, sweep
from expertcache.tools.sweep_table import COUNT_COLUMNS, TIMING_COLUMNS
from expertcache.trace import load_trace, synthesize

COLUMNS = [name for name, _ in COUNT_COLUMNS]
ALL_COLUMNS = COLUMNS + [name for name, _ in TIMING_COLUMNS]


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> tuple[Path, Path]:
    """Two small traces of different shapes (32 and 48 experts in all)."""
    folder = tmp_path_factory.mktemp("traces")
    a, b = folder / "a.npz", folder / "b.npz"
    synthesize("sticky", tokens=300, layers=4, experts=8, top_k=2, seed=1, sequences=2, prompt_len=20).save(a)
    synthesize("zipf", tokens=200, layers=3, experts=16, top_k=2, seed=2, sequences=2, prompt_len=10).save(b)
    return a, b


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def quiet(**kwargs) -> list[dict]:
    return sweep(log=None, **kwargs)


# -- grids ---------------------------------------------------------------------------------------------
def test_flags_make_the_grid_and_rows_come_in_its_order(capsys, traces):
    a, b = traces
    code, out, err = run(
        capsys, "sweep", "--trace", str(a), str(b), "--policy", "lru", "opt", "--capacity", "4", "50%",
        "--order", "layer", "flat", "--json", "--jobs", "1",
    )  # fmt: skip
    assert code == 0, err
    rows = json.loads(out)
    assert all(list(r) == COLUMNS for r in rows)
    got = [(Path(r["trace"]).name, r["policy"], r["order"], r["capacity"]) for r in rows]
    want = [
        (t, p, o, c)
        for t, half in (("a.npz", 16), ("b.npz", 24))
        for p in ("lru", "opt")
        for o in ("layer", "flat")
        for c in (4, half)
    ]
    assert got == want
    assert {r["share"] for r in rows if r["capacity"] == 16 and "a.npz" in r["trace"]} == {0.5}
    assert err.startswith("sweep: 16 rows (16 computed), 0 cells left out")
    assert len(err.splitlines()) == 1  # the summary, always; no progress bar when stderr is not a TTY


def test_csv_on_stdout_by_default(capsys, traces):
    code, out, _ = run(capsys, "sweep", "--trace", str(traces[0]), "--policy", "lru", "--capacity", "8")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ",".join(COLUMNS) and len(lines) == 2
    assert lines[1].startswith(f"{traces[0]},")


def test_yaml_and_toml_grids_are_the_same_grid(tmp_path, traces):
    a, b = traces
    (tmp_path / "g.yaml").write_text(
        f"traces: [{a}, {b}]\npolicies: [lru, 'lcp:rho=0.5', lru-dist]\ncapacities: [8, 25%, 4:12:4]\n"
        "orders: [layer, rounds]\nseeds: 0\ntiming:\n  prefetch: [none, eam]\n  link_bandwidth: 16GB/s\n"
    )
    (tmp_path / "g.toml").write_text(
        f'traces = ["{a}", "{b}"]\npolicies = ["lru", "lcp:rho=0.5", "lru-dist"]\n'
        'capacities = [8, "25%", "4:12:4"]\norders = ["layer", "rounds"]\nseeds = 0\n'
        '[timing]\nprefetch = ["none", "eam"]\nlink_bandwidth = "16GB/s"\n'
    )
    from_yaml, from_toml = Grid.load(tmp_path / "g.yaml"), Grid.load(tmp_path / "g.toml")
    assert from_yaml == from_toml
    assert from_yaml.capacities == (8, "25%", "4:12:4") and from_yaml.seeds == (0,)
    assert from_yaml.timing == Timing(prefetch=("none", "eam"), link_bandwidth=("16GB/s",))
    (tmp_path / "z.yaml").write_text("capacities: [010]\npolicies: [lru]\n")  # YAML 1.1's octal: 8
    assert Grid.load(tmp_path / "z.yaml").capacities == (10,)


def test_flags_replace_the_files_values_and_traces_are_read_beside_the_file(tmp_path, traces, capsys):
    folder = tmp_path / "grids"
    folder.mkdir()
    (folder / "t.npz").write_bytes(traces[0].read_bytes())
    (folder / "g.yaml").write_text("traces: [t.npz]\npolicies: [fifo, opt]\ncapacities: [8, 16]\n")
    code, out, err = run(capsys, "sweep", str(folder / "g.yaml"), "--policy", "lru", "--json", "--jobs", "1")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["trace"], r["policy"], r["capacity"]) for r in rows] == [
        ("t.npz", "lru", 8),
        ("t.npz", "lru", 16),
    ]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("g.yaml", "policies: [lru, opt\n", "g.yaml: not valid YAML (line 2: "),
        ("g.toml", "policies = [\n", "g.toml: not valid TOML ("),
        ("g.yaml", "polices: [lru]\n", "g.yaml: unknown key 'polices'; a grid has traces, policies, "),
        ("g.yaml", "- lru\n", "g.yaml: a grid is a mapping of traces, policies"),
        ("g.toml", 'policies = ["lruu"]\n', "g.toml: unknown policy 'lruu'"),
        ("g.yaml", "capacities: [0]\n", "g.yaml: capacity 0: a capacity is at least 1 expert"),
        ("g.yaml", "capacities: [120%]\n", "g.yaml: capacity '120%': a share is in (0%, 100%]"),
        ("g.yaml", "capacities: [{a: 1}]\n", "g.yaml: 'capacities' takes a value or a list of values"),
        ("g.yaml", "orders: [zigzag]\n", "g.yaml: order 'zigzag' is not one of layer, flat, rounds"),
        ("g.yaml", "seeds: [a]\n", "g.yaml: seed 'a' is not a whole number of at least 0"),
        ("g.yaml", "policies: []\n", "g.yaml: 'policies' is empty"),
        ("g.yaml", "timing: {miss: [nope]}\n", "g.yaml: unknown miss path 'nope'"),
        ("g.yaml", "timing: {links: [1]}\n", "g.yaml: unknown key 'links' in timing"),
        ("g.yaml", "timing: {link_latency: [20]}\n", "g.yaml: link latency '20' needs a unit"),
        ("g.yaml", "orders: [flat]\ntiming: true\n", "g.yaml: timing cells run in layer order"),
        ("g.txt", "policies: [lru]\n", "g.txt: a grid file is .yaml, .yml or .toml"),
        # checked once the grid's values are merged with the flags: they named no file
        ("g.yaml", "timing: {prefetch: [eam], predictor: nothere.npz}\n", "g.yaml: "),
        ("g.yaml", "timing: {window: [2]}\n", "g.yaml: a window sets the layers ahead of a predictor"),
        (
            "g.yaml",
            "capacities: [24]\npolicies: [lru]\ntiming: {prefetch: [token]}\n",
            "g.yaml: predictor 'token' needs a recorded trace to count from (--predictor TRACE.npz, or "
            "predictor: in the grid's timing)",
        ),
    ],
)
def test_a_bad_grid_file_is_one_line_naming_it(tmp_path, capsys, name, text, message):
    (tmp_path / name).write_text(text)
    code, out, err = run(capsys, "sweep", str(tmp_path / name))
    assert code == 2 and out == ""
    assert err.startswith(f"expertcache: error: {tmp_path / name}: ")
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace", "missing.npz"], "missing.npz: no such trace file"),
        (["--capacity", "8:4:0"], "capacity '8:4:0': a capacity is at least 1 expert, a step at least 1"),
        (
            ["--capacity", "lots"],
            "capacity 'lots' is not experts (24), a range (8:96:8), a share (25%) or all",
        ),
        (["--policy", "lru:rho=2"], "policy 'lru' does not take rho"),
        (["--policy", "lcp:rho=7"], "rho"),
        (["--prefetch", "token"], "predictor 'token' needs a recorded trace"),
        (["--prefetch", "next-gate"], "the simulator replays the predictions an engine recorded"),
        (["--order", "flat", "--timing"], "timing cells run in layer order"),
        (["--window", "2"], "a window sets the layers ahead of a predictor, and the grid has none"),
        (
            ["--predictor", "p.npz", "--prefetch", "none"],
            "predictor trace p.npz: no predictor of the grid reads",
        ),
        (["--out", "r.txt"], "r.txt: a results file is .csv, .json or .parquet"),
        (["--out", "no/such/dir/r.csv"], "cannot write the results: directory"),
        (["--resume"], "resuming reads the results file: give it (--out FILE; out=FILE)"),
        (["--force"], "--force (force=True) replaces the results file: give it (--out FILE; out=FILE)"),
        (["--jobs", "0"], "--jobs must be at least 1, got 0"),
        (["--ray", "--jobs", "2"], "with --ray the cluster's CPUs run the cells"),
        (["--ray", "127.0.0.1:1"], "--ray 127.0.0.1:1: nothing answers there"),
        (["--policy", "lru-dist", "--capacity", "4"], "no cell of the grid can run"),
        (["--capacity", "12:4"], "capacity 12:4 selects no capacity"),
        (["--policy", "lru", "--capacity", "12:4", "8"], "capacity 12:4 selects no capacity"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, traces, argv, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "sweep", "--trace", str(traces[0]), *argv)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("expertcache: error: ") and message in err.splitlines()[-1], err
    assert "Traceback" not in err


def test_a_window_clipped_to_the_traces_layers_is_said(capsys, traces):
    argv = ["sweep", "--trace", str(traces[0]), "--policy", "lru", "--capacity", "8", "--prefetch", "eam"]
    code, out, err = run(capsys, *argv, "--window", "1", "99", "--json")
    assert code == 0, err
    assert sorted(r["window"] for r in json.loads(out)) == [1, 4]  # 99 runs as the trace's 4 layers
    assert "prefetch window 99 reaches past a model of 4 MoE layers" in err


@pytest.mark.parametrize(
    "timing, refused",
    [
        ("{window: [1]}", "a window sets the layers ahead of a predictor, and the grid has none"),
        ("{prefetch: [oracle], predictor: t.npz}", "no predictor of the grid reads one (token and eam do"),
    ],
)  # fmt: skip
def test_the_timing_values_are_checked_once_the_flags_replace_the_files(
    tmp_path, capsys, traces, timing, refused
):
    """A window needs a predictor and a predictor trace a predictor that reads one, in the merged grid:
    a flag that supplies what the file lacks is not refused on the file alone."""
    (tmp_path / "t.npz").write_bytes(traces[0].read_bytes())
    grid = tmp_path / "g.yaml"
    grid.write_text(f"traces: [t.npz]\npolicies: [lru]\ncapacities: [8]\ntiming: {timing}\n")
    code, _, err = run(capsys, "sweep", str(grid))
    assert code == 2 and refused in err
    code, out, err = run(capsys, "sweep", str(grid), "--prefetch", "eam", "--json", "--quiet")
    assert code == 0, err
    assert {r["prefetch"] for r in json.loads(out) if r["prefetch"] is not None} == {"eam"}


@pytest.mark.parametrize(
    "flag", ["--trace", "--policy", "--capacity", "--order", "--seed", "--miss", "--ray"]
)
def test_a_grid_file_after_a_list_flag_is_named_as_one(tmp_path, capsys, flag):
    (tmp_path / "g.toml").write_text('policies = ["lru"]\n')
    with pytest.raises(SystemExit) as refused:
        value = {"--seed": ["1"], "--order": ["layer"], "--ray": []}.get(flag, ["x"])
        main(["sweep", flag, *value, str(tmp_path / "g.toml")])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and len(err.splitlines()) == 1
    assert f"{tmp_path / 'g.toml'} looks like a grid file: give it first, before {flag}" in err


def test_a_range_that_selects_no_capacity_of_a_trace_is_a_note_even_quiet(capsys, traces):
    for quiet_flag in ([], ["--quiet"]):
        code, _, err = run(capsys, "sweep", "--trace", str(traces[0]), "--capacity", "100:200", *quiet_flag)
        assert code == 2
        assert err.splitlines() == [
            f"note: {traces[0]}: capacities 100:200 select no capacity of its 32 experts; left out",
            "expertcache: error: no cell of the grid can run (see the notes above)",
        ]
    with pytest.raises(expertcache.ExpertcacheError, match=r"can run \(.*100:200 select no capacity"):
        quiet(traces=[str(traces[0])], capacities=["100:200"])  # no log: the note is the message


def test_a_range_cut_at_every_expert_says_what_it_left_out(capsys, traces):
    """24:40:8 on a 32-expert trace ran 24 and 32 and said nothing of 40."""
    code, out, err = run(
        capsys, "sweep", "--trace", str(traces[0]), "--policy", "lru", "--capacity", "24:40:8"
    )
    assert (
        code == 0 and f"note: {traces[0]}: capacities 24:40:8 (40) of the ranges are more than all 32" in err
    )
    assert [r["capacity"] for r in csv.DictReader(io.StringIO(out))] == ["24", "32"]


def test_a_capacity_above_every_expert_is_capped_with_a_note(capsys, traces):
    # a row said capacity 200 and share 2.08 of a 96-expert trace (a new user found it)
    code, out, err = run(
        capsys, "sweep", "--trace", str(traces[0]), "--policy", "lru", "--capacity", "200", "32"
    )
    assert (
        code == 0 and f"note: {traces[0]}: capacities 200 are more than all 32 experts; capped at 32" in err
    )
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["capacity"], r["share"]) for r in rows] == [("32", "1.0")]


def test_a_trace_a_grid_file_names_is_reported_as_resolved(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    grid = tmp_path / "sub" / "g.toml"
    grid.write_text('traces = ["small.npz"]\n')
    code, _, err = run(capsys, "sweep", str(grid))
    assert code == 2
    assert (
        err
        == f"expertcache: error: {tmp_path / 'sub' / 'small.npz'} (from grid {grid}): no such trace file\n"
    )


# -- rows ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["layer", "flat", "rounds"])
def test_rows_equal_the_simulators_results(traces, order):
    trace = load_trace(traces[0])
    policies = ["opt", "lru", "fifo", "llru", "lcp:rho=0.5", "lru-dist", "random"]
    caps = [2, 4, 8, 12, 20, 32]
    rows = quiet(traces=[str(traces[0])], policies=policies, capacities=caps, orders=[order], jobs=2)
    want = expertcache.simulate(trace, policies, caps, order, skip_infeasible=True)
    assert len(rows) == len(want)
    for row, r in zip(rows, want, strict=True):
        assert (row["capacity"], row["requests"], row["misses"]) == (r.capacity, r.requests, r.misses)
        assert (row["opt_misses"], row["opt_is_bound"]) == (r.opt_misses, r.opt_is_bound)
        assert row["ratio_to_opt"] == pytest.approx(r.ratio_to_opt)
        assert row["miss_ratio"] == pytest.approx(r.miss_ratio)


def test_infeasible_cells_are_left_out_with_a_note(capsys, traces):
    code, out, err = run(
        capsys, "sweep", "--trace", str(traces[0]), "--policy", "lru", "lru-dist", "--capacity", "1", "4",
        "8", "--json",
    )  # fmt: skip
    assert code == 0
    assert [(r["policy"], r["capacity"]) for r in json.loads(out)] == [
        ("lru", 4),
        ("lru", 8),
        ("lru-dist", 8),
    ]
    assert "capacities 1 are below top-k 2: left out in layer order" in err
    assert "lru-dist left out at capacities 4 in layer order (each layer needs 2 slot(s))" in err
    assert "3 cells left out" in err.splitlines()[-1]


def test_dist_budgets_a_trace_cannot_take_are_left_out_before_any_work(tmp_path, capsys, traces):
    a, b = traces  # 4 and 3 layers, top-2
    out = tmp_path / "r.csv"
    code, _, err = run(
        capsys, "sweep", "--trace", str(a), str(b), "--policy", "opt", "lru-dist:budgets=1/1/1/5",
        "--capacity", "8", "--order", "layer", "flat", "--jobs", "2", "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    rows = [(Path(r["trace"]).name, r["policy"], r["order"]) for r in csv.DictReader(out.open())]
    assert rows == [
        ("a.npz", "opt", "layer"), ("a.npz", "opt", "flat"), ("a.npz", "lru-dist", "flat"),
        ("b.npz", "opt", "layer"), ("b.npz", "opt", "flat"),
    ]  # fmt: skip
    assert err.splitlines()[:2] == [
        f"note: {a}: lru-dist:budgets=1/1/1/5 left out in layer order (its budgets give layer 0 1 slot(s), "
        "below top-k 2)",
        f"note: {b}: lru-dist:budgets=1/1/1/5 left out: 4 budgets given for its 3 layers",
    ]
    assert "5 rows (5 computed), 3 cells left out" in err.splitlines()[-1]
    code, _, err = run(capsys, "sweep", "--trace", str(b), "--policy", "lru-dist:budgets=1/1/1/5")
    assert code == 2 and err.splitlines()[-1].endswith("no cell of the grid can run (see the notes above)")


def test_an_error_in_a_task_names_it_and_keeps_the_rows_in_the_grids_order(tmp_path, monkeypatch, traces):
    grid = {"traces": [str(traces[0])], "policies": ["opt", "lru", "fifo"], "capacities": [4, 8]}
    full = quiet(**grid)
    real = sweep_module.run_task

    def failing(task, trace, predictor=None):
        if task.policy == "fifo":
            raise expertcache.ExpertcacheError("it broke")
        return real(task, trace, predictor)

    monkeypatch.setattr(sweep_module, "run_task", failing)
    lines: list[str] = []
    out = tmp_path / "r.json"
    with pytest.raises(expertcache.ExpertcacheError) as raised:
        sweep(out=out, jobs=1, log=lines.append, **grid)
    assert str(raised.value) == f"{traces[0]}: fifo in layer order: it broke"
    assert lines == [f"note: 4 rows are in {out}; run again with --resume (resume=True) to go on"]
    assert json.loads(out.read_text()) == full[:4]  # the finished rows, in the grid's order
    with pytest.raises(expertcache.ExpertcacheError, match=f"^{traces[0]}: fifo in layer order: it broke$"):
        quiet(out=tmp_path / "pool.csv", jobs=2, **grid)  # from a worker process (forked: patched too)

    def dying(task, trace, predictor=None):
        if task.policy == "fifo":
            os._exit(1)  # a worker killed (out of memory, say)
        return real(task, trace, predictor)

    monkeypatch.setattr(sweep_module, "run_task", dying)
    with pytest.raises(expertcache.ExpertcacheError, match=f"^{traces[0]}: .* a worker process died"):
        quiet(jobs=2, **grid)
    monkeypatch.setattr(sweep_module, "run_task", lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError) as bug:  # a bug keeps its traceback, with the task noted
        quiet(**grid)
    assert bug.value.__notes__ == [f"in the sweep task {traces[0]}: opt in layer order"]
    monkeypatch.setattr(sweep_module, "run_task", real)
    assert quiet(out=out, resume=True, **grid) == full


def test_seeds_are_a_dimension(traces):
    rows = quiet(traces=[str(traces[0])], policies=["random"], capacities=[8], seeds=[0, 1, 2])
    assert [r["seed"] for r in rows] == [0, 1, 2]
    assert len({r["misses"] for r in rows}) > 1  # a randomized policy: the seed matters


def test_a_policy_that_draws_no_random_numbers_runs_once_with_a_note(capsys, traces):
    """sweep --seed 1 2 3 with lru computed three identical rows; now one, and a note says why."""
    code, out, err = run(capsys, "sweep", "--trace", str(traces[0]), "--policy", "lru", "random",
                         "--capacity", "8", "--seed", "1", "2", "3", "--json")  # fmt: skip
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["policy"], r["seed"]) for r in rows] == [
        ("lru", 1),
        ("random", 1),
        ("random", 2),
        ("random", 3),
    ]
    assert (
        "note: lru draws no random numbers: its cells run once, with seed 1" in err
        and "note: random" not in err
    )
    code, out, err = run(capsys, "sweep", "--trace", str(traces[0]), "--policy", "lru", "--capacity", "8",
                         "--seed", "3", "--json")  # fmt: skip
    assert code == 0 and "note: lru draws no random numbers: its cells run once, with seed 3" in err
    code, out, err = run(
        capsys, "sweep", "--trace", str(traces[0]), "--policy", "lru", "--capacity", "8", "--json"
    )
    assert code == 0 and "draws no random numbers" not in err  # the default seed: nothing to say


def test_the_python_api(traces):
    rows = expertcache.sweep(traces=[str(traces[1])], policies=["lru"], capacities=["all"], log=None)
    assert [r["capacity"] for r in rows] == list(range(2, 49))
    assert rows[-1]["misses"] == rows[-1]["opt_misses"]  # everything fits: only first uses miss


def test_a_trace_read_from_a_file_is_taken_as_its_path_one_made_in_memory_is_named(traces):
    by_path = quiet(traces=[str(traces[1])], policies=["lru"], capacities=[8])
    assert quiet(traces=[load_trace(traces[1])], policies=["lru"], capacities=[8]) == by_path
    default = quiet(traces=[expertcache.default_trace()], policies=["lru"], capacities=[8])
    assert default[0]["trace"] == "default"
    made = synthesize("zipf", tokens=50, layers=2, experts=8, top_k=2, seed=0)
    with pytest.raises(expertcache.ExpertcacheError, match=r"reads its traces from files .* save it"):
        quiet(traces=[made], policies=["lru"], capacities=[8])


def test_the_python_api_speaks_to_python_callers(tmp_path, traces):
    with pytest.raises(expertcache.ExpertcacheError) as raised:
        quiet(traces=[str(traces[0])], polices=["lru"])
    assert str(raised.value) == (
        "sweep() has no keyword 'polices'; it takes grid, out, resume, force, jobs, ray, plot, progress, "
        "quiet, log and the dimensions traces, policies, capacities, orders, seeds, timing"
    )
    with pytest.raises(expertcache.ExpertcacheError, match="unknown dimension 'polices'"):
        Grid().with_overrides(polices=["lru"])
    with pytest.raises(expertcache.ExpertcacheError, match=r"give it \(--out FILE; out=FILE\)"):
        quiet(resume=True)
    with pytest.raises(
        expertcache.ExpertcacheError, match=r"--resume \(resume=True\) goes on .* --force \(force"
    ):
        quiet(out=tmp_path / "r.csv", resume=True, force=True)
    grid = {"traces": [str(traces[0])], "policies": ["lru"], "capacities": [8]}
    quiet(out=tmp_path / "r.csv", **grid)
    with pytest.raises(
        expertcache.ExpertcacheError, match=r"--resume \(resume=True\) to go on .* \(force=True\)"
    ):
        quiet(out=tmp_path / "r.csv", **grid)


# -- results files and resuming ------------------------------------------------------------------------
GRID = {"policies": ["opt", "lru", "fifo", "llru"], "capacities": [4, 8, 16, 24], "orders": ["layer", "flat"]}


def test_csv_json_and_parquet_hold_the_same_table(tmp_path, traces):
    grid = {**GRID, "traces": [str(traces[0])]}
    rows = quiet(out=tmp_path / "r.csv", **grid)
    with open(tmp_path / "r.csv", newline="") as f:
        text_rows = list(csv.DictReader(f))
    assert [list(r) for r in text_rows[:1]] == [COLUMNS]
    assert [r["misses"] for r in text_rows] == [str(r["misses"]) for r in rows]
    assert quiet(out=tmp_path / "r.json", **grid) == rows
    assert json.loads((tmp_path / "r.json").read_text()) == rows
    assert not (tmp_path / "r.json.partial").exists()
    pq = pytest.importorskip("pyarrow.parquet")
    assert quiet(out=tmp_path / "r.parquet", **grid) == rows
    assert pq.read_table(tmp_path / "r.parquet").to_pylist() == rows


def test_parquet_without_pyarrow_is_refused_before_the_work(tmp_path, monkeypatch, capsys, traces):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    code, out, err = run(capsys, "sweep", "--trace", str(traces[0]), "--out", str(tmp_path / "r.parquet"))
    assert code == 2 and out == ""
    assert "writing Parquet needs pyarrow: pip install pyarrow" in err and len(err.splitlines()) == 1


def test_ray_missing_is_refused_before_the_work(monkeypatch, capsys, traces):
    monkeypatch.setitem(sys.modules, "ray", None)
    code, _, err = run(capsys, "sweep", "--trace", str(traces[0]), "--ray")
    assert code == 2
    assert (
        err
        == "expertcache: error: --ray needs Ray: pip install 'expertcache[cluster]' (or pip install ray)\n"
    )


@pytest.mark.parametrize("given", [[], ["auto"]])
def test_a_ray_address_in_the_environment_where_nothing_answers_is_refused_at_once(
    monkeypatch, capsys, traces, given
):
    """``--ray`` without an address, or ``auto``, joins RAY_ADDRESS when it is set: Ray would retry for
    minutes (``--ray auto`` did: a stale RAY_ADDRESS hung it for more than ten)."""
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    code, out, err = run(capsys, "sweep", "--trace", str(traces[0]), "--policy", "lru", "--ray", *given)
    assert code == 2 and out == ""
    assert err.startswith("expertcache: error: RAY_ADDRESS=127.0.0.1:1: nothing answers there")
    assert len(err.splitlines()) == 1, err


def test_a_ray_address_where_something_else_answers_is_refused_without_rays_retries(capsys, traces):
    """A listener that is no gRPC server (no answer to an HTTP/2 preface): Ray would retry for minutes."""
    pytest.importorskip("ray")
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        code, out, err = run(capsys, "sweep", "--trace", str(traces[0]), "--policy", "lru", "--ray", address)
    assert code == 2 and out == ""
    assert err == f"expertcache: error: --ray {address}: something answers there, but not a Ray cluster " + (
        "(no gRPC server)\n"
    )


def test_an_existing_results_file_is_resumed_or_replaced_never_overwritten(tmp_path, capsys, traces):
    out = tmp_path / "r.csv"
    argv = ["sweep", "--trace", str(traces[0]), "--policy", "lru", "--capacity", "8", "--out", str(out)]
    assert run(capsys, *argv)[0] == 0
    before = out.read_text()
    code, _, err = run(capsys, *argv[:-2], "--capacity", "16", "--out", str(out))
    assert code == 2
    refusal = (
        f"{out}: results exist; --resume (resume=True) to go on from them, or --force (force=True) to "
        "replace them"
    )
    assert err == f"expertcache: error: {refusal}\n"
    assert out.read_text() == before
    assert run(capsys, *argv[:-4], "--capacity", "16", "--out", str(out), "--force")[0] == 0
    assert [r["capacity"] for r in csv.DictReader(out.open())] == ["16"]
    with pytest.raises(SystemExit) as refused:  # argparse's own one-line refusal
        main([*argv, "--resume", "--force"])
    assert refused.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    # a sweep that failed before its first row leaves the header alone: nothing to lose, no refusal
    # (a new user's rerun was refused after a --ray address that did not answer)
    header = out.read_text().splitlines()[0]
    out.write_text(header + "\n")
    assert run(capsys, *argv)[0] == 0
    assert [r["capacity"] for r in csv.DictReader(out.open())] == ["8"]
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    code, _, err = run(capsys, *argv[:-1], str(tmp_path / "other.csv"), "--resume")
    assert code == 2 and "not this sweep's results (its header lacks trace" in err
    # a file that is not a sweep's is neither cut nor replaced, with or without --resume (a new user's
    # notes lost their last line, or all of it, where it held a line or two)
    for i, text in enumerate(("name,score\nalice,1\nbob,2", "name,score\nbob,2", "name,score\n", "notes")):
        other = tmp_path / f"other{i}.csv"
        other.write_text(text)
        for more in ((), ("--resume",)):
            code, _, err = run(capsys, *argv[:-1], str(other), *more)
            assert code == 2 and other.read_text() == text
            assert ("not this sweep's results" if more else "results exist; --resume") in err


def test_resume_runs_only_the_missing_cells_and_ends_with_the_same_table(tmp_path, monkeypatch, traces):
    grid = {**GRID, "traces": [str(traces[0]), str(traces[1])]}
    quiet(out=tmp_path / "full.csv", **grid)
    computed: list[tuple] = []
    real = sweep_module.run_task

    def counting(task, trace, predictor=None):
        computed.extend((task.trace, task.policy, task.order, c) for c in task.capacities)
        return real(task, trace, predictor)

    monkeypatch.setattr(sweep_module, "run_task", counting)
    part = tmp_path / "part.csv"
    quiet(out=part, **{**grid, "capacities": [4, 16]})  # a sweep that stopped half way
    first = list(computed)
    computed.clear()
    quiet(out=part, resume=True, **grid)
    assert not set(first) & set(computed)  # no cell ran twice
    assert len(first) + len(computed) == len(set(first) | set(computed)) == 2 * 4 * 2 * 4
    assert part.read_text() == (tmp_path / "full.csv").read_text()


def test_an_interrupted_sweep_keeps_its_rows_even_a_cut_line(tmp_path, monkeypatch, traces):
    grid = {**GRID, "traces": [str(traces[0])]}
    full = quiet(out=tmp_path / "full.json", **grid)
    from expertcache.tools.sweep_table import Results

    appended = []
    real = Results.append

    def append_then_stop(self, rows):
        real(self, rows)
        appended.append(len(rows))
        if len(appended) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Results, "append", append_then_stop)
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        quiet(out=out, **grid)
    journal = tmp_path / "r.json.partial"
    assert not out.exists() and len(journal.read_text().splitlines()) == sum(appended)
    with open(journal, "a") as f:
        f.write('{"trace": "cut off wh')  # killed while writing a row
    monkeypatch.setattr(Results, "append", real)
    assert quiet(out=out, resume=True, **grid) == full
    assert json.loads(out.read_text()) == full and not journal.exists()


def test_resume_counts_only_this_grids_cells_and_names_the_file_they_were_in(tmp_path, monkeypatch, traces):
    trace = tmp_path / "t.npz"
    trace.write_bytes(traces[0].read_bytes())
    grid = {"traces": [str(trace)], "policies": ["lru", "opt"], "capacities": [4, 8]}
    out = tmp_path / "gr.csv"
    quiet(out=out, **grid)
    trace.write_bytes(traces[1].read_bytes())  # the same name, other contents: another trace
    lines: list[str] = []
    rows = sweep(out=out, resume=True, log=lines.append, **grid)
    assert len(rows) == 8 and [r["trace_sha"] for r in rows[:4]] == [rows[0]["trace_sha"]] * 4
    assert lines[0] == (
        f"note: 4 rows in {out} are not cells of this grid (another trace content, a plugin's changed code, "
        "or removed from the grid): kept"
    )
    assert f"8 rows (4 computed, 0 already in {out}, 4 kept that are not cells of this grid)" in lines[1]
    # a JSON sweep interrupted after its first task: its rows are in the journal, and said to be there
    from expertcache.tools.sweep_table import Results

    real = Results.append

    def append_then_stop(self, rows):
        real(self, rows)
        raise KeyboardInterrupt

    monkeypatch.setattr(Results, "append", append_then_stop)
    with pytest.raises(KeyboardInterrupt):
        quiet(out=tmp_path / "r.json", **grid)
    monkeypatch.setattr(Results, "append", real)
    lines.clear()
    sweep(out=tmp_path / "r.json", resume=True, log=lines.append, **grid)
    assert f"(2 computed, 2 already in {tmp_path / 'r.json.partial'})" in lines[-1]


def test_ctrl_c_stops_the_workers_and_the_sweep_resumes(tmp_path):
    """A real interruption: SIGINT to the command, after its first rows, on two processes."""
    out = tmp_path / "r.csv"
    argv = [
        sys.executable, "-m", "expertcache", "sweep", "--policy", "fifo", "lfu", "lcp", "--capacity",
        "8:96:8", "--order", "layer", "flat", "rounds", "--jobs", "2", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and len(out.read_text().splitlines()) > 1:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    kept = len(out.read_text().splitlines()) - 1
    # the signal may come half way, after the last row (a fast machine), or as Python exits (-2)
    assert proc.returncode in (130, 0, -signal.SIGINT), err
    if proc.returncode == 130:
        assert "expertcache: interrupted" in err
        if kept < 3 * 12 * 3:  # stopped half way: said how to go on
            assert "run again with --resume (resume=True) to go on" in err
    done = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 3 * 12 * 3
    assert f"({len(rows) - kept} computed, {kept} already in" in done.stderr


def _children(pid: int) -> list[int]:
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return [c.pid for c in psutil.Process(pid).children()]
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _running(pid: int) -> bool:
    """Whether a process is there and not a zombie (one that exited, not yet reaped by its new parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_a_killed_sweep_leaves_no_workers_behind(tmp_path):
    """kill -9 of the sweep cannot stop its worker processes: they notice their parent is gone and exit."""
    argv = [
        sys.executable, "-m", "expertcache", "sweep", "--policy", "fifo", "lfu", "lcp", "--capacity",
        "8:96:8", "--order", "layer", "flat", "rounds", "--jobs", "2", "--out", str(tmp_path / "r.csv"),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and len(workers) < 2:
        workers = _children(proc.pid)
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=10)
    assert len(workers) == 2, "the sweep ended before its workers were seen"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(_running, workers)):
        time.sleep(0.1)
    left = [pid for pid in workers if _running(pid)]
    for pid in left:  # not to leave them running past a failure
        os.kill(pid, signal.SIGKILL)
    assert not left, "workers outlived their killed parent"


# -- timing cells --------------------------------------------------------------------------------------
def test_timing_cells_have_units_and_equal_the_timing_model(tmp_path, traces, capsys):
    a = traces[0]
    code, out, err = run(
        capsys, "sweep", "--trace", str(a), "--policy", "lru", "opt", "--capacity", "8", "16", "--order",
        "layer", "flat", "--prefetch", "none", "eam", "--miss", "fetch", "host", "--link-bandwidth",
        "16GB/s", "32GB/s", "--link-latency", "10us", "--json",
    )  # fmt: skip
    assert code == 0, err
    rows = json.loads(out)
    assert all(list(r) == ALL_COLUMNS for r in rows)
    timed = [r for r in rows if r["order"] == "layer"]
    assert len(timed) == 2 * 2 * 2 * 2 * 2  # policies x capacities x miss paths x predictors x links
    assert all(r["miss"] is None and r["tpot_ms"] is None for r in rows if r["order"] == "flat")
    assert {(r["link_bandwidth_gb_s"], r["link_latency_us"]) for r in timed} == {(16.0, 10.0), (32.0, 10.0)}
    assert {r["window"] for r in timed if r["prefetch"] == "eam"} == {1}
    from expertcache.costs import CostModel

    r = next(r for r in timed if (r["policy"], r["miss"], r["prefetch"], r["link_bandwidth_gb_s"]) ==
             ("lru", "host", "eam", 32.0) and r["capacity"] == 16)  # fmt: skip
    cost = CostModel.from_dict({"link_bandwidth": "32GB/s", "link_latency": "10us"})
    want = simulate_timing(load_trace(a), 16, cache="lru", prefetch="eam", miss="host", cost=cost)
    assert r["tpot_ms"] == pytest.approx(want.tpot_s * 1e3) and r["ttft_ms"] == pytest.approx(
        want.ttft_s * 1e3
    )
    assert (r["misses"], r["bytes_moved"], r["stall_s"]) == (want.misses, want.bytes_moved, want.stall_s)
    assert r["opt_is_bound"] is False  # prefetching and host compute: OPT is a reference there
    plain = {
        (r["policy"], r["capacity"]): r for r in timed if (r["miss"], r["prefetch"]) == ("fetch", "none")
    }
    counted = expertcache.simulate(load_trace(a), ["lru", "opt"], [8, 16])
    for c in counted:  # a plain cache misses as the counting simulator says
        row = plain[c.policy, c.capacity]
        assert (row["misses"], row["opt_misses"], row["opt_is_bound"]) == (
            c.misses,
            c.opt_misses,
            c.opt_is_bound,
        )


def test_a_capacity_a_miss_path_cannot_divide_is_left_out(capsys, traces):
    code, out, err = run(
        capsys, "sweep", "--trace", str(traces[0]), "--policy", "lru", "--capacity", "2", "8", "--miss",
        "split", "--json",
    )  # fmt: skip
    assert code == 0
    assert [r["capacity"] for r in json.loads(out)] == [8]
    assert err.count("lru at capacity 2 with miss split left out (expert memory of") == 1


# -- backends ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (starting one takes seconds); stopped after it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    yield ray
    ray.shutdown()


def test_ray_and_local_processes_give_the_same_table(tmp_path, traces, local_ray):
    grid = {
        "traces": [str(traces[0]), str(traces[1])], "policies": ["opt", "lru", "random"],
        "capacities": [4, "50%"], "orders": ["layer", "flat"], "seeds": [0, 1],
        "timing": Timing(prefetch=("none", "eam")),
    }  # fmt: skip
    on_ray = quiet(out=tmp_path / "ray.csv", ray=True, **grid)
    local = quiet(out=tmp_path / "local.csv", jobs=2, **grid)
    # traces x (opt, lru: one seed; random: two) x capacities x (layer: two timing cells; flat)
    assert on_ray == local and len(local) == 2 * (1 + 1 + 2) * 2 * (2 + 1)
    assert (tmp_path / "ray.csv").read_text() == (tmp_path / "local.csv").read_text()
    assert quiet(out=tmp_path / "ray.csv", ray=True, resume=True, **grid) == local  # nothing left to run


def test_ray_ships_each_trace_once(traces, local_ray, monkeypatch):
    put = []
    real = local_ray.put

    def counting_put(value, *args, **kwargs):
        put.append(value)
        return real(value, *args, **kwargs)

    monkeypatch.setattr(local_ray, "put", counting_put)
    rows = quiet(
        traces=[str(traces[0]), str(traces[1])], policies=["lru", "fifo", "opt"], capacities=[8], ray=True
    )
    assert len(rows) == 6 and len(put) == 2


def test_errors_in_a_ray_task_are_one_line(traces, local_ray, capsys):
    code, _, err = run(capsys, "sweep", "--trace", str(traces[0]), "--policy", "lcp:rho=7", "--ray")
    assert code == 2 and err.startswith("expertcache: error: ") and "rho" in err
    assert len(err.splitlines()) == 1  # refused before any cell runs
    trace = load_trace(traces[0])
    task = sweep_module.Task(str(traces[0]), "sha", trace.num_keys, "lru", (), 0, "layer", (1,))
    with pytest.raises(expertcache.ExpertcacheError) as raised:  # what a worker raises comes back as it was
        sweep_module.run_ray([task], {"sha": trace}, None, lambda *_: None)
    assert type(raised.value) is expertcache.ExpertcacheError
    assert str(raised.value).startswith(  # naming the task it came from
        f"{traces[0]}: lru in layer order: capacity 1 is below top-k 2: in layer order a token's 2 experts"
    )


def test_on_a_ray_already_initialised_an_address_or_jobs_is_refused_and_the_summary_says_where(
    traces, local_ray
):
    """sweep(ray="nosuchhost:1234") ran on the Ray already initialised and its summary named the address;
    sweep(ray=True, jobs=4) took jobs and ignored it."""
    with pytest.raises(expertcache.ExpertcacheError, match="Ray is already initialised in this process"):
        quiet(traces=[str(traces[0])], policies=["lru"], capacities=[8], ray="nosuchhost:1234")
    with pytest.raises(expertcache.ExpertcacheError, match="jobs sets local processes; with ray"):
        quiet(traces=[str(traces[0])], policies=["lru"], capacities=[8], ray=True, jobs=4)
    said = []
    sweep(traces=[str(traces[0])], policies=["lru"], capacities=[8], ray=True, log=said.append)
    assert said[-1].endswith("on the Ray initialised in this process")


def test_ray_takes_true_false_none_or_an_address(traces):
    with pytest.raises(expertcache.ExpertcacheError, match="ray is True, False, None or a cluster's address"):
        quiet(traces=[str(traces[0])], policies=["lru"], capacities=[8], ray=0)  # was the address "0"


def test_a_policy_file_named_relative_is_read_from_the_sweeps_folder_wherever_a_worker_runs(
    tmp_path, traces, monkeypatch
):
    """reuse:weights=w/reuse.json on a cluster started elsewhere read the cluster's w/reuse.json: the row
    named one file (its sha) and was computed with another."""
    from expertcache.tools.train_policy import train_policy, write_weights
    from expertcache.trace.default import default_trace

    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    for folder, orders in ((here, ("flat",)), (elsewhere, ("layer",))):  # two different weights files
        (folder / "w").mkdir(parents=True)
        write_weights(train_policy([default_trace()], ["default"], orders=orders), folder / "w" / "r.json")
    monkeypatch.chdir(here)
    spec = "reuse:weights=w/r.json"
    want = quiet(traces=[str(traces[0])], policies=[spec], capacities=[8])
    trace = load_trace(traces[0])
    (task,) = sweep_module.plan_cells(
        sweep_module.Grid(traces=(str(traces[0]),), policies=(spec,), capacities=(8,)),
        sweep_module._load_traces(sweep_module.Grid(traces=(str(traces[0]),)), None),
        None,
    ).tasks
    monkeypatch.chdir(elsewhere)  # a worker of a cluster started in another folder
    rows, _ = sweep_module.run_task(task, trace)
    assert rows[0]["misses"] == want[0]["misses"] and task.base == str(here)
    theirs = quiet(traces=[str(traces[0])], policies=[spec], capacities=[8])  # the other file's weights
    assert theirs[0]["misses"] != want[0]["misses"]


def test_a_policy_file_named_in_a_grid_file_is_read_from_the_grid_files_folder(tmp_path, traces, monkeypatch):
    """Traces named in a grid file were read from its folder, a policy's weights file from the current
    one: the same grid failed (or read another file) when run from elsewhere. A policy given on the
    command line reads from the current folder, as its traces do."""
    from expertcache.tools.train_policy import train_policy, write_weights
    from expertcache.trace.default import default_trace

    grid_dir, elsewhere = tmp_path / "g", tmp_path / "elsewhere"
    for folder, orders in ((grid_dir, ("flat",)), (elsewhere, ("layer",))):  # two different weights files
        (folder / "w").mkdir(parents=True)
        write_weights(train_policy([default_trace()], ["default"], orders=orders), folder / "w" / "r.json")
    (grid_dir / "grid.yaml").write_text(
        f"traces: [{traces[0]}]\npolicies: ['reuse:weights=w/r.json']\ncapacities: [8]\n"
    )
    monkeypatch.chdir(grid_dir)
    want = quiet(traces=[str(traces[0])], policies=["reuse:weights=w/r.json"], capacities=[8])
    monkeypatch.chdir(elsewhere)
    (row,) = quiet(grid=str(grid_dir / "grid.yaml"))
    assert row["misses"] == want[0]["misses"] and row["params"] == want[0]["params"]
    (mine,) = quiet(grid=str(grid_dir / "grid.yaml"), policies=["reuse:weights=w/r.json"])  # this folder's
    assert mine["misses"] != row["misses"] and mine["params"] != row["params"]  # another file, another sha


# -- plots and the rest --------------------------------------------------------------------------------
def test_plots_per_trace_order_and_timing_combination(tmp_path, capsys, traces):
    plots = tmp_path / "plots"
    code, _, err = run(
        capsys, "sweep", "--trace", str(traces[0]), "--policy", "opt", "lru", "--capacity", "4", "8", "16",
        "--order", "layer", "flat", "--prefetch", "none", "eam", "--plot", str(plots), "--out",
        str(tmp_path / "r.csv"),
    )  # fmt: skip
    assert code == 0, err
    names = sorted(p.name for p in plots.iterdir())
    assert names == sorted(
        f"a_{g}_{kind}.png"
        for g in ("flat", "layer_fetch_none_25GBps_20us", "layer_fetch_eam-w1_25GBps_20us")
        for kind in ("mrc", "ratio")
    )
    assert all((plots / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    assert "6 plots in" in err


def test_a_heat_map_of_many_capacities_stays_readable(tmp_path, capsys, traces):
    from expertcache.tools.sweep_plots import _heatmap

    rows = quiet(traces=[str(traces[1])], policies=["lru", "fifo"], capacities=["all"], plot=tmp_path)
    png = (tmp_path / "b_layer_ratio.png").read_bytes()
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width <= 1600 and height <= 1200  # 47 capacities: 16 inches at 100 dpi, not 26.5
    fig = _heatmap(rows, "t")
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert len(labels) <= 40 and labels[:3] == ["2", "4", "6"]  # every second capacity of 47


def test_a_plot_folder_that_cannot_be_written_is_refused_first(tmp_path, capsys, traces):
    (tmp_path / "file").write_text("")
    out = tmp_path / "r.csv"
    code, _, err = run(
        capsys, "sweep", "--trace", str(traces[0]), "--plot", str(tmp_path / "file"), "--out", str(out)
    )
    assert code == 2 and "cannot write the plots there: it is a file, not a folder" in err
    assert not out.exists()


_LIGHT = """
import sys
sys.modules["torch"] = None  # an import of torch now fails
sys.modules["transformers"] = None
import expertcache.cli, expertcache.tools.sweep
heavy = [m for m in ("ray", "pandas", "pyarrow", "matplotlib", "yaml", "tqdm") if m in sys.modules]
assert not heavy, heavy
sys.exit(expertcache.cli.main(sys.argv[1:]))
"""


def test_the_sweep_runs_without_torch_and_imports_the_heavy_parts_only_when_used(tmp_path, traces):
    out = tmp_path / "r.csv"
    done = subprocess.run(
        [sys.executable, "-c", _LIGHT, "sweep", "--trace", str(traces[0]), "--policy", "lru", "--capacity",
         "8", "--prefetch", "eam", "--out", str(out), "--jobs", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 2


def test_simulate_takes_one_policy_and_shares_as_sim_and_sweep_do():
    # ec.simulate(t, "lru", ...) iterated the string ("unknown policy 'l'"), and "25%" was a raw ValueError
    trace = expertcache.default_trace()
    one = expertcache.simulate(trace, "lru", capacities=24)
    listed = expertcache.simulate(trace, ["lru"], capacities=["25%"])
    assert [(r.policy, r.capacity, r.misses) for r in one] == [
        (r.policy, r.capacity, r.misses) for r in listed
    ]
    assert listed[0].capacity == 24  # a quarter of 96
    for bad, words in (("x", "is not experts .24., a range"), ("0.5%", "less than one expert")):
        with pytest.raises(expertcache.ExpertcacheError, match=words):
            expertcache.simulate(trace, ["lru"], capacities=[bad])


def test_a_long_title_stays_inside_the_figure():
    """A trace's path and a timing combination ran off both edges of a 7-inch figure's title."""
    import matplotlib

    matplotlib.use("Agg")
    from expertcache.tools.sweep_plots import _curves, _heatmap, _timing_title

    row = {"trace": "t", "trace_sha": "0", "order": "layer", "policy": "lru", "params": "", "capacity": 4,
           "requests": 10, "misses": 5, "miss_ratio": 0.5, "opt_misses": 4, "ratio_to_opt": 1.25}  # fmt: skip
    title = "/a/rather/long/path/to/the/traces/of/this/study/qwen1.5-moe-a2.7b-chat.npz (layer order" + (
        _timing_title(("fetch", "eam", 2, 25.0, 20.0)) + ")"
    )
    for fig in (_curves([row], title), _heatmap([row], title)):
        fig.canvas.draw()
        box = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
        assert box.x0 >= 0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1, (box, fig.bbox)
        assert "qwen1.5-moe" in fig.axes[0].get_title().replace("\n", "")


def test_a_grid_of_the_wrong_type_is_named():
    from expertcache import ExpertcacheError, sweep

    with pytest.raises(ExpertcacheError, match="sweep's grid is a Grid, a YAML or TOML file, or None, got 5"):
        sweep(5)


def test_a_resumed_results_file_with_a_bad_cell_names_its_row_and_column(tmp_path, traces):
    """A resumed CSV holding 'abc' among the misses said Python's "invalid literal for int() with base
    10", naming no column."""
    grid = {**GRID, "traces": [str(traces[0])]}
    out = tmp_path / "r.csv"
    quiet(out=out, **grid)
    lines = out.read_text().splitlines()
    names = lines[0].split(",")
    cells = lines[1].split(",")
    cells[names.index("misses")] = "abc"
    out.write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    with pytest.raises(
        expertcache.ExpertcacheError, match=r"row 2, column misses: 'abc' is not a whole number"
    ):
        quiet(out=out, resume=True, **grid)
