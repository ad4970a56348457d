"""The trace format, its validation, the synthetic generators, trace statistics and schedules."""

from __future__ import annotations

import io
import math
import re
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from expertcache.cache.schedule import build_schedule
from expertcache.errors import ExpertcacheError, TraceError
from expertcache.trace import GENERATORS, Trace, layer_entropy, load_trace, reuse_between_tokens, summary
from expertcache.trace.synth import synthesize

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
QWEN = SHARED_TRACES / "qwen15_moe_a27b_chat.npz"


def tiny_experts() -> np.ndarray:
    """3 tokens, 2 layers, top-2 of 4 experts, one unknown entry."""
    return np.array([[[0, 1], [2, 3]], [[1, 2], [3, -1]], [[3, 0], [0, 1]]], dtype=np.int16)


# --------------------------------------------------------------------------------------- format


class TestSaveLoad:
    def test_round_trip_keeps_everything(self, tmp_path: Path) -> None:
        ex = tiny_experts()
        trace = Trace(
            ex,
            4,
            weights=np.linspace(0, 1, ex.size, dtype=np.float32).reshape(ex.shape),
            seq_id=np.array([0, 0, 1], dtype=np.int32),
            is_prefill=np.array([1, 0, -1], dtype=np.int8),
            token_id=np.array([7, -1, 9], dtype=np.int32),
            predicted=np.where(ex > 1, ex, -1),
            predicted_from=np.stack([np.where(ex > 1, ex, -1), np.full_like(ex, -1), ex], axis=2),
            meta={"model": "tiny", "alpha": 1.5, "layer_ids": np.array([3, 7])},
        )
        path = tmp_path / "t.npz"
        trace.save(path)
        loaded = load_trace(path)
        assert loaded.source == str(path)
        assert loaded.num_experts == 4
        assert (loaded.num_tokens, loaded.num_layers, loaded.top_k) == (3, 2, 2)
        for name, dtype in [
            ("experts", np.int16),
            ("weights", np.float32),
            ("seq_id", np.int32),
            ("is_prefill", np.int8),
            ("token_id", np.int32),
            ("predicted", np.int16),
            ("predicted_from", np.int16),
        ]:
            assert getattr(loaded, name).dtype == dtype
            assert np.array_equal(getattr(loaded, name), getattr(trace, name))
        assert loaded.meta["model"] == "tiny"
        assert loaded.meta["alpha"] == 1.5
        assert np.array_equal(loaded.meta["layer_ids"], [3, 7])
        assert (loaded.meta["num_layers"], loaded.meta["top_k"]) == (2, 2)  # written by save

    def test_optional_arrays_stay_absent(self, tmp_path: Path) -> None:
        path = tmp_path / "bare.npz"
        Trace(tiny_experts(), 4).save(path)
        loaded = load_trace(path)
        assert loaded.weights is None and loaded.seq_id is None
        assert loaded.is_prefill is None and loaded.token_id is None
        assert np.array_equal(loaded.experts, tiny_experts())

    def test_generated_trace_round_trip(self, tmp_path: Path) -> None:
        trace = synthesize(
            "sticky", tokens=50, layers=3, experts=6, top_k=2, seed=4, sequences=2, prompt_len=3
        )
        trace.save(tmp_path / "s.npz")
        loaded = load_trace(tmp_path / "s.npz")
        assert np.array_equal(loaded.experts, trace.experts)
        assert np.array_equal(loaded.seq_id, trace.seq_id)
        assert np.array_equal(loaded.is_prefill, trace.is_prefill)
        assert {k: loaded.meta[k] for k in trace.meta} == trace.meta

    def test_dtypes_are_canonicalised(self) -> None:
        trace = Trace(tiny_experts().astype(np.int64), 4, seq_id=np.zeros(3, dtype=np.int64))
        assert trace.experts.dtype == np.int16 and trace.seq_id.dtype == np.int32
        assert trace.num_keys == 8

    def test_unwritable_path(self, tmp_path: Path) -> None:
        path = tmp_path / "no" / "such" / "dir" / "t.npz"
        with pytest.raises(TraceError, match="cannot write"):
            Trace(tiny_experts(), 4).save(path)

    def test_meta_that_cannot_be_stored_is_refused_or_round_trips(self, tmp_path: Path) -> None:
        path = tmp_path / "m.npz"
        trace = Trace(tiny_experts(), 4, meta={"note": None})
        try:
            trace.save(path)
        except ExpertcacheError:
            return  # refusing at save time is a fine answer
        assert load_trace(path).meta.get("note") is None  # None is stored as absent

    def test_object_meta_is_stored_as_text(self, tmp_path: Path) -> None:
        path = tmp_path / "m.npz"
        Trace(tiny_experts(), 4, meta={"cfg": {"a": 1}, "tags": ["x", 2]}).save(path)
        meta = load_trace(path).meta
        assert meta["cfg"] == "{'a': 1}"
        assert list(meta["tags"]) == ["x", "2"]


def good_arrays() -> dict[str, np.ndarray]:
    return {"experts": tiny_experts(), "num_experts": np.int32(4)}


