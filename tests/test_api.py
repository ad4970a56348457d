"""The Python API's contract: one ``ExpertcacheError`` naming the argument in Python terms (never a CLI
flag, never a deep TypeError), the same capacity and trace forms in every function, notes as warnings,
useful reprs, and a closed model that says so."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
from trace_fixtures import prefix

import expertcache as ec
from expertcache import CostModel, ExpertcacheError, ExpertcacheWarning
from expertcache.cli import main
from expertcache.errors import command_line, option


@pytest.fixture(scope="module")
def trace():
    return ec.default_trace()


@pytest.fixture(scope="module")
def short():
    """The trace's first 256 tokens: for the planner's and the doctor's many replays (seconds, not tens)."""
    return prefix(256)


@pytest.fixture(scope="module")
def model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        m = ec.load(expert_memory="25%", prefetch="none")
    yield m
    m.close()


# ------------------------------------------------------------------ traces and capacities, one form
def test_functions_of_one_capacity_take_a_share_as_simulate_does(short):
    trace = short
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
    with pytest.raises(ExpertcacheError, match="seed must be at least 0, got -1"):  # it drew as 1 does
        ec.simulate(trace, ["random"], [24], seed=-1)
    random = ec.simulate(trace, ["random", "lru"], [24], seed=3)  # a random run's seed is in its row
    assert [r.to_dict()["seed"] for r in random] == [3, None]


