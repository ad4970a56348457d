"""compressed-tensors' checkpoints (llm-compressor's W4A16, W8A16), read in their own format
(``engine.packed``: pack-int4, pack-int8).

- The kernels (numba) for both bit widths, a scale per group or per row, in float32 and bfloat16 models,
  equal a float32 product with the model's weights: each ``(u - 2 ** (bits - 1)) * scale`` rounded to
  bfloat16 first in a bfloat16 model, as compressed-tensors computes it in the scale's dtype.
- Against transformers, which reads the same checkpoints on a CPU by decompressing them (the reference;
  the checkpoints written by compressed-tensors' own tools, ``compressed_fixtures``): every expert the engine
  expands and every dense weight it dequantises is bit-identical to transformers' parameter, the greedy
  tokens are the same, and the engine gives the same bits at any budget, tier and miss path.
- What it does not read gets one line: asymmetric weights, quantised activations, fused experts.
"""

from __future__ import annotations

import json

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import assert_experts_are, assert_same_everywhere, engine_load, greedy, with_config

from expertcache.engine.packed import Packed, PackedKernels
from expertcache.errors import ExpertcacheError

IDS = torch.tensor([engine_fixtures.PROMPT])
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir


def _stored(w: torch.Tensor, bits: int, group: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``w`` ``[out, in]`` as compressed-tensors stores a symmetric pack-quantized weight: int32 words of
    unsigned values (the even column in the low nibble for int4) and a scale per group in ``dtype``."""
    rows, cols = w.shape
    g = group or cols
    top = 2 ** (bits - 1)
    scale = (w.view(rows, cols // g, g).abs().amax(-1) / (top - 1)).to(dtype)
    q = torch.round(w.view(rows, cols // g, g) / scale.float()[..., None]).clamp(-top, top - 1)
    q = q.view(rows, cols)
    u = (q + top).to(torch.uint8)
    if bits == 4:
        u = u[:, 0::2] | (u[:, 1::2] << 4)
    return {"q": u.contiguous().view(torch.int32).view(torch.uint8).view(rows, -1, 4), "scale": scale}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 0])  # 0: a scale per row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_equal_the_product_with_the_model_s_weights(bits, group, dtype):
    from expertcache.engine.memory import SlotPool

    torch.manual_seed(5)
    H, F = 160, 96
    shapes = {"gate_up_proj": (2 * F, H), "down_proj": (H, F)}
    p = Packed(f"pack-int{bits}", group, shapes, dtype, False, method="compressed-tensors")
    k = PackedKernels(p)
    pool = SlotPool(k.layout, 3, torch.device("cpu"))
    for s in range(3):
        for name, shape in shapes.items():
            stored = _stored(torch.randn(*shape), bits, group, dtype)
            pool.views[s][f"{name}.q"].copy_(stored["q"])
            pool.views[s][f"{name}.scale"].copy_(stored["scale"].unsqueeze(-1).view(torch.uint8))
    arr = pool.buffer.numpy()

    def weights(slot: int, name: str) -> torch.Tensor:  # the model's weights, in float32
        return p.expand(pool.views[slot], name).to(dtype).to(torch.float32)

    slots = np.array([2, 0], dtype=np.int64)
    for x in (torch.randn(1, H), torch.randn(2, H)):
        got = k.project("gate_up_proj", arr, slots, x)
        for i, s in enumerate(slots):
            xi = x[0 if x.shape[0] == 1 else i]
            want = xi @ weights(int(s), "gate_up_proj").T
            torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-4)
            if dtype == torch.bfloat16:  # the rounding is the kernel's, not within the tolerance
                unrounded = xi @ p.expand(pool.views[int(s)], "gate_up_proj").T
                assert (got[i] - unrounded).abs().max() > 10 * (got[i] - want).abs().max()
    for name, inputs in (("gate_up_proj", torch.randn(13, H)), ("down_proj", torch.randn(13, F))):
        got = k.project_tokens(name, arr, 1, inputs)
        torch.testing.assert_close(got, inputs @ weights(1, name).T, rtol=1e-5, atol=1e-4)


CASES = [("qwen3_moe", 4, "group", "bfloat16"), ("qwen3_moe", 8, "channel", "float32"),
         ("mixtral", 4, "group", "bfloat16"), ("olmoe", 8, "group", "bfloat16"),
         ("deepseek_v3", 4, "group", "bfloat16"), ("qwen2_moe", 4, "channel", "bfloat16")]  # fmt: skip
GROUP = 16


@pytest.fixture(scope="module")
def compressed(make_ckpt, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    from compressed_fixtures import write_compressed_tensors

    built = {}

    def make(family: str, bits: int, strategy: str, dtype: str, symmetric: bool = True):
        key = (family, bits, strategy, dtype, symmetric)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{family}-w{bits}") / "ckpt"
            write_compressed_tensors(make_ckpt(family, dtype=dtype), out, bits=bits, strategy=strategy,
                                     group=GROUP, symmetric=symmetric)  # fmt: skip
            built[key] = out
        return built[key]

    return make


@pytest.mark.parametrize(("family", "bits", "strategy", "dtype"), CASES)
def test_the_engine_reads_what_transformers_reads(family, bits, strategy, dtype, compressed, make_ckpt):
    from expertcache.engine.loader import build_skeleton, load_reference
    from expertcache.engine.offloaded import model_info

    path = compressed(family, bits, strategy, dtype)
    ref = load_reference(path, experts="eager")  # transformers, decompressing on a CPU
    sk = build_skeleton(path)
    assert sk.packed.format == f"pack-int{bits}" and sk.dtype == getattr(torch, dtype)
    mods = [m for m in ref.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)]
    assert_experts_are(sk, mods)
    want = greedy(ref, IDS)  # transformers decompresses the dense layers at their first forward
    theirs = ref.state_dict()
    for name, t in sk.model.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    info = model_info(path)
    assert info["expert_format"] == f"pack-int{bits}-" + ("channel" if strategy == "channel" else f"g{GROUP}")
    with engine_load(path) as model:
        full = greedy(model, IDS)
        stats = model.stats
    assert stats["kernel"] == "packed" and stats["lossy"] is False and stats["made_from"] is None
    assert stats["experts_as_stored"]  # another tool's checkpoint, read exactly: that model
    width = 32 if dtype == "float32" else 16  # a scale's bits, and a full-precision weight's
    share = (bits + width / (GROUP if strategy == "group" else 16)) / width  # a weight's bits, its scale's
    full_bytes = model_info(make_ckpt(family, dtype=dtype))["expert_bytes"]
    assert stats["expert_bytes"] == info["expert_bytes"] <= share * full_bytes
    assert full[0].tolist() == want[0].tolist()
    tol = (1e-5 if dtype == "float32" else 2e-2) * float(want[1].abs().max())
    torch.testing.assert_close(full[1], want[1], rtol=0, atol=tol)
    assert_same_everywhere(path, IDS, full)


KEPT = "model.layers.1.mlp.experts"


def test_what_it_does_not_read_gets_one_line(compressed, make_ckpt, tmp_path):
    from expertcache.engine.offloaded import load

    good = compressed("qwen3_moe", 4, "group", "bfloat16")
    qc = json.loads((good / "config.json").read_text())["quantization_config"]
    group = dict(qc["config_groups"]["group_0"])
    token = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    acts = {**group, "input_activations": token}
    cases = [
        (compressed("qwen3_moe", 4, "group", "bfloat16", symmetric=False), "asymmetric"),
        (
            with_config(
                good, tmp_path / "acts", quantization_config={**qc, "config_groups": {"group_0": acts}}
            ),
            "quantised activations",
        ),
        (
            with_config(
                good, tmp_path / "frozen", quantization_config={**qc, "quantization_status": "frozen"}
            ),
            "status 'frozen'",
        ),
        (  # what llm-compressor leaves unquantised where its group does not divide the inputs (a down
            # projection of 96 inputs, group 64): it said "checkpoint lacks expert tensor ...weight_packed"
            with_config(
                good,
                tmp_path / "kept",
                quantization_config={**qc, "ignore": [*qc["ignore"], f"{KEPT}.3.down_proj"]},
            ),  # fmt: skip
            "keeps some of its experts' projections at full precision (its 'ignore' lists "
            f"{KEPT}.3.down_proj)",
        ),
    ]
    for path, words in cases:
        with pytest.raises(ExpertcacheError) as err:
            load(path)
        msg = str(err.value)
        assert "\n" not in msg and words in msg and "compressed-tensors" in msg, msg
    # a family storing its experts fused (Granite): refused before any weight is read
    fused = with_config(make_ckpt("granitemoe"), tmp_path / "fused", quantization_config=qc)
    with pytest.raises(ExpertcacheError, match="stores its experts fused"):
        load(fused)


def test_quality_of_a_checkpoint_quantised_elsewhere_runs_against_transformers_own_run(
    compressed, capsys, monkeypatch
):
    """quality --model on a checkpoint another tool quantised (none recorded its full-precision source,
    as downloaded) was refused unless --reference-model named one: it now runs against transformers' own
    (dequantising) run of the checkpoint, and says that this is not the quantisation's cost."""
    from expertcache.tools.quality import measure

    path = compressed("qwen3_moe", 8, "channel", "float32")
    texts = ["The quick brown fox jumps over the lazy dog.", "hello world, hello experts, hello cache"]
    r = measure(path, "fetch", "100%", texts=texts, tokens=24)
    assert "the reference is transformers' own run of" in capsys.readouterr().err
    assert r["top1_agreement"] == 1.0 and r["logits_max_difference"] < 1e-4
    # where transformers cannot run the checkpoint itself (5.24 failed on a compressed-tensors checkpoint of
    # tied embeddings: "Linear has no attribute weight"), the error says what stands in (a new user's trial)
    import expertcache.tools.quality as quality

    def fails(self, *args, **kwargs):
        raise ExpertcacheError(f"{path}: transformers cannot load this checkpoint (Linear has no attribute)")

    monkeypatch.setattr(quality.Reference, "__init__", fails)
    with pytest.raises(ExpertcacheError, match=r"no attribute\); give a full-precision checkpoint of the "
                       r"model to measure against \(reference_model="):  # fmt: skip
        measure(path, "fetch", "100%", texts=texts, tokens=24)