def nan_weights() -> np.ndarray:
    w = np.full((3, 2, 2), 0.5, dtype=np.float32)
    w[1, 0, 1] = np.nan
    return w


BAD_FILES = {
    "missing experts": ({"experts": None}, "missing array 'experts'"),
    "missing num_experts": ({"num_experts": None}, "missing scalar 'num_experts'"),
    "num_experts not a scalar": ({"num_experts": np.array([4])}, "'num_experts' must be an integer scalar"),
    "num_experts float": ({"num_experts": np.float64(4)}, "'num_experts' must be an integer scalar"),
    "wrong rank": ({"experts": np.zeros((3, 2), np.int16)}, "must have 3 dimensions"),
    "float experts": ({"experts": tiny_experts().astype(np.float32)}, "must hold integers"),
    "id >= num_experts": ({"num_experts": np.int32(3)}, "expert id 3 out of range for num_experts=3"),
    "id < -1": ({"experts": np.full((3, 2, 2), -2, np.int16)}, "outside -1..32767"),
    "empty": ({"experts": np.zeros((0, 2, 2), np.int16)}, "is empty"),
    "top-k above num_experts": (
        {"experts": np.zeros((3, 2, 3), np.int16), "num_experts": np.int32(2)},
        "top-k 3 exceeds num_experts 2",
    ),
    "seq_id shape": ({"seq_id": np.zeros(4, np.int32)}, "'seq_id' has shape (4,), expected (3,)"),
    "seq_id float": ({"seq_id": np.zeros(3, np.float32)}, "'seq_id' has dtype float32"),
    "seq_id negative": ({"seq_id": np.array([0, -1, 1], np.int32)}, "'seq_id' must be non-negative"),
    "is_prefill shape": ({"is_prefill": np.zeros((3, 1), np.int8)}, "'is_prefill' has shape (3, 1)"),
    "is_prefill values": ({"is_prefill": np.array([0, 1, 2], np.int8)}, "'is_prefill' must hold only"),
    "weights shape": ({"weights": np.zeros((3, 2, 1), np.float32)}, "'weights' has shape (3, 2, 1)"),
    "weights NaN": (
        {"weights": nan_weights()},
        "'weights' has NaN or infinite values where the expert is known (token 1, layer 0, slot 1)",
    ),
    "token_id shape": ({"token_id": np.zeros(2, np.int32)}, "'token_id' has shape (2,)"),
    "predicted_from rank": (
        {"predicted_from": np.zeros((3, 2, 2), np.int16)},
        "'predicted_from' has shape (3, 2, 2), expected (3, 2, W, 2), W at least 1",
    ),
    "predicted_from no sources": ({"predicted_from": np.zeros((3, 2, 0, 2), np.int16)}, "W at least 1"),
    "predicted_from ids": (
        {"predicted_from": np.full((3, 2, 3, 2), 4, np.int16)},
        "'predicted_from' has expert ids outside -1..3",
    ),
    "expert twice in a top-k": (
        {"experts": np.array([[[0, 1, 2], [2, 3, 0]], [[1, 2, 3], [3, -1, 3]]], np.int16)},
        "expert 3 appears twice in the top-k of token 1, layer 1 (slots 0 and 2;",
    ),
}


