"""Files made wrong as real files go wrong, handed to the commands and the API: one line naming the file
and the problem (exit 2), never a traceback, never a plausible wrong answer (a new user's trial)."""

from __future__ import annotations

import json
import re
import shutil
from functools import partial
from pathlib import Path

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import TOP_K

from expertcache.cli import main
from expertcache.costs import CostModel
from expertcache.errors import ExpertcacheError
from expertcache.trace import Trace, load_trace, synthesize
from expertcache.trace.default import default_trace
from expertcache.trace.importers import import_trace

BOM = "\ufeff"
_one_torch_thread = engine_fixtures._one_torch_thread
tokenizer_dir = engine_fixtures.tokenizer_dir
make_ckpt = engine_fixtures.make_ckpt
ckpt = engine_fixtures.ckpt


def _err(capsys, argv: list[str]) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_trace_of_more_experts_than_its_ids_can_name_is_refused(tmp_path):
    """num_experts 2**31 + 5 gave an OPT above LRU (keys wrapped) and 'out of memory' elsewhere."""
    t = default_trace()
    path = tmp_path / "huge.npz"
    np.savez(path, experts=t.experts, num_experts=np.int64(2**31 + 5))
    with pytest.raises(ExpertcacheError, match=r"num_experts must be in 1 \.\. 32768, got 2147483653"):
        Trace(t.experts, 2**31 + 5)
    with pytest.raises(ExpertcacheError, match="num_experts must be in 1 .. 32768"):
        load_trace(path)


def test_a_byte_order_mark_is_no_part_of_a_prompt_or_template(tmp_path, capsys):
    """--prompts with a BOM read its JSON lines as plain text; a prompt file's BOM went to the model."""
    from expertcache.tools.prompts import read_prompt_items, read_text

    lines = tmp_path / "p.txt"
    lines.write_text(BOM + '{"prompt": "def add(", "id": "a"}\n', encoding="utf-8")
    items = read_prompt_items(lines)
    assert [(i.prompt, i.id) for i in items] == [("def add(", "a")]
    one = tmp_path / "one.txt"
    one.write_text(BOM + "hello", encoding="utf-8")
    assert read_text(one) == "hello"
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9")
    with pytest.raises(ExpertcacheError, match=r"not UTF-8 text \(byte 0xe9 at position 3\)"):
        read_text(latin)
    with pytest.raises(ExpertcacheError, match="it is a folder, not a file"):
        read_text(tmp_path)
    empty = tmp_path / "t.jinja"
    empty.write_text("")
    err = _err(capsys, ["generate", "--prompt", "hi", "--chat", "--chat-template", str(empty)])
    assert f"{empty}: the chat template is empty" in err  # not "the tokenizer has no chat template"


def test_a_profile_without_its_model_or_of_another_version_is_refused(tmp_path):
    good = {"format": "expertcache-profile", "version": 1, "cost": {"expert_s": 0.001},
            "model": {"name": "m", "layers": 6, "experts": 16, "top_k": 2}}  # fmt: skip
    for change, needle in (
        ({"model": None}, "a profile without its 'model' object"),
        ({"model": []}, "a profile without its 'model' object"),
        ({"version": 99}, "a profile of version 99; this expertcache reads version 1"),
        (
            {"model": {**good["model"], "layers": "6"}},
            "the profile's model.layers must be a whole number, got '6'",
        ),
    ):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(ExpertcacheError, match=needle):
            CostModel.load(path)
    path.write_text(BOM + json.dumps(good), encoding="utf-8")  # an editor's BOM: read
    assert CostModel.load(path).expert_s == 0.001


