"""The embedded default model and the default trace recorded from it: shipped, small, exact, consistent."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import expertcache
from expertcache.cache.schedule import build_schedule
from expertcache.cli import main
from expertcache.engine.loader import load_reference
from expertcache.engine.offloaded import DEFAULT_MODEL
from expertcache.sim.replay import replay
from expertcache.trace.default import DEFAULT_TRACE, default_trace

LIMIT_BYTES = 25_000_000  # the "at most 25 MB", counted in decimal megabytes


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_default_model_is_shipped_and_small():
    files = {p.name: p.stat().st_size for p in DEFAULT_MODEL.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sum(files.values()) <= LIMIT_BYTES
    info = expertcache.engine.offloaded.model_info()
    assert info["family"] == "mixtral"
    assert info["moe_layers"] * info["experts_per_layer"] >= 64  # enough keys for a cache to matter


def test_training_record_shows_learning():
    """training.json is the measured record: the trained model beats its initialisation by far."""
    ev = json.loads((DEFAULT_MODEL / "training.json").read_text())["evaluation"]
    trained, init = ev["trained"], ev["untrained_init"]
    assert trained["perplexity"] < init["perplexity"] / 10
    assert trained["loss"] == pytest.approx(np.log(trained["perplexity"]), rel=1e-6)
    assert min(trained["expert_usage_entropy_bits"]) > 3.0  # every layer uses its experts, not a few


def test_default_model_generates_exactly_at_30_percent():
    model = expertcache.load(expert_memory="30%", device="cpu")
    try:
        ids = model.encode("def read_config(path):\n")
        got = model.generate(
            ids, max_new_tokens=8, output_logits=True, return_dict_in_generate=True, pad_token_id=0
        )
        assert model.capacity == int(model.num_layers * model.num_experts * 0.3)
        assert model.stats["misses"] > 0
    finally:
        model.close()
    ref = load_reference(DEFAULT_MODEL)
    with torch.no_grad():
        want = ref.generate(
            ids,
            max_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits, strict=True))


def test_generate_without_model_uses_the_embedded_one(capsys):
    assert (
        main(
            ["generate", "--prompt", "import os", "--max-new-tokens", "4", "--expert-memory", "25%", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) == 4
    assert out["capacity_experts"] == int(out["total_experts"] * 0.25)
    assert out["hits"] + out["misses"] > 0


def test_default_trace_is_the_default_models_routing():
    trace = default_trace()
    model = expertcache.load(expert_memory="100%", device="cpu")
    try:
        assert (trace.num_layers, trace.num_experts, trace.top_k) == (
            model.num_layers,
            model.num_experts,
            model.top_k,
        )
        seq0 = trace.seq_id == 0
        prompt = trace.token_id[seq0 & (trace.is_prefill == 1)]
        model.generate(torch.from_numpy(prompt.astype(np.int64))[None], max_new_tokens=4, pad_token_id=0)
        mine = model.trace()
    finally:
        model.close()
    assert mine.meta["model"] == trace.meta["model"] == "embedded"  # a name, never a machine's path
    n = mine.num_tokens
    assert np.array_equal(mine.token_id, trace.token_id[:n])
    same = (np.sort(mine.experts, axis=2) == np.sort(trace.experts[:n], axis=2)).all(axis=2)
    assert same.mean() >= 0.95  # rows may differ only where another CPU's rounding flips a near tie


def test_default_trace_replays():
    trace = default_trace()
    assert DEFAULT_TRACE.is_file()
    assert trace.step_id is not None and trace.is_prefill is not None
    result = replay(build_schedule(trace, "layer"), "lru", trace.num_layers * trace.num_experts // 4)
    assert 0 < result.misses < result.requests


def test_model_info_counts_a_tied_head_once():
    """The embedded model ties lm_head to the input embedding: one tensor in memory and on disk, so the
    dense bytes are the checkpoint's non-expert tensors, each once (issue: models larger than memory)."""
    from safetensors import safe_open

    from expertcache.engine.offloaded import stored_bytes

    info = expertcache.engine.offloaded.model_info()
    on_disk = 0
    with safe_open(str(DEFAULT_MODEL / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            if ".experts." not in name:
                t = f.get_slice(name)
                on_disk += int(np.prod(t.get_shape())) * 4  # float32
    assert info["dense_bytes"] == info["dense_stored_bytes"] == on_disk

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("kept", torch.zeros(3))
            self.register_buffer("scratch", torch.zeros(100), persistent=False)  # not saved: not counted

    assert stored_bytes(Tied()) == (10 * 4 + 3) * 4


def test_the_heldout_texts_are_stored_with_the_model_and_read_from_no_stdlib(monkeypatch):
    """quality, the predictors' accuracy and the benchmarks read the held-out files of the default trace's
    prompts; a Python without some of them (Debian's idlelib is a package of its own, 3.13 has no crypt.py
    or lib2to3) made ``quality`` exit 2 (seen on the GPU machine's Python). They are stored with the model:
    the names are the trace's, the texts this Python's files where it has them, and no stdlib is read."""
    import sysconfig

    from expertcache.tools.predictor_accuracy import HELDOUT_CHARS, heldout_prompts
    from expertcache.tools.quality import heldout_texts as quality_texts
    from expertcache.trace.default import HELDOUT_STORED_CHARS, heldout_texts

    stored = heldout_texts()
    names = [n for n in str(default_trace().meta["prompts"]).split(";") if n]
    assert [n for n, _ in stored] == names and len(names) == 16
    root = Path(sysconfig.get_paths()["stdlib"])
    here = [(n, t) for n, t in stored if (root / n).is_file()]
    for name, text in here:  # the regenerate helper: tools/record_default_trace.py --heldout
        assert text == (root / name).read_text(encoding="utf-8", errors="replace")[:HELDOUT_STORED_CHARS]
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": "/nonexistent"})
    assert quality_texts(3, 100) == [t[:100] for _, t in stored[:3]]
    prompts = heldout_prompts()
    assert len(prompts) == 16 and all(0 < len(p) <= HELDOUT_CHARS for p in prompts)
    assert prompts[0] == stored[0][1].strip()[:HELDOUT_CHARS]
    with pytest.raises(ValueError, match="stored to 4000"):
        heldout_texts(1, HELDOUT_STORED_CHARS + 1)
