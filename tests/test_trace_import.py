"""``expertcache trace import``: routing logs as JSON lines (vLLM loggers), CSV and torch tensors, into
traces; profiling rows left out and reported; bad logs one line each."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from expertcache.cli import main
from expertcache.errors import TraceError
from expertcache.trace import load_trace
from expertcache.trace.default import default_trace
from expertcache.trace.importers import import_trace


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _routes(req: str, tokens: int, layers: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for t in range(tokens):
        for layer in range(layers):
            ids = rng.choice(8, 2, replace=False).tolist()
            out.append(
                {"req_id": req, "token_idx": t, "layer": layer, "topk_ids": ids, "topk_weights": [0.6, 0.4]}
            )
    return out


def test_jsonl_with_requests_a_header_and_a_profiling_run(tmp_path):
    dummy = [
        {
            "req_id": "dummy_profile",
            "token_idx": t,
            "layer": 0,
            "topk_ids": [1, 2],
            "topk_weights": [0.5, 0.5],
        }
        for t in range(4)
    ]
    records = [
        {"type": "meta", "model_id": "m", "num_experts": 8},
        *dummy,
        *_routes("a", 3, 2, 1),
        *_routes("b", 2, 2, 2),
    ]
    trace, notes = import_trace(_jsonl(tmp_path / "r.jsonl", records))
    assert notes == ["left out 4 leading profiling rows (request 'dummy_profile')"]
    assert (
        trace.experts.shape == (5, 2, 2)
        and trace.num_experts == 8
        and trace.seq_id.tolist() == [0, 0, 0, 1, 1]
    )
    want = [r["topk_ids"] for r in records[5:] if r["layer"] == 1]
    assert trace.experts[:, 1].tolist() == want and trace.meta["model_id"] == "m"
    kept, notes = import_trace(tmp_path / "r.jsonl", skip_profiling=False)
    assert kept.num_tokens == 9 and notes == []


def test_an_expert_only_the_left_out_profiling_rows_name_still_counts(tmp_path):
    """A new user's log: the profiling pass routes to expert 9, the kept rows to 1..4; E was 5."""
    path = tmp_path / "r.csv"
    path.write_text("token_idx,layer,topk_ids\n0,0,5 9\n1,0,5 9\n0,0,1 2\n1,0,3 4\n")
    trace, notes = import_trace(path)
    assert notes and "profiling" in notes[0]
    assert trace.num_experts == 10 and trace.experts[:, 0].tolist() == [[1, 2], [3, 4]]


def test_jsonl_without_request_ids_splits_where_token_idx_goes_back(tmp_path):
    # a dummy run routes every token alike: left out; then two requests, told apart by token_idx
    dummy = [{"token_idx": t, "layer": layer, "topk_ids": [0, 1]} for t in range(3) for layer in range(2)]
    real = [
        {k: v for k, v in r.items() if k != "req_id"} for r in _routes("x", 3, 2, 3) + _routes("y", 2, 2, 4)
    ]
    trace, notes = import_trace(_jsonl(tmp_path / "r.jsonl", dummy + real))
    assert "every token routed alike" in notes[0]
    assert trace.seq_id.tolist() == [0, 0, 0, 1, 1]


def test_a_phase_is_prefill_or_decode_by_either_name(tmp_path):
    records = [
        {"req_id": "a", "token_idx": i, "layer": 0, "topk_ids": [1, 2], "phase": phase}
        for i, phase in enumerate(["prompt", "Prefill", "generate", "decode", "decoding", "generation"])
    ]
    trace, _ = import_trace(_jsonl(tmp_path / "p.jsonl", records))
    assert trace.is_prefill.tolist() == [1, 1, 0, 0, 0, 0]


def test_gaps_are_unknown_entries(tmp_path):
    records = _routes("a", 2, 3, 5)
    del records[4]  # token 1, layer 1
    trace, _ = import_trace(_jsonl(tmp_path / "r.jsonl", records))
    assert (trace.experts[1, 1] == -1).all() and (trace.experts[0] >= 0).all()
    assert trace.weights[1, 1].tolist() == [0, 0]  # an unknown entry's weight reads as 0


