"""Generation as people use it: prompts from flags, files and pipes, left-padded batches, sampling, stop
strings, chat, Hugging Face ids in the local cache, output that pipes cleanly, work kept on Ctrl-C."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import engine_load

from expertcache.cache.recorder import Recorder
from expertcache.cli import main
from expertcache.config import SamplingConfig
from expertcache.engine.generation import finish
from expertcache.engine.loader import load_reference
from expertcache.errors import ExpertcacheError
from expertcache.tools.prompts import read_prompt_items
from expertcache.trace import load_trace

_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir

PROMPTS = ["hello world", "the quick brown fox jumps over"]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def gen(capsys, path, *extra: str, new: int = 4) -> tuple[int, str, str]:
    return run(
        capsys, "generate", "--model", str(path), "--device", "cpu", "--max-new-tokens", str(new), *extra
    )


def one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2, (out, err)
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("expertcache: error: "), err
    return lines[0]


# ------------------------------------------------------------------------------------ batches
def test_a_batch_is_padded_on_the_left_and_equals_the_reference_batch(ckpt):
    path = ckpt("mixtral")
    with engine_load(path, 4) as model:
        results = model.generate_text(PROMPTS, max_new_tokens=5)
        tok = model.tokenizer
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
        assert tok.padding_side == "left" and (enc.attention_mask[0, :1] == 0).all()  # row 0 is shorter
        singles = [model.generate_text(p, max_new_tokens=5) for p in PROMPTS]
    with torch.inference_mode():
        ref = load_reference(path).generate(
            enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=5, do_sample=False,
            pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    width = enc.input_ids.shape[1]
    for row, g in enumerate(results):
        want = ref[row, width:].tolist()
        assert g.tokens == want[: len(g.tokens)] and len(g.tokens) >= 1
        assert g.batch_size == 2 and g.prompt_tokens == int(enc.attention_mask[row].sum())
    assert results[1].tokens == singles[1].tokens  # the longest row has no padding at all


def test_a_list_of_prompts_runs_in_batches_of_batch_size(ckpt):
    with engine_load(ckpt("qwen2_moe"), 8) as model:
        results = model.generate_text(PROMPTS * 3, max_new_tokens=3, batch_size=4)
    assert [g.batch_size for g in results] == [4, 4, 4, 4, 2, 2]
    assert results[0].tokens == results[2].tokens == results[4].tokens


def test_generate_prompts_file_writes_json_lines_in_order(capsys, ckpt, tmp_path):
    path = ckpt("mixtral")
    plain = tmp_path / "p.txt"
    plain.write_text("hello world\n\nthe quick\\nbrown fox\n")
    code, out, err = gen(capsys, path, "--prompts", str(plain), "--batch-size", "1")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == [1, 3] and [r["batch"] for r in rows] == [0, 1]
    with engine_load(path) as model:
        want = model.generate_text(["hello world", "the quick\nbrown fox"], max_new_tokens=4, batch_size=1)
    assert [r["tokens"] for r in rows] == [g.tokens for g in want]
    assert "2/2 prompts done" in err and "host level" not in err
    # each batch's line has the timings and the bytes a single generation's table has (it had neither)
    assert re.search(
        r"batch 1: 1 prompt\(s\), \d+ new tokens .* TTFT [\d.]+ ms \| TPOT [\d.]+ ms \| .* moved ", err
    )
    code, out, _ = gen(capsys, path, "--prompts", str(plain), "--record-trace", str(tmp_path / "t.npz"))
    assert code == 0 and all(
        json.loads(line)["trace"] == str(tmp_path / "t.npz") for line in out.splitlines()
    )
    # the batch's shorter prompt was padded on the left: its padding is routed (the replay keeps it) and
    # marked, and trace info counts the prompts' own tokens (it counted the padding among them)
    from transformers import AutoTokenizer

    from expertcache.trace.stats import summary

    trace = load_trace(tmp_path / "t.npz")
    enc = AutoTokenizer.from_pretrained(path)
    lengths = [len(enc(t)["input_ids"]) for t in ("hello world", "the quick\nbrown fox")]
    pad = abs(lengths[0] - lengths[1])
    assert pad and int(trace.padding.sum()) == pad and (trace.is_prefill[trace.padding == 1] == 1).all()
    assert summary(trace)["prefill_tokens"] == sum(lengths)
    assert main(["trace", "info", str(tmp_path / "t.npz")]) == 0
    assert f"(prefill tokens: {sum(lengths)}, and {pad} rows of left padding)" in capsys.readouterr().out
    code, out, err = gen(
        capsys, path, "--prompts", str(plain), "--expert-memory", "40%", "--host-memory", "60%"
    )
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("batch 0:"))
    hits, misses = (int(x) for x in re.search(r"host level hits (\d+), misses (\d+)", line).groups())
    assert hits + misses == int(re.search(r"\| misses (\d+) \|", line).group(1)) > 0
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "hello world", "id": "a"}) + "\n" + json.dumps("the quick") + "\n")
    code, out, err = gen(capsys, path, "--prompts", str(jsonl), "--quiet")
    assert code == 0 and err == ""
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == ["a", 2] and rows[0]["tokens"] == want[0].tokens[
        : len(rows[0]["tokens"])
    ]


def test_prompts_from_stdin_and_from_a_file(capsys, ckpt, tmp_path, monkeypatch):
    path = ckpt("mixtral")
    code, out, _ = gen(capsys, path, "--prompt", "hello world", "--json")
    want = json.loads(out)["tokens"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello world"))
    code, out, err = gen(capsys, path, "--prompt", "-", "--json")
    assert code == 0, err
    assert json.loads(out)["tokens"] == want
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello world\r\n"))  # a Windows line end, as --prompts
    code, out, err = gen(capsys, path, "--prompt", "-", "--json")  # reads its lines (the \r was kept)
    assert code == 0 and json.loads(out)["tokens"] == want, err
    f = tmp_path / "prompt.txt"
    f.write_text("hello world")
    code, out, err = gen(capsys, path, "--prompt-file", str(f), "--json", "--echo")
    assert json.loads(out)["tokens"] == want and json.loads(out)["prompt"] == "hello world"
    code, out, err = gen(capsys, path, "--prompt-file", str(f), "--echo", "--quiet")
    assert out.startswith("hello world") and err == ""


def test_read_prompt_items_refuses_bad_json_lines(tmp_path):
    f = tmp_path / "p.jsonl"
    for text, words in [
        ('{"prompt": 3}', '"prompt" must be text'),
        ('{"prompt": "a", "messages": []}', 'an object with "prompt" or "messages"'),
        ('{"prompt": "a", "max_tokens": 3}', "unknown key"),
        ("{oops", "not JSON"),
    ]:
        f.write_text(text + "\n")
        with pytest.raises(ExpertcacheError, match=words):
            read_prompt_items(f)
    f.write_text("\n\n")
    with pytest.raises(ExpertcacheError, match="no prompts"):
        read_prompt_items(f)


# ------------------------------------------------------------------------------------ sampling
def test_sampling_repeats_with_a_seed_and_reports_a_drawn_one(ckpt):
    with engine_load(ckpt("olmoe"), 8) as model:
        s = SamplingConfig(temperature=1.5, top_k=50, seed=7)
        a = model.generate_text("hello", 8, sampling=s)
        b = model.generate_text("hello", 8, sampling=s)
        greedy = model.generate_text("hello", 8)
        drawn = model.generate_text("hello", 8, sampling=SamplingConfig(temperature=1.5))
        again = model.generate_text("hello", 8, sampling=SamplingConfig(temperature=1.5, seed=drawn.seed))
    assert a.tokens == b.tokens and a.seed == 7 and greedy.seed is None
    assert drawn.seed is not None and again.tokens == drawn.tokens


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--top-p", "0.9"], "--top-p is for sampling: give --temperature > 0"),
        (["--seed", "3"], "--seed is for sampling"),
        (["--temperature", "-1"], "temperature must be"),
        (["--temperature", "1", "--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
        (["--temperature", "1", "--top-k", "0"], "--top-k must be at least 1"),
        (["--temperature", "1", "--top-k", "100000"], "top-k 100000 is more than the vocabulary's"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
        (["--stop", ""], "stop strings must be non-empty"),
        (["--batch-size", "4"], "--batch-size is for --prompts FILE"),  # not ignored (a new user's)
        (["--chat-template", "x.jinja"], "--chat-template needs --chat"),
    ],
)
def test_bad_sampling_options_are_one_line(capsys, ckpt, extra, words):
    import re

    line = one_line_error(*gen(capsys, ckpt("mixtral"), "--prompt", "hi", *extra))
    assert re.search(words, line), line


def test_a_stop_string_cuts_the_text(ckpt):
    with engine_load(ckpt("mixtral"), 8) as model:
        full = model.generate_text("hello world", 12)
        assert len(full.text) > 3
        stop = full.text[2:4]
        cut = model.generate_text("hello world", 12, sampling=SamplingConfig(stop=(stop,)))
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    assert cut.tokens == full.tokens[: len(cut.tokens)] and len(cut.tokens) <= len(full.tokens)


def test_finish_cuts_at_eos_then_at_a_stop_string():
    decode = lambda ts: "".join(chr(96 + t) for t in ts)  # noqa: E731  1 -> "a", 2 -> "b", ...
    assert finish([1, 2, 0, 3], decode, {0}, ()) == ([1, 2, 0], "ab`", "eos")
    assert finish([1, 2, 3, 4], decode, {0}, ("bc",)) == ([1, 2, 3], "a", "stop")
    assert finish([1, 2], decode, {0}, ("z",)) == ([1, 2], "ab", "length")


# ------------------------------------------------------------------------------------ chat
def test_chat_mode_needs_a_template_and_uses_the_one_given(capsys, ckpt, tmp_path):
    path = ckpt("mixtral")
    line = one_line_error(*gen(capsys, path, "--prompt", "hi", "--chat"))
    assert "no chat template" in line and "--chat-template" in line
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    code, out, err = gen(capsys, path, "--prompt", "hi", "--chat", "--chat-template", str(template), "--json")
    assert code == 0, err
    with engine_load(path) as model:
        model.tokenizer.chat_template = TEMPLATE
        want = model.generate_text("user: hi\nassistant:", 4)
        convo = model.generate_text([{"role": "user", "content": "hi"}], 4, chat=True)
    assert json.loads(out)["tokens"] == want.tokens == convo.tokens
    # --echo prints what the model saw, the conversation through the template (it printed "hi" alone)
    code, out, err = gen(capsys, path, "--prompt", "hi", "--chat", "--chat-template", str(template), "--echo")
    assert code == 0 and out.startswith("user: hi\nassistant:") and out.endswith(want.text + "\n"), (out, err)


def test_the_embedded_model_has_a_plain_chat_template():
    from transformers import AutoTokenizer

    from expertcache.engine.generation import render
    from expertcache.engine.hub import DEFAULT_MODEL

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    text = render(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], True)
    assert text == "<|endoftext|># system: be brief\n# user: hi\n# assistant:\n"
    text = render(tok, [{"role": "user", "content": "import os\ndef f():"}], True)  # each line a comment
    assert text == "<|endoftext|># user: import os\n# def f():\n# assistant:\n"


def test_chat_command_keeps_a_conversation_on_stdin(capsys, ckpt, tmp_path, monkeypatch):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/stats\nmore \\\ntext\n/reset\nagain\n"))
    code, out, err = run(
        capsys, "chat", "--model", str(ckpt("mixtral")), "--device", "cpu", "--max-new-tokens", "3",
        "--chat-template", str(template), "--expert-memory", "25%",
    )  # fmt: skip
    assert code == 0, err
    assert err.count("tokens,") == 3  # three turns answered; /stats and /reset are commands
    assert "hits" in err and "conversation forgotten" in err
    assert out.count("\n") == 3  # one reply a line on stdout, nothing else


def test_chat_records_the_conversations_routing_and_it_replays_to_the_same_counts(
    capsys, ckpt, tmp_path, monkeypatch
):
    """``chat --record-trace``: the whole conversation's routing, written when it ends (end of input, or
    Ctrl-C at the prompt), replayed by the timing model to the chat's own hits and misses; a chat that ends
    before any turn says it wrote nothing; an unwritable path is refused before the model loads."""
    from expertcache.sim.timing import simulate_timing
    from expertcache.trace import load_trace

    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    chat = ["chat", "--model", str(ckpt("mixtral")), "--device", "cpu", "--max-new-tokens", "3",
            "--chat-template", str(template), "--expert-memory", "25%", "--prefetch", "none"]  # fmt: skip
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/stats\nagain\n/stats\n"))
    path = tmp_path / "chat.npz"
    code, out, err = run(capsys, *chat, "--record-trace", str(path))
    assert code == 0, err
    assert f"trace written to {path}" in err
    *_, last = [line for line in err.splitlines() if line.startswith("hits ")]  # the second /stats
    hits, misses = (int(last.split()[i]) for i in (1, 4))
    trace = load_trace(path)
    assert trace.meta["policy"] == "lru" and len(set(trace.seq_id.tolist())) == 2  # two turns
    replay = simulate_timing(trace, trace.meta["capacity"], cache="lru").cache
    assert (replay["hits"], replay["misses"]) == (hits, misses)

    class CtrlC(io.StringIO):  # a turn, then Ctrl-C at the prompt: the chat so far is kept
        def readline(self, *args):
            if self.getvalue() and not getattr(self, "done", False):
                self.done = True
                return "hello\n"
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdin", CtrlC("x"))
    path.unlink()
    code, out, err = run(capsys, *chat, "--record-trace", str(path))
    assert code == 130 and path.is_file() and f"trace written to {path}" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, out, err = run(capsys, *chat, "--record-trace", str(tmp_path / "none.npz"))
    assert code == 0 and "no trace written" in err and not (tmp_path / "none.npz").exists()
    code, out, err = run(capsys, *chat, "--record-trace", str(tmp_path / "no" / "such.npz"))
    assert code == 2 and err.count("\n") == 1 and "trace" in err


# ------------------------------------------------------------------------------------ hub ids
def test_a_hugging_face_id_is_found_in_the_local_cache_and_never_downloaded(ckpt, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--tiny-org--tiny-moe"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    shutil.copytree(ckpt("mixtral"), repo / "snapshots" / "0123abcd")
    from expertcache.engine import load

    with load("tiny-org/tiny-moe", "50%", device="cpu", progress=False) as model:
        assert model.path == repo / "snapshots" / "0123abcd"
        assert len(model.generate_text("hello", 2).tokens) >= 1
    with pytest.raises(ExpertcacheError, match="not in the local Hugging Face cache.*hf download other/moe"):
        load("other/moe", device="cpu")


# ------------------------------------------------------------------------------------ pipes, Ctrl-C
def test_piping_into_head_prints_no_traceback(ckpt):
    cmd = [sys.executable, "-m", "expertcache.cli", "generate", "--model", str(ckpt("mixtral")), "--device",
           "cpu", "--prompt", "hello", "--max-new-tokens", "40", "--stream", "--json"]  # fmt: skip
    p = subprocess.run(f"{' '.join(cmd)} | head -1", shell=True, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 1
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def test_ctrl_c_keeps_the_trace_of_what_was_generated(capsys, ckpt, tmp_path, monkeypatch):
    from expertcache.engine.offloaded import OffloadedModel

    original = OffloadedModel.generate_text

    def interrupted(self, prompt, max_new_tokens=32, *a, **kw):
        original(self, prompt, 2, *a, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(OffloadedModel, "generate_text", interrupted)
    out_file = tmp_path / "t.npz"
    code, out, err = gen(capsys, ckpt("mixtral"), "--prompt", "hello", "--record-trace", str(out_file))
    assert code == 130 and "interrupted" in err and f"trace written to {out_file}" in err
    assert load_trace(out_file).num_tokens >= 2


@pytest.mark.parametrize("steps", [0, 2])
def test_a_failed_run_says_what_became_of_its_trace_after_the_error(
    capsys, ckpt, tmp_path, monkeypatch, steps
):
    """A new user's trial: a policy that failed at the first step printed "no trace written" before the
    error that explained why; the error comes first, then what was kept of the steps before it."""
    from expertcache.engine.offloaded import OffloadedModel

    original = OffloadedModel.generate_text

    def failing(self, prompt, max_new_tokens=32, *a, **kw):
        if steps:
            original(self, prompt, steps, *a, **kw)
        raise ExpertcacheError("policy broken: its victim is not resident")

    monkeypatch.setattr(OffloadedModel, "generate_text", failing)
    out_file = tmp_path / "t.npz"
    code, out, err = gen(capsys, ckpt("mixtral"), "--prompt", "hello", "--record-trace", str(out_file))
    lines = [line for line in err.splitlines() if line.startswith("expertcache:")]
    assert code == 2 and lines[0] == "expertcache: error: policy broken: its victim is not resident", err
    if steps:
        assert lines[1] == f"expertcache: trace written to {out_file} (the steps before the run stopped)"
        assert load_trace(out_file).num_tokens >= steps
    else:
        assert lines[1].startswith("expertcache: no trace written: ") and not out_file.exists()


def test_a_step_cut_off_before_its_last_layer_is_left_out_of_the_trace():
    rec = Recorder(num_layers=2, num_experts=4, top_k=1)
    for layers in (2, 1):  # the second step stops after one layer
        rec.begin(np.array([5]), False, np.array([0]))
        for layer in range(layers):
            rec.add(layer, np.array([[layer]]), None)
    assert rec.trace().num_tokens == 1
    rec = Recorder(num_layers=2, num_experts=4, top_k=1)
    for step in range(2):
        rec.begin(np.array([6]), False, np.array([0]))
        rec.add(1, np.array([[3]]), None)  # the last layer, twice in the second step, but no first layer
        if step == 0:
            rec.add(0, np.array([[2]]), None)
    rec.add(1, np.array([[3]]), None)
    assert rec.trace().num_tokens == 1


def test_the_recorder_gives_each_step_its_routing_in_token_layer_order():
    rec = Recorder(num_layers=3, num_experts=8, top_k=2)
    rng = np.random.default_rng(0)
    steps = [(np.array([1, 2, 3]), True), (np.array([4]), False), (np.array([5]), False)]
    want_e, want_w = [], []
    for tokens, prefill in steps:
        rec.begin(tokens, prefill, np.zeros(len(tokens), np.int32))
        e = np.array([[rng.choice(8, 2, replace=False) for _ in tokens] for _ in range(3)])
        w = rng.random((3, len(tokens), 2)).astype(np.float32)
        for layer in (2, 0, 1):  # any order
            rec.add(layer, e[layer], w[layer] if layer != 1 else None)  # layer 1 without weights
        w[1] = 0
        want_e.append(e.transpose(1, 0, 2))
        want_w.append(w.transpose(1, 0, 2))
    trace = rec.trace()
    assert trace.experts.dtype == np.int16 and np.array_equal(trace.experts, np.concatenate(want_e))
    assert np.array_equal(trace.weights, np.concatenate(want_w))
    assert trace.is_prefill.tolist() == [1, 1, 1, 0, 0] and trace.step_id.tolist() == [0, 0, 0, 1, 2]
    assert trace.token_id.tolist() == [1, 2, 3, 4, 5]


def test_streamed_text_stops_where_the_result_does(capsys, ckpt):
    path = ckpt("mixtral")
    code, out, _ = gen(capsys, path, "--prompt", "hello world", "--json", new=12)
    text = json.loads(out)["text"]
    stop = text[3:5]
    code, out, _ = gen(capsys, path, "--prompt", "hello world", "--json", "--stop", stop, new=12)
    cut = json.loads(out)
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.find(stop)]
    code, out, err = gen(capsys, path, "--prompt", "hello world", "--stop", stop, new=12)
    assert code == 0 and out == cut["text"] + "\n" and "(stop)" in err


def test_text_that_may_start_a_stop_string_is_held_back():
    from expertcache.engine.generation import held_back as _held_back

    assert _held_back("abc<", ("<end>",)) == 1 and _held_back("abc<en", ("<end>",)) == 3
    assert _held_back("abc", ("<end>",)) == 0 and _held_back("abc", ()) == 0


def test_a_chat_prompt_may_be_a_json_conversation_and_an_empty_prompt_is_refused(capsys, ckpt, tmp_path):
    path = ckpt("mixtral")
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    chat = ("--chat", "--chat-template", str(template), "--json")
    convo = json.dumps([{"role": "user", "content": "hi"}])
    code, out, err = gen(capsys, path, "--prompt", convo, *chat)
    code2, out2, _ = gen(capsys, path, "--prompt", "hi", *chat)
    assert code == code2 == 0 and json.loads(out)["tokens"] == json.loads(out2)["tokens"]
    code, out, err = gen(capsys, path, "--prompt", "[1, 2] sorted", *chat)  # text that starts with [
    assert code == 0, err
    assert "the prompt is empty" in one_line_error(*gen(capsys, path, "--prompt", ""))


def test_a_stop_string_is_matched_in_the_new_text_only(ckpt):
    with engine_load(ckpt("mixtral"), 8) as model:
        full = model.generate_text("hello world", 12)
        spanning = "world" + full.text[:2]  # begins in the prompt, ends in the reply
        assert spanning not in full.text
        g = model.generate_text("hello world", 12, sampling=SamplingConfig(stop=(spanning,)))
    assert g.tokens == full.tokens and g.finish_reason == full.finish_reason


def test_chat_survives_a_turn_that_fails_and_keeps_the_conversation_before_it(
    capsys, ckpt, tmp_path, monkeypatch
):
    """The oldest turns were dropped to fit a turn before it ran, and stayed dropped when it failed: the
    conversation after a too-long turn had lost everything said before it."""
    from expertcache.engine.offloaded import OffloadedModel

    sent = []
    real = OffloadedModel.generate_text

    def recording(self, prompt, *args, **kwargs):
        sent.append([m["content"] for m in prompt])
        return real(self, prompt, *args, **kwargs)

    monkeypatch.setattr(OffloadedModel, "generate_text", recording)
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    long_turn = "hello world, " * 2000  # more tokens than the tiny model's context, alone
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"first\n{long_turn}\n/stat\nhi\n"))
    code, out, err = run(
        capsys, "chat", "--model", str(ckpt("mixtral")), "--device", "cpu", "--max-new-tokens", "3",
        "--chat-template", str(template),
    )  # fmt: skip
    assert code == 0, err
    assert (
        "turn dropped: prompt of" in err and "exceeds the model's context" in err
    )  # not an error: it goes on
    assert "unknown command /stat" in err and "exchange(s) dropped" not in err
    assert err.count("tokens,") == 2  # "first", and "hi" after the failed turn
    assert sent[0] == ["first"] and len(sent) == 3 and sent[1][-1] == long_turn
    assert sent[2][0] == "first" and sent[2][-1] == "hi" and len(sent[2]) == 3  # first, its reply, hi


def test_ctrl_c_in_a_chat_reply_stops_that_reply_and_the_conversation_goes_on(
    capsys, ckpt, tmp_path, monkeypatch
):
    """Ctrl-C while a reply streams ends that reply (kept as far as it got) and reads the next turn; it
    ended the whole conversation with exit 0."""
    import signal

    from expertcache.cli import generate as cli_gen

    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    original, seen = cli_gen._text_out, []

    def text_out(tokenizer, stop=()):
        streamer = original(tokenizer, stop)
        show = streamer.on_finalized_text

        def on_text(text, stream_end=False):
            seen.append(text)
            if len(seen) == 2:  # the user presses Ctrl-C while the first reply streams
                signal.raise_signal(signal.SIGINT)
            show(text, stream_end)

        streamer.on_finalized_text = on_text
        return streamer

    monkeypatch.setattr(cli_gen, "_text_out", text_out)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
    # Python's own handler, as in a terminal: a test run started in the background of a script inherits
    # SIGINT ignored, and the reply restores whatever was there before it
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, out, err = run(
            capsys, "chat", "--model", str(ckpt("mixtral")), "--device", "cpu", "--max-new-tokens", "12",
            "--chat-template", str(template), "--stop", "NEVER-SEEN",  # the user's stop criteria stay
        )  # fmt: skip
        handler = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert code == 0, err
    turns = [line for line in err.splitlines() if line.startswith("[")]
    assert len(turns) == 2 and "stopped by Ctrl-C" in turns[0] and "stopped" not in turns[1]
    assert int(turns[0][1:].split()[0]) < 12 and turns[1].startswith("[12 tokens")
    assert handler is signal.default_int_handler  # restored after each reply


def test_a_chat_says_its_refusals_under_quiet_reports_its_seed_and_refuses_a_reply_longer_than_the_context(
    capsys, ckpt, tmp_path, monkeypatch
):
    """A new user's trial: --quiet hid "unknown command"; a sampled chat never said its seed; and
    --max-new-tokens beyond the context was taken, every turn then failed, and the chat ended with 0."""
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    chat = ["chat", "--model", str(ckpt("mixtral")), "--device", "cpu", "--chat-template", str(template)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("/foo\nhello\n"))
    code, out, err = run(capsys, *chat, "--max-new-tokens", "3", "--quiet")
    assert code == 0 and err.startswith("expertcache: unknown command /foo, not sent to the model; commands")
    assert out
    sampled = [*chat, "--max-new-tokens", "6", "--temperature", "0.9"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
    code, first, err = run(capsys, *sampled)
    assert code == 0, err
    seed = err.split("sampling with seed ")[1].split()[0]
    assert f"(--seed {seed} repeats the conversation)" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
    code, again, err = run(capsys, *sampled, "--seed", seed)
    assert code == 0 and again == first and "sampling with seed" not in err  # the seed repeats it
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(ckpt("mixtral")).max_position_embeddings
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    line = one_line_error(*run(capsys, *chat, "--max-new-tokens", str(limit - 1)))  # the turn needs more
    assert f"--max-new-tokens {limit - 1} leaves no room for a turn in the model's context of {limit}" in line
    most = int(line.rsplit("give at most ", 1)[1])
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    code, out, err = run(capsys, *chat, "--max-new-tokens", str(most))  # the most it takes: a turn runs
    assert code == 0 and "exceeds" not in err, err


def test_a_chat_ends_at_the_end_of_input_after_a_turn_left_open_and_with_130_at_ctrl_c(
    capsys, ckpt, tmp_path, monkeypatch
):
    """A terminal's Ctrl-D is not lasting (read again, it waits for more): after a pending turn the chat
    went on waiting. Ctrl-C at the prompt ended it with 0, where every command gives 130."""
    from expertcache.cli.generate import _read_turn

    class CtrlC(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    monkeypatch.setattr(sys, "stdin", CtrlC())
    chat = ["chat", "--model", str(ckpt("mixtral")), "--device", "cpu", "--chat-template", str(template)]
    code, out, err = run(capsys, *chat)
    assert code == 130 and err.endswith("expertcache: interrupted\n") and out == ""

    class Terminal:  # a line left open by a backslash, Ctrl-D, and whatever is typed after
        def __init__(self):
            self.buffer = io.BytesIO(b"first \\\n")
            self.more = [b"second\n"]

        def readline(self):
            got = self.buffer.readline()
            if not got and self.more:
                self.buffer = io.BytesIO(self.more.pop())
            return got

    ended = [False]
    monkeypatch.setattr(sys, "stdin", Terminal())
    assert _read_turn(False, ended) == "first "
    assert ended == [True] and _read_turn(False, ended) is None  # "second" is never read


def test_bad_input_that_needs_the_model_is_one_line(capsys, ckpt, tmp_path, monkeypatch):
    path = ckpt("mixtral")
    bad = tmp_path / "bad.jinja"
    bad.write_text("not a template {% for")
    line = one_line_error(*gen(capsys, path, "--prompt", "x", "--chat", "--chat-template", str(bad)))
    assert "the chat template does not render" in line
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe bad\n")))
    line = one_line_error(*gen(capsys, path, "--prompt", "-"))
    assert "standard input: cannot read the prompt: not UTF-8 text (byte 0xff at position 0)" in line
    many = tmp_path / "p.txt"
    many.write_text("hello\n" + "hello world, " * 2000 + "\nworld\n")
    code, out, err = gen(capsys, path, "--prompts", str(many), "--batch-size", "1")
    assert out == "" and f"{many}:2: prompt of" in one_line_error(code, out, err)  # before batch 0
    line = one_line_error(*gen(capsys, path, "--prompts", str(many), "--batch-size", "0"))
    assert "--batch-size must be at least 1, got 0" in line
    assert "float7" in one_line_error(*gen(capsys, path, "--prompt", "x", "--dtype", "float7"))


def test_a_piped_prompt_loses_its_last_newline(capsys, ckpt, monkeypatch):
    path = ckpt("mixtral")
    code, out, _ = gen(capsys, path, "--prompt", "hello world", "--json")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello world\n"))
    code2, out2, _ = gen(capsys, path, "--prompt", "-", "--json")
    assert json.loads(out)["tokens"] == json.loads(out2)["tokens"]


def test_a_failed_download_says_so(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from expertcache.engine.hub import resolve_model

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ExpertcacheError, match="could not download it"):
        resolve_model("some-org/some-model", download=True)


def test_a_download_of_a_family_the_engine_cannot_run_stops_after_its_config(tmp_path, monkeypatch):
    """--download fetched every weight (hundreds of GB for Llama 4) before the family was refused."""
    import huggingface_hub

    from expertcache.engine.hub import resolve_model

    calls = []

    def fake(repo_id, allow_patterns=None, **kwargs):
        calls.append(allow_patterns)
        folder = tmp_path / "snap"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama4_text"}))
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(ExpertcacheError, match="unsupported architecture 'llama4_text': Llama 4's MoE block"):
        resolve_model("meta-llama/Llama-4-Scout-17B-16E", download=True)
    assert calls == [["config.json"]]


# ------------------------------------------------------------------------------------ start-up
_AS_PROGRAM = """
import atexit, gc, runpy, sys
atexit.register(lambda: print("gc", gc.isenabled(), gc.get_freeze_count(), file=sys.stderr))
sys.argv = ["expertcache", *sys.argv[1:]]
runpy.run_module("expertcache", run_name="__main__")
"""


def test_the_command_loads_without_the_collector_and_generates_the_same_tokens(capsys):
    """Run as a program, generate imports and loads with the cyclic collector off, then freezes what
    it loaded (start-up; cli.util.startup_gc): the collector is on again for generation and the tokens
    are those of main() called in-process, which freezes nothing (a test process would keep every
    model's cycles) and also leaves the collector on, after a failed load too."""
    import gc

    argv = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "8", "--device", "cpu", "--json"]
    frozen = gc.get_freeze_count()
    code, out, _ = run(capsys, *argv)
    assert code == 0 and gc.isenabled() and gc.get_freeze_count() == frozen
    code, _, err = run(capsys, *argv[:-1], "--model", "/nonexistent/checkpoint")
    assert code == 2 and "no such checkpoint" in err
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the in-process run (one torch thread)
    done = subprocess.run(
        [sys.executable, "-c", _AS_PROGRAM, *argv], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    _, enabled, count = done.stderr.strip().splitlines()[-1].split()
    assert enabled == "True" and int(count) > 100_000  # the modules and the model: about 560,000
    assert json.loads(done.stdout)["tokens"] == json.loads(out)["tokens"]


_HQQ_PROBE = """
import atexit, runpy, sys
def probe():
    import transformers.cache_utils as cu, transformers.utils as tu
    left = [n for n, m in sys.modules.items() if n.startswith("transformers")
            and getattr(m, "is_hqq_available", tu.is_hqq_available) is not tu.is_hqq_available]
    print("hqq", "hqq" in sys.modules, cu.is_hqq_available(), left, file=sys.stderr)
atexit.register(probe)
sys.argv = ["expertcache", *sys.argv[1:]]
runpy.run_module("expertcache", run_name="__main__")
"""


@pytest.mark.skipif(importlib.util.find_spec("hqq") is None, reason="hqq is not installed")
def test_generate_does_not_import_hqq_and_transformers_still_finds_it():
    """With hqq installed (the quant extra), transformers' cache_utils imports it at its own import for
    a quantised KV cache the engine never uses: 0.7-0.8 s of every start here. The engine imports
    cache_utils without it (lazy.defer_transformers_hqq); transformers' check still says hqq is there,
    no module of transformers keeps the stand-in check, and that cache's quantizer is hqq's when used."""
    argv = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "2", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _HQQ_PROBE, *argv], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "hqq False True []"
    used = (
        "import sys, expertcache.engine, transformers.cache_utils as cu; before = 'hqq' in sys.modules; "
        "quantize = cu.HQQQuantizer.quantize; from hqq.core.quantize import Quantizer; "
        "print(before, quantize == Quantizer.quantize)"
    )
    done = subprocess.run([sys.executable, "-c", used], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]  # the stand-in imports hqq when first used


