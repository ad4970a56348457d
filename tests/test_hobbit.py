"""Low-precision copies (HOBBIT): the quantiser, the miss path's decisions, its cache policy and adaptive
prefetch, the engine running them, the accuracy they cost, and the timing simulator replaying them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import engine_fixtures
import pytest
import torch
from engine_fixtures import TOP_K, assert_exact, engine_load, greedy
from hypothesis import example, given, settings
from hypothesis import strategies as st

from expertcache.cli import main
from expertcache.costs import CostModel, quantized_bytes
from expertcache.engine.quantized import find_copy, packed_of, read_meta
from expertcache.errors import ExpertcacheError, ExpertcacheWarning, PolicyError
from expertcache.miss import FETCH, SKIPPED, MissContext, MissPathError, Need, make_miss
from expertcache.policy import PolicyContext, make_policy
from expertcache.sim.timing import simulate_timing
from expertcache.tools.quantize import quantize_model

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
reference = engine_fixtures.reference
tokenizer_dir = engine_fixtures.tokenizer_dir

FAMILIES = ("mixtral", "gpt_oss", "qwen2_moe")  # per-expert, fused transposed with biases, shared expert


@pytest.fixture(scope="module")
def quantized(ckpt):
    """``quantized(family)``: the family's tiny checkpoint with int8/int4/int2 copies beside it."""
    done = {}

    def make(family: str):
        if family not in done:
            path = ckpt(family)
            quantize_model(path, bits=(8, 4, 2), group=32, progress=False)
            done[family] = path
        return done[family]

    return make


def need(expert: int, importance: float) -> Need:
    return Need((0, expert), 1, 1.0 - importance, importance, 0, 1.0 - importance)


class _View:
    def present(self, part, key):
        return False

    def resident(self, part, key):
        return False


