"""The Python API's contract: one ``ExpertcacheError`` naming the argument in Python terms (never a CLI
flag, never a deep TypeError), the same capacity and trace forms in every function, notes as warnings,
useful reprs, and a closed model that says so."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import expertcache as ec
from expertcache import CostModel, ExpertcacheError, ExpertcacheWarning
from expertcache.cli import main
from expertcache.errors import command_line, option


@pytest.fixture(scope="module")
def trace():
    return ec.default_trace()


@pytest.fixture(scope="module")
def model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        m = ec.load(expert_memory="25%", prefetch="none")
    yield m
    m.close()


# ------------------------------------------------------------------ traces and capacities, one form
def test_functions_of_one_capacity_take_a_share_as_simulate_does(trace):
    expected = ec.simulate(trace, ["lru"], ["25%"])[0].capacity
    assert expected == 24
    assert ec.simulate_timing(trace, "25%").capacity == ec.simulate_timing(trace, 24).capacity == 24
    assert ec.simulate_timing(trace, "24").misses == ec.simulate_timing(trace, 24).misses
    plan = ec.make_plan(trace, "25%", misses="fetch")  # a single name, not split into letters
    assert plan.capacity == 24
    assert ec.diagnose(trace, "25%", misses="fetch")["capacity"] == 24


@pytest.mark.parametrize(
    ("capacity", "needle"),
    [
        (2.5, "a whole number of experts (24) or a share of all experts ('25%'), got 2.5"),
        (True, "got True"),
        ("8:16", "one capacity, not a range"),
        ("0.5%", "less than one expert of 96"),
        ("many", "is not experts"),
    ],
)
def test_a_capacity_that_is_not_one_is_one_clear_error(trace, capacity, needle):
    for fn in (ec.simulate_timing, ec.make_plan, ec.diagnose):
        with pytest.raises(ExpertcacheError, match=None) as err:
            fn(trace, capacity)
        assert needle in str(err.value)


def test_a_trace_may_be_given_as_its_file(trace, tmp_path):
    path = tmp_path / "t.npz"
    trace.save(path)
    assert ec.simulate(str(path), ["lru"], [24])[0].misses == ec.simulate(trace, ["lru"], [24])[0].misses
    assert ec.simulate_timing(path, 24).misses == ec.simulate_timing(trace, 24).misses
    assert ec.batch_requests(str(path), 4).num_tokens == ec.batch_requests(trace, 4).num_tokens
    with pytest.raises(ec.TraceError, match="a Trace or a trace file's path"):
        ec.simulate(3, ["lru"], [24])
    with pytest.raises(ec.TraceError, match="no such trace file"):
        ec.simulate_timing(tmp_path / "missing.npz", 24)
    with pytest.raises(ec.TraceError, match="a directory, not a trace file"):
        ec.load_trace(tmp_path)
    with pytest.raises(ec.TraceError, match="a trace file's path, got NoneType"):
        ec.load_trace(None)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"concurrency": 2.5}, "concurrency must be a whole number, got 2.5"),
        ({"concurrency": 0}, "concurrency must be at least 1"),
        ({"concurrency": 2, "requests": "8"}, "requests must be a whole number"),
        ({"concurrency": 2, "stagger": -1}, "must be at least 0"),
    ],
)
def test_batch_requests_counts_are_whole_numbers(trace, kwargs, needle):
    with pytest.raises(ec.TraceError) as err:
        ec.batch_requests(trace, **kwargs)
    assert needle in str(err.value)


def test_wrong_types_are_expertcache_errors(trace):
    with pytest.raises(ec.PolicyError, match="policy must be a name or 'name:key=value,...', got 3"):
        ec.simulate(trace, [3], [24])
    with pytest.raises(ExpertcacheError, match="seed must be a whole number, got 'a'"):
        ec.simulate(trace, ["random"], [24], seed="a")


def test_cost_model_fields_take_units_as_its_json_does():
    cost = CostModel(link_bandwidth="25GB/s", disk_read_s="2ms", expert_bytes="336MiB", dense_s=["1ms", 2e-3])
    same = CostModel(link_bandwidth=25e9, disk_read_s=2e-3, expert_bytes=336 << 20, dense_s=(1e-3, 2e-3))
    assert cost == same
    with pytest.raises(ExpertcacheError, match="'fast' is not a rate"):
        CostModel(link_bandwidth="fast")
    with pytest.raises(ExpertcacheError, match="a positive rate .* got None"):
        CostModel(link_bandwidth=None)


def test_a_replay_of_a_prefetching_run_warns_in_python_and_notes_on_the_command_line(trace, tmp_path, capsys):
    predicted = np.full_like(trace.experts, -1)
    predicted[::7] = trace.experts[::7]
    prefetched = ec.Trace(
        trace.experts, trace.num_experts, seq_id=trace.seq_id, is_prefill=trace.is_prefill,
        predicted=predicted, meta={"predictor": "next-gate"},
    )  # fmt: skip
    with pytest.warns(ExpertcacheWarning, match="this run prefetched .*prefetch='recorded'"):
        ec.simulate(prefetched, ["lru"], [24])
    path = tmp_path / "p.npz"
    prefetched.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the command line notes it once, on stderr, and warns nothing
        assert main(["sim", str(path), "--policy", "lru", "--capacity", "24"]) == 0
    err = capsys.readouterr().err
    assert err.count("this run prefetched") == 1 and "--prefetch recorded" in err


def test_messages_name_python_arguments_in_python_and_flags_on_the_command_line(capsys):
    assert option("--host-memory", "host_memory") == "host_memory"
    with command_line():
        assert option("--host-memory", "host_memory") == "--host-memory"
    assert option("--host-memory", "host_memory") == "host_memory"
    with pytest.raises(ExpertcacheError) as err:
        ec.load(prefetch="none", window=2)
    assert "prefetch=NAME" in str(err.value) and "--" not in str(err.value)
    with pytest.raises(ExpertcacheError) as err:
        ec.load(chunking=False, chunk_size="64KiB")
    assert "chunking=False" in str(err.value) and "--" not in str(err.value)
    with pytest.raises(ExpertcacheError, match="use it with expertcache.simulate$"):
        ec.load(policy="opt")
    with pytest.raises(ExpertcacheError, match=r"a host level \(host_memory\) serves the fetch miss path"):
        ec.load(expert_memory="50%", host_memory="50%", miss="host")
    assert main(["generate", "--prompt", "x", "--prefetch", "none", "--window", "2"]) == 2
    assert "(--prefetch NAME)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"expert_memory": 0.25}, "a number is bytes, a whole number of them; a share of all experts is"),
        ({"expert_memory": 24}, "(a number is bytes; a share of all experts is a string, '25%')"),
        ({"expert_memory": "30%", "seed": "a"}, "seed must be a whole number, got 'a'"),
        ({"policy": 3}, "policy must be a name"),
    ],
)
def test_load_refuses_what_it_would_misread(kwargs, needle):
    with pytest.raises(ExpertcacheError) as err:
        ec.load(**kwargs)
    assert needle in str(err.value)


def test_load_warns_its_notes():
    with pytest.warns(ExpertcacheWarning, match=r"the host level \(19 experts\) holds no more than"):
        m = ec.load(expert_memory="50%", host_memory="20%", prefetch="none")
    try:
        assert any("holds no more than" in n for n in m.notes)
    finally:
        m.close()


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        (("x", 4), {"max_new_token": 3}, "unknown argument 'max_new_token' (did you mean max_new_tokens"),
        (("x", "8"), {}, "max_new_tokens must be a whole number, got '8'"),
        (("x", 2.5), {}, "max_new_tokens must be a whole number, got 2.5"),
        (("x", 4), {"batch_size": 0}, "batch_size must be at least 1"),
        ((None, 4), {}, "prompt must be a string or a list of them, got NoneType"),
        (("x", 4), {"sampling": "greedy"}, "sampling must be a SamplingConfig, got str"),
        (("x", 4), {"attention_mask": None}, "generate_text sets attention_mask itself"),
    ],
)
def test_generate_text_refuses_bad_arguments_before_any_work(model, args, kwargs, needle):
    before = model.stats["misses"]
    with pytest.raises(ExpertcacheError) as err:
        model.generate_text(*args, **kwargs)
    assert needle in str(err.value)
    assert model.stats["misses"] == before  # nothing ran


def test_generate_text_passes_transformers_settings_through(model):
    one = model.generate_text("Hello", 3)
    again = model.generate_text("Hello", 3, repetition_penalty=1.0, num_beams=1)
    assert one.tokens == again.tokens


def test_reprs_are_one_line_summaries(model, trace):
    assert repr(model) == "<OffloadedModel embedded: 24 of 96 experts, policy lru, miss fetch, cpu>"
    assert repr(trace).endswith("5192 tokens, 16 sequences, 6 layers x 16 experts, top-2>")
    result = ec.simulate(trace, ["lru"], [24])[0]
    assert repr(result) == (
        f"<SimResult lru at 24 experts (layer order): {result.requests} requests, {result.hits} hits, "
        f"{result.misses} misses ({result.miss_ratio:.1%}), OPT {result.opt_misses}>"
    )
    g = model.generate_text("Hello", 2)
    assert repr(g).startswith(f"<Generation {g.text!r}: 2 tokens (") and "\n" not in repr(g)


def test_a_closed_model_says_so():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        m = ec.load(expert_memory="25%", prefetch="none")
    m.close()
    m.close()  # twice: nothing more to do
    assert "closed" in repr(m)
    for use in (lambda: m.generate_text("x", 2), lambda: m.generate(m.encode("x").reshape(1, -1))):
        with pytest.raises(ExpertcacheError, match=r"this model is closed \(close\(\) was called\)"):
            use()


def test_a_replay_says_when_its_host_level_is_not_the_recorded_runs(trace):
    recorded = ec.Trace(trace.experts, trace.num_experts, seq_id=trace.seq_id, meta={"host_exclusive": True})
    notes = ec.simulate_timing(recorded, 24, host_capacity=48).notes
    assert "the trace was recorded with an exclusive host level; this replay's is inclusive" in notes
    same = ec.simulate_timing(recorded, 24, host=ec.HostConfig(None, exclusive=True), host_capacity=46).notes
    assert not any("was recorded with" in n for n in same)


def test_a_replay_of_another_miss_path_says_so_and_names_what_replays_it(trace, tmp_path, capsys):
    meta = {
        "policy": "tlfu",
        "capacity": 20,
        "miss": "batch:buffer=4",
        "capacities": '{"stream": 4, "full": 20}',
    }
    served = ec.Trace(trace.experts, trace.num_experts, seq_id=trace.seq_id, meta=meta)
    with pytest.warns(ExpertcacheWarning, match=r"miss path batch:buffer=4 \(in the memory of 24 experts\)"):
        ec.simulate(served, ["tlfu"], [24])
    path = tmp_path / "served.npz"
    served.save(path)
    assert main(["sim", str(path), "--policy", "tlfu", "--capacity", "24"]) == 0
    err = capsys.readouterr().err
    assert f"'expertcache timing --trace {path} --policy tlfu --miss batch:buffer=4 --capacity 24'" in err
    fetched = ec.Trace(trace.experts, trace.num_experts, meta={"miss": "fetch", "capacity": 24})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ec.simulate(fetched, ["lru"], [24])  # a fetch run without prefetching: the replay is the run's