def test_routing_logs_with_a_repeated_column_an_odd_request_or_header_are_named(tmp_path):
    dup = tmp_path / "dup.csv"
    dup.write_text("token_idx,layer,topk_ids,layer\n0,0,1 2,3\n")
    with pytest.raises(ExpertcacheError, match="the header names layer twice"):
        import_trace(dup)
    for record, needle in (
        ({"req_id": [1], "token_idx": 0, "layer": 0, "topk_ids": [1, 2]}, "req_id must be text or a whole"),
        ({"type": "meta", "num_experts": "x"}, "the header's num_experts must be a whole number >= 1"),
        ({"type": "meta", "num_experts": -1}, "the header's num_experts must be a whole number >= 1"),
    ):
        log = tmp_path / "r.jsonl"
        rows = [record, {"token_idx": 0, "layer": 0, "topk_ids": [1, 2]}]
        if "req_id" in record:
            rows = [record, {"req_id": 2, "token_idx": 0, "layer": 0, "topk_ids": [1, 2]}]
        log.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(ExpertcacheError, match=needle):
            import_trace(log)
    with pytest.raises(ExpertcacheError, match="num_experts must be a whole number >= 1, got 0"):
        import_trace(log, num_experts=0)
    with pytest.raises(ExpertcacheError, match="a folder, not a routing log"):
        import_trace(tmp_path)
    trace = tmp_path / "t.npz"
    synthesize("zipf", tokens=20, layers=2, experts=4, top_k=2).save(trace)
    with pytest.raises(ExpertcacheError, match=r"already a trace \(\.npz\)"):
        import_trace(trace)
    junk = tmp_path / "junk.npz"  # named .npz, and no trace: not called one
    junk.write_text("junk")
    with pytest.raises(ExpertcacheError, match="not a readable .npz trace"):
        import_trace(junk)


def test_a_plan_with_fields_of_the_wrong_kind_is_refused(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--trace", "default", "--expert-memory", "25%", "-o", str(out)]) == 0
    capsys.readouterr()
    good = json.loads(out.read_text())
    for change, needle in (
        ({"source": "x"}, "plan: source must be an object, got 'x'"),  # an AttributeError in timing
        ({"policy": 5}, "plan: policy must be text, got 5"),
        ({"method": "magic"}, "plan: method must be one of shared, uniform, knapsack, fate, moepic"),
        ({"objective": "speed"}, "plan: objective must be one of tpot, ttft"),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**good, **change}))
        assert needle in _err(capsys, ["timing", "--plan", str(bad)])


def test_a_checkpoint_whose_index_or_copies_are_broken_is_named(ckpt, tmp_path, capsys):
    from expertcache.engine.store import Checkpoint

    base = ckpt("mixtral")
    for weight_map, needle in (
        ([], r"not a safetensors index \(its weight_map maps names to files\)"),
        ({"x": "../../etc/passwd"}, r"names a file outside the checkpoint's folder \(\.\./\.\./etc/passwd\)"),
        ({"x": "/etc/passwd"}, r"names a file outside the checkpoint's folder \(/etc/passwd\)"),
    ):
        folder = tmp_path / "idx"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(ExpertcacheError, match=needle):
            Checkpoint(folder)
    from expertcache.engine.quantized import read_meta
    from expertcache.tools.quantize import quantize_model

    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    path = Path(quantize_model(copy, bits=(4,), progress=False)[0]["path"])
    from safetensors.torch import load_file, save_file

    meta = read_meta(path)
    assert meta["layout"] == "packed" and meta["path"] == str(path)
    from expertcache.engine.quantized import packed_of

    tensors = load_file(str(path))
    written = {k: v for k, v in meta.items() if k != "path"} | {"tensors": json.dumps(meta["tensors"])}
    shapes = {n: [2 * v[0], *v[1:]] for n, v in json.loads(meta["shapes"]).items()}  # another model's
    for edit, needle in (
        ({"shapes": json.dumps(shapes)}, "tensors do not match their layout"),
        ({"bits": "x"}, "its metadata does not describe its packing"),
        ({"shapes": "[1]"}, "its metadata does not describe its packing"),
    ):
        save_file(tensors, str(path), written | edit)
        with pytest.raises(ExpertcacheError, match=f"^{re.escape(str(path))}: {needle}"):
            packed_of(read_meta(path), torch.bfloat16)
    save_file(tensors, str(path), written | {"tensors": "nope"})
    with pytest.raises(ExpertcacheError, match="its metadata does not describe its tensors"):
        read_meta(path)