def test_trace_info_says_how_a_recorded_run_was_laid_out(capsys, ckpt, tmp_path):
    """A new user's idea: `trace info` on a trace the engine recorded gave routing statistics alone, where
    the run's policy, miss path, budget and prefetch are what a replay must repeat."""
    out_file = tmp_path / "t.npz"
    argv = ("--prompt", "hello", "--record-trace", str(out_file), "--expert-memory", "50%", "--policy", "lfu")
    assert gen(capsys, ckpt("mixtral"), *argv, "--prefetch", "none")[0] == 0
    assert main(["trace", "info", str(out_file)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("recorded"))
    assert "on cpu" in line and "policy lfu, miss fetch, no prefetch" in line
    assert main(["trace", "info", str(out_file), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["recorded"]
    assert run["policy"] == "lfu" and run["capacities"] == {"full": run["capacity"]}
    synthetic = tmp_path / "s.npz"
    assert main(["trace", "synth", "--kind", "zipf", "--tokens", "8", "-o", str(synthetic)]) == 0
    assert main(["trace", "info", str(synthetic), "--json"]) == 0
    assert "recorded" not in json.loads(capsys.readouterr().out)


def test_the_transfers_by_part_say_which_are_on_demand_and_which_prefetched(capsys, ckpt):
    """A split expert's parts moved on demand and by prefetches: the stderr table names both, so that the
    counts times the parts' bytes add up to the bytes moved (it named the demand ones "transfers")."""
    path = ckpt("mixtral")
    run = ("--prompt", "hello there", "--expert-memory", "50%", "--miss", "split:theta=0.3", "--prefetch",
           "next-gate", "--deterministic")  # fmt: skip
    code, out, err = gen(capsys, path, *run, "--json", new=8)
    assert code == 0, err
    got = json.loads(out)
    assert got["part_misses"] and got["part_prefetches"], got
    code, _, err = gen(capsys, path, *run, new=8)
    assert code == 0, err
    demand = ", ".join(f"{p} {n}" for p, n in got["part_misses"].items())
    dropped = got["part_cancelled"]  # a prefetch cancelled before it moved is not among those prefetched
    ahead = ", ".join(f"{p} {n - dropped.get(p, 0)}" for p, n in got["part_prefetches"].items())
    assert f"transfers by part on demand: {demand}, prefetched: {ahead}" in err, err
    if dropped:
        assert "prefetches cancelled: " + ", ".join(f"{p} {n}" for p, n in dropped.items()) in err, err


def test_a_randomized_policy_is_seeded_by_policy_seed_and_replays_with_that_seed(capsys, ckpt, tmp_path):
    """``--seed`` is the sampling seed, so a randomized policy in the engine always drew with seed 0 from the
    command line; ``--policy-seed`` seeds it, and the simulator given that seed makes the same decisions."""
    from expertcache.sim.simulate import simulate

    path = ckpt("mixtral")
    got = {}
    for seed in (0, 7):
        trace = tmp_path / f"r{seed}.npz"
        code, out, err = gen(capsys, path, "--prompt", "hello there", "--expert-memory", "50%", "--policy",
                             "random", "--policy-seed", str(seed), "--prefetch", "none", "--record-trace",
                             str(trace), "--json", new=8)  # fmt: skip
        assert code == 0, err
        got[seed] = json.loads(out)
        (sim,) = simulate(trace, ["random"], [got[seed]["capacity_experts"]], seed=seed)
        assert (sim.hits, sim.misses) == (got[seed]["hits"], got[seed]["misses"])
    code, _, err = gen(capsys, path, "--prompt", "hi", "--policy-seed", "3", new=2)
    assert code == 0 and "--policy-seed 3 changes nothing here: lru draws nothing at random" in err
    assert one_line_error(*gen(capsys, path, "--prompt", "hi", "--policy-seed", "-1")).endswith(
        "--policy-seed must be at least 0, got -1"
    )


def test_a_chunk_size_the_timing_model_could_not_replay_is_refused(capsys, ckpt):
    """``--chunk-size 1B`` ran (an expert in as many chunks as it has bytes), and ``timing`` then refused to
    replay the run at the same size: both hold to the timing model's most chunks an expert."""
    from expertcache.costs import MAX_CHUNKS

    line = one_line_error(*gen(capsys, ckpt("mixtral"), "--prompt", "hi", "--expert-memory", "50%",
                               "--prefetch", "next-gate", "--chunk-size", "1B"))  # fmt: skip
    assert "--chunk-size 1 B cuts an expert of" in line and f"at most {MAX_CHUNKS}" in line


def test_a_sampled_prompts_run_draws_one_seed_and_each_batch_its_own(capsys, ckpt, tmp_path):
    """Every batch was reseeded with the same --seed (a prompt listed twice in two batches was sampled twice
    alike), without --seed each batch drew and reported its own seed (the run could not be repeated), and
    the run's seed was never said on stderr."""
    path = ckpt("mixtral")
    prompts = tmp_path / "same.txt"
    prompts.write_text("hello there\n" * 4)
    argv = ("--prompts", str(prompts), "--temperature", "1.5", "--batch-size", "1")
    code, out, err = gen(capsys, path, *argv, new=6)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    seed = rows[0]["seed"]
    assert f"sampled with seed {seed} (--seed {seed} repeats the run; batch b draws with seed + b)" in err
    assert [r["seed"] for r in rows] == [seed + i for i in range(4)]
    assert len({tuple(r["tokens"]) for r in rows}) > 1  # four draws, not one drawn four times
    code, again, _ = gen(capsys, path, *argv, "--seed", str(seed), new=6)
    assert [json.loads(line)["tokens"] for line in again.splitlines()] == [r["tokens"] for r in rows]
    from expertcache.config import SamplingConfig

    with engine_load(path) as model:  # generate_text given more prompts than batch_size: the same rule
        many = model.generate_text(
            ["hello there"] * 3, 6, sampling=SamplingConfig(temperature=1.5), batch_size=1
        )
    assert [g.seed for g in many] == [many[0].seed + i for i in range(3)]


def test_one_new_token_has_no_tpot_not_a_tpot_of_zero(capsys, ckpt):
    """A generation of one token (max 1, or an end at once) reported TPOT 0.0 ms: no decode step to time."""
    path = ckpt("mixtral")
    code, out, err = gen(capsys, path, "--prompt", "hello", "--json", new=1)
    assert code == 0 and json.loads(out)["tpot_s"] is None, (out, err)
    code, _, err = gen(capsys, path, "--prompt", "hello", new=1)
    assert code == 0 and "TPOT - (one new token)" in err, err


def test_generate_refuses_ids_it_cannot_run_and_a_failed_step_leaves_no_request(ckpt):
    """Token ids ``generate`` cannot run failed deep in torch (an IndexError for an id beyond the
    vocabulary, a RuntimeError for floats or an empty tensor, a 1030-token input ran past a 1024 context
    with transformers' "reminder"), and a forward that raised left a request of unknown experts in
    ``trace()`` (a new user's trial): one line each, and no step of a failed forward in the trace."""
    with engine_load(ckpt("mixtral"), 8) as model:
        rows = model.model.get_input_embeddings().num_embeddings
        limit = model.config.max_position_embeddings
        for ids, words in (
            (torch.tensor([[1.0, 2.0]]), "token ids must be integers"),
            (torch.tensor([1, 2]), "a tensor [batch, tokens] with at least one token, got shape [2]"),
            (torch.zeros(1, 0, dtype=torch.long), "got shape [1, 0]"),
            (torch.tensor([[5, rows]]), f"token id {rows} is not one of the model's (0 .. {rows - 1})"),
            (torch.tensor([[-1, 3]]), "token id -1 is not one of the model's"),
            (
                torch.ones(1, limit, dtype=torch.long),
                f"{limit} tokens + 2 new tokens exceed",
            ),
        ):
            with pytest.raises(ExpertcacheError) as err:
                model.generate(ids, max_new_tokens=2)
            assert words in str(err.value), err.value
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
        with pytest.raises(IndexError):  # past the check, inside transformers: the step begun, never done
            model.model.generate(torch.tensor([[1, rows + 5]]), max_new_tokens=2)
        model.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=2)
        trace = model.trace()
    assert trace.num_tokens == 2 * (3 + 1) and (trace.experts >= 0).all()


def test_generations_from_several_threads_run_one_at_a_time(ckpt):
    """Two threads' ``generate_text`` on one model broke the recorder's step ("could not broadcast input
    array") and lost one generation (a new user's trial): they now take turns, each with its own counts."""
    import threading

    with engine_load(ckpt("mixtral"), 8) as model:
        alone = model.generate_text(PROMPTS, max_new_tokens=4)
        got, errors = {}, []

        def run(i: int) -> None:
            try:
                got[i] = model.generate_text(PROMPTS, max_new_tokens=4)
            except Exception as exc:  # noqa: BLE001 (what the test reports)
                errors.append(repr(exc))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert all([g.tokens for g in got[i]] == [g.tokens for g in alone] for i in range(3))


def test_generate_text_refuses_token_ids_and_streamers_transformers_would_fail_on(ckpt):
    """``eos_token_id="a"`` failed deep in a step ("new(): invalid data type 'str'"), ``streamer=object()``
    with an AttributeError (a new user's trial): one line each, before any work."""
    with engine_load(ckpt("mixtral"), 8) as model:
        for kw, words in (
            ({"eos_token_id": "a"}, "eos_token_id must be a token id (a whole number >= 0) or a list"),
            ({"eos_token_id": [2, "b"]}, "got [2, 'b']"),
            ({"streamer": object()}, "streamer must be a transformers streamer (put() and end()"),
        ):
            with pytest.raises(ExpertcacheError) as err:
                model.generate_text("hello", 2, **kw)
            assert words in str(err.value), err.value
        assert model.generate_text("hello", 2, eos_token_id=[0, 1]).tokens  # a list of ids: taken
