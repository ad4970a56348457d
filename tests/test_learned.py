"""The learned predictor (ProMoE Sec. 4): capture, training, save/load, errors, ACCURACY, shipped, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_fixtures import exit_code
from engine_fixtures import _one_torch_thread, make_ckpt, tokenizer_dir  # noqa: F401  (fixtures)

from expertcache.cli import main
from expertcache.errors import ExpertcacheError
from expertcache.predict import PredictContext, Predictor, PredictorError, make_predictor
from expertcache.predict.learned import (
    CONFIG,
    DEFAULT_PREDICTORS,
    WEIGHTS,
    Learned,
    load_predictor,
    make_mlp,
    save_predictor,
)
from expertcache.tools.capture import Captured, capture_model
from expertcache.tools.predictor_accuracy import build_predictor, evaluate, evaluate_model, heldout_prompts
from expertcache.tools.train_predictor import read_prompts, train_predictor

LAYERS, EXPERTS, HIDDEN, TOP_K = 4, 8, 32, 2
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts models route every token to a few experts.",
    "Experts that are not resident are loaded from the slow tier.",
    "hello world, hello experts, hello cache",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? ; :",
    "The lazy dog sleeps; the quick fox runs.",
]
NEW = 8


@pytest.fixture(scope="module")
def tiny(make_ckpt) -> Path:  # noqa: F811
    return make_ckpt("mixtral", layers=LAYERS, experts=EXPERTS)


@pytest.fixture(scope="module")
def trained(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("learned")
    report = train_predictor(tiny, out, PROMPTS, window=[1, 2], hidden=32, epochs=60, max_new_tokens=NEW)
    return out, report


@pytest.fixture(scope="module")
def captured(tiny: Path) -> Captured:
    return capture_model(tiny, PROMPTS, max_new_tokens=NEW)


def ctx(window: int | None = 2, path: Path | str | None = None, **kw) -> PredictContext:
    shape = dict(num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K)
    return PredictContext(**{**shape, **kw}, window=window, path=None if path is None else str(path))


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg
    return msg


class TestCapture:
    def test_rows_steps_and_routing_agree(self, captured: Captured):
        assert captured.gate_input.shape[1:] == (LAYERS, HIDDEN)
        assert captured.experts.shape[1:] == (LAYERS, TOP_K)
        steps = captured.steps()
        assert len(steps) == len(PROMPTS) * NEW  # one prefill step, then NEW - 1 decode steps per prompt
        assert int(captured.prefill.sum()) == sum(s.stop - s.start for s in steps[::NEW])
        top = np.argsort(-captured.logits, axis=-1, kind="stable")[..., :TOP_K]
        assert (np.sort(top, -1) == np.sort(captured.experts, -1)).all()  # the recorded top-k is the logits'

    def test_save_load_round_trip(self, captured: Captured, tmp_path: Path):
        captured.save(tmp_path / "c.npz")
        back = Captured.load(tmp_path / "c.npz")
        assert all(
            np.array_equal(getattr(back, n), getattr(captured, n)) for n in ("gate_input", "experts", "step")
        )


class TestTraining:
    def test_writes_one_directory_per_window(self, trained):
        out, report = trained
        assert sorted(report["windows"]) == [1, 2]
        for k in (1, 2):
            meta = json.loads((out / f"window-{k}" / CONFIG).read_text())
            assert (meta["window"], meta["num_layers"], meta["num_experts"]) == (k, LAYERS, EXPERTS)
            assert meta["hidden_size"] == HIDDEN and meta["targets"] == list(range(1, LAYERS))
            assert len(meta["model"]["routers_sha256"]) == 64
            assert meta["validation"]["val_prompts"] >= 1

    def test_validation_reports_learned_and_skip_per_layer(self, trained):
        for k, w in trained[1]["windows"].items():
            assert [r["layer"] for r in w["per_layer"]] == list(range(1, LAYERS))
            assert [r["source"] for r in w["per_layer"]] == [max(i - k, 0) for i in range(1, LAYERS)]
            assert all(0 <= r["learned"] <= 1 and 0 <= r["skip"] <= 1 for r in w["per_layer"])

    def test_beats_random_on_its_training_distribution(self, trained, tiny, captured):
        predictor = build_predictor("learned", _model(tiny), 2, trained[0])
        result = evaluate(predictor, captured)
        assert result["accuracy"] > 2 * TOP_K / EXPERTS  # random top-k guesses score K/E

    def test_one_window_writes_the_directory_itself(self, tiny, tmp_path):
        train_predictor(tiny, tmp_path, PROMPTS[:3], window=3, hidden=8, epochs=1, max_new_tokens=3)
        assert (tmp_path / CONFIG).is_file() and (tmp_path / WEIGHTS).is_file()
        assert Learned(ctx(None, tmp_path)).window == 3  # no window asked: the trained one

    def test_a_folder_with_a_predictor_is_refused_first_or_replaced_with_force(
        self, tiny, tmp_path, monkeypatch
    ):
        """Never a trained predictor lost, and never two layouts (DIR/predictor.* beside DIR/window-K/)."""
        small = dict(hidden=8, epochs=1, max_new_tokens=3)
        train_predictor(tiny, tmp_path, PROMPTS[:3], window=[1, 2], **small)
        (tmp_path / "notes.txt").write_text("mine\n")
        import expertcache.tools.train_predictor as tp

        def no_capture(*a, **k):
            raise AssertionError("the capture ran")

        with monkeypatch.context() as m:
            m.setattr(tp, "load_for_capture", no_capture)
            refused = "holds a trained predictor already: give a new folder, or --force"
            with pytest.raises(ExpertcacheError, match=refused) as exc:
                train_predictor(tiny, tmp_path, PROMPTS[:3], window=3, **small)
            one_line(exc)
        train_predictor(tiny, tmp_path, PROMPTS[:3], window=3, force=True, **small)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG, WEIGHTS, "notes.txt"])
        assert Learned(ctx(None, tmp_path)).window == 3
        train_predictor(tiny, tmp_path, PROMPTS[:3], window=[1, 2], force=True, **small)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "window-1", "window-2"]

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            (dict(window=0), "windows must be integers >= 1"),
            (dict(epochs=0), "epochs must be at least 1"),
            (dict(prompts=PROMPTS[:1]), "1 prompt given: training needs at least 2"),
        ],
    )
    def test_bad_arguments(self, tiny, tmp_path, kwargs, match):
        out = tmp_path / "new"
        with pytest.raises(Exception, match=match) as exc:
            train_predictor(tiny, out, **{"prompts": PROMPTS[:3], "max_new_tokens": 3, **kwargs})
        one_line(exc)
        assert not out.exists()  # a failed run leaves no empty folder of its own

    def test_a_window_given_twice_is_one_window_and_a_weak_predictor_is_noted(self, tiny, tmp_path):
        lines: list[str] = []
        report = train_predictor(tiny, tmp_path / "a", PROMPTS[:3], window=[2, 2], hidden=8, epochs=1,
                                 max_new_tokens=3, log=lines.append)  # fmt: skip
        assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["window-2"]
        w = report["windows"][2]
        noted = [line for line in lines if line.startswith("note: at window 2 the learned predictor scores")]
        assert w["learned"] < w["skip"] and len(noted) == 1  # one epoch on 3 prompts: below skip
        prompts = tmp_path / "p.txt"
        prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
        argv = ["train-predictor", "--model", str(tiny), "--out", str(tmp_path / "b"), "--window", "2", "2",
                "--epochs", "1", "--hidden", "8", "--max-new-tokens", "3", "--prompts", str(prompts),
                "--json"]  # fmt: skip
        assert main(argv) == 0 and (tmp_path / "b" / CONFIG).is_file()  # the CLI: one window, into --out

    def test_prompt_file_escapes(self, tmp_path):
        f = tmp_path / "p.txt"
        f.write_text("def f():\\n\\treturn 1\n\n  \nback\\\\slash\n")
        assert read_prompts(f) == ["def f():\n\treturn 1", "back\\slash"]


def _model(path: Path):
    from expertcache.engine.loader import load_reference

    return load_reference(path)


class TestLoad:
    def test_save_load_round_trip(self, tmp_path):
        torch.manual_seed(0)
        mlps = {1: make_mlp(HIDDEN, 16, EXPERTS), 3: make_mlp(HIDDEN, 16, EXPERTS)}
        meta = dict(
            window=2, hidden=16, num_layers=LAYERS, num_experts=EXPERTS, hidden_size=HIDDEN, top_k=TOP_K
        )
        save_predictor(tmp_path / "f32", mlps, meta, dtype=torch.float32)
        save_predictor(tmp_path / "f16", mlps, meta)
        back32 = load_predictor(tmp_path / "f32")[1]
        meta16, back16, probe = load_predictor(tmp_path / "f16")
        assert probe is None and meta16["dtype"] == "float16" and meta16["targets"] == [1, 3]
        for t, mlp in mlps.items():
            for (name, p), q32, q16 in zip(
                mlp.state_dict().items(),
                back32[t].state_dict().values(),
                back16[t].state_dict().values(),
                strict=True,
            ):
                assert torch.equal(p, q32), name
                assert torch.equal(p.half().float(), q16), name

    def test_picks_the_window_subdirectory(self, trained):
        for k in (1, 2):
            assert Learned(ctx(k, trained[0])).directory == trained[0] / f"window-{k}"
        assert Learned(ctx(None, trained[0])).window == Learned.default_window

    @pytest.mark.parametrize(
        "build, match",
        [
            (lambda d: ctx(3, d), r"no predictor trained for window 3 \(trained: 1, 2\)"),
            (
                lambda d: ctx(2, d, num_layers=LAYERS + 1),
                "trained for a model with 4 MoE layers, this one has 5",
            ),
            (lambda d: ctx(2, d, num_experts=EXPERTS * 2), "8 experts per layer, this one has 16"),
            (lambda d: ctx(1, d / "window-2"), "trained for window 2, asked for window 1"),
            (lambda d: ctx(2, d / "missing"), "no such learned-predictor directory"),
            (lambda d: ctx(2, d.parent), r"neither predictor.json nor window-<k>/"),
        ],
    )
    def test_mismatches_are_one_line_errors(self, trained, build, match):
        with pytest.raises(PredictorError, match=match) as exc:
            Learned(build(trained[0]))
        one_line(exc)

    def test_another_model_with_the_same_shapes(self, trained, make_ckpt):  # noqa: F811
        # refused as it is built (at load), not at its first prediction: a new user's generation was
        # lost halfway, its text already out
        other = make_ckpt("mixtral", layers=LAYERS, experts=EXPERTS, seed=1)
        with pytest.raises(PredictorError, match="trained for another model") as exc:
            build_predictor("learned", _model(other), 2, trained[0])
        one_line(exc)

    def test_missing_weights_and_wrong_hidden_size(self, trained, tmp_path):
        import shutil

        broken = tmp_path / "broken"
        shutil.copytree(trained[0] / "window-2", broken)
        (broken / WEIGHTS).unlink()
        with pytest.raises(PredictorError, match="no predictor.safetensors") as exc:
            Learned(ctx(2, broken))
        one_line(exc)
        predictor = Learned(ctx(2, trained[0]))
        with pytest.raises(PredictorError, match="hidden size 32, the gate input has 16") as exc:
            predictor.after_router(0, np.zeros((1, TOP_K), dtype=np.int64), torch.zeros(1, 16))
        one_line(exc)


class TestPredictions:
    def test_valid_expert_ids_for_the_window_targets(self, trained, captured):
        predictor = Learned(ctx(2, trained[0]))
        rows = captured.steps()[1]  # a decode step: one token
        predictor.begin_step(captured.token_ids[rows], False, False)
        seen = {}
        for layer in range(LAYERS):
            x = torch.from_numpy(captured.gate_input[rows, layer])
            seen[layer] = predictor.after_router(layer, captured.experts[rows, layer], x)
        assert sorted(seen[0]) == [1, 2] and sorted(seen[1]) == [3] and seen[2] == seen[3] == {}
        for preds in seen.values():
            for ranked in preds.values():
                assert len(ranked) == TOP_K == len(set(ranked))
                assert all(isinstance(e, int) and 0 <= e < EXPERTS for e in ranked)

    def test_no_gate_input_no_prediction(self, trained):
        predictor = Learned(ctx(2, trained[0]))
        assert predictor.after_router(0, np.zeros((1, TOP_K), dtype=np.int64), None) == {}


class _Fixed(Predictor):
    """Predicts experts [0, 1] for every target layer at the start of the step (hand-made case)."""

    name = "fixed"
    default_window = 2

    def _predict(self, source, target, gate_input):
        return [0, 1]


def _hand_captured() -> Captured:
    """2 prompts; each a 2-token prefill then 2 decode steps; 2 layers, 4 experts, top-2."""
    experts = np.array(
        [
            [[0, 1], [0, 1]], [[2, 3], [2, 3]],  # prefill of prompt 0 (not counted)
            [[0, 1], [0, 1]],  # decode: layer 1 gets 2 of 2 right
            [[0, 1], [1, 2]],  # decode: 1 of 2
            [[0, 1], [0, 1]], [[0, 1], [0, 1]],  # prefill of prompt 1
            [[3, 2], [3, 2]],  # decode: 0 of 2
            [[3, 2], [0, 3]],  # decode: 1 of 2
        ]
    )  # fmt: skip
    n = len(experts)
    return Captured(
        gate_input=np.zeros((n, 2, 4), dtype=np.float32),
        logits=np.zeros((n, 2, 4), dtype=np.float32),
        experts=experts,
        token_ids=np.arange(n),
        step=np.array([0, 0, 1, 2, 3, 3, 4, 5]),
        prefill=np.array([1, 1, 0, 0, 1, 1, 0, 0], dtype=bool),
        sequence=np.array([0, 0, 0, 0, 1, 1, 1, 1]),
    )


class TestEvaluate:
    def test_hand_made_case(self):
        hand = _hand_captured()
        result = evaluate(_Fixed(PredictContext(num_layers=2, num_experts=4, top_k=2)), hand)
        assert result["steps"] == 4
        assert result["per_layer"] == [pytest.approx(4 / 8), pytest.approx(4 / 8)]
        assert result["accuracy"] == pytest.approx(4 / 8)  # layers 1.. only
        everything = evaluate(_Fixed(PredictContext(num_layers=2, num_experts=4, top_k=2)), hand, False)
        # prefill groups: layer 1 {0,1,2,3} -> pred [0,1] = 2 of 4; {0,1} -> 2 of 2
        assert everything["per_layer"][1] == pytest.approx((4 + 2 + 2) / (8 + 4 + 2))

    def test_oracle_is_exact_and_unpredicted_layers_are_none(self):
        hand = _hand_captured()
        oracle = make_predictor("oracle", PredictContext(num_layers=2, num_experts=4, top_k=2))
        result = evaluate(oracle, hand, decode_only=False)
        assert result["accuracy"] == 1.0 and result["per_layer"] == [1.0, 1.0]

    def test_model_predictors_skip_layer_zero(self, trained, tiny):
        rows = evaluate_model(tiny, PROMPTS[:2], ["next-gate", "learned"], [1, 2], max_new_tokens=4,
                              learned_path=trained[0])  # fmt: skip
        assert [(r["name"], r["window"]) for r in rows] == [
            ("next-gate", 1),
            ("next-gate", 2),
            ("learned", 1),
            ("learned", 2),
        ]
        for r in rows:
            assert r["per_layer"][0] is None and all(a is not None for a in r["per_layer"][1:])
            assert r["steps"] == 2 * 3


class TestShippedDefault:
    def test_every_window_loads_and_is_small(self):
        size = sum(p.stat().st_size for p in DEFAULT_PREDICTORS.rglob("*") if p.is_file())
        assert size < 2_000_000
        for k in (1, 2, 3, 4):
            p = Learned(PredictContext(num_layers=6, num_experts=16, top_k=2, window=k))
            assert p.window == k and sorted(p.mlps) == [1, 2, 3, 4, 5]

    def test_beats_next_gate_at_window_2_on_held_out_prompts(self):
        rows = evaluate_model(None, heldout_prompts(3), ["next-gate", "learned"], [2], max_new_tokens=24)
        gate, learned = (r["accuracy"] for r in rows)
        assert learned > gate + 0.1


class TestCli:
    def test_trains_and_reports(self, tiny, tmp_path, capsys):
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
        out = tmp_path / "pred"
        argv = ["train-predictor", "--model", str(tiny), "--out", str(out), "--prompts", str(prompts),
                "--window", "1", "2", "--epochs", "1", "--hidden", "8", "--max-new-tokens", "3",
                "--json"]  # fmt: skip
        assert main(argv) == 0
        got = capsys.readouterr()
        report = json.loads(got.out)
        assert sorted(report["windows"]) == ["1", "2"]
        assert (out / "window-2" / CONFIG).is_file()
        # --json keeps stderr to the notes: one for each window whose predictor scores below skipping (a
        # new user's trial: with --json the note was lost), and no progress lines
        below = [k for k, r in report["windows"].items() if r["learned"] < r["skip"]]
        lines = [line for line in got.err.splitlines() if line.strip()]
        assert all(line.startswith("note:") for line in lines), lines
        assert len(lines) == len(below)

    @pytest.mark.parametrize(
        "extra, match",
        [
            (["--model", "/nonexistent/model"], "no such checkpoint directory"),
            (["--window", "0"], "windows must be integers >= 1"),
            (["--window", "two"], "invalid int value"),
            (["--window", "2", "4"], f"window 4 reaches past the first of {{tiny}}'s {LAYERS} MoE layers"),
            (["--window", "9"], f"use a window in 1..{LAYERS - 1}"),
            (["--out", "{file}/pred"], "cannot write the predictor there"),
        ],
    )
    def test_bad_model_or_window_is_one_line_and_exit_2(
        self, tiny, tmp_path, capsys, monkeypatch, extra, match
    ):
        import expertcache.tools.train_predictor as tp

        def no_capture(*args, **kwargs):
            raise AssertionError("captured before the options were checked")

        monkeypatch.setattr(tp, "capture", no_capture)
        (tmp_path / "file").write_text("")
        extra = [a.format(file=tmp_path / "file") for a in extra]
        given = {"--model": str(tiny), "--out": str(tmp_path / "o")}  # an option is given once: extra's wins
        argv = ["train-predictor", *[a for k, v in given.items() if k not in extra for a in (k, v)], *extra]
        code = exit_code(argv)
        err = capsys.readouterr().err
        assert code == 2
        assert len(err.strip().splitlines()) == 1 and match.format(tiny=tiny) in err

    def test_predictor_accuracy_refuses_the_bundled_predictor_before_capturing(
        self, tiny, capsys, monkeypatch
    ):
        import expertcache.tools.predictor_accuracy as pa

        def no_capture(*args, **kwargs):
            raise AssertionError("captured before the predictors were built")

        monkeypatch.setattr(pa, "capture", no_capture)
        code = main(["predictor-accuracy", "--model", str(tiny), "--predictors", "learned", "--window", "2"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1
        assert "the bundled learned predictor is for the embedded model" in err
        assert "train-predictor --model MODEL --out DIR), then pass --predictor DIR" in err

    def test_default_windows_fit_the_model_and_each_other(self, make_ckpt, tmp_path, capsys):  # noqa: F811
        """Run as documented, ``train-predictor`` then ``predictor-accuracy --predictor DIR`` failed on any
        model (trained for window 2, asked for window 1), and on a model of 2 MoE layers the trainer's own
        default window 2 was refused (a new user's trial). Scoring takes the windows the predictor was
        trained for and those the model leaves room for; training cuts its default to the model."""
        two = make_ckpt("mixtral", layers=2, experts=EXPERTS)
        out = tmp_path / "pred"
        argv = ["train-predictor", "--model", str(two), "--out", str(out), "--epochs", "1", "--hidden", "8",
                "--max-new-tokens", "3", "--json"]  # fmt: skip
        assert main(argv) == 0
        got = capsys.readouterr()
        assert list(json.loads(got.out)["windows"]) == ["1"] and (out / CONFIG).is_file()
        assert f"note: window 1, as {two}'s 2 MoE layers leave room for (the default is 2)" in got.err
        argv = ["predictor-accuracy", "--model", str(two), "--predictor", str(out), "--max-new-tokens", "3",
                "--json"]  # fmt: skip
        assert main(argv) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [(r["name"], r["window"]) for r in rows] == [("next-gate", 1), ("learned", 1)]

    def test_capture_progress_goes_to_stderr_only(self, tiny, capsys):
        from expertcache.tools.capture import capture, load_for_capture

        model, tokenizer = load_for_capture(tiny)
        got = capture(model, tokenizer, PROMPTS[:2], 2, progress=True)
        out, err = capsys.readouterr()
        assert out == "" and "capturing routing" in err
        assert np.unique(got.sequence).tolist() == [0, 1]


def test_predictor_data_a_predictor_does_not_read_is_refused(tmp_path, capsys):
    """``--predictor`` was ignored where the predictor reads none (next-gate, oracle), and the wrong kind
    (a trace for learned, a directory for eam) was taken silently or named 'no such trace file' (a new
    user found each)."""
    from expertcache.trace.default import default_trace

    trace = tmp_path / "t.npz"
    default_trace().save(trace)
    cases = [
        (["timing", "--capacity", "24", "--prefetch", "oracle", "--predictor", str(trace)],
         "prefetch oracle reads no recorded trace (token and eam do)"),
        (["timing", "--capacity", "24", "--prefetch", "eam", "--predictor", str(tmp_path)],
         "is a directory: the simulator's predictors learn from a recorded trace"),
        (["generate", "--prompt", "x", "--max-new-tokens", "1", "--expert-memory", "50%", "--prefetch",
          "next-gate", "--predictor", str(trace)], "prefetch next-gate reads no predictor data"),
        (["generate", "--prompt", "x", "--max-new-tokens", "1", "--expert-memory", "50%", "--prefetch",
          "learned", "--predictor", str(trace)], "is a trace: prefetch learned reads a trained predictor"),
        (["generate", "--prompt", "x", "--max-new-tokens", "1", "--expert-memory", "50%", "--prefetch",
          "eam", "--predictor", str(tmp_path)], "is a directory: prefetch eam reads a recorded trace"),
    ]  # fmt: skip
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert main(["timing", "--capacity", "24", "--prefetch", "eam", "--predictor", str(trace)]) == 0