def test_cost_model_fields_take_units_as_its_json_does():
    cost = CostModel(link_bandwidth="25GB/s", disk_read_s="2ms", expert_bytes="336MiB", dense_s=["1ms", 2e-3])
    same = CostModel(link_bandwidth=25e9, disk_read_s=2e-3, expert_bytes=336 << 20, dense_s=(1e-3, 2e-3))
    assert cost == same
    with pytest.raises(ExpertcacheError, match="'fast' is not a rate"):
        CostModel(link_bandwidth="fast")
    with pytest.raises(ExpertcacheError, match="a positive rate .* got None"):
        CostModel(link_bandwidth=None)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        (
            "link_bandwidth",
            16,
            '16 would be 16 bytes a second; a bare number is bytes a second, so give the unit ("16GB/s")',
        ),
        (
            "link_latency",
            5,
            '5 would be 5 s; a bare number is seconds, so give the unit ("5us", "5ms", or "5s"',
        ),
        ("dense_s", [0.001, 2], "'dense_s': 2 would be 2 s"),
    ],
)
def test_a_cost_files_bare_number_far_from_any_machine_is_refused_not_read_in_base_units(
    tmp_path, capsys, field, value, needle
):
    """A new user wrote ``{"link_bandwidth": 16}`` and got a link of 16 B/s and experts of 2e10 ms."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({field: value}))
    with pytest.raises(ExpertcacheError, match=re.escape(needle)):
        CostModel.load(path)
    with pytest.raises(ExpertcacheError, match=re.escape(needle)):
        ec.simulate_timing(ec.default_trace(), 24, cost={field: value})
    assert main(["timing", "--cost", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"expertcache: error: {path}: cost field")
    assert CostModel.from_dict({"link_bandwidth": 16e9, "link_latency": 5e-6, "step_s": "2s"}).step_s == 2.0
    assert CostModel.from_dict({"disk_read_s": 3.4}).disk_read_s == 3.4  # 336 MiB from a slow disk


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
        ({"path": 5}, "path: a checkpoint folder or a Hugging Face id (org/name), got int 5"),
        ({"prefetch": "window", "window": "2"}, "window must be a whole number of layers, got '2'"),
        ({"deterministic": "yes"}, "deterministic must be True or False, got 'yes'"),
        ({"prefetch": "window:size=3"}, "predictor 'window' takes no parameters ('window:size=3')"),
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
        (("x", 4), {"temperature": 0.5}, "temperature is a sampling setting: give sampling=SamplingConfig("),
        # SamplingConfig's stop strings: it said "(did you mean top_p or top_k?)", names refused as well
        (("x", 4), {"stop": ["\n"]}, "stop is a sampling setting: give sampling=SamplingConfig(stop=...)"),
        (("x", 4), {"do_sample": True}, "give sampling=SamplingConfig(temperature=...)"),
        # settings that would change what comes back, or ignore max_new_tokens: refused, not passed on
        (("x", 4), {"num_beams": 2}, "num_beams=2: generate_text decodes one sequence a prompt"),
        (("x", 4), {"num_return_sequences": 3}, "num_return_sequences=3: generate_text returns one result"),
        (("x", 4), {"return_dict_in_generate": True}, "use generate() on the model"),
        (("x", 4), {"output_scores": True}, "output_scores=True: generate_text returns no scores"),
        (("x", 4), {"max_length": 3}, "generate_text's length is max_new_tokens"),
        (("x", 4), {"min_new_tokens": 5}, "min_new_tokens 5 is more than max_new_tokens 4"),
        (("x", 4), {"min_new_tokens": -1}, "min_new_tokens must be at least 0"),
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
    again = model.generate_text(
        "Hello", 3, no_repeat_ngram_size=0, num_beams=1, num_return_sequences=1, output_scores=False
    )
    assert one.tokens == again.tokens
    assert len(model.generate_text("Hello", 3, min_new_tokens=3).tokens) == 3


@pytest.mark.parametrize("given", ["Hello", [1, 2, 3]])
def test_generate_takes_token_ids_and_names_anything_else(model, given):
    with pytest.raises(ExpertcacheError, match="generate takes token ids .* give text to generate_text"):
        model.generate(given, max_new_tokens=2)
    with pytest.raises(ExpertcacheError, match="generate takes token ids"):
        model.generate(inputs=given, max_new_tokens=2)
    ids = model.encode("Hello").reshape(1, -1)
    assert model.generate(ids, max_new_tokens=2).shape == (1, ids.shape[1] + 2)


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
    assert "batch" not in repr(g)
    # a batch's prompts share its timings and counts: said (each showed them as its own: a trial)
    assert all(repr(x).endswith(" misses (the batch of 2's)>") for x in model.generate_text(["Hi", "Yo"], 2))


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
        "memory": 24,
    }
    served = ec.Trace(trace.experts, trace.num_experts, seq_id=trace.seq_id, meta=meta)
    said = r"batch:buffer=4 \(in an expert memory of 24 experts\).*simulate_timing\(trace, 'recorded'"
    with pytest.warns(ExpertcacheWarning, match=said):
        ec.simulate(served, ["tlfu"], [24])
    path = tmp_path / "served.npz"
    served.save(path)
    assert main(["sim", str(path), "--policy", "tlfu", "--capacity", "24"]) == 0
    err = capsys.readouterr().err  # timing replays the run's own parts: no capacity to give
    assert f"'expertcache timing --trace {path} --policy tlfu --miss batch:buffer=4' replays it at" in err
    # a trace of an engine before its expert memory was recorded: the parts alone, nothing said of it
    older = ec.Trace(trace.experts, trace.num_experts, meta={k: v for k, v in meta.items() if k != "memory"})
    with pytest.warns(ExpertcacheWarning, match=r"by miss path batch:buffer=4; these replays"):
        ec.simulate(older, ["tlfu"], [24])
    predicted = np.full_like(trace.experts, -1)
    predicted[::5] = trace.experts[::5]
    both = ec.Trace(trace.experts, trace.num_experts, seq_id=trace.seq_id, predicted=predicted, meta=meta)
    both.save(path)
    assert main(["sim", str(path), "--policy", "tlfu", "--capacity", "24"]) == 0
    err = capsys.readouterr().err
    assert err.count("note: this run") == 1  # one note, one command that replays both
    assert "this run prefetched (a predictor, in " in err
    assert "and served its misses by miss path batch" in err
    assert "these replays do not prefetch, fetch every miss whole" in err
    assert "--policy tlfu --miss batch:buffer=4 --prefetch recorded'" in err
    with pytest.warns(ExpertcacheWarning, match=r"miss='batch:buffer=4', prefetch='recorded'\)") as got:
        ec.simulate(both, ["tlfu"], [24])
    assert len(got) == 1
    fetched = ec.Trace(trace.experts, trace.num_experts, meta={"miss": "fetch", "capacity": 24})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ec.simulate(fetched, ["lru"], [24])  # a fetch run without prefetching: the replay is the run's


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"policies": None}, "policies: a policy spec ('lru') or a non-empty list of them, got None"),
        ({"policies": []}, "a non-empty list of them, got []"),
        ({"capacities": 24.5}, "capacities: experts (24), a range ('8:96:8'), a share ('25%'), 'all' or"),
        ({"capacities": None}, "or a non-empty list of these, got None"),
        ({"jobs": "2"}, "jobs must be a whole number, got '2'"),
        ({"jobs": 0}, "jobs must be at least 1, got 0"),
        ({"skip_infeasible": "no"}, "skip_infeasible must be True or False, got 'no'"),
    ],
)
def test_simulate_refuses_arguments_it_would_misread(trace, kwargs, needle):
    args = {"policies": ["lru"], "capacities": [24], **kwargs}
    with pytest.raises(ExpertcacheError) as err:
        ec.simulate(trace, **args)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"capacities": {"foo": 1}}, "capacities: a dict of each part of miss path fetch (full) to the"),
        ({"capacities": [1, 2]}, "capacities: a dict of each part of miss path fetch (full)"),
        ({"capacities": {"full": "24"}}, "capacities['full']: a whole number of experts, or a list of 6"),
        ({"cost": 3}, "cost must be a CostModel, a dict of its fields or the path of a cost model"),
        ({"cost": "/nonexistent/cost.json"}, "/nonexistent/cost.json: cannot read cost model"),
        ({"cost": {"expert_z": 1}}, "cost: unknown field(s) expert_z"),
        ({"host": "lru"}, "host 'lru' is not the host level's memory (bytes, '8GiB', or a share of all"),
        ({"host": "1GiB", "host_capacity": -1}, "host_capacity: a whole number of experts, 1 or more, got -"),
        ({"host_capacity": 2.5}, "host_capacity: a whole number of experts, 1 or more, got 2.5"),
        ({"prefetch": "eam:size=3"}, "predictor 'eam' takes no parameters ('eam:size=3'); how far ahead"),
        ({"prefetch": "auto"}, "name one, with PrefetchConfig(NAME, when='pays') for the governor, or"),
    ],
)
def test_simulate_timing_refuses_arguments_it_would_misread(trace, kwargs, needle):
    with pytest.raises(ExpertcacheError) as err:
        ec.simulate_timing(trace, 24, **kwargs)
    assert needle in str(err.value)


def test_a_cost_model_may_be_given_as_a_dict_or_a_file(short, tmp_path):
    trace = short
    fields = {"expert_s": "1ms", "link_bandwidth": "8GB/s", "expert_bytes": "184KiB"}
    cost = CostModel.from_dict(fields)
    cost.save(tmp_path / "cost.json")
    want = ec.simulate_timing(trace, 24, cost=cost).to_dict()
    for given in (fields, tmp_path / "cost.json", str(tmp_path / "cost.json")):
        assert ec.simulate_timing(trace, 24, cost=given).to_dict() == want
    assert ec.make_plan(trace, 24, cost=fields).predicted == ec.make_plan(trace, 24, cost=cost).predicted
    assert ec.diagnose(trace, 24, cost=fields) == ec.diagnose(trace, 24, cost=cost)


def test_plan_and_doctor_check_their_counts(trace):
    with pytest.raises(ExpertcacheError, match="seed must be a whole number, got 'x'"):
        ec.make_plan(trace, 24, seed="x")
    with pytest.raises(ExpertcacheError, match="window_tokens must be a whole number, got '16'"):
        ec.diagnose(trace, 24, window_tokens="16")
    with pytest.raises(ExpertcacheError, match="jobs must be at least 1, got 0"):
        ec.make_plan(trace, 24, jobs=0)
    with pytest.raises(ExpertcacheError, match="jobs must be a whole number, got 2.0"):
        ec.diagnose(trace, 24, jobs=2.0)


def test_simulate_takes_every_capacity_item_as_sim_does(trace):
    """A list holding "all" or a range from 1 was refused in layer order ("capacity 1 is below top-k 4")
    where sim --capacity takes them; a range past every expert was cut without a word."""
    K, total = trace.top_k, trace.num_keys
    assert [r.capacity for r in ec.simulate(trace, ["lru"], ["all"])][0] == K
    with pytest.warns(ExpertcacheWarning, match=f"capacity 1:{K + 2}: left out 1.* \\(below top-k {K}\\)"):
        got = ec.simulate(trace, ["lru"], [f"1:{K + 2}", 24])
    assert [r.capacity for r in got] == [K, K + 1, K + 2, 24]
    with pytest.warns(ExpertcacheWarning, match=f"left out {total + 8}:{total + 16}:8 \\(above all {total}"):
        got = ec.simulate(trace, ["lru"], [f"{total - 8}:{total + 16}:8"])
    assert [r.capacity for r in got] == [total - 8, total]
    with pytest.raises(ExpertcacheError, match=f"select no capacity of the trace's {total} experts"):
        ec.simulate(trace, ["lru"], [f"{total + 1}:{total + 9}"])


def test_simulate_timing_warns_its_notes_and_sums_itself_up_in_one_line(short):
    trace = short
    with pytest.warns(ExpertcacheWarning, match="a cache of 1000 experts is more than all 96; capped at 96"):
        result = ec.simulate_timing(trace, 1000)
    assert result.notes == ["a cache of 1000 experts is more than all 96; capped at 96"]
    with warnings.catch_warnings():  # the planner's and the doctor's own replays do not warn theirs
        warnings.simplefilter("error", ExpertcacheWarning)
        ec.make_plan(trace, 24)
    text = repr(result)
    assert text.startswith("<TimingResult lru at 96 experts, miss fetch: TTFT ") and "\n" not in text
    assert f"{result.misses} misses of {result.requests} requests" in text and len(text) < 200


def test_sampling_settings_are_checked_when_made():
    from expertcache.config import SamplingConfig

    with pytest.raises(ExpertcacheError, match="top_p must be a number, got '0.9'"):
        SamplingConfig(temperature=0.5, top_p="0.9")
    with pytest.raises(ExpertcacheError, match="top_k must be a whole number, got 2.5"):
        SamplingConfig(temperature=0.5, top_k=2.5)
    with pytest.raises(ExpertcacheError, match="temperature must be a number >= 0"):
        SamplingConfig(temperature="0.5")


def test_a_trace_is_saved_to_a_path_and_a_closed_models_run_can_be_saved(model, tmp_path):
    with pytest.raises(ExpertcacheError, match=r"a trace is saved to a path \(\.npz\), got int 5"):
        model.save_trace(5)
    with pytest.raises(ec.TraceError, match=r"a trace is saved to a path \(\.npz\), got int 5"):
        ec.default_trace().save(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        m = ec.load(expert_memory="25%", prefetch="none")
    m.generate_text("Hello", 2)
    m.close()
    m.save_trace(tmp_path / "closed.npz")
    assert ec.load_trace(tmp_path / "closed.npz").num_tokens == m.trace().num_tokens > 0
    assert m.stats["misses"] > 0


def test_the_doctors_advice_names_python_arguments_in_python(short):
    trace = short
    report = ec.diagnose(trace, 24, host_capacity=48)
    text = " ".join(report["verdict"])
    assert "HostConfig(exclusive=True)" in text and "make_plan compares other host policies" in text
    assert " --" not in text
    with command_line():
        text = " ".join(ec.diagnose(trace, 24, host_capacity=48)["verdict"])
    assert "--host-exclusive" in text and "--host-policy" in text


def test_simulate_caps_a_capacity_over_all_experts_and_says_so():
    """As ``sim --capacity`` and ``simulate_timing`` do: the row was labelled 1000 experts of 96."""
    from expertcache.trace.default import default_trace

    trace = default_trace()
    with pytest.warns(ExpertcacheWarning, match="a cache of 1000 experts is more than all 96; capped at 96"):
        (row,) = ec.simulate(trace, ["lru"], [1000])
    assert row.capacity == 96 and row.misses == ec.simulate(trace, ["lru"], [96])[0].misses
    # replay, on a schedule, caps it the same way (it kept 1000 in its result, beside the warning)
    schedule = ec.build_schedule(trace)
    with pytest.warns(ExpertcacheWarning, match="a cache of 1000 experts is more than all 96; capped at 96"):
        one = ec.replay(schedule, "lru", 1000)
    assert one.capacity == 96 and one.misses == row.misses


def test_the_planner_and_the_doctor_cap_a_capacity_over_all_experts_as_the_simulator_does(short):
    """They refused 1000 experts of 96 that ``simulate`` and ``simulate_timing`` cap with a note."""
    note = "a cache of 1000 experts is more than all 96; capped at 96"
    with pytest.warns(ExpertcacheWarning, match=note):
        plan = ec.make_plan(short, 1000)
    assert plan.capacity == 96 and note in plan.source["notes"]
    with pytest.warns(ExpertcacheWarning, match=note):
        report = ec.diagnose(short, 1000)
    assert note in report["notes"] and report["capacity"] == 96
    with pytest.raises(ExpertcacheError, match=r"a cache of 1 experts: the planner needs top-k \(2\)"):
        ec.make_plan(short, 1)


def test_a_misspelt_load_argument_is_named_before_anything_loads():
    """``load(expert_memroy="30%")`` was a TypeError from OffloadedModel, after the model had loaded."""
    import expertcache

    with pytest.raises(expertcache.ExpertcacheError, match=r"unknown argument 'expert_memroy' \(did you mean "
                       r"expert_memory\?\)"):  # fmt: skip
        expertcache.load(expert_memroy="30%")
    with pytest.raises(
        expertcache.ExpertcacheError, match="unknown argument 'kernal' \\(did you mean kernel"
    ):
        expertcache.load(kernal="eager")


def test_a_third_trial_of_the_api_is_one_clear_error_each(tmp_path):
    """What a trial of the Python API found: raw TypeErrors and AttributeErrors from deep inside, a
    truthy "no" taken for True, numpy's integers refused, a float capacity rounded up in silence."""
    import numpy as np

    import expertcache as ec
    from expertcache.config import HostConfig
    from expertcache.tools.train_policy import train_policy
    from expertcache.trace.importers import import_trace

    t = ec.default_trace()
    flat = ec.build_schedule(t, "flat")
    for call, words in (
        (lambda: ec.replay(flat, "lru", 24.5), "capacity must be a whole number of experts, got 24.5"),
        (lambda: ec.replay(flat, "lru", True), "capacity must be a whole number of experts, got True"),
        (
            lambda: ec.replay(t, "lru", 24),
            "replay takes a Schedule (build_schedule(trace, order)), got Trace",
        ),
        (lambda: ec.run_policy(flat, "lru", 24), "capacities is a list of whole numbers, got 24"),
        (lambda: ec.run_policy(flat, "lcp", [24], params=[("rho", 0.5)]), "params is a dict"),
        (lambda: ec.simulate_timing(t, 24, polcy="lru"), "simulate_timing got an unknown argument 'polcy'"),
        (lambda: ec.profile(steps=0), "steps must be at least 2, got 0"),
        (lambda: ec.synthesize("zipf", tokens=10, layers=2, seed=-1), "seed must be at least 0, got -1"),
        (lambda: train_policy([t], ["s"], orders="layer"), "orders is a list, got 'layer'"),
        (lambda: train_policy([t], []), "a name per trace: 1 traces and 0 names"),
        (lambda: ec.build_schedule(None), "a Trace or a trace file's path"),
        (lambda: HostConfig("1GiB", exclusive="no"), "host_exclusive must be True or False, got 'no'"),
        (lambda: ec.sweep(resume="no"), "resume must be True or False, got 'no'"),
        (lambda: ec.load(record="no"), "record must be True or False, got 'no'"),
        (lambda: ec.load(costs=5), "cost must be a CostModel, a dict of its fields or the path"),
        (lambda: import_trace(tmp_path / "r.pt"), "read by expertcache.tools.trace_import.import_torch"),
        (lambda: ec.simulate_timing(t, 24, predictor_trace=t), "predictor_trace: prefetch none reads no"),
        (lambda: ec.make_plan(t, 24, predictor_trace=t), "predictor_trace: prefetch none reads no recorded"),
        (lambda: ec.make_plan(t, 24, host_policies=["lru"]), "host_policies rules a host level: give host"),
        (
            lambda: ec.make_policy("lru-dist", ec.PolicyContext(4, 2, 4, 1), budgets="2/x"),
            "budgets is a list of whole numbers (or '2/2/4'), got '2/x'",
        ),
    ):
        with pytest.raises(ec.ExpertcacheError) as info:
            call()
        assert words in str(info.value), (words, str(info.value))
    assert ec.replay(flat, "lru", np.int64(24)).misses == ec.replay(flat, "lru", 24).misses
    assert ec.simulate_timing(t, np.int64(24)).capacity == 24
    both = ec.make_plan(t, 24, prefetches=["none", "eam"], predictor_trace=t, methods=["shared"])
    assert {c["prefetch"] for c in both.candidates} >= {"none", "eam"}  # each candidate its own reading
    assert ec.make_policy("lru-dist", ec.PolicyContext(4, 2, 4, 1), budgets="2/2") is not None  # as --policy
    spec = ec.make_policy("lcp:rho=0.5", ec.PolicyContext(4, 2, 4, 1))  # a spec, as --policy gives it
    assert spec.name == "lcp" and spec.rho == 0.5
    with pytest.raises(ec.PolicyError, match="rho given in the spec and as a keyword"):
        ec.make_policy("lcp:rho=0.5", ec.PolicyContext(4, 2, 4, 1), rho=0.3)
    t.save(tmp_path / "t.npz")
    assert ec.build_schedule(tmp_path / "t.npz").num_layers == t.num_layers
    with ec.load(expert_memory="30%", miss="host", costs={"link_bandwidth": "1GB/s"}, device="cpu") as model:
        assert model.costs.link_bandwidth == 1e9  # a dict, as simulate_timing takes it: it crashed later
        assert len(model.generate_text("x = 1", 2).tokens) == 2
        with pytest.raises(ec.ExpertcacheError, match="chat must be True or False, got 'no'"):
            model.generate_text("hi", 2, chat="no")
        with pytest.raises(ec.ExpertcacheError, match="prompt 2 must be text, got NoneType None"):
            model.generate_text(["a", None], 2)  # it said "a conversation: it needs chat mode"
        assert len(model.generate_text("hi", np.int64(2)).tokens) == 2