def test_unknown_slots_may_repeat_and_a_repeated_expert_is_refused_everywhere(tmp_path: Path, capsys) -> None:
    """-1 (unknown) may fill several slots of a top-k; a known expert twice is refused on load, by every
    command that reads a trace (sim and trace info took it, and in flat order counted it as a hit)."""
    from expertcache.cli import main

    experts = tiny_experts()
    experts[1, 1] = [-1, -1]
    assert Trace(experts, 4).top_k == 2
    experts[2, 0] = [3, 3]
    path = tmp_path / "twice.npz"
    np.savez(path, experts=experts, num_experts=np.int32(4))
    for argv in (["sim", str(path)], ["sim", str(path), "--order", "flat"], ["trace", "info", str(path)],
                 ["timing", "--trace", str(path)]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "expert 3 appears twice in the top-k of token 2, layer 0 (slots 0 and 1" in err


class TestValidation:
    @pytest.mark.parametrize("case", list(BAD_FILES))
    def test_bad_file(self, tmp_path: Path, case: str) -> None:
        changes, fragment = BAD_FILES[case]
        arrays = {**good_arrays(), **changes}
        path = tmp_path / "bad.npz"
        np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
        with pytest.raises(TraceError) as err:
            load_trace(path)
        assert str(path) in str(err.value)
        assert fragment in str(err.value)

    def test_nan_weights_of_unknown_entries_are_taken_and_read_as_zero(self, tmp_path: Path) -> None:
        """Real recordings have gaps: an entry with expert id -1 may carry a NaN weight."""
        arrays = good_arrays()
        experts, weights = arrays["experts"].copy(), nan_weights()
        experts[1, 0, 1] = -1  # the NaN's entry is unknown
        path = tmp_path / "gaps.npz"
        np.savez(path, **{**arrays, "experts": experts, "weights": weights})
        trace = load_trace(path)
        assert trace.weights[1, 0, 1] == 0 and np.isfinite(trace.weights).all()
        assert trace.weights[0, 0, 0] == weights[0, 0, 0]

    def test_good_file_loads(self, tmp_path: Path) -> None:
        path = tmp_path / "good.npz"
        np.savez(path, **good_arrays())
        assert load_trace(path).num_experts == 4

    def test_missing_file(self, tmp_path: Path) -> None:
        for path, says in ((tmp_path / "absent.npz", "no such trace file"), (tmp_path, "a directory, not a")):
            with pytest.raises(TraceError, match=says) as err:  # a directory is not a trace file either
                load_trace(path)
            assert str(path) in str(err.value)

    def test_truncated_and_empty_zip(self, tmp_path: Path) -> None:
        good = tmp_path / "good.npz"
        Trace(tiny_experts(), 4).save(good)
        for name, data in (("trunc.npz", good.read_bytes()[:60]), ("empty.npz", b"")):
            path = tmp_path / name
            path.write_bytes(data)
            with pytest.raises(TraceError, match="not a readable .npz trace") as err:
                load_trace(path)
            assert str(path) in str(err.value)

    @pytest.mark.parametrize("what", ["text", "npy"])
    def test_not_an_npz(self, tmp_path: Path, what: str) -> None:
        path = tmp_path / ("notes.dat" if what == "text" else "experts.npy")
        if what == "text":
            path.write_text("these are not the routing decisions you are looking for\n")
        else:
            np.save(path, tiny_experts())  # a bare .npy array is not a trace archive
        with pytest.raises(TraceError, match="not a readable .npz trace") as err:
            load_trace(path)
        assert str(path) in str(err.value)
        assert "pickle" not in str(err.value)

    def test_corrupt_member_is_a_trace_error(self, tmp_path: Path) -> None:
        path = tmp_path / "corrupt.npz"
        path.write_bytes(corrupt_deflate_npz())
        with pytest.raises(TraceError) as err:
            load_trace(path)
        assert str(path) in str(err.value)


def corrupt_deflate_npz() -> bytes:
    """A valid-looking .npz whose 'experts' member has an invalid deflate block (type 3)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, arr in good_arrays().items():
            member = io.BytesIO()
            np.lib.format.write_array(member, np.asanyarray(arr))
            z.writestr(f"{name}.npy", member.getvalue())
    data = bytearray(buf.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        info = z.getinfo("experts.npy")
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start : start + info.compress_size] = b"\xff" * info.compress_size
    return bytes(data)


@pytest.mark.skipif(
    not QWEN.is_file(), reason=f"real trace not found at {QWEN} (the shared/ directory beside the repository)"
)
def test_real_trace_loads() -> None:
    trace = load_trace(QWEN)
    assert trace.experts.shape == (1096, 24, 4)
    assert trace.num_experts == 60
    assert trace.experts.dtype == np.int16 and trace.weights.shape == (1096, 24, 4)
    assert (trace.experts >= 0).all()  # "no missing entries"
    assert np.unique(trace.seq_id).size == 6
    assert trace.top_k == int(trace.meta["top_k"]) == 4


# --------------------------------------------------------------------------------------- generators

SMALL = {
    "zipf": {"tokens": 60, "layers": 3, "experts": 6, "top_k": 2},
    "uniform": {"tokens": 60, "layers": 3, "experts": 6, "top_k": 2},
    "sticky": {"tokens": 60, "layers": 3, "experts": 6, "top_k": 2},
    "cyclic": {"tokens": 60, "layers": 3, "experts": 6},
    "partition": {"tokens": 60, "layers": 3, "experts": 6, "layer": 1},
}


class TestGenerators:
    def test_every_generator_is_covered(self) -> None:
        assert set(SMALL) == set(GENERATORS)

    @pytest.mark.parametrize("kind", list(SMALL))
    def test_shapes_and_dtypes(self, kind: str) -> None:
        trace = synthesize(kind, **SMALL[kind])
        k = SMALL[kind].get("top_k", 1)
        assert trace.experts.shape == (60, 3, k) and trace.experts.dtype == np.int16
        assert trace.num_experts == 6
        assert trace.seq_id.dtype == np.int32 and trace.seq_id.shape == (60,)
        assert trace.is_prefill.dtype == np.int8 and trace.is_prefill.shape == (60,)
        assert ((trace.experts >= 0) & (trace.experts < 6)).all()
        assert trace.meta["generator"] == kind

    @pytest.mark.parametrize("kind", ["zipf", "uniform", "sticky"])
    def test_seeded(self, kind: str) -> None:
        one = synthesize(kind, seed=5, **SMALL[kind])
        two = synthesize(kind, seed=5, **SMALL[kind])
        assert np.array_equal(one.experts, two.experts)
        assert not np.array_equal(one.experts, synthesize(kind, seed=6, **SMALL[kind]).experts)

    @pytest.mark.parametrize("kind", ["cyclic", "partition"])
    def test_a_kind_that_draws_nothing_takes_no_seed(self, kind: str) -> None:
        """A seed given to these was taken and changed nothing (a new user compared two seeds' traces)."""
        with pytest.raises(ExpertcacheError, match=f"trace kind '{kind}' does not take seed"):
            synthesize(kind, seed=5, **SMALL[kind])

    @pytest.mark.parametrize("kind", ["zipf", "uniform", "sticky"])
    def test_distinct_experts_per_row(self, kind: str) -> None:
        trace = synthesize(kind, tokens=300, layers=4, experts=5, top_k=3, seed=1)
        rows = np.sort(trace.experts.reshape(-1, 3), axis=1)
        assert (np.diff(rows, axis=1) > 0).all()

    def test_zipf_popularity(self) -> None:
        a, b, experts, tokens = 1.2, 0.5, 8, 20_000
        trace = synthesize("zipf", tokens=tokens, layers=3, experts=experts, top_k=1, a=a, b=b, seed=2)
        w = np.array([1 / (j + b) ** a for j in range(1, experts + 1)])
        p = w / w.sum()  # p_1 = 0.314 for these parameters
        for layer in range(3):
            freq = np.bincount(trace.experts[:, layer, 0], minlength=experts) / tokens
            ranked = np.sort(freq)[::-1]
            assert abs(ranked[0] - p[0]) < 0.015  # sd of a frequency here is ~0.0033
            assert np.abs(ranked - p).max() < 0.015

    def test_zipf_layers_rank_experts_differently(self) -> None:
        trace = synthesize("zipf", tokens=3000, layers=8, experts=8, top_k=1, a=1.5, seed=0)
        top = {int(np.bincount(trace.experts[:, layer, 0]).argmax()) for layer in range(8)}
        assert len(top) > 1

    def test_uniform_entropy_near_maximum(self) -> None:
        trace = synthesize("uniform", tokens=4000, layers=3, experts=8, top_k=2, seed=3)
        assert np.all(np.abs(layer_entropy(trace) - 3.0) < 0.01)

    def test_sticky_reuse_grows_with_stickiness(self) -> None:
        def reuse(s: float) -> float:
            t = synthesize("sticky", tokens=3000, layers=4, experts=8, top_k=2, stickiness=s, seed=9)
            return float(reuse_between_tokens(t).mean())

        r = {s: reuse(s) for s in (0.0, 0.3, 0.6, 0.9)}
        assert r[0.0] < r[0.3] < r[0.6] < r[0.9]
        for s in (0.3, 0.6, 0.9):  # a repeat reuses everything, a fresh draw reuses r(0)
            assert abs(r[s] - (s + (1 - s) * r[0.0])) < 0.05
        always = synthesize("sticky", tokens=50, layers=2, experts=8, top_k=2, stickiness=1.0, seed=1)
        assert (always.experts == always.experts[0]).all()

    def test_cyclic(self) -> None:
        trace = synthesize("cyclic", tokens=25, layers=3, experts=4)
        assert trace.top_k == 1
        expected = np.arange(25) % 4
        for layer in range(3):
            assert np.array_equal(trace.experts[:, layer, 0], expected)

    def test_partition(self) -> None:
        trace = synthesize("partition", tokens=25, layers=4, experts=5, layer=2)
        assert trace.top_k == 1
        assert np.array_equal(trace.experts[:, 2, 0], np.arange(25) % 5)
        assert (trace.experts[:, [0, 1, 3], 0] == 0).all()

    def test_sequences_and_prompts(self) -> None:
        trace = synthesize("zipf", tokens=10, layers=2, experts=4, top_k=1, sequences=3, prompt_len=2)
        # contiguous near-equal requests: token i belongs to request i * 3 // 10
        assert trace.seq_id.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert trace.is_prefill.tolist() == [1, 1, 0, 0, 1, 1, 0, 1, 1, 0]
        with pytest.raises(ExpertcacheError, match="a prompt length of 5 leaves no generated token"):
            synthesize("uniform", tokens=6, layers=1, experts=3, top_k=1, sequences=2, prompt_len=5)
        plain = synthesize("zipf", tokens=5, layers=1, experts=3, top_k=1)
        assert plain.seq_id.tolist() == [0] * 5 and plain.is_prefill.tolist() == [0] * 5

    @pytest.mark.parametrize(
        ("kind", "params"),
        [
            ("zipf", {"tokens": 0}),
            ("zipf", {"layers": 0}),
            ("zipf", {"experts": 0}),
            ("zipf", {"top_k": 0}),
            ("zipf", {"experts": 4, "top_k": 5}),
            ("zipf", {"experts": 40_000, "top_k": 1}),
            ("zipf", {"a": -0.5}),
            ("zipf", {"b": -1.0}),
            ("zipf", {"tokens": 5, "sequences": 6}),
            ("zipf", {"sequences": 0}),
            ("zipf", {"prompt_len": -1}),
            ("sticky", {"stickiness": 1.5}),
            ("sticky", {"stickiness": -0.1}),
            ("partition", {"layers": 4, "layer": 4}),
            ("partition", {"layer": -1}),
            ("cyclic", {"sequences": 2}),  # unknown parameter for this kind
            ("uniform", {"a": 1.0}),
            ("zipf", {"bogus": 1}),
            ("pareto", {}),
        ],
    )
    def test_bad_parameters(self, kind: str, params: dict[str, object]) -> None:
        with pytest.raises(ExpertcacheError):
            synthesize(kind, **{"tokens": 20, **params})


# --------------------------------------------------------------------------------------- stats


class TestStats:
    def test_layer_entropy(self) -> None:
        ex = np.array([[0, 2, 0, -1], [1, 2, -1, -1], [0, 2, 3, -1], [1, 2, -1, -1]], dtype=np.int16)
        trace = Trace(ex[:, :, None], 4)
        # layer 0: 0,1,0,1 -> 1 bit; layer 1: constant -> 0; layer 2: 0,3 (unknowns skipped) -> 1;
        # layer 3: nothing known -> NaN (no distribution to measure; trace info prints "-")
        assert layer_entropy(trace).tolist() == pytest.approx([1.0, 0.0, 1.0, np.nan], nan_ok=True)

    def test_reuse_between_tokens(self) -> None:
        ex = np.array([[0, 1], [1, 2], [1, 2], [3, 0]], dtype=np.int16)[:, None, :]
        # t1 vs t0: 1 of 2 reused; t2 vs t1: 2 of 2; t3 vs t2: 0 of 2 -> 3/6
        assert reuse_between_tokens(Trace(ex, 4)).tolist() == pytest.approx([0.5])
        # with requests [0, 0, 1, 1] only t1 vs t0 (1/2) and t3 vs t2 (0/2) count -> 1/4
        split = Trace(ex, 4, seq_id=np.array([0, 0, 1, 1]))
        assert reuse_between_tokens(split).tolist() == pytest.approx([0.25])

    def test_reuse_skips_unknown_entries(self) -> None:
        ex = np.array([[0, 1], [1, -1], [-1, -1], [0, 1]], dtype=np.int16)[:, None, :]
        # t1: known [1], reused -> 1/1; t2: nothing known; t3: [0, 1] after nothing -> 0/2 => 1/3
        assert reuse_between_tokens(Trace(ex, 2)).tolist() == pytest.approx([1 / 3])
        assert np.isnan(reuse_between_tokens(Trace(ex[:1], 2))).all()  # one token: no pair to compare

    def test_summary(self) -> None:
        ex = np.array([[0, 1], [1, 2], [1, 2], [3, 0]], dtype=np.int16)[:, None, :]
        trace = Trace(ex, 4, seq_id=np.array([0, 0, 1, 1]), is_prefill=np.array([1, 0, 1, 0]))
        # usage 0:2 1:3 2:2 3:1 of 8
        entropy = -sum(c / 8 * math.log2(c / 8) for c in (2, 3, 2, 1))
        s = summary(trace)
        assert s["source"] == "<memory>"
        assert (s["tokens"], s["layers"], s["experts"], s["top_k"]) == (4, 1, 4, 2)
        assert (s["sequences"], s["prefill_tokens"], s["unknown_entries"]) == (2, 2, 0)
        assert s["max_entropy_bits"] == 2.0
        assert s["entropy_bits"] == [round(entropy, 4)]
        assert s["mean_entropy_bits"] == pytest.approx(entropy)
        assert s["reuse"] == [0.25] and s["mean_reuse"] == pytest.approx(0.25)
        bare = summary(Trace(np.array([[[0, -1]]], dtype=np.int16), 2))
        assert (bare["sequences"], bare["prefill_tokens"], bare["unknown_entries"]) == (None, None, 1)


# --------------------------------------------------------------------------------------- schedules


def schedule_trace() -> Trace:
    """Request 0: a 3-token prompt then one decode token; request 1: a 1-token prompt, 2 decodes."""
    ex = np.array(
        [
            [[0, 1], [2, -1]],  # t0 prompt (request 0)
            [[1, 3], [2, 0]],  # t1 prompt
            [[-1, 0], [4, 2]],  # t2 prompt
            [[3, 4], [1, 0]],  # t3 decode
            [[2, 0], [3, -1]],  # t4 prompt (request 1)
            [[0, 2], [-1, -1]],  # t5 decode
            [[1, 4], [0, 3]],  # t6 decode
        ],
        dtype=np.int16,
    )
    return Trace(ex, 5, seq_id=np.array([0, 0, 0, 0, 1, 1, 1]), is_prefill=np.array([1, 1, 1, 0, 1, 0, 0]))


class TestSchedule:
    def test_layer_order_groups(self) -> None:
        s = build_schedule(schedule_trace(), "layer")
        # steps: t0-t2 (one prefill step), t3, t4 (a 1-token prompt), t5, t6; one group per layer
        assert s.groups == [
            ((0, 0), (0, 1), (0, 3)),  # layer 0 over t0..t2: 0 1 | 1 3 | - 0 -> first use 0, 1, 3
            ((1, 2), (1, 0), (1, 4)),  # layer 1 over t0..t2: 2 - | 2 0 | 4 2 -> 2, 0, 4
            ((0, 3), (0, 4)),
            ((1, 1), (1, 0)),
            ((0, 2), (0, 0)),
            ((1, 3),),
            ((0, 0), (0, 2)),
            (),  # t5 layer 1 is all unknown
            ((0, 1), (0, 4)),
            ((1, 0), (1, 3)),
        ]
        assert (s.order, s.per_layer, s.num_rounds) == ("layer", 1, 5)
        assert s.round_prefill.tolist() == [True, False, True, False, False]
        assert s.num_requests == 19 and s.max_group == 3
        # requests per (decode, prefill) x layer
        assert s.layer_requests.tolist() == [[6, 4], [5, 4]]
        assert s.future[(0, 0)] == [0, 4, 6] and s.profile[(0, 0)] == 3
        assert (1, 1) in s.future and (0, 5) not in s.profile

    def test_prompts_of_different_requests_are_separate_steps(self) -> None:
        ex = np.array([[[0]], [[1]], [[1]], [[2]]], dtype=np.int16)
        trace = Trace(ex, 3, seq_id=np.array([0, 0, 1, 1]), is_prefill=np.array([1, 1, 1, 1]))
        s = build_schedule(trace, "layer")
        assert s.groups == [((0, 0), (0, 1)), ((0, 1), (0, 2))]
        assert s.round_prefill.tolist() == [True, True]

    def test_without_prefill_flags_every_token_is_a_step(self) -> None:
        ex = np.array([[[0, 1]], [[1, 0]], [[1, 0]]], dtype=np.int16)
        s = build_schedule(Trace(ex, 2), "layer")
        assert s.groups == [((0, 0), (0, 1)), ((0, 1), (0, 0)), ((0, 1), (0, 0))]
        assert s.round_prefill.tolist() == [False, False, False]

    def test_flat_order(self) -> None:
        trace = schedule_trace()
        s = build_schedule(trace, "flat")
        # token, layer, then the K experts in stored order: one request per group
        assert s.groups[:8] == [
            ((0, 0),),
            ((0, 1),),
            ((1, 2),),
            (),
            ((0, 1),),
            ((0, 3),),
            ((1, 2),),
            ((1, 0),),
        ]
        expected = [
            ((layer, int(e)),) if e >= 0 else ()
            for t in range(7)
            for layer in range(2)
            for e in trace.experts[t, layer]
        ]
        assert s.groups == expected
        assert (s.per_layer, s.num_rounds, s.num_requests) == (2, 7, 23)
        assert s.round_prefill.tolist() == [True, True, True, False, True, False, False]
        assert s.req_group.tolist() == [g for g, keys in enumerate(expected) if keys]

    def test_rounds_order(self) -> None:
        trace = schedule_trace()
        s = build_schedule(trace, "rounds")
        # round t*K + k requests the k-th expert of every layer
        assert s.groups[:8] == [
            ((0, 0),),
            ((1, 2),),
            ((0, 1),),
            (),
            ((0, 1),),
            ((1, 2),),
            ((0, 3),),
            ((1, 0),),
        ]
        expected = [
            ((layer, int(trace.experts[t, layer, k])),) if trace.experts[t, layer, k] >= 0 else ()
            for t in range(7)
            for k in range(2)
            for layer in range(2)
        ]
        assert s.groups == expected
        assert (s.per_layer, s.num_rounds, s.num_requests) == (1, 14, 23)
        assert s.round_prefill.tolist() == [True] * 6 + [False] * 2 + [True] * 2 + [False] * 4

    def test_unknown_order(self) -> None:
        with pytest.raises(ExpertcacheError, match="unknown order"):
            build_schedule(schedule_trace(), "zigzag")


def test_round_token_counts_tokens_in_every_order() -> None:
    """The clock's token time: a prefill step starts at its first token, K rounds share a token."""
    trace = synthesize("zipf", tokens=12, layers=2, experts=4, top_k=2, seed=0, sequences=2, prompt_len=3)
    layer = build_schedule(trace, "layer")
    assert layer.round_token.tolist() == [0, 3, 4, 5, 6, 9, 10, 11]
    assert layer.round_prefill.tolist() == [True, False, False, False, True, False, False, False]
    assert build_schedule(trace, "flat").round_token.tolist() == list(range(12))
    assert build_schedule(trace, "rounds").round_token.tolist() == [t for t in range(12) for _ in range(2)]


@pytest.mark.parametrize("base", [9, 300, 2**20])  # a table of codes, sorted codes, rows as they are
def test_unique_layer_rows_equals_numpy_unique(base):
    from expertcache.cache.schedule import _unique_layer_rows

    rng = np.random.default_rng(base)
    ex = rng.integers(-1, 8, size=(200, 3, 3)).astype(np.int16)
    sig = np.concatenate([np.broadcast_to(np.arange(3)[None, :, None], (200, 3, 1)), ex], axis=2)
    want, want_inverse = np.unique(sig.reshape(-1, 4).astype(np.int64), axis=0, return_inverse=True)
    uniq, inverse = _unique_layer_rows(ex, base)
    assert uniq.tolist() == want.tolist() and inverse.tolist() == want_inverse.reshape(-1).tolist()


def test_a_prompt_as_long_as_a_sequence_is_refused(capsys) -> None:
    """trace synth --prompt-len 1000 --tokens 100 made every token a prompt token (no decode at all)."""
    from expertcache.cli import main

    assert (
        main(["trace", "synth", "--kind", "zipf", "--prompt-len", "1000", "--tokens", "100", "-o", "x.npz"])
        == 2
    )
    assert capsys.readouterr().err == (
        "expertcache: error: a prompt length of 1000 leaves no generated token in a sequence of 100 tokens "
        "(100 tokens in 1 sequence(s)): give a prompt length below 100, or more tokens\n"
    )
    trace = synthesize("zipf", tokens=100, layers=2, experts=4, top_k=1, sequences=2, prompt_len=49)
    assert int((trace.is_prefill == 0).sum()) == 2  # one generated token in each sequence of 50


def test_synthetic_traces_beyond_memory_or_with_nan_parameters_are_refused() -> None:
    """A 95 GiB trace ended in numpy's MemoryError traceback; --a nan wrote a degenerate trace."""
    with pytest.raises(
        ExpertcacheError, match="is 95.4 GiB of expert ids; a synthetic trace is at most 4 GiB"
    ):
        synthesize("zipf", tokens=100_000_000, layers=64, experts=256, top_k=8)
    for a, b in ((float("nan"), 0.0), (float("inf"), 0.0), (1.0, float("nan"))):
        with pytest.raises(ExpertcacheError, match="needs finite a >= 0 and b > -1"):
            synthesize("zipf", tokens=10, layers=1, experts=4, top_k=1, a=a, b=b)


def test_synthetic_parameters_of_the_wrong_type_are_named() -> None:
    """``synthesize("zipf", tokens="100")`` ended in "'<' not supported between 'str' and 'int'"."""
    import numpy as np

    for key, bad, kind in (("tokens", "100", "whole"), ("tokens", 2.5, "whole"), ("a", True, "real")):
        with pytest.raises(ExpertcacheError, match=f"zipf': {key} must be a {kind} number, got {bad!r}"):
            synthesize("zipf", **{key: bad})
    t = synthesize("zipf", tokens=np.int64(12), layers=2, experts=4, top_k=1, a=np.float32(1.5), b=0)
    assert t.num_tokens == 12


def test_a_trace_is_made_of_whole_numbers_and_its_ids_are_not_wrapped() -> None:
    """Trace(ex, "4") was a TypeError, Trace(ex, 4.5) "a trace of 4.5 experts" that failed in a replay,
    seq_id 2**32 wrapped to 0 (three requests read as one), meta=None failed only at save."""
    import numpy as np

    from expertcache.trace import Trace

    ex = np.array([[[0, 1]], [[1, 2]], [[2, 3]]])
    for kwargs, words in (
        ({"num_experts": "4"}, "num_experts must be a whole number, got '4'"),
        ({"num_experts": 4.5}, "num_experts must be a whole number, got 4.5"),
        (
            {"num_experts": 4, "seq_id": np.array([0, 2**32, 2**33])},
            "'seq_id' holds 8589934592, more than int32",
        ),
        ({"num_experts": 4, "meta": None}, "meta must be a dict, got NoneType"),
    ):
        with pytest.raises(ExpertcacheError, match=re.escape(words)):
            Trace(ex, **kwargs)
    assert Trace(ex, np.int64(4)).num_experts == 4


def test_select_takes_some_tokens_with_every_per_token_array_and_refuses_what_is_not_a_selection():
    """The docs' train-on-half / test-on-half recipes needed a Trace rebuilt by hand from its arrays."""
    import expertcache as ec
    from expertcache.errors import TraceError

    trace = ec.default_trace()
    first, rest = trace.select(trace.seq_id < 8), trace.select(trace.seq_id >= 8)
    assert first.num_tokens + rest.num_tokens == trace.num_tokens
    assert (first.experts == trace.experts[trace.seq_id < 8]).all()
    assert (first.is_prefill == trace.is_prefill[trace.seq_id < 8]).all() and first.meta == trace.meta
    assert trace.select([0, 5, 9]).token_id.tolist() == trace.token_id[[0, 5, 9]].tolist()
    for bad in ([3, 1], [0, trace.num_tokens], trace.seq_id[:5] < 8, ["a"]):
        with pytest.raises(TraceError, match="select: "):
            trace.select(bad)


def test_a_padded_batchs_left_padding_is_marked_saved_selected_and_not_counted_as_prompt(tmp_path):
    """``padding`` (1: a row of a padded batch's left padding): 0 or 1 only, int8 whether given as bools
    or integers, kept by save and select; the summary counts the prompts' own tokens apart from it."""
    import expertcache as ec
    from expertcache.errors import TraceError
    from expertcache.trace.stats import summary

    ex = np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[0, 3]]], dtype=np.int16)  # T=4, L=1, K=2
    prefill, pad = np.array([1, 1, 1, 0]), np.array([True, False, False, False])
    trace = ec.Trace(ex, 4, is_prefill=prefill, seq_id=np.array([0, 0, 1, 0]), padding=pad)
    assert trace.padding.dtype == np.int8 and trace.padding.tolist() == [1, 0, 0, 0]
    with pytest.raises(TraceError, match="'padding' must hold only 0 or 1"):
        ec.Trace(ex, 4, padding=np.array([0, 2, 0, 0]))
    with pytest.raises(TraceError, match="'padding' has shape"):
        ec.Trace(ex, 4, padding=np.zeros(3, np.int8))
    trace.save(tmp_path / "t.npz")
    saved = ec.load_trace(tmp_path / "t.npz")
    assert saved.padding.tolist() == [1, 0, 0, 0] and saved.select([1, 2]).padding.tolist() == [0, 0]
    got = summary(saved)
    assert got["prefill_tokens"] == 2 and got["padding_tokens"] == 1
    assert summary(ec.Trace(ex, 4, is_prefill=prefill))["padding_tokens"] == 0


