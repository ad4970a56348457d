"""``expertcache generate`` as a user runs it: JSON, text and streamed output, traces the simulator
replays to the same misses, and one-line errors with exit code 2 for every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import engine_fixtures
import pytest
import torch
from engine_fixtures import (
    MISSING_EXPERT,
    TOP_K,
    engine_load,
    total_experts,
)

from expertcache.cache.schedule import build_schedule
from expertcache.cli import main
from expertcache.sim.replay import replay
from expertcache.trace import load_trace, synthesize

# the shared fixtures, by name
_one_torch_thread = engine_fixtures._one_torch_thread
bad_ckpt = engine_fixtures.bad_ckpt
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir

PROMPT = "hello world, the quick brown fox"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def generate(capsys, model: Path, *extra: str, prompt: str = PROMPT, new: int = 5) -> tuple[int, str, str]:
    device = () if "--device" in extra else ("--device", "cpu")  # an option is given once
    return run(
        capsys, "generate", "--model", str(model), "--prompt", prompt, "--max-new-tokens", str(new), *device,
        *extra,
    )  # fmt: skip


def one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2, (out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("expertcache: error: ")
    return lines[0]


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def test_generate_json_reports_tokens_text_timings_and_cache(capsys, ckpt, tmp_path):
    path = ckpt("mixtral")
    trace_file = tmp_path / "run.npz"
    code, out, err = generate(
        capsys, path, "--json", "--expert-memory", "25%", "--record-trace", str(trace_file), new=6
    )
    assert code == 0, err
    r = json.loads(out)
    want = {"tokens", "text", "ttft_s", "tpot_s", "tokens_per_s", "hits", "misses", "bytes_transferred"}
    assert want | {"stall_s", "capacity_experts", "total_experts", "expert_bytes", "prompt_tokens"} <= set(r)
    assert isinstance(r["tokens"], list) and 1 <= len(r["tokens"]) <= 6
    assert all(isinstance(t, int) and 0 <= t < 300 for t in r["tokens"])
    assert isinstance(r["text"], str)
    assert r["new_tokens"] == len(r["tokens"]) and r["prompt_tokens"] > 1
    assert r["ttft_s"] > 0 and r["tpot_s"] >= 0 and r["tokens_per_s"] > 0
    assert r["stall_s"] >= 0
    total = total_experts("mixtral")
    assert r["total_experts"] == total and r["capacity_experts"] == total // 4
    assert r["policy"] == "lru" and r["device"] == "cpu"
    assert r["trace"] == str(trace_file)
    assert r["misses"] > 0 and r["hits"] >= 0
    assert r["bytes_transferred"] == r["misses"] * r["expert_bytes"]
    trace = load_trace(trace_file)
    requests = int(build_schedule(trace, "layer").layer_requests.sum())
    assert r["hits"] + r["misses"] == requests
    assert trace.num_tokens == r["prompt_tokens"] + r["new_tokens"] - 1
    assert trace.token_id[r["prompt_tokens"] :].tolist() == r["tokens"][:-1]
    with engine_load(path) as model:  # the same greedy tokens as the Python API
        gen = model.generate_text(PROMPT, max_new_tokens=6)
        assert gen.tokens == r["tokens"] and gen.text == r["text"]
        assert r["expert_bytes"] == model.layout.nbytes


def test_generate_tokens_equal_transformers_greedy(capsys, ckpt):
    from transformers import AutoTokenizer

    from expertcache.engine.loader import load_reference

    path = ckpt("gpt_oss")
    line = one_line_error(*generate(capsys, path, "--json", "--expert-memory", "1%", new=6))
    assert "holds 0 expert(s)" in line  # 1% of 16 experts
    code, out, err = generate(capsys, path, "--json", "--expert-memory", "12.5%", new=6)
    assert code == 0, err
    r = json.loads(out)
    assert r["capacity_experts"] == TOP_K
    ids = AutoTokenizer.from_pretrained(str(path))(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = load_reference(path).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert r["tokens"] == ref[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize(
    ("policy", "memory"),
    [("lru", "25%"), ("lfu", "40%"), ("llru", "2"), ("random", "5"), ("lru-dist", "4"), ("lcp-dist", "50%")],
)
def test_recorded_trace_replays_to_the_same_misses(capsys, ckpt, tmp_path, policy, memory):
    path = ckpt("qwen2_moe")
    trace_file = tmp_path / "t.npz"
    if not memory.endswith("%"):  # a number of experts, as bytes
        with engine_load(path) as model:
            memory = f"{int(memory) * model.layout.slot_bytes}B"
    code, out, err = generate(
        capsys,
        path,
        "--json",
        "--policy",
        policy,
        "--expert-memory",
        memory,
        "--record-trace",
        str(trace_file),
    )
    assert code == 0, err
    gen = json.loads(out)
    cap = gen["capacity_experts"]
    code, out, err = run(
        capsys, "sim", str(trace_file), "--policy", policy, "--capacity", str(cap), "--json", "--jobs", "1"
    )
    assert code == 0, err
    (row,) = json.loads(out)
    assert row["capacity"] == cap
    assert row["misses"] == gen["misses"]
    assert row["hits"] == gen["hits"]
    sim = replay(build_schedule(load_trace(trace_file), "layer"), policy, cap)
    assert sim.misses == gen["misses"]


def test_generate_text_mode_prints_the_text_on_stdout_and_the_stats_on_stderr(capsys, ckpt):
    path = ckpt("mixtral")
    code, out, err = generate(capsys, path, "--json", "--expert-memory", "25%")
    assert code == 0, err
    r = json.loads(out)
    code, out, err = generate(capsys, path, "--expert-memory", "25%")
    assert code == 0, err
    assert out == r["text"] + "\n"  # stdout holds the text alone: `generate ... > out.txt`
    _, sep, table = err.partition("---\n")
    assert sep, err
    assert f"hits {r['hits']}" in table and f"misses {r['misses']}" in table
    assert f"{r['prompt_tokens']} prompt + {r['new_tokens']} new tokens" in table
    assert f"cache {r['capacity_experts']}/{r['total_experts']} experts (lru, cpu)" in table
    assert "TTFT" in table and "TPOT" in table
    assert f"| {r['kernel']} kernel | {r['attention']} attention" in table  # what computed it, by name


def test_generate_stream_json_prints_a_line_per_token_then_the_result(capsys, ckpt):
    path = ckpt("olmoe")
    code, out, err = generate(capsys, path, "--stream", "--json", "--expert-memory", "50%", new=5)
    assert code == 0, err
    lines = [json.loads(line) for line in out.strip().splitlines()]
    *tokens, final = lines
    assert len(tokens) == len(final["tokens"]) >= 1
    assert [t["token"] for t in tokens] == final["tokens"]
    assert all(set(t) == {"token", "text"} and isinstance(t["text"], str) for t in tokens)
    assert final["hits"] + final["misses"] > 0


def test_generate_with_an_emulated_link_and_a_static_profile(capsys, ckpt, tmp_path):
    path = ckpt("mixtral")
    trace_file = tmp_path / "profile.npz"
    code, out, err = generate(
        capsys,
        path,
        "--json",
        "--expert-memory",
        "25%",
        "--link-bandwidth",
        "200MB/s",
        "--link-latency",
        "200us",
        "--record-trace",
        str(trace_file),
    )
    assert code == 0, err
    linked = json.loads(out)
    # the first layer of the prompt starts with an empty cache and nothing known to fetch early: its first
    # expert waits a whole latency at least. (Not a latency a miss: a layer's transfers are in flight
    # together, and the prefetch may move some before they are needed.)
    assert linked["misses"] > 0 and linked["prefill_stall_s"] >= 200e-6
    code, out, err = generate(capsys, path, "--json", "--expert-memory", "25%")
    assert json.loads(out)["tokens"] == linked["tokens"]
    code, out, err = generate(
        capsys, path, "--json", "--expert-memory", "25%", "--policy", "static", "--profile", str(trace_file)
    )
    assert code == 0, err
    static = json.loads(out)
    assert static["tokens"] == linked["tokens"] and static["policy"] == "static"


# ------------------------------------------------------------------------------------------------
# Errors: one line on stderr, exit code 2, no traceback
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing_dir", "no such checkpoint directory"),
        ("a_file", "model.txt: a file, not a checkpoint directory"),
        ("no_config", "no config.json"),
        ("unsupported", "'llama' is not a mixture-of-experts model .*; supported: .*mixtral"),
        ("corrupt", "cannot read safetensors file"),
        ("truncated", "model.safetensors"),
        ("missing_expert", f"lacks expert tensor {MISSING_EXPERT}"),
    ],
)
def test_generate_bad_checkpoint(capsys, bad_ckpt, kind, message):
    import re

    line = one_line_error(*generate(capsys, bad_ckpt(kind), "--json"))
    assert re.search(message, line), line


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--expert-memory", "1kB"], r"needs at least 2 \([0-9.]+ KiB, [0-9]+B\)"),
        (["--expert-memory", "12 parsecs"], "is not a size"),
        (["--expert-memory", "150%"], r"must be a share in \(0%, 100%\]"),
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--policy", "opt"], "simulator only"),
        (["--policy", "opt-dist"], "simulator only"),
        (["--policy", "static"], "usage profile: pass --profile TRACE.npz"),
        (
            ["--policy", "static:profile=run.npz"],
            "not a policy parameter; give it as --policy static --profile",
        ),
        (["--link-latency", "20"], "link latency '20' needs a unit: 20us, 20ms or 20s"),
        (["--link-bandwidth", "16"], "link bandwidth '16' needs a unit: 16GB/s or 16MB/s"),
        (["--expert-memory", "6"], "expert memory '6' needs a unit: 6B, 6MB or 6GiB"),
        (["--expert-memory", "-5%"], r"expert memory '-5%' must be a share in \(0%, 100%\]"),
        (["--expert-memory=-5%"], r"expert memory '-5%' must be a share in \(0%, 100%\]"),
        (["--chunk-size", "100"], "chunk size '100' needs a unit"),
        (
            ["--prefetch", "learned"],
            "bundled learned predictor is for the embedded model; .* train-predictor",
        ),
        (["--prefetch", "token"], "needs a recorded trace of this model .*--predictor TRACE.npz"),
        (["--policy", "lru-dist:budgets=2/2"], r"budgets sum to 4; give budgets that sum to \d+"),
        (["--policy", "lru-dist", "--expert-memory", "3kB"], "needs at least 4"),
        (["--max-new-tokens", "0"], "at least 1"),
        (["--max-new-tokens", "-3"], "at least 1"),
        (["--link-bandwidth", "fast"], "link bandwidth 'fast'"),
        (["--link-bandwidth", "0GB/s"], "must be positive"),
        (["--link-bandwidth", "16B/s"], "below 1 MB/s an expert's transfer takes minutes to days"),
        (["--link-bandwidth", "1GB/s", "--link-latency", "soon"], "link latency 'soon'"),
        (["--device", "cuda"], "CUDA") if not torch.cuda.is_available() else (["--dtype", "x"], "dtype"),
        (["--dtype", "int8"], "not a compute dtype"),
        (["--dtype", "float8_e5m2"], "not a compute dtype"),
        (["--record-trace", "/nonexistent-dir/t.npz"], "does not exist"),
        (["--profile", "/nonexistent.npz", "--policy", "static"], "nonexistent"),
    ],
)
def test_generate_bad_options(capsys, ckpt, extra, message):
    import re

    args = list(extra)
    if "--max-new-tokens" in args:
        i = args.index("--max-new-tokens")
        new = args[i + 1]
        del args[i : i + 2]
        line = one_line_error(*generate(capsys, ckpt("mixtral"), *args, new=int(new)))
    else:
        line = one_line_error(*generate(capsys, ckpt("mixtral"), *args))
    assert re.search(message, line), line


def test_generate_prompt_longer_than_the_context(capsys, make_ckpt):
    path = make_ckpt("mixtral", max_positions=16)
    line = one_line_error(*generate(capsys, path, prompt="the quick brown fox jumps over the lazy dog " * 4))
    assert "exceeds the model's context of 16" in line
    code, out, err = generate(capsys, path, "--json", prompt="hello", new=3)
    assert code == 0, err


def test_generate_notes_expert_memory_capped_at_all_experts(capsys, ckpt):
    path = ckpt("mixtral")
    code, out, err = generate(capsys, path, "--json", "--expert-memory", "6GiB", new=2)
    assert code == 0, err
    r = json.loads(out)
    assert r["capacity_experts"] == r["total_experts"] == total_experts("mixtral")
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "expert memory 6GiB is more than all experts take; capped at" in notes[0]
    assert notes[0].endswith("(100%: no offloading)")


def test_generate_refuses_an_unwritable_trace_before_loading(capsys, ckpt, tmp_path, monkeypatch):
    import expertcache.engine.offloaded as offloaded

    def no_load(*args, **kwargs):
        raise AssertionError("loaded the model before checking the trace path")

    monkeypatch.setattr(offloaded, "load", no_load)
    out_file = "/proc/t.npz"  # refused even to root, whom the permission bits let write anywhere
    line = one_line_error(*generate(capsys, ckpt("mixtral"), "--record-trace", out_file))
    assert line == f"expertcache: error: {out_file}: cannot write the trace: no such file or directory"


def test_model_synth_replaces_an_older_sharded_checkpoint(capsys, tmp_path, tokenizer_dir):
    out = tmp_path / "m"
    synth = ("model", "synth", "--family", "mixtral", "-o", str(out), "--tokenizer", str(tokenizer_dir))
    code, _, err = run(capsys, *synth, "--max-shard-size", "100KB")
    assert code == 2 and "unit 'KB' is ambiguous; write 100kB (10^3 bytes) or 100KiB (2^10 bytes)" in err
    code, _, err = run(capsys, *synth, "--max-shard-size", "100kB")
    assert code == 0, err
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 2
    code, _, err = run(capsys, *synth, "--layers", "3")
    assert code == 0, err
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]  # no stale index
    code, out_text, err = run(capsys, "model", "info", str(out), "--json")
    assert code == 0 and json.loads(out_text)["moe_layers"] == 3, err
    assert json.loads((out / "expertcache-random.json").read_text())["layers"] == 3  # what replaces it
    packed = tmp_path / "packed"  # made from it, and so not replaced by synth either
    assert run(capsys, "quantize", str(out), "--bits", "8", "--checkpoint", str(packed))[0] == 0
    assert (packed / "tokenizer.json").is_file() and not (packed / "expertcache-random.json").exists()
    mask = os.umask(0)
    os.umask(mask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask  # as any file it writes


def test_model_synth_refuses_a_folder_that_is_not_a_checkpoint(capsys, tmp_path, tokenizer_dir):
    from expertcache.engine.offloaded import DEFAULT_MODEL

    (tmp_path / "notes.txt").write_text("mine")
    synth = ("model", "synth", "--family", "mixtral", "--tokenizer", str(tokenizer_dir), "-o")
    line = one_line_error(*run(capsys, *synth, str(tmp_path)))
    assert line.endswith("not empty and not a checkpoint; choose a new or empty folder")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    packed = tmp_path / "packed"  # a checkpoint synth did not make (a new user lost one quantize wrote)
    assert run(capsys, "quantize", "--bits", "8", "--checkpoint", str(packed))[0] == 0
    before = {f.name: f.stat().st_mtime_ns for f in packed.iterdir()}
    line = one_line_error(*run(capsys, *synth, str(packed)))
    assert line.endswith("not empty and a checkpoint not made by model synth; choose a new or empty folder")
    assert {f.name: f.stat().st_mtime_ns for f in packed.iterdir()} == before
    line = one_line_error(*run(capsys, "model", "synth", "--family", "mixtral", "-o", str(DEFAULT_MODEL)))
    assert line.endswith("is the checkpoint the tokenizer comes from; choose another folder")


def test_generate_rejects_a_malformed_link_latency_even_without_bandwidth(capsys, ckpt):
    line = one_line_error(*generate(capsys, ckpt("mixtral"), "--link-latency", "soon"))
    assert "link latency 'soon'" in line


def test_console_script_reports_a_bad_checkpoint_in_one_line(bad_ckpt):
    exe = Path(sys.executable).with_name("expertcache")
    assert exe.is_file()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [
            str(exe),
            "generate",
            "--model",
            str(bad_ckpt("missing_expert")),
            "--prompt",
            "hi",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"expertcache: error: {bad_ckpt('missing_expert')}: checkpoint lacks expert tensor {MISSING_EXPERT}"
    ]


def test_options_that_would_do_nothing_are_refused_or_noted(capsys, ckpt, tmp_path):
    """--profile with a policy that reads none, --stream without --json: refused (they were ignored);
    a miss path that leaves the expert memory unused says so."""
    path = str(ckpt("mixtral"))
    capsys.readouterr()
    trace = tmp_path / "t.npz"
    synthesize("zipf", tokens=20, layers=5, experts=3, top_k=1).save(trace)  # another shape, even
    base = ("generate", "--model", path, "--device", "cpu", "--prompt", "x", "--max-new-tokens", "2")
    code, _, err = run(capsys, *base, "--profile", str(trace))
    assert code == 2 and err == (
        "expertcache: error: a usage profile (--profile) ranks experts for the static policies; policy lru "
        "uses none (give --policy static or static-dist, or leave out --profile)\n"
    )
    code, _, err = run(capsys, *base, "--expert-memory", "")
    assert (
        code == 2
        and err == "expertcache: error: --expert-memory is empty; give a value or leave the option out\n"
    )
    code, _, err = run(capsys, *base, "--stream")
    assert code == 2 and "--stream changes only --json's output" in err and err.count("\n") == 1
    code, _, err = run(capsys, *base, "--miss", "placement", "--expert-memory", "30%")
    assert code == 0, err
    assert "note: miss path placement:layers=all computes every expert on the host: the expert memory" in err
    assert "holds none and is not used" in err
    assert "miss path placement:layers=all: " in err and "expert uses computed on the host" in err


def test_the_table_says_when_host_compute_left_the_cache_empty():
    from expertcache.cli.generate import miss_work

    out = {"host_computed": 102, "hits": 0, "bytes_transferred": 0, "capacity_experts": 28, "miss": "host"}
    assert miss_work(out) == (
        "102 expert uses computed on the host, the cache's 28 slots stayed empty (host:fill=1 moves experts "
        "in after computing)"
    )
    assert miss_work({**out, "hits": 3}) == "102 expert uses computed on the host"
    # hybrid takes no fill: the hint named another path (and hybrid:fill=1 is refused)
    assert miss_work({**out, "miss": "hybrid"}).endswith("the cache's 28 slots stayed empty")
    # batch without its fills says so too (its default fills; host:fill=0 is host's default, as described)
    unfilled = miss_work({**out, "miss": "batch:buffer=4,fill=0"})
    assert unfilled.endswith("stayed empty (batch:fill=1 moves experts in after computing)")
    assert miss_work({**out, "miss": "batch:buffer=4"}).endswith("the cache's 28 slots stayed empty")
    assert miss_work({"low_precision": 18}) == "18 expert uses at low precision (lossy)"


def test_hybrid_on_a_cpu_reading_the_disk_fetches_and_caches_as_fetch_does(ckpt):
    """On a CPU-only machine reading from the disk, computing a missed expert on the host and fetching it
    cost the same read and the same computation: HybriMoE's schedule sent every such tie to the host, so
    the cache stayed empty and every use read the expert again (2-3x fetch's TPOT). A tie fetches now."""
    from dataclasses import replace

    from expertcache.costs import CostModel
    from expertcache.miss.base import Need
    from expertcache.miss.hybrid import makespan_split

    tie = CostModel(expert_s=1e-3, expert_token_s=0.0, host_expert_s=1e-3, host_expert_token_s=0.0,
                    host_read_s=2e-3, link_bandwidth=1e9, link_latency=0.0, expert_bytes=2_000_000,
                    chunk_bytes=None, host_parallel=False)  # fmt: skip
    assert tie.transfer_time() == tie.host_read_s
    assert makespan_split(tie, [Need((0, e), 1, 1.0, 0.0, 0) for e in range(4)]) == [False] * 4
    cheaper = replace(tie, host_read_s=1e-3)  # the host's read really is cheaper: it computes there
    assert makespan_split(cheaper, [Need((0, 0), 1, 1.0, 0.0, 0)]) == [True]
    with engine_load(ckpt("mixtral"), expert_memory="50%", policy="mrs", miss="hybrid") as model:
        model.generate_text("hello world, hello experts", 8)
        assert model.stats["hits"] > 0 and model.stats["bytes_transferred"] > 0


def test_a_model_saved_without_its_tokenizer_is_refused_in_one_whole_line(ckpt, tmp_path, capsys):
    """A model saved by save_pretrained alone: the line was cut mid-sentence ("... serialization file,)")."""
    bare = engine_fixtures.without_tokenizer(ckpt("mixtral"), tmp_path / "bare")
    assert main(["generate", "--model", str(bare), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tokenizer beside the weights" in err[0]
    assert err[0].endswith("(tokenizer.save_pretrained(FOLDER))")