def test_a_cost_model_takes_numpy_numbers_and_refuses_true_for_a_number():
    import expertcache as ec

    c = ec.CostModel(
        link_bandwidth=np.float32(2e10), link_latency=np.float32(1e-5), expert_bytes=np.int64(1000)
    )
    assert c.expert_bytes == 1000 and isinstance(c.expert_bytes, int) and c.link_bandwidth == 2e10
    for kwargs, words in (
        ({"link_latency": True}, "link_latency must be a number or a string with a unit, not True"),
        ({"expert_bytes": True}, "expert_bytes must be a number"),  # was 1 byte
        ({"host_parallel": 0}, "host_parallel must be True or False, got 0"),
        ({"weight_bits": 16.0}, "weight_bits must be 16 or 32, got 16.0"),
    ):
        with pytest.raises(ec.ExpertcacheError, match=re.escape(words)):
            ec.CostModel(**kwargs)


def test_contexts_are_whole_numbers_and_repeats_run_once():
    import numpy as np

    import expertcache as ec

    for call, words in (
        (lambda: ec.PolicyContext("4", 2, 4), "PolicyContext capacity must be a whole number, got '4'"),
        (lambda: ec.PolicyContext(4.5, 2, 4), "PolicyContext capacity must be a whole number, got 4.5"),
        (lambda: ec.PolicyContext(4, 2, 4, top_k=9), "top_k must be 1 .. num_experts (4), got 9"),
        (lambda: ec.PolicyContext(4, 2, 4, clock=5), "clock must be a Clock (or None), got 5"),
        (lambda: ec.PredictContext("6", 16, 2), "PredictContext num_layers must be a whole number, got '6'"),
        (lambda: ec.PredictContext(6, 16, 2, window=1.5), "window must be a whole number, got 1.5"),
        (lambda: ec.make_predictor("window", None), "make_predictor needs a PredictContext"),
    ):
        with pytest.raises(ec.ExpertcacheError) as info:
            call()
        assert words in str(info.value), str(info.value)
    assert ec.PolicyContext(np.int64(4), 2, 4).capacity == 4
    results = ec.simulate(ec.default_trace(), ["lru", "lru", "fifo"], [24])
    assert [r.policy for r in results] == ["lru", "fifo"]  # a repeat is the same replay, as for capacities