def test_a_runs_wall_clock_comes_in_pairs_of_finite_times_in_order_and_select_keeps_it(tmp_path, capsys):
    """A recorded run's clock (``step_start_s``, ``step_end_s``): both or neither, finite, no step ending
    before it starts; saved and loaded as float64, kept by select, and summed up by trace info."""
    import expertcache as ec
    from expertcache.cli import main
    from expertcache.errors import TraceError

    ex = np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[0, 3]]], dtype=np.int16)  # T=4, L=1, K=2
    step, prefill = np.array([0, 0, 1, 2]), np.array([1, 1, 0, 0])
    start, end = np.array([0.0, 0.0, 0.02, 0.031]), np.array([0.015, 0.015, 0.025, 0.036])
    trace = ec.Trace(ex, 4, step_id=step, is_prefill=prefill, seq_id=np.zeros(4, int), step_start_s=start,
                     step_end_s=end)  # fmt: skip
    for bad, words in (({"step_end_s": None}, "'step_start_s' without its pair"),
                       ({"step_end_s": np.r_[end[:2], 0.01, 0.036]}, "token 2's step ends"),
                       ({"step_start_s": np.r_[start[:3], np.nan]}, "must be finite"),
                       ({"step_start_s": start.astype(np.int64)}, "has dtype int64")):  # fmt: skip
        with pytest.raises(TraceError, match=words):
            ec.Trace(ex, 4, step_id=step, **{"step_start_s": start, "step_end_s": end, **bad})
    trace.save(tmp_path / "t.npz")
    saved = ec.load_trace(tmp_path / "t.npz")
    assert saved.step_start_s.dtype == np.float64 and np.array_equal(saved.step_end_s, end)
    assert saved.select([2, 3]).step_start_s.tolist() == [0.02, 0.031]
    from expertcache.trace.stats import step_walls

    walls = step_walls(saved)
    assert walls["steps"] == 3 and walls["seconds"] == 0.036
    assert walls["prefill"]["steps"] == 1 and walls["prefill"]["forward_median_s"] == 0.015
    assert walls["prefill"]["whole_median_s"] == 0.02  # to the next step's start
    assert walls["decode"]["forward_median_s"] == pytest.approx(0.005)
    assert walls["decode"]["whole_median_s"] == pytest.approx(0.008)  # 11 ms; the last step its forward, 5
    from expertcache.trace.stats import whole_steps

    # a pause of more than 10 medians is idle (no request to run): the median pause instead
    idle = whole_steps(np.array([0.0, 0.02, 0.5, 0.51]), np.array([0.01, 0.03, 0.505, 0.515]))
    assert idle == pytest.approx([0.02, 0.02, 0.01, 0.005])  # 0.47 s of pause taken as 0.01
    assert main(["trace", "info", str(tmp_path / "t.npz")]) == 0
    out = capsys.readouterr().out
    assert "wall        3 steps over 0.036 s, the run's own clock; 2 decode steps: forward 5 ms" in out
    assert ec.default_trace().step_start_s is None  # a trace of another kind has none


