"""transformers' attention implementation, chosen at load (``load(attention=...)``, ``--attention``).

- Every family runs through the engine with ``eager`` attention, at a small budget from disk: tokens and
  logits bit-identical to transformers loaded with the same attention; the stats say which one ran, and
  the default is transformers' own (``sdpa``), except on a GPU, where it is ``sdpa_no_cudnn`` in place of
  ``sdpa``.
- ``quality --attention eager`` compares against a reference with the same attention: exact on ``fetch``.
- A name the engine does not run is one line (exit 2 from the CLI); the CLI's list is the engine's.
"""

from __future__ import annotations

import json

import engine_fixtures
import pytest
import torch
from engine_fixtures import FAMILIES, assert_exact, engine_load, greedy, moe_layers

from expertcache.engine.loader import ATTENTION, load_reference
from expertcache.errors import ExpertcacheError

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_with_eager_attention_equals_transformers_with_it(family, ckpt):
    path = ckpt(family)
    ref = load_reference(
        path, device=engine_fixtures.DEVICE, experts=engine_fixtures.REFERENCE, attention="eager"
    )
    assert ref.config._attn_implementation == "eager"
    want = greedy(ref, IDS)
    with engine_load(
        path, moe_layers(family) * engine_fixtures.TOP_K, slow_tier="disk", attention="eager"
    ) as m:
        got = greedy(m, IDS)
        assert m.stats["attention"] == "eager"
    assert_exact(got, want)


def test_the_default_is_transformers_own(ckpt):
    path = ckpt("granitemoe")
    ref = load_reference(path, device="cpu")
    with engine_load(path) as m:
        assert m.stats["attention"] == ref.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", ["granitemoe", "gpt_oss"])
def test_the_default_on_a_gpu_is_sdpa_without_cudnn_where_transformers_takes_sdpa(family, ckpt):
    """On a GPU the default replaces transformers' sdpa with sdpa_no_cudnn, in the engine and its reference
    alike; a family whose default is eager keeps it, an attention asked for is kept, a CPU keeps sdpa. The
    device only names where the model will run: nothing here needs a GPU."""
    from expertcache.engine.loader import build_skeleton, default_attention

    path = ckpt(family)
    want = "sdpa_no_cudnn" if family == "granitemoe" else "eager"
    assert build_skeleton(path, device="cuda").model.config._attn_implementation == want
    assert build_skeleton(path, device=torch.device("cuda", 0)).model.config._attn_implementation == want
    own = "sdpa" if family == "granitemoe" else "eager"
    assert build_skeleton(path, device="cpu").model.config._attn_implementation == own
    assert build_skeleton(path).model.config._attn_implementation == own
    ref = load_reference(path, device="cpu")
    default_attention(ref, None, "cuda")  # what load_reference(device="cuda") does after loading
    assert ref.config._attn_implementation == want
    ref = load_reference(path, device="cpu", attention="eager")
    default_attention(ref, "eager", "cuda")
    assert ref.config._attn_implementation == "eager"
    if family == "granitemoe":
        ref = load_reference(path, device="cpu", attention="sdpa")
        default_attention(ref, "sdpa", "cuda")  # asked for: transformers' own sdpa, cuDNN allowed
        assert ref.config._attn_implementation == "sdpa"


def test_quality_compares_against_the_same_attention(ckpt, capsys):
    from expertcache.cli import main

    path = ckpt("qwen3_moe")
    code = main(["quality", "--model", str(path), "--expert-memory", "50%", "--tokens", "16", "--attention",
                 "eager", "--device", "cpu", "--json"])  # fmt: skip
    assert code == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["attention"] == "eager" and r["logits_identical"] == 1.0 and r["top1_agreement"] == 1.0


def test_an_attention_the_engine_does_not_run_is_one_line(ckpt, capsys):
    from expertcache.cli import main
    from expertcache.cli.generate import ATTENTION as CLI_ATTENTION
    from expertcache.engine import load

    assert list(ATTENTION) == CLI_ATTENTION  # the CLI's copy (no torch before its checks)
    with pytest.raises(
        ExpertcacheError, match="attention 'flash' .* is not one the engine runs: sdpa, eager, sdpa_no_cudnn"
    ):
        load(ckpt("mixtral"), attention="flash", progress=False)
    with pytest.raises(ExpertcacheError, match="attention 'flash'"):
        load_reference(ckpt("mixtral"), attention="flash")
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(ckpt("mixtral")), "--prompt", "a", "--attention", "flash"])
    assert exit_.value.code == 2 and "--attention" in capsys.readouterr().err