# ------------------------------------------------------------------------------------------------
# The quantiser
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_writes_one_file_per_precision_beside_the_checkpoint(family, quantized):
    path = quantized(family)
    for bits in (8, 4, 2):
        copy = find_copy(path, bits, 32)
        assert copy.parent == path / "expertcache-quant"
        meta = read_meta(copy)
        assert meta["bits"] == str(bits) and meta["group"] == "32"
        per_expert = sum(t["bytes"] for t in meta["tensors"].values())
        with engine_load(path) as model:
            full = model.layout.nbytes
        packed = packed_of(meta, torch.float32)
        if bits == 2:  # HQQ's: packed weights, a 16-bit scale and zero per group
            assert packed is None and meta.get("layout") is None
            plain = sum(t["bytes"] for n, t in meta["tensors"].items() if "." not in n)  # biases as they are
            assert per_expert - plain == quantized_bytes(full - plain, bits, 32, 32)  # fp32, groups of 32
            continue
        # int8 and int4: the packed checkpoints' formats, computed by the packed kernels
        assert packed is not None and packed.format == f"int{bits}"
        assert packed.group == (32 if bits == 4 else 0)
        stored = {n: b for n, (b,) in packed.tensors().items()}
        assert {n: t["bytes"] for n, t in meta["tensors"].items()} == stored
        matrices = [packed.matrix(n) for n in ("gate_up_proj", "down_proj")]
        weights = sum(r * c for r, c in matrices)
        # int8: a float32 scale per row; int4: a bfloat16 scale and minimum per group of 32 columns
        scales = sum(4 * r * (1 if bits == 8 else -(-c // 32)) for r, c in matrices)
        plain = sum(b for n, b in stored.items() if "." not in n)  # biases, float32
        assert per_expert == weights * bits // 8 + scales + plain


def test_int8_and_int4_copies_need_no_hqq(make_ckpt, monkeypatch):
    """The packed copies are written and computed without hqq; int2 says in one line that it needs it."""
    import sys

    monkeypatch.setitem(sys.modules, "hqq", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "hqq.core.quantize", None)
    path = make_ckpt("mixtral", seed=7)
    quantize_model(path, bits=(4,), group=32, progress=False)
    with engine_load(path, TOP_K + 2, miss="hobbit:bits=4,t1=-1,group=32") as model:
        greedy(model, IDS)
        assert model.stats["low_precision"] > 0
    with pytest.raises(ExpertcacheError, match="int2 copies of the experts need the optional hqq"):
        quantize_model(path, bits=(2,), group=32, progress=False)


def test_quantize_refuses_bad_requests_before_working(ckpt, tmp_path):
    path = ckpt("mixtral")
    with pytest.raises(ExpertcacheError, match="^bits must be among 8, 4, 2"):  # Python's name in Python
        quantize_model(path, bits=(3,), progress=False)
    with pytest.raises(ExpertcacheError, match="power of two"):
        quantize_model(path, bits=(4,), group=48, progress=False)
    for kwargs, needle in (  # each before any work (bits=8 is one precision, not "not iterable")
        ({"bits": ["8"]}, "bits holds str '8'; it takes whole numbers"),
        ({"bits": (4,), "group": "64"}, "group must be a whole number, got '64'"),
        ({"bits": (8,), "optimize": False}, "optimize=False is int2's (HQQ without its optimisation)"),
    ):
        with pytest.raises(ExpertcacheError, match=re.escape(needle)):
            quantize_model(path, progress=False, **kwargs)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ExpertcacheError, match="cannot write the quantised copies"):
        quantize_model(path, bits=(4,), out=blocker / "sub", progress=False)


def test_copies_say_how_they_were_made_and_the_engine_and_quality_say_which_file_ran(make_ckpt):
    """int2's two makings (HQQ optimised, or --fast) share a file: a new user measured one and read
    the other's figures. The file says which it holds, a replacement by the other is said, and the
    engine's stats (quality's line) name the file and its making."""
    pytest.importorskip("hqq")
    path = make_ckpt("mixtral", seed=3)
    lines: list[str] = []
    slow = quantize_model(path, bits=(2,), group=32, progress=False, log=lines.append)
    assert slow[0]["method"] == "hqq" and not any("replaced" in line for line in lines)
    fast = quantize_model(path, bits=(2,), group=32, optimize=False, progress=False, log=lines.append)
    assert fast[0]["method"] == "hqq-fast" and fast[0]["path"] == slow[0]["path"]
    assert any("held copies made by hqq; they are replaced by hqq-fast's" in line for line in lines)
    assert read_meta(Path(fast[0]["path"]))["method"] == "hqq-fast"
    packed = quantize_model(path, bits=(4,), group=32, progress=False)
    assert packed[0]["method"] == "round"
    with engine_load(path, TOP_K + 2, miss="hobbit:bits=2,t1=-1,group=32") as model:
        greedy(model, IDS)
        copies = [p.get("copies") for p in model.stats["parts"].values()]
    assert "int2-g32.safetensors (hqq-fast)" in copies


def test_quantize_command_prints_the_files(ckpt, capsys, tmp_path):
    rc = main(
        ["quantize", str(ckpt("olmoe")), "--bits", "4", "--group", "32", "--out", str(tmp_path), "--json"]
    )
    got = capsys.readouterr()
    out = json.loads(got.out)
    assert rc == 0 and out[0]["bits"] == 4 and (tmp_path / "int4-g32.safetensors").is_file()
    assert out[0]["bytes_per_expert"] < out[0]["full_bytes_per_expert"] / 4
    # --out is not where the engine looks: said, with where it does (a new user lost the copies there)
    assert "note: the engine looks for copies in" in got.err and "expertcache-quant" in got.err
    assert main(["quantize", str(ckpt("olmoe")), "--bits", "8", "--group", "32", "--out", str(tmp_path)]) == 2
    assert "--group applies to int4 and int2 only" in capsys.readouterr().err
    # an int8 copy has one scale a row: no group in its record (it said 64, a new user's trial)
    assert main(["quantize", str(ckpt("olmoe")), "--bits", "8", "4", "--out", str(tmp_path), "--json"]) == 0
    records = {r["bits"]: r for r in json.loads(capsys.readouterr().out)}
    assert records[8]["group"] is None and records[4]["group"] == 64


def test_missing_copies_say_how_to_make_them(ckpt):
    with pytest.raises(MissPathError, match="expertcache quantize .* --bits 2 --group 16"):
        engine_load(ckpt("mixtral"), TOP_K + 2, miss="hobbit:bits=2,group=16")


# ------------------------------------------------------------------------------------------------
# The miss path's decisions and its policy
# ------------------------------------------------------------------------------------------------
class TestHobbitDecisions:
    def test_importance_thresholds(self):
        path = make_miss("hobbit", MissContext(2, 8, 4))
        low = path.low_route
        routes = path.decide(0, [need(0, 0.0), need(1, 0.6), need(2, 0.61), need(3, 0.95)], _View())
        assert routes == [FETCH, FETCH, low, low]  # s <= t1 full, then low precision (no skip asked)
        skipping = make_miss("hobbit:skip=1", MissContext(2, 8, 4))
        assert skipping.decide(0, [need(3, 0.95)], _View()) == [SKIPPED]
        everything_low = make_miss("hobbit:t1=-1", MissContext(2, 8, 4))
        assert everything_low.decide(0, [need(0, 0.0)], _View()) == [everything_low.low_route]
        assert low.lossy and low.parts == ("int4",)

    def test_the_budget_is_shared_between_the_two_caches(self):
        path = make_miss("hobbit:bits=2,low_share=0.5", MissContext(2, 8, 4))
        assert path.capacities(1000, {"full": 100, "int2": 20}) == {"full": 5, "int2": 16}  # at most L*E

    @pytest.mark.parametrize(
        "spec, words",
        [
            ("hobbit:bits=3", "bits must be 8, 4 or 2"),
            ("hobbit:t1=1.5", "t1 must be in"),
            ("hobbit:t1=0.8,t2=0.5", "at least t1"),
            ("hobbit:skip=2", "skip is 0 or 1"),
            ("hobbit:low_share=1", "low_share must be"),
            ("hobbit:group=50", "power of two"),
        ],
    )
    def test_bad_parameters(self, spec, words):
        with pytest.raises(MissPathError, match=words):
            make_miss(spec, MissContext(2, 8, 4))


class TestHobbitPolicy:
    def test_hand_traced_score(self):
        # one layer of 2 + ... : cap 2, L = 2. Sequence 0: token 0 uses a = (0,0) twice over two groups
        # (F 2, H 2, last 1), token 1 uses b = (0,1) once (F 1, H 1, last 1); at token 2, layer 0, T = 3:
        # score(a) = .25 * (2/3) + .25 * (2/3) + .25 * (2/3) + .25 * 1 = 0.75
        # score(b) = .25 * (2/3) + .25 * (1/3) + .25 * (1/3) + .25 * 1 = 0.5833 -> b is evicted
        ctx = PolicyContext(capacity=2, num_layers=2, num_experts=4)
        policy = make_policy("hobbit", ctx)
        from expertcache.cache import Residency

        res, clock = Residency(policy), policy.clock
        for token, expert in ((0, 0), (1, 0), (1, 1)):
            clock.token, clock.layer = token, 0
            res.admit([(0, expert)])
        clock.token = 2
        assert policy.score((0, 0)) == pytest.approx(0.75) and policy.score((0, 1)) == pytest.approx(7 / 12)
        assert res.admit([(0, 2)]) == [((0, 2), (0, 1))]

    def test_layer_distance_favours_the_layers_coming_next(self):
        ctx = PolicyContext(capacity=2, num_layers=4, num_experts=4)
        policy = make_policy("hobbit", ctx, w_lru=0.0, w_lfu=0.0, w_lhu=0.0, w_fld=1.0)
        policy.clock.layer = 1
        assert policy.score((2, 0)) > policy.score((0, 0))  # layer 2 comes next, layer 0 comes last

    @settings(max_examples=60, deadline=None)
    @given(
        weights=st.sampled_from(
            [(0.25,) * 4, (0.5, 0.0, 0.25, 0.25), (0.0, 0.0, 0.0, 1.0), (0.1, 0.6, 0.3, 0.0)]
        ),
        steps=st.lists(  # (a new sequence if 2, tokens to advance, the group's keys as L * E ids)
            st.tuples(
                st.integers(0, 2), st.integers(0, 2), st.sets(st.integers(0, 11), min_size=1, max_size=4)
            ),
            min_size=1,
            max_size=40,
        ),
    )
    # a sequence whose first request comes after tokens have passed (CI drew it): the policy counts from it
    @example(weights=(0.25,) * 4, steps=[(0, 2, {3}), (0, 1, {0}), (0, 1, {4, 5}), (0, 2, {2, 5})])
    def test_every_victim_is_the_formula_s_lowest_score(self, weights, steps):
        """Against HOBBIT's formula written out key by key (no arrays): the victim is the resident key of
        the lowest score, ties to the least recently used, then the lowest key; records restart with each
        sequence; pinned keys (the group being served) are never chosen."""
        L, E, cap = 3, 4, 5
        names = ("w_lru", "w_lfu", "w_lhu", "w_fld")
        ctx = PolicyContext(capacity=cap, num_layers=L, num_experts=E)
        policy = make_policy("hobbit", ctx, **dict(zip(names, weights, strict=True)))
        clock, resident, rec = policy.clock, set(), {}  # rec: key -> (1 + last use, uses, served)
        seq = token = 0
        start = None  # the policy counts a sequence's tokens from the first it sees of it

        def score(key, layer: int) -> float:
            last, uses, served = rec.get(key, (0, 0, 0))
            near = 1.0 - ((key[0] - layer) % L) / L
            t = token - start + 1
            return (weights[0] * last + weights[1] * uses + weights[2] * served) / t + weights[3] * near

        for new_seq, advance, ids in steps:
            token += advance
            if new_seq == 2:  # a new sequence: the records restart
                seq, start, rec = seq + 1, token, {}
            start = token if start is None else start
            layer = min(ids) // E
            clock.seq, clock.token, clock.layer = seq, token, layer
            keys = sorted({(layer, i % E) for i in ids})
            policy.on_request(keys)
            for key in keys:
                _, uses, served = rec.get(key, (0, 0, 0))
                rec[key] = (token - start + 1, uses + 1, served + 1)
            for key in keys:
                if key in resident:
                    policy.on_hit(key)
                    continue
                want = None  # a group holds at most E < cap keys: there is always one to evict
                if len(resident) >= cap:
                    free = [k for k in resident if k not in keys]
                    want = min(free, key=lambda k: (score(k, layer), rec.get(k, (0,))[0], k))  # noqa: B023
                assert policy.victim(key, set(keys)) == want
                if want is not None:
                    policy.on_evict(want)
                    resident.discard(want)
                policy.on_insert(key)
                resident.add(key)
            assert all(key in policy for key in resident) and len(policy) == len(resident)

    def test_weights_must_sum_to_one(self):
        with pytest.raises(PolicyError, match="sum to 1"):
            make_policy("hobbit", PolicyContext(capacity=2, num_layers=2, num_experts=4), w_lru=0.5)


# ------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_full_precision_thresholds_are_exact(family, quantized, reference):
    """t1 = 1: every miss is fetched whole: the low-precision cache is never used, the output exact."""
    path = quantized(family)
    with engine_load(path, TOP_K + 2, miss="hobbit:t1=1,t2=1,group=32") as model:
        assert_exact(greedy(model, IDS), reference(path, IDS))
        assert model.stats["low_precision"] == 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_low_precision_misses_stay_close_and_are_counted(family, bits, quantized, reference):
    path = quantized(family)
    with engine_load(
        path,
        TOP_K + 2,
        miss=f"hobbit:bits={bits},t1=-1" + (",group=32" if bits != 8 else ""),
        prefetch="next-gate",
    ) as model:
        seq, logits = greedy(model, IDS)
        stats = model.stats
    ref_seq, ref_logits = reference(path, IDS)
    assert stats["low_precision"] == stats["misses"] > 0 and stats["lossy"]
    assert stats["part_misses"][f"int{bits}"] > 0
    # the first step's logits (the same prompt for both) differ by the quantisation error only
    err = float((logits[0] - ref_logits[0]).abs().max() / ref_logits[0].abs().max())
    assert err < {8: 0.02, 4: 0.3, 2: 1.0}[bits]


def test_int8_everywhere_keeps_the_tokens(quantized, reference):
    path = quantized("mixtral")
    with engine_load(path, TOP_K + 2, miss="hobbit:bits=8,t1=-1") as model:
        assert greedy(model, IDS)[0].tolist() == reference(path, IDS)[0].tolist()


def test_skipped_experts_are_not_computed(quantized, reference):
    path = quantized("mixtral")
    with engine_load(path, TOP_K + 2, miss="hobbit:t1=0,t2=0.1,skip=1,group=32") as model:
        greedy(model, IDS)
        stats = model.stats
    assert stats["skipped"] > 0 and stats["low_precision"] >= 0
    assert stats["requests"] == stats["hits"] + stats["misses"]


def test_adaptive_prefetch_runs_and_changes_nothing_exact(quantized, reference):
    path = quantized("mixtral")
    with engine_load(path, TOP_K + 1, prefetch="adaptive") as model:
        assert_exact(greedy(model, IDS), reference(path, IDS))
        # its default window 3, cut to what the model's MoE layers leave room for
        assert model.stats["prefetch_issued"] > 0 and model.predictor.window == min(3, model.num_layers - 1)


def test_adaptive_walk_stops_at_the_first_layer_with_a_miss():
    from expertcache.cache.step import StepDriver

    class Cache:
        limit, primary = 2, "full"
        policy = type("P", (), {"clock": None})()

        def present(self, part, key):
            return key in {(1, 0), (1, 1), (3, 0), (3, 1)}

    driver = StepDriver.__new__(StepDriver)
    driver.cache = Cache()
    walked = driver._up_to_first_miss({1: [0, 1], 2: [5, 0], 3: [0, 1]})
    assert walked == {1: [0, 1], 2: [5, 0]}  # layer 1 cached: go on; layer 2 misses: stop there


# ------------------------------------------------------------------------------------------------
# What it costs, and the timing simulator
# ------------------------------------------------------------------------------------------------
def test_quality_of_an_exact_path_is_exact_and_of_int8_close(quantized, tokenizer_dir):
    from expertcache.tools.quality import measure

    path = quantized("mixtral")
    texts = ["The quick brown fox jumps over the lazy dog.", "hello world, hello experts, hello cache"]
    exact = measure(path, "fetch", expert_memory="25%", texts=texts, tokens=40)
    assert exact["perplexity_change"] == 0.0 and exact["top1_agreement"] == 1.0
    assert exact["logits_identical"] == 1.0 and exact["logits_max_difference"] == 0.0
    assert exact["prefill_logits_identical"] == 1.0 and exact["prefill_logits_max_difference"] == 0.0
    low = measure(path, "hobbit:bits=8,t1=-1", expert_memory="25%", texts=texts, tokens=40)
    assert low["low_precision_share"] > 0 and abs(low["perplexity_change"]) < 0.05
    assert low["prefill_logits_identical"] < 1 and 0 < low["prefill_logits_max_difference"] < 1
    assert low["tokens"] == exact["tokens"] > 0 and math.isfinite(low["perplexity"])


def test_quality_command_refuses_a_bad_path_before_loading(capsys):
    assert main(["quality", "--miss", "hobbit:bits=5"]) == 2
    assert "bits must be 8, 4 or 2" in capsys.readouterr().err


def test_quality_api_refuses_an_unknown_reference_implementation_before_loading(monkeypatch):
    import expertcache.engine
    from expertcache.tools.quality import measure

    monkeypatch.setattr(expertcache.engine, "load", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(
        ExpertcacheError, match=r"reference_implementation must be one of grouped_mm, eager, "
    ):
        measure(None, "fetch", reference_implementation="fast")


@pytest.mark.parametrize("policy", ["lru", "hobbit"])
def test_recorded_trace_replays_to_the_engine_counts(policy, quantized):
    path = quantized("mixtral")
    miss = "hobbit:bits=4,group=32,skip=1,t2=0.8"
    cap = TOP_K + 2
    with engine_load(path, cap, policy, miss=miss) as model:
        greedy(model, IDS)
        greedy(model, torch.tensor([engine_fixtures.PROMPT_B]))
        trace, stats, layout, part = model.trace(), model.stats, model.layout, model.parts["int4"]
        capacities = model.capacities
    # the simulator sizes a copy from the cost model (within a few % of the engine's padded slot) ...
    cost = CostModel(expert_bytes=layout.nbytes, weight_bits=32, chunk_bytes=None)
    assert abs(quantized_bytes(layout.nbytes, 4, 32, 32) - part.slot_bytes()) / part.slot_bytes() < 0.05
    # ... and takes the engine's part capacities, recorded in the trace, to replay it exactly
    assert json.loads(trace.meta["capacities"]) == capacities
    sim = simulate_timing(trace, cap, cache=policy, miss=miss, cost=cost, capacities=capacities)
    for key in ("requests", "hits", "misses", "low_precision", "skipped"):
        assert stats[key] == sim.cache[key], key
    assert sim.capacities == capacities


def test_the_hint_for_missing_int8_copies_is_a_command_that_runs(tmp_path, capsys):
    """It named --group 64, which quantize refuses for int8 (one scale a row); group= is int4's and
    int2's (a trial's finding)."""
    import re
    import shlex

    from expertcache.cli import main

    model = tmp_path / "m"
    assert main(["model", "synth", "--family", "mixtral", "-o", str(model), "--hidden", "64"]) == 0
    capsys.readouterr()
    run = [
        "generate",
        "--model",
        str(model),
        "--prompt",
        "hi",
        "--max-new-tokens",
        "2",
        "--expert-memory",
        "50%",
    ]
    assert main([*run, "--miss", "hobbit:bits=8"]) == 2
    err = capsys.readouterr().err
    hint = re.search(r"build them once with '([^']+)'", err).group(1)
    assert "--group" not in hint and "(group" not in err
    assert main(shlex.split(hint)[1:]) == 0
    capsys.readouterr()
    assert main([*run, "--miss", "hobbit:bits=8"]) == 0
    capsys.readouterr()
    # int8 copies have no group: a spec's group is refused, as quantize --bits 8 --group 32 refuses it
    # (it was taken and dropped without a word)
    assert main([*run, "--miss", "hobbit:bits=8,group=32"]) == 2
    assert "group applies to int4 and int2 copies only" in capsys.readouterr().err
    folder = find_copy(model, 8, 64).parent
    for f in folder.glob("int8-*.safetensors"):
        f.unlink()
    assert main(["quantize", str(model), "--bits", "8", "4", "--group", "32"]) == 0
    assert sorted(f.name for f in folder.glob("*.safetensors")) == [
        "int4-g32.safetensors",
        "int8-g64.safetensors",
    ]
    capsys.readouterr()
    assert main([*run, "--miss", "hobbit:bits=8"]) == 0


def test_a_float32_runs_trace_sizes_low_precision_copies_of_32_bit_weights(quantized):
    """``timing --miss hobbit`` on the trace of a float32 run that fetched: the default costs took 16-bit
    weights, so each int4 copy was priced at twice its bytes and the budget held half of them (a new
    user's trial). The trace records its weights' width, and the what-if lays the budget out as the
    engine does."""
    path = quantized("mixtral")
    miss = "hobbit:bits=4,group=32,t1=-1"
    cap = TOP_K + 4
    with engine_load(path, cap, "lru", miss=miss) as model:
        capacities = model.capacities
    with engine_load(path, cap, "lru") as model:
        greedy(model, IDS)
        trace = model.trace()
    assert trace.meta["weight_bits"] == 32
    with pytest.warns(ExpertcacheWarning, match="priced by the default costs"):
        sim = simulate_timing(trace, cap, miss=miss)
    assert sim.capacities == capacities