def test_a_model_or_bits_of_the_wrong_type_is_named_before_any_work(tmp_path):
    """model_info(42) raised pathlib's TypeError; write_checkpoint(None, "8", out) wrote an 'int8'
    checkpoint recording bits "8"."""
    from expertcache.engine.offloaded import model_info
    from expertcache.tools.quantize import write_checkpoint

    with pytest.raises(ExpertcacheError, match="a model is a checkpoint's folder or a Hugging Face id"):
        model_info(42)
    with pytest.raises(ExpertcacheError, match="bits must be a whole number, got '8'"):
        write_checkpoint(None, "8", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_configurations_are_at_the_top_of_the_package():
    """README: the configurations engine and replays share are ``ec.<Name>``, as their notes write them."""
    from expertcache import config

    for name in ("CacheConfig", "PrefetchConfig", "MissConfig", "HostConfig", "LinkConfig", "SamplingConfig",
                 "ServeConfig"):  # fmt: skip
        assert getattr(ec, name) is getattr(config, name) and name in ec.__all__
    assert ec.PrefetchConfig("recorded", deterministic=True).when == "always"


def test_replay_and_run_policy_take_specs_shares_and_say_capacities_beyond_every_expert():
    """``simulate`` takes ``"lcp:rho=0.5"`` and ``"25%"``; the replays below it refused both ("unknown
    policy 'lcp:rho=0.5'"), and gave rows "at 500 experts" of a trace of 96 without a word."""
    trace = ec.default_trace()
    schedule = ec.build_schedule(trace, "layer")
    quarter = trace.num_keys // 4
    assert (
        ec.replay(schedule, "lcp:rho=0.5", "25%").misses
        == ec.replay(schedule, "lcp", quarter, rho=0.5).misses
    )
    (by_spec,) = ec.run_policy(schedule, "lcp:rho=0.5", ["25%"])
    assert by_spec.capacity == quarter and by_spec.params == {"rho": 0.5}
    with pytest.raises(ExpertcacheError, match="rho given in the spec and as a keyword"):
        ec.replay(schedule, "lcp:rho=0.5", 24, rho=0.3)
    with pytest.warns(ec.ExpertcacheWarning, match=f"capacity 500 is more than all {trace.num_keys} experts"):
        (beyond,) = ec.run_policy(schedule, "lru", [500])
    assert beyond.misses == ec.replay(schedule, "lru", trace.num_keys).misses


@pytest.mark.parametrize(
    "call, words",
    [
        (
            lambda t: ec.simulate(t, polices=["lru"]),
            "simulate got an unknown argument 'polices' (did you mean policies",
        ),
        (
            lambda t: ec.make_plan(t, 24, polcy="lru"),
            "make_plan got an unknown argument 'polcy' (did you mean policy",
        ),
        (
            lambda t: ec.diagnose(t, capacty=24),
            "diagnose got an unknown argument 'capacty' (did you mean capacity",
        ),
        (
            lambda t: ec.batch_requests(t, concurency=4),
            "got an unknown argument 'concurency' (did you mean concurrency",
        ),
        (lambda t: ec.run_policy(ec.build_schedule(t, "layer"), "lru", [24], sed=1), "(did you mean seed"),
    ],
)
def test_a_misspelt_keyword_of_the_trace_functions_is_one_error_naming_the_one_meant(call, words):
    """make_plan, diagnose, simulate, batch_requests and run_policy raised Python's TypeError, naming no
    alternative; load, simulate_timing and sweep said what was meant."""
    with pytest.raises(ExpertcacheError, match=re.escape(words)):
        call(ec.default_trace())


def test_reprs_say_what_an_object_is_in_a_line():
    """A Schedule printed every group (1,710 characters for the embedded trace in flat order); a
    PrefetchConfig of a predictor object looked like a registered name; policies and predictors printed
    as objects at addresses."""
    from expertcache.policy.base import Clock

    schedule = ec.build_schedule(ec.default_trace(), "flat")
    assert len(repr(schedule)) < 200 and "flat order" in repr(schedule)
    policy = ec.make_policy(
        "lru", ec.PolicyContext(capacity=8, num_layers=2, num_experts=8, top_k=2, clock=Clock())
    )
    assert repr(policy) == "<LRU policy 'lru': 0 of 8 keys>"
    predictor = ec.make_predictor("eam", ec.PredictContext(num_layers=4, num_experts=8, top_k=2))
    assert repr(predictor) == "<Eam predictor 'eam', window 1>"
    assert repr(ec.PrefetchConfig(predictor)).startswith("PrefetchConfig(predictor=<Eam predictor 'eam'")


def test_configs_check_their_values_when_made_and_name_python_arguments():
    """``CacheConfig(seed="a")`` and ``CacheConfig(profile=5)`` were kept until a run, ``ServeConfig
    (log_level="loud")`` until the server started, and ServeConfig's errors named the command line's flags
    (``--max-batch-tokens`` for ``batch_tokens``) in Python (a new user's trial)."""
    import numpy as np

    from expertcache.config import CacheConfig, ServeConfig
    from expertcache.errors import ExpertcacheError

    assert CacheConfig("lru", seed=np.int64(3)).seed == 3
    for kw, words in (
        ({"seed": "a"}, "seed must be a whole number, got 'a'"),
        ({"seed": True}, "seed must be a whole number, got True"),
        ({"policy": "static", "profile": 5}, "profile: a trace or its file, got int"),
    ):
        with pytest.raises(ExpertcacheError, match=re.escape(words)):
            CacheConfig(**kw)
    for kw, words in (
        ({"log_level": "loud"}, "log_level must be one of critical, error, warning, info, debug, trace"),
        ({"batch_tokens": 0}, "batch_tokens must be at least 1, got 0"),
        ({"kv_tokens": 0}, "kv_tokens must be at least 1"),
        ({"port": 0}, "port must be in 1..65535"),
    ):
        with pytest.raises(ExpertcacheError) as err:
            ServeConfig(**kw)
        assert words in str(err.value) and "--" not in str(err.value), err.value


def test_a_profile_as_expertcache_profile_returns_it_is_a_cost_model():
    """``make_plan(cost=ec.profile(...))`` was refused ("unknown field(s) cost, date, ..."): the profile
    object is taken as its file is, its shape checked against the trace (a new user's trial)."""
    from expertcache.costs import PROFILE_FORMAT, PROFILE_VERSION, as_cost

    trace = ec.default_trace()
    shape = {"layers": trace.num_layers, "experts": trace.num_experts, "top_k": trace.top_k}
    prof = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": shape,
            "cost": {"expert_s": 0.002, "expert_bytes": 184320}, "how": {"slow_tier": "disk"}}  # fmt: skip
    assert as_cost(prof, trace).expert_s == 0.002
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        plan = ec.make_plan(trace, "25%", cost=prof, methods=("uniform",))
    assert plan.to_dict()["source"]["slow_tier"] == "disk"
    with pytest.raises(ExpertcacheError, match="the profile given"):
        as_cost({**prof, "model": {**shape, "layers": 7}}, trace)


