"""``expertcache trace import``: routing logs as JSON lines (vLLM loggers), CSV and torch tensors, into
traces; profiling rows left out and reported; bad logs one line each."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from expertcache.cli import main
from expertcache.errors import TraceError
from expertcache.trace import load_trace
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


def test_jsonl_without_request_ids_splits_where_token_idx_goes_back(tmp_path):
    # a dummy run routes every token alike: left out; then two requests, told apart by token_idx
    dummy = [{"token_idx": t, "layer": layer, "topk_ids": [0, 1]} for t in range(3) for layer in range(2)]
    real = [
        {k: v for k, v in r.items() if k != "req_id"} for r in _routes("x", 3, 2, 3) + _routes("y", 2, 2, 4)
    ]
    trace, notes = import_trace(_jsonl(tmp_path / "r.jsonl", dummy + real))
    assert "every token routed alike" in notes[0]
    assert trace.seq_id.tolist() == [0, 0, 0, 1, 1]


def test_gaps_are_unknown_entries(tmp_path):
    records = _routes("a", 2, 3, 5)
    del records[4]  # token 1, layer 1
    trace, _ = import_trace(_jsonl(tmp_path / "r.jsonl", records))
    assert (trace.experts[1, 1] == -1).all() and (trace.experts[0] >= 0).all()
    assert trace.weights[1, 1].tolist() == [0, 0]  # an unknown entry's weight reads as 0


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
    assert "only files of plain tensors are" in captured.err and "ran" not in captured.out


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