def test_a_recorders_clock_is_every_steps_from_the_first_or_none():
    """The engine gives each step its forward's start and end (a provisional end at its start, so a forward
    that raised keeps the run's clock); a step recorded without one, the trace has none."""
    from expertcache.cache.recorder import Recorder

    rec = Recorder(num_layers=1, num_experts=4, top_k=2)
    for tokens, wall in (([1, 2], (10.0, 10.5)), ([3], (11.0, 11.25))):
        rec.begin(np.array(tokens), len(tokens) > 1, np.zeros(len(tokens), np.int32))
        rec.wall(wall[0], wall[0])  # provisional, then the forward's end
        rec.wall(*wall)
        rec.add(0, np.array([[0, 1]] * len(tokens)), None)
    trace = rec.trace()
    assert trace.step_start_s.tolist() == [0.0, 0.0, 1.0] and trace.step_end_s.tolist() == [0.5, 0.5, 1.25]
    rec.begin(np.array([4]), False, np.zeros(1, np.int32))
    rec.add(0, np.array([[2, 3]]), None)  # no wall: a driver fed by something other than the engine
    assert rec.trace().step_start_s is None and rec.trace().step_end_s is None


def test_the_api_names_the_embedded_trace_default_as_the_command_line_does():
    """``simulate("default", ...)`` was refused ("no such trace file") where ``sim default`` and
    ``sweep(traces=["default"])`` take it (a new user's trial)."""
    import expertcache as ec
    from expertcache.trace.default import default_trace
    from expertcache.trace.trace import as_trace

    assert as_trace("default").digest() == default_trace().digest()
    assert ec.simulate("default", ["lru"], [24])[0].capacity == 24