def test_a_models_repr_gives_its_specs_and_host_level():
    """The model's repr named the miss path and policy without their parameters, and no host level (a new
    user's trial)."""
    with ec.load(expert_memory="30%", miss="split:theta=0.5", policy="lcp", progress=False) as model:
        assert ", policy lcp, miss split:theta=0.5, cpu>" in repr(model)
    with ec.load(expert_memory="30%", host_memory="60%", slow_tier="disk", progress=False) as model:
        assert ", miss fetch, host level 57 experts (lru), cpu>" in repr(model)
    assert ": closed, " in repr(model)


def test_reprs_are_short_and_counted_right():
    """``repr(Plan)`` printed about 5 KB of candidate rows, and a trace of one sequence said "1 sequences"
    (a new user's trial)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExpertcacheWarning)
        plan = ec.make_plan(ec.default_trace(), "25%", methods=("uniform",))
    assert repr(plan) == f"<Plan {plan.describe()}>" and len(repr(plan)) < 200
    trace = ec.default_trace()
    assert ", 1 sequence, " in repr(trace.select(trace.seq_id == 0)) and ", 16 sequences, " in repr(trace)


def test_warnings_point_at_the_callers_line_however_deep_they_are_made():
    """The notes of ``simulate``, ``make_plan`` and ``diagnose`` pointed at the package's own lines
    (``errors.py:64``, ``sim/doctor.py:156``) where ``load``'s pointed at the caller's (a new user's
    trial): each at the line that called the API."""
    import inspect

    trace = ec.default_trace()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        ec.simulate(trace, ["lru"], [100000])
        ec.make_plan(trace, 1000, methods=("uniform",))
        ec.diagnose(trace, 1000)
    mine = [w for w in got if issubclass(w.category, ExpertcacheWarning)]
    assert mine and all(w.filename == __file__ for w in mine), [(w.filename, w.lineno) for w in mine]
    assert {w.lineno for w in mine} <= {line, line + 1, line + 2}


def test_one_capacity_is_refused_in_its_own_grammar():
    """``make_plan(trace, "5MiB")`` said the capacity "is not experts (24), a range (8:96:8), a share
    (25%) or all", and refused the range and "all" it offered (a new user's trial)."""
    trace = ec.default_trace()
    with pytest.raises(ExpertcacheError) as err:
        ec.make_plan(trace, "5MiB", methods=("uniform",))
    assert "is not experts (24) or a share of all experts ('25%'); a size in bytes is the timing" in str(
        err.value
    ) and "range" not in str(err.value)
    with pytest.raises(
        ExpertcacheError, match=r"'x' is not experts \(24\) or a share of all experts \('25%'\)$"
    ):
        ec.diagnose(trace, "x")