def test_a_config_that_does_not_describe_the_weights_is_refused_or_said(ckpt, tmp_path, capsys):
    """num_local_experts 8 over weights of 16 was torch's size-mismatch traceback; num_hidden_layers
    3 over 6 layers of weights ran another model without a word."""
    from expertcache.engine import load

    base = ckpt("mixtral")
    config = json.loads((base / "config.json").read_text())
    fewer = tmp_path / "fewer-experts"
    shutil.copytree(base, fewer)
    (fewer / "config.json").write_text(
        json.dumps({**config, "num_local_experts": config["num_local_experts"] // 2})
    )
    with pytest.raises(
        ExpertcacheError, match=r"config.json does not describe these weights: .* is \[\d+, \d+\] in"
    ):
        load(fewer, progress=False)
    short = tmp_path / "fewer-layers"
    shutil.copytree(base, short)
    layers = config["num_hidden_layers"]
    (short / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers - 1}))
    with load(short, progress=False) as model:
        assert any(f"weights of layer(s) {layers - 1}, beyond config.json's num_hidden_layers" in n
                   for n in model.notes)  # fmt: skip
    assert model.top_k == TOP_K


def test_a_learned_predictor_whose_description_is_wrong_is_refused(tmp_path):
    from expertcache.predict.learned import DEFAULT_PREDICTORS, load_predictor

    for change, needle in (
        ({"window": 0}, "window must be a whole number >= 1, got 0"),
        ({"window": 9}, "window 9 reaches past the 6 MoE layers"),
        ({"activation": "swish9"}, "activation 'swish9'; the learned predictor's MLPs use gelu"),
        ({"dtype": "int8"}, "dtype 'int8' is not a float dtype"),
        ({"top_k": 40}, "top_k 40 of 16 experts"),
    ):
        folder = tmp_path / "p"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(DEFAULT_PREDICTORS / "window-2", folder)
        meta = json.loads((folder / "predictor.json").read_text())
        (folder / "predictor.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(ExpertcacheError, match=needle):
            load_predictor(folder)


def test_weights_that_make_the_outputs_nan_are_one_error_not_an_empty_text(ckpt, tmp_path):
    """A NaN in one expert gave token 0 for ever: text '', exit 0."""
    from safetensors.torch import load_file, save_file

    from expertcache.engine import load

    bad = tmp_path / "nan"
    shutil.copytree(ckpt("mixtral"), bad)
    (file,) = bad.glob("*.safetensors")
    tensors = load_file(str(file))
    name = next(k for k in tensors if "experts" in k)
    tensors = {k: (v.fill_(float("nan")) if k == name else v) for k, v in tensors.items()}
    save_file(tensors, str(file), {"format": "pt"})
    with (  # found at load's warm-up already
        pytest.raises(ExpertcacheError, match="the model's outputs are not finite"),
        load(bad, expert_memory="100%", progress=False) as model,
    ):
        model.generate_text("Hello there", 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finite_check_takes_values_whose_sum_overflows_and_finds_one_nan_or_infinity(dtype):
    """The check sums the logits first (torch's isfinite over a vocabulary is slow on a CPU): a sum that
    overflows while every value is finite is no error; one NaN or infinity among them is."""
    from types import SimpleNamespace

    from expertcache.engine.runtime import Engine

    check = partial(Engine._finite_logits, SimpleNamespace(step_source=None))
    big = torch.full((1, 1, 50), torch.finfo(dtype).max, dtype=dtype)
    assert not torch.isfinite(big.sum())
    check(SimpleNamespace(logits=big))  # no error
    check(SimpleNamespace(logits=torch.arange(6, dtype=torch.int64)))  # not scores: not checked
    for bad in (float("nan"), float("inf"), -float("inf")):
        logits = torch.zeros(1, 1, 50, dtype=dtype)
        logits[0, 0, 17] = bad
        with pytest.raises(ExpertcacheError, match="the model's outputs are not finite"):
            check(SimpleNamespace(logits=logits))
    mixed = big.clone()
    mixed[0, 0, 3] = -float("inf")  # inf and -inf: a NaN sum
    with pytest.raises(ExpertcacheError, match="not finite"):
        check(SimpleNamespace(logits=mixed))


def test_a_log_s_unknown_fields_and_disagreeing_layers_are_said(tmp_path):
    """A misspelt "topk_weight" on every record gave a trace without weights, and a token's layers that
    disagreed on is_prefill were settled by the last record, each without a word."""
    rows = [
        {
            "token_idx": t,
            "layer": layer,
            "topk_ids": [1, 2],
            "topk_weight": [0.5, 0.5],
            "is_prefill": layer == 0,
        }
        for t in range(3)
        for layer in range(2)
    ]
    log = tmp_path / "r.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace, notes = import_trace(log)
    assert trace.weights is None
    assert "ignored the field 'topk_weight' (did you mean topk_weights" in notes[0] and "line 1" in notes[0]
    assert notes[1] == "line 2: is_prefill 0 where another layer said 1: the last record's is kept"


bad_ckpt = engine_fixtures.bad_ckpt


def _nan_copy(src: Path, dst: Path) -> Path:
    """``src`` with every expert weight NaN."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (file,) = dst.glob("*.safetensors")
    tensors = load_file(str(file))
    save_file({k: (v.fill_(float("nan")) if "experts" in k else v) for k, v in tensors.items()}, str(file),
              {"format": "pt"})  # fmt: skip
    return dst


@pytest.mark.parametrize(
    "kind, words",
    [
        ("truncated", "cannot read safetensors file"),
        ("bad_json", "config.json: not valid JSON"),
        ("missing_expert", "transformers cannot load this checkpoint (a weight is missing"),
        ("nan", "not finite"),
    ],
)
def test_the_tools_that_run_transformers_refuse_a_broken_checkpoint_in_one_line(
    kind, words, ckpt, bad_ckpt, tmp_path, capsys
):
    """``quality --reference-model`` and ``train-predictor`` load the checkpoint with transformers: a
    truncated file, broken JSON or a missing tensor ended in its traceback (exit 1), and NaN weights gave a
    perplexity of NaN and "+nan%" (exit 0) or a "perfect" predictor of NaN hidden states."""
    good = ckpt("mixtral")
    bad = _nan_copy(good, tmp_path / "nan") if kind == "nan" else bad_ckpt(kind)
    err = _err(capsys, ["quality", "--model", str(good), "--reference-model", str(bad), "--tokens", "8"])
    assert words in err, err
    out = tmp_path / "predictor"
    assert main(["train-predictor", "--model", str(bad), "--out", str(out), "--window", "1", "--epochs", "1",
                 "--max-new-tokens", "2"]) == 2  # fmt: skip
    err = capsys.readouterr().err  # NaN is found as the routing is captured, after the line saying so
    assert "Traceback" not in err and words in err.splitlines()[-1] and not out.exists(), err


def test_a_config_routing_to_more_experts_than_a_layer_has_is_refused(ckpt, tmp_path, capsys):
    """top-k 99 of 8 experts: ``model info`` printed a minimum expert memory above all experts', and
    ``generate`` asked for a budget no setting could give."""
    bad = tmp_path / "topk"
    shutil.copytree(ckpt("mixtral"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_experts_per_tok"] = cfg["num_local_experts"] + 1
    (bad / "config.json").write_text(json.dumps(cfg))
    for argv in (["model", "info", str(bad)], ["generate", "--model", str(bad), "--prompt", "hi"]):
        err = _err(capsys, argv)
        assert f"num_experts_per_tok {cfg['num_local_experts'] + 1} routes each token to more experts" in err


def test_quality_refuses_a_text_too_short_to_measure_on(ckpt, tmp_path, capsys):
    """An empty ``--text`` file measured one token (BOS to EOS) and printed "top-1 agreement 100.00% over
    1 tokens", exit 0, where ``--tokens 1`` is refused (a new user's trial): one line, exit 2, for an empty
    text and for a text of too few tokens alike."""
    path = ckpt("mixtral")
    empty, word = tmp_path / "empty.txt", tmp_path / "word.txt"
    empty.write_text("\n")
    word.write_text("a")
    err = _err(capsys, ["quality", "--model", str(path), "--expert-memory", "100%", "--text", str(empty)])
    assert "holds no text to measure on" in err, err
    err = _err(capsys, ["quality", "--model", str(path), "--expert-memory", "100%", "--text", str(word)])
    assert "fewer than 2 tokens to predict" in err, err