def test_a_sampled_log_s_skipped_tokens_and_layers_are_said(tmp_path):
    """A new user's trial: records of tokens 0 and 5, of layers 0 and 5, became adjacent tokens and layers
    without a word, which changes what "the next token" and "a layer ahead" mean."""
    records = [r for r in _routes("a", 6, 6, 1) if r["token_idx"] in (0, 5) and r["layer"] in (0, 5)]
    trace, notes = import_trace(_jsonl(tmp_path / "r.jsonl", records))
    assert (trace.num_tokens, trace.num_layers) == (2, 2) and trace.meta["layer_ids"].tolist() == [0, 5]
    assert any(n.startswith("the layers logged (0, 5) skip some ids") for n in notes)
    assert any(
        n.startswith("1 gap(s) in the token indices (the first: request 'a', token 0 then 5)") for n in notes
    )
    whole = [r for r in _routes("a", 2, 3, 1)]
    assert import_trace(_jsonl(tmp_path / "w.jsonl", whole))[1] == []  # nothing skipped: nothing said
    both = tmp_path / "both.csv"  # expert_N beside topk_ids: topk_ids read, expert_N said to be ignored
    both.write_text("token_idx,layer,topk_ids,expert_0\n0,0,1 2,3\n1,0,2 3,3\n")
    trace, notes = import_trace(both, num_experts=4)
    assert trace.experts[:, 0].tolist() == [[1, 2], [2, 3]]
    assert notes == ["ignored the field 'expert_0' (first at line 1)"]


def test_a_csv_s_first_line_is_its_header_and_its_every_column_is_read_or_said(tmp_path):
    """Values on the first line were "the header names 0 twice"; a column the importer does not read was
    dropped without a word (JSON lines' fields were noted); a request_id column was not read at all."""
    bare = tmp_path / "bare.csv"
    bare.write_text("0,0,1 2\n1,0,1 3\n")
    with pytest.raises(TraceError, match="the first line holds values, not column names"):
        import_trace(bare)
    named = tmp_path / "named.csv"
    named.write_text("request_id,token_idx,layer,topk_ids,extra\na,0,0,1 2,x\nb,0,0,1 3,y\n")
    trace, notes = import_trace(named, num_experts=4)
    assert trace.seq_id.tolist() == [0, 1] and notes == ["ignored the field 'extra' (first at line 1)"]


def test_csv_both_layouts(tmp_path):
    a = tmp_path / "a.csv"
    a.write_text(
        "req_id,token_idx,layer,topk_ids,topk_weights,is_prefill\nq,0,0,3 5,0.7 0.3,1\nq,0,1,1;2,0.5;0.5,1\n"
        "q,1,0,4 5,0.6 0.4,0\nq,1,1,2 7,0.9 0.1,0\n"
    )
    b = tmp_path / "b.csv"
    b.write_text("token_idx,layer,expert_0,expert_1\n0,0,3,5\n0,1,1,2\n1,0,4,5\n1,1,2,7\n")
    ta, _ = import_trace(a)
    tb, _ = import_trace(b, num_experts=8)
    assert ta.experts.tolist() == tb.experts.tolist() == [[[3, 5], [1, 2]], [[4, 5], [2, 7]]]
    assert ta.is_prefill.tolist() == [1, 0] and tb.num_experts == 8 and tb.weights is None