def test_a_family_without_the_attention_asked_is_one_line(ckpt, capsys):
    """transformers runs GPT-OSS without ``sdpa``: its default there is eager, and asking sdpa is refused."""
    from expertcache.cli import main
    from expertcache.engine import load

    path = ckpt("gpt_oss")
    with pytest.raises(ExpertcacheError, match="gpt_oss: transformers runs no sdpa attention for"):
        load(path, attention="sdpa", progress=False)
    with pytest.raises(ExpertcacheError, match="gpt_oss: transformers runs no sdpa attention"):
        load_reference(path, attention="sdpa")
    code = main(["generate", "--model", str(path), "--prompt", "a", "--attention", "sdpa", "--quiet"])
    assert code == 2 and capsys.readouterr().err.count("\n") == 1
    with engine_load(path) as m:
        assert m.stats["attention"] == "eager"
    with pytest.raises(ExpertcacheError, match="gpt_oss: transformers runs no sdpa_no_cudnn attention"):
        load(path, attention="sdpa_no_cudnn", progress=False)


def test_sdpa_without_cudnn_is_refused_where_transformers_has_no_sdpa(ckpt, monkeypatch):
    """sdpa_no_cudnn runs transformers' sdpa function: a class without sdpa (any family's, here made so)
    refuses it as it refuses sdpa, in one line."""
    from transformers import GraniteMoeForCausalLM

    from expertcache.engine import load

    monkeypatch.setattr(GraniteMoeForCausalLM, "_supports_sdpa", False)
    path = ckpt("granitemoe")
    with pytest.raises(ExpertcacheError, match="granitemoe: transformers runs no sdpa_no_cudnn attention"):
        load(path, attention="sdpa_no_cudnn", progress=False)
    with pytest.raises(ExpertcacheError, match="granitemoe: transformers runs no sdpa_no_cudnn attention"):
        load_reference(path, attention="sdpa_no_cudnn")


def test_a_reference_given_to_quality_is_compared_by_the_attention_it_runs(ckpt):
    from expertcache.tools.quality import Reference, measure

    path = ckpt("qwen3_moe")
    ref = Reference(path)  # transformers' default: sdpa
    r = measure(path, "fetch", "100%", texts=["def f(x):\n    return x\n" * 4], tokens=16, reference=ref,
                attention="sdpa")  # fmt: skip
    assert r["attention"] == "sdpa" and r["logits_identical"] == 1.0
    with pytest.raises(ExpertcacheError, match="the reference given runs attention sdpa, not eager"):
        measure(path, "fetch", "100%", texts=["def f(x):\n"], tokens=4, reference=ref, attention="eager")


@pytest.mark.parametrize("family", ["qwen2_moe", "granitemoe", "deepseek_v3"])
def test_sdpa_without_cudnn_equals_transformers_with_it_and_with_sdpa(family, ckpt):
    """``sdpa_no_cudnn`` (cuDNN's attention plans every new key length on a GPU: 33 ms each on an H200):
    the engine with it equals transformers loaded with it; on a CPU, whose sdpa has no cuDNN, that is
    transformers' own sdpa too, bit for bit. The family's mask is sdpa's (a padded batch: one family
    with a left-padded row)."""
    path = ckpt(family)
    ref = load_reference(path, device=engine_fixtures.DEVICE, experts=engine_fixtures.REFERENCE,
                         attention="sdpa_no_cudnn")  # fmt: skip
    assert ref.config._attn_implementation == "sdpa_no_cudnn"
    want = greedy(ref, IDS)
    with engine_load(path, moe_layers(family) * engine_fixtures.TOP_K, slow_tier="disk",
                     attention="sdpa_no_cudnn") as m:  # fmt: skip
        got = greedy(m, IDS)
        assert m.stats["attention"] == "sdpa_no_cudnn"
    assert_exact(got, want)
    if engine_fixtures.DEVICE == "cpu":
        sdpa = load_reference(path, device="cpu", experts=engine_fixtures.REFERENCE, attention="sdpa")
        assert_exact(greedy(sdpa, IDS), want)
    if family == "qwen2_moe" and engine_fixtures.DEVICE == "cpu":  # a left-padded batch: sdpa's mask
        n = len(engine_fixtures.PROMPT)
        ids = torch.tensor([[0, 0, *engine_fixtures.PROMPT[:-2]], engine_fixtures.PROMPT])
        mask = torch.tensor([[0, 0] + [1] * (n - 2), [1] * n])
        with torch.inference_mode():
            got_logits = ref(input_ids=ids, attention_mask=mask).logits
            assert torch.equal(got_logits, sdpa(input_ids=ids, attention_mask=mask).logits)