def test_torch_tensors_read_weights_only(tmp_path, capsys):
    ids = [torch.tensor([[1, 2], [3, 4], [1, 5]]), torch.tensor([[0, 6], [6, 7], [2, 3]])]
    path = tmp_path / "r.pt"
    weights = [t.float() / 10 for t in ids]
    torch.save({"topk_ids": {"layer_0": ids[0], "layer_1": ids[1]}, "topk_weights": weights}, path)
    out = tmp_path / "t.npz"
    assert main(["trace", "import", str(path), "-o", str(out), "--num-experts", "8"]) == 0
    assert "wrote" in capsys.readouterr().err
    t = load_trace(out)
    assert t.experts[:, 1].tolist() == ids[1].tolist() and t.num_experts == 8
    assert t.weights[2, 0].tolist() == pytest.approx([0.1, 0.5])

    class Evil:  # a pickled object: refused, never run
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"topk_ids": [Evil()]}, tmp_path / "evil.pt")
    assert main(["trace", "import", str(tmp_path / "evil.pt"), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert "ran" not in captured.out and captured.err.count("\n") == 1 and "\x1b" not in captured.err
    assert (
        "evil.pt: refused: the file holds Python objects, not only tensors (it names print; read with "
        "weights_only=True, so code in it is never run)" in captured.err
    )


@pytest.mark.parametrize(
    "content, words",
    [
        ('{"token_idx": 0, "layer": 0, "topk_ids": [1]}\nnot json\n', "line 2: not JSON"),
        ('{"token_idx": 0, "layer": 0}\n', "line 1: no 'topk_ids'"),
        ('{"token_idx": "x", "layer": 0, "topk_ids": [1]}\n', "'token_idx' must be an integer"),
        (
            '{"req_id": "a", "token_idx": 0, "layer": 0, "topk_ids": [1]}\n'
            '{"token_idx": 1, "layer": 0, "topk_ids": [1]}\n',
            "'req_id' is given for some records",
        ),  # fmt: skip
        (
            '{"req_id": "a", "token_idx": 0, "layer": 0, "topk_ids": [1]}\n' * 2,
            "a second record of request 'a'",
        ),
        (
            '{"token_idx": 0, "layer": 0, "topk_ids": [1], "topk_weights": [0.5, 0.5]}\n',
            "2 weights for 1 experts",
        ),
        ("", "no routing records"),
        (
            '{"token_idx": 0, "layer": 0, "topk_ids": [1], "topk_weights": ["a"]}\n',
            "must be a list of numbers",
        ),
        (
            '{"token_idx": 0, "layer": 0, "topk_ids": [1], "is_prefill": "maybe"}\n',
            "'is_prefill' must be 1, 0",
        ),
        (  # was taken as "not said" (no is_prefill at all), or as unknown (-1), at exit 0
            '{"token_idx": 0, "layer": 0, "topk_ids": [1], "phase": "warmup"}\n',
            "'phase' must be prefill or decode, or prompt or generate, got 'warmup'",
        ),
    ],
)
def test_bad_logs_are_one_line(tmp_path, capsys, content, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match=words.replace("(", r"\(").replace("[", r"\[")):
        import_trace(path)
    assert main(["trace", "import", str(path), "-o", str(tmp_path / "t.npz")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_import_cli_refuses_before_reading(tmp_path, capsys):
    for argv, words in [
        (
            ["trace", "import", str(tmp_path / "x.jsonl"), "-o", str(tmp_path / "no" / "t.npz")],
            "does not exist",
        ),
        (["trace", "import", str(tmp_path / "x.log"), "-o", str(tmp_path / "t.npz")], "give the format"),
        (["trace", "import", str(tmp_path / "x.jsonl"), "-o", str(tmp_path / "t.npz")], "no such file"),
        (
            ["trace", "import", str(tmp_path / "x.csv"), "-o", str(tmp_path / "t.npz"), "--num-experts", "0"],
            "--num-experts must be at least 1",
        ),  # fmt: skip
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def _import_cli(path: Path, capsys, *flags: str) -> tuple[int, str]:
    code = main(["trace", "import", str(path), "-o", str(path.with_suffix(".npz")), *flags])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "content, words",
    [
        (b"", "empty file"),
        (b"hello world\n", "not a file torch.save wrote of tensors (torch.load: KeyError"),
        (b"garbage" * 10, "not a file torch.save wrote of tensors (torch.load: Unsupported operand"),
        (None, "not a file torch.save wrote of tensors (torch.load: PytorchStreamReader failed reading zip"),
        ("numpy", "(it names numpy."),
    ],
)
def test_unreadable_torch_files_are_one_clean_line(tmp_path, capsys, content, words):
    path = tmp_path / "bad.pt"
    if content is None:  # a file torch.save wrote, cut in half
        torch.save([torch.zeros(3, 2, dtype=torch.long)], path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif content == "numpy":  # a numpy array is a Python object to weights_only=True
        torch.save({"topk_ids": np.zeros((3, 2, 2), dtype=np.int64)}, path)
    else:
        path.write_bytes(content)
    code, err = _import_cli(path, capsys)
    assert code == 2 and words in err and str(path) in err
    assert err.count("\n") == 1 and "\x1b" not in err and "Traceback" not in err


def test_torch_messages_lose_their_terminal_escapes():
    import pickle

    from expertcache.tools.trace_import import _load_error

    exc = pickle.UnpicklingError(
        "Weights only load failed. \x1b[1mtrust\x1b[0m the source.\n\tPlease file an issue: "
        "WeightsUnpickler error: \n\n\x1b[1mUnsupported\x1b[0m operand 103\n\nCheck the documentation of "
        "torch.load to learn more."
    )
    assert str(_load_error(Path("x.pt"), exc)) == (
        "x.pt: not a file torch.save wrote of tensors (torch.load: Unsupported operand 103)"
    )


def test_torch_forms_all_read_alike(tmp_path):
    ids = torch.tensor([[[1, 2], [0, 6]], [[3, 4], [6, 7]], [[1, 5], [2, 3]]])  # [T=3, L=2, K=2]
    weights = ids.float() / 10
    per_layer = [ids[:, 0], ids[:, 1]]
    forms = {
        "bare": ids,
        "list": per_layer,
        "tuple": tuple(per_layer),
        "dict": {1: per_layer[1], 0: per_layer[0]},
        "named": {"layer_0": per_layer[0], "layer_1": per_layer[1]},
        "ids": {"topk_ids": ids},
        "weighted": {"topk_ids": ids, "topk_weights": weights},
        "mixed": {"topk_ids": ids, "topk_weights": [weights[:, 0], weights[:, 1]]},
        "grad": {"topk_ids": per_layer, "topk_weights": weights.clone().requires_grad_()},
    }
    from expertcache.tools.trace_import import import_torch

    for name, obj in forms.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        trace = import_torch(tmp_path / f"{name}.pt")
        assert trace.experts.tolist() == ids.tolist() and trace.num_experts == 8, name
        if name in ("weighted", "mixed", "grad"):
            np.testing.assert_allclose(trace.weights, weights.numpy(), err_msg=name)
        else:
            assert trace.weights is None, name


@pytest.mark.parametrize(
    "obj, words",
    [
        (
            torch.tensor([[1, 2], [3, 4]]),
            "topk_ids: a tensor of shape [2, 2]; expected [tokens, layers, top-k]",
        ),
        (torch.ones(2, 1, 2), "expert ids must be integers, got torch.float32"),
        (torch.ones(2, 1, 2, dtype=torch.bfloat16), "expert ids must be integers, got torch.bfloat16"),
        (torch.zeros(0, 2, 2, dtype=torch.long), "no routing (topk_ids has shape [0, 2, 2])"),
        (
            {
                "topk_ids": torch.zeros(2, 1, 2, dtype=torch.long) + torch.tensor([0, 1]),
                "topk_weights": torch.ones(2, 2),
            },
            "topk_weights: a tensor of shape [2, 2]",
        ),
        (
            {"topk_ids": torch.tensor([[[0, 1]]]), "topk_weights": torch.ones(1, 1, 3)},
            "topk_weights has shape [1, 1, 3] as [tokens, layers, top-k], topk_ids [1, 1, 2]",
        ),
        (
            {0: torch.tensor([[0, 1]]), "layer_0": torch.tensor([[0, 1]])},
            "two keys name the same layer number",
        ),
        ("text", "expected a [tokens, layers, top-k] tensor, or a list or dict of per-layer"),
    ],
)
def test_bad_torch_forms_are_one_line(tmp_path, capsys, obj, words):
    path = tmp_path / "bad.pt"
    torch.save(obj, path)
    code, err = _import_cli(path, capsys)
    assert code == 2 and words in err and err.count("\n") == 1, err


def test_a_repeated_expert_is_refused_in_every_format(tmp_path, capsys):
    jsonl = _jsonl(
        tmp_path / "r.jsonl",
        [
            {"req_id": "a", "token_idx": 0, "layer": 0, "topk_ids": [1, 2]},
            {"req_id": "a", "token_idx": 1, "layer": 3, "topk_ids": [4, 4]},
        ],
    )
    ids_csv = tmp_path / "ids.csv"
    ids_csv.write_text("token_idx,layer,topk_ids\n0,0,1 2\n0,1,5 5\n")
    cols_csv = tmp_path / "cols.csv"
    cols_csv.write_text("token_idx,layer,expert_0,expert_1\n0,0,1,2\n1,0,7,7\n")
    pt = tmp_path / "r.pt"
    torch.save(torch.tensor([[[0, 1], [2, 3]], [[0, 1], [6, 6]]]), pt)
    for path, words in [
        (jsonl, "r.jsonl: line 2: expert 4 appears twice in the top-k of request 'a', token 1, layer 3"),
        (ids_csv, "ids.csv: line 3: expert 5 appears twice in the top-k of token 0, layer 1"),
        (cols_csv, "cols.csv: line 3: expert 7 appears twice in the top-k of token 1, layer 0"),
        (pt, "r.pt: expert 6 appears twice in the top-k of token 1, layer 1"),
    ]:
        code, err = _import_cli(path, capsys)
        assert code == 2 and words in err and err.count("\n") == 1, err
    # unknown slots (-1) may repeat
    ok = tmp_path / "ok.csv"
    ok.write_text("token_idx,layer,topk_ids\n0,0,1 2\n1,0,-1 -1\n")
    trace, notes = import_trace(ok)
    assert trace.experts[1, 0].tolist() == [-1, -1] and notes == []


def test_rows_with_fewer_ids_than_top_k_are_reported(tmp_path, capsys):
    path = tmp_path / "r.csv"
    path.write_text("token_idx,layer,topk_ids\n0,0,1 2\n0,1,3\n1,0,4 5\n1,1,6\n")
    trace, notes = import_trace(path)
    assert trace.experts[:, 1].tolist() == [[3, -1], [6, -1]]
    assert notes == [
        "2 of 4 rows have fewer than 2 expert ids (top-k is the widest row's); the first: line 3 (token 0, "
        "layer 1); their missing slots are unknown (-1)"
    ]
    code, err = _import_cli(path, capsys)
    assert code == 0 and "note: 2 of 4 rows have fewer than 2 expert ids" in err
    cols = tmp_path / "cols.jsonl"  # JSON lines alike, naming the request
    _jsonl(
        cols,
        [
            {"req_id": "a", "token_idx": 0, "layer": 0, "topk_ids": [1, 2, 3]},
            {"req_id": "a", "token_idx": 1, "layer": 0, "topk_ids": [1, 2]},
        ],
    )
    assert "the first: line 2 (request 'a', token 1, layer 0)" in import_trace(cols)[1][0]


def test_weights_on_some_records_only_say_which(tmp_path, capsys):
    dummy = [{"req_id": "dummy", "token_idx": t, "layer": 0, "topk_ids": [1, 2]} for t in range(3)]
    path = _jsonl(tmp_path / "r.jsonl", dummy + _routes("a", 2, 1, 1))
    code, err = _import_cli(path, capsys)
    assert code == 0 and "left out 3 leading profiling rows" in err
    code, err = _import_cli(path, capsys, "--keep-profiling")
    assert code == 2 and err.count("\n") == 1
    assert (
        "r.jsonl: the kept profiling run's records (request 'dummy') have no topk_weights while the others "
        "do: import without --keep-profiling, or give the profiling records weights" in err
    )
    # the other way round: weighted profiling records, left out, no longer spoil the rest
    weighted = [{**r, "topk_weights": [0.5, 0.5]} for r in dummy]
    plain = [{k: v for k, v in r.items() if k != "topk_weights"} for r in _routes("a", 2, 1, 1)]
    other = _jsonl(tmp_path / "o.jsonl", weighted + plain)
    trace, _ = import_trace(other)
    assert trace.weights is None and trace.num_tokens == 2
    with pytest.raises(TraceError, match="have topk_weights while the others do not"):
        import_trace(other, skip_profiling=False)
    # no profiling run: the first record that differs from those before it is named
    mixed = _jsonl(tmp_path / "m.jsonl", _routes("a", 2, 1, 1) + [{**plain[0], "req_id": "b"}])
    code, err = _import_cli(mixed, capsys)
    assert code == 2 and err.count("\n") == 1
    assert (
        "m.jsonl: line 3: request 'b', token 0, layer 0 has no topk_weights while the records before it "
        "have them: give every record topk_weights, or none" in err
    )


def test_cut_and_overlong_csv_rows_a_byte_order_mark_and_the_input_as_output(tmp_path, capsys):
    """A row cut short (what a killed logger leaves) was a traceback; a row with more fields than the
    header lost them silently; Excel's byte-order mark hid the header; and -o naming the input
    overwrote it (a new user found all four)."""
    for rows, words in (("0,0,1 2\n1\n", "line 3: 1 field(s), the header has 3"),
                        ("0,0,1 2,x\n", "line 2: 4 field(s), the header has 3")):  # fmt: skip
        path = tmp_path / "cut.csv"
        path.write_text("token_idx,layer,topk_ids\n" + rows)
        with pytest.raises(TraceError, match=re.escape(words)):
            import_trace(path)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbftoken_idx,layer,topk_ids\n0,0,1 2\n")
    assert import_trace(bom, num_experts=4)[0].num_tokens == 1
    log = tmp_path / "log.jsonl"
    log.write_text('{"token_idx": 0, "layer": 0, "topk_ids": [1, 2]}\n')
    before = log.read_bytes()
    assert main(["trace", "import", str(log), "-o", str(log)]) == 2
    assert "is the input itself" in capsys.readouterr().err and log.read_bytes() == before
    batched = tmp_path / "t.npz"
    default_trace().save(batched)
    assert main(["trace", "batch", str(batched), "-c", "4", "-o", str(batched)]) == 2
    assert "is the input itself" in capsys.readouterr().err


def test_an_unknown_format_given_in_python_is_named_and_torch_is_sent_to_its_reader(tmp_path):
    """``import_trace(path, fmt="xml")`` said "give the format" without naming 'xml', and offered
    ``fmt="torch"``, which it refuses (a new user's trial)."""
    from expertcache.trace.importers import import_trace

    log = tmp_path / "x.log"
    log.write_text("a")
    with pytest.raises(TraceError, match=r"fmt='xml' is not one; give the format \(fmt= jsonl or csv, or "
                       r"tools.trace_import.import_torch for .pt\)"):  # fmt: skip
        import_trace(log, fmt="xml")
