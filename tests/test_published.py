"""Checkpoints quantised by other tools, read in their own format (``engine.packed``: mxfp4, fp8).

- The writers (``tools.published``) round as the formats define: MXFP4 to the nearest e2m1 (ties to the
  even code) under a power-of-two scale per 32 columns, FP8 e4m3 under ``absmax / 448`` per block.
- The packed kernels for both (numba) equal a float32 product with the expanded matrices, one token and
  several, with row blocks split between two checkpoint tensors (gate, up) and columns a block does not
  divide.
- Against transformers, which reads the same checkpoints on a CPU by dequantising them (the reference):
  every expert the engine expands and every dense weight it dequantises is bit-identical to transformers'
  parameter; the greedy tokens are the same and the logits within float32 rounding (the kernels sum in
  another order); and the engine gives the same bits at any budget, tier and miss path.
- Errors are one line: a method or family the engine does not read, fp8 without block scales or with
  static activation scales, a --format with --bits.
"""

from __future__ import annotations

import json

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import engine_load, greedy

from expertcache.engine.packed import MATRICES, Packed, PackedKernels, dequantize_fp8
from expertcache.errors import ExpertcacheError
from expertcache.tools.published import quantize_fp8, quantize_mxfp4, write_published

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def test_mxfp4_rounds_to_the_nearest_value_under_a_power_of_two():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    w = torch.randn(2, 6, 64) * torch.logspace(-3, 2, 6)[None, :, None]
    w[0, 0, :32] = 0  # an all-zero block
    w[0, 1, :4] = torch.tensor([0.25, 0.75, 2.5, 5.0]) * 4  # ties: to the even code
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (2, 6, 2, 16) and scales.shape == (2, 6, 2)
    # transformers' own dequantisation (its [E, in, out] transposes back)
    back = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    step = torch.exp2(scales.to(torch.float32) - 127).repeat_interleave(32, dim=-1)
    nearest = (w.unsqueeze(-1).abs() - E2M1 * step[..., None]).abs().amin(-1)  # to any e2m1 value
    assert ((back - w).abs() <= nearest + 1e-12).all() and (back * w >= 0).all()
    assert back[0, 0, :32].eq(0).all()
    assert back[0, 1, :4].tolist() == [0.0, 4.0, 8.0, 16.0]  # 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4 (x4)


def test_fp8_rounds_each_block_to_e4m3():
    torch.manual_seed(1)
    w = torch.randn(200, 300)
    q, scale = quantize_fp8(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    back = dequantize_fp8(q, scale, (128, 128), torch.float32)
    assert torch.allclose(scale[1, 2], w[128:, 256:].abs().max() / 448)
    # e4m3: 3 mantissa bits, so within 1/16 of a value (relative), the block's max kept at 448 * scale
    assert (
        (back - w).abs()
        <= w.abs() / 16 + scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 2**-9
    ).all()


def _fill(p: Packed, pool, slot: int, full: dict[str, torch.Tensor]) -> None:
    for name in MATRICES:
        w = full[name]  # [out, in]
        if p.format == "mxfp4":
            q, s = quantize_mxfp4(w)
            pool.views[slot][f"{name}.q"].copy_(q)
            pool.views[slot][f"{name}.scale"].copy_(s)
        else:
            parts = dict(p.parts)[name]
            qs, ss = zip(*(quantize_fp8(part, p.block) for part in w.split(parts)), strict=True)
            pool.views[slot][f"{name}.q"].copy_(torch.cat(qs).view(torch.uint8))
            pool.views[slot][f"{name}.scale"].copy_(torch.cat(ss).unsqueeze(-1).view(torch.uint8))


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_the_kernels_equal_the_product_with_the_expanded_matrices(fmt):
    from expertcache.engine.memory import SlotPool

    torch.manual_seed(2)
    H, F = 160, 96  # fp8 at blocks of 64 x 128: gate and up of 96 rows each take two row blocks, the
    shapes = {"gate_up_proj": (2 * F, H), "down_proj": (H, F)}  # second one shorter; 160 columns: 2 blocks
    if fmt == "mxfp4":
        p = Packed("mxfp4", 32, shapes, torch.float32, False, method="mxfp4")
    else:
        parts = (("gate_up_proj", (F, F)), ("down_proj", (H,)))
        p = Packed("fp8", 0, shapes, torch.float32, False, block=(64, 128), parts=parts, method="fp8")
    k = PackedKernels(p)
    pool = SlotPool(k.layout, 3, torch.device("cpu"))
    fulls = []
    for s in range(3):
        fulls.append({"gate_up_proj": torch.randn(2 * F, H), "down_proj": torch.randn(H, F)})
        _fill(p, pool, s, fulls[-1])
    if fmt == "fp8":  # the expanded matrix: each part dequantised on its own blocks
        gate, up = fulls[0]["gate_up_proj"].split(F)
        want = torch.cat(
            [dequantize_fp8(*quantize_fp8(t, (64, 128)), (64, 128), torch.float32) for t in (gate, up)]
        )
        assert torch.equal(p.expand(pool.views[0], "gate_up_proj"), want)
    close = (fulls[0]["down_proj"] - p.expand(pool.views[0], "down_proj")).abs().max()
    assert 0 < close < 0.35 * fulls[0]["down_proj"].abs().max()  # a quantisation of it, not another matrix
    arr = pool.buffer.numpy()
    slots = np.array([2, 0], dtype=np.int64)
    for x in (torch.randn(1, H), torch.randn(2, H)):  # one row for both, one each
        got = k.project("gate_up_proj", arr, slots, x)
        for i, s in enumerate(slots):
            want = x[0 if x.shape[0] == 1 else i] @ p.expand(pool.views[int(s)], "gate_up_proj").T
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
    for name, inputs in (("gate_up_proj", torch.randn(13, H)), ("down_proj", torch.randn(13, F))):
        got = k.project_tokens(name, arr, 1, inputs)
        torch.testing.assert_close(got, inputs @ p.expand(pool.views[1], name).T, rtol=1e-4, atol=1e-4)


CASES = [("gpt_oss", "mxfp4", "float32"), ("gpt_oss", "mxfp4", "bfloat16"), ("qwen3_moe", "fp8", "float32"),
         ("deepseek_v3", "fp8", "bfloat16"), ("mixtral", "fp8", "float32")]  # fmt: skip


@pytest.fixture(scope="module")
def published(make_ckpt, tmp_path_factory):
    built = {}

    def make(family: str, fmt: str, dtype: str):
        if (family, fmt, dtype) not in built:
            out = tmp_path_factory.mktemp(f"{family}-{fmt}") / "ckpt"
            write_published(make_ckpt(family, dtype=dtype), fmt, out)
            built[family, fmt, dtype] = out
        return built[family, fmt, dtype]

    return make


@pytest.mark.parametrize(("family", "fmt", "dtype"), CASES)
def test_the_engine_reads_what_transformers_reads(family, fmt, dtype, published, make_ckpt):
    from expertcache.engine.loader import build_skeleton, load_reference
    from expertcache.engine.memory import SlotPool
    from expertcache.engine.offloaded import model_info

    path = published(family, fmt, dtype)
    ref = load_reference(path, experts="eager")  # transformers, dequantising on a CPU
    sk = build_skeleton(path)
    assert sk.packed.format == fmt and sk.dtype == getattr(torch, dtype)
    # every expert, expanded, and every dense weight, dequantised: transformers' parameters, bit for bit
    mods = [
        m
        for m in ref.modules()
        if hasattr(m, "has_gate") and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
    ]
    scratch = SlotPool(sk.layout, 1, torch.device("cpu")).views[0]
    for layer, mod in enumerate(mods):
        for e in range(sk.num_experts):
            sk.store.read((layer, e), scratch)
            for name in MATRICES:
                want = getattr(mod, name)[e]
                got = sk.packed.expand(scratch, name).to(want.dtype)
                assert torch.equal(got.T if sk.packed.transposed else got, want), (layer, e, name)
            if sk.packed.transposed:
                for name in ("gate_up_proj_bias", "down_proj_bias"):
                    assert torch.equal(sk.packed.bias(scratch, name), getattr(mod, name)[e])
    theirs = ref.state_dict()
    for name, t in sk.model.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    # the tokens of transformers' forward, the logits within float32 rounding of it
    want = greedy(ref, IDS)
    info = model_info(path)
    with engine_load(path) as model:
        full = greedy(model, IDS)
        stats = model.stats
    assert stats["kernel"] == "packed" and stats["expert_format"] == info["expert_format"]
    share = (4.25 if fmt == "mxfp4" else 8.01) / (32 if dtype == "float32" else 16)  # bits a weight
    assert (
        stats["expert_bytes"]
        == info["expert_bytes"]
        < (share + 0.1) * model_info(make_ckpt(family, dtype=dtype))["expert_bytes"]
    )
    assert full[0].tolist() == want[0].tolist()
    tol = (1e-5 if dtype == "float32" else 2e-2) * float(want[1].abs().max())
    torch.testing.assert_close(full[1], want[1], rtol=0, atol=tol)
    # any budget, tier and miss path: the same bits
    for kwargs in (dict(expert_memory="30%", slow_tier="disk"), dict(expert_memory="30%", miss="host"),
                   dict(expert_memory="40%", slow_tier="host", prefetch="next-gate")):  # fmt: skip
        with engine_load(path, **kwargs) as model:
            got = greedy(model, IDS)
        assert got[0].tolist() == full[0].tolist() and torch.equal(got[1], full[1]), kwargs


def test_quantize_format_from_the_cli_and_errors(make_ckpt, tmp_path, capsys):
    from expertcache.cli import main

    gpt = make_ckpt("gpt_oss")
    out = tmp_path / "mx"
    assert main(["quantize", str(gpt), "--format", "mxfp4", "--checkpoint", str(out), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["format"] == "mxfp4" and record["bytes_per_expert"] < record["full_bytes_per_expert"] / 4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    code = main(["generate", "--model", str(out), "--prompt", "def f(x):", "--max-new-tokens", "3",
                 "--expert-memory", "50%", "--json"])  # fmt: skip
    assert code == 0
    run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert run["expert_format"] == "mxfp4" and run["kernel"] == "packed"
    for argv, message in (
        (["quantize", "--format", "mxfp4", "--checkpoint", str(tmp_path / "a")], "mxfp4 is GPT-OSS's layout"),
        (["quantize", "--format", "fp8", "--bits", "8", "--checkpoint", str(tmp_path / "b")], "drop --bits"),
        (["quantize", "--format", "fp8"], "give --checkpoint DIR"),
        (["quantize", str(make_ckpt("granitemoe")), "--format", "fp8", "--checkpoint", str(tmp_path / "c")],
         "stores them fused"),
        (["quantize", str(out), "--format", "mxfp4", "--checkpoint", str(tmp_path / "d")],
         "quantised already"),
    ):  # fmt: skip
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def _with_config(src, dst, **entries):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(entries)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_quantisations_it_cannot_read_are_one_line(published, make_ckpt, tmp_path):
    from expertcache.engine import load

    fp8 = published("qwen3_moe", "fp8", "float32")
    cfg = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    qwen = make_ckpt("qwen3_moe")
    cases = [
        (_with_config(fp8, tmp_path / "noblock", quantization_config={**cfg, "weight_block_size": None}),
         "without block scales"),
        (_with_config(fp8, tmp_path / "static", quantization_config={**cfg, "activation_scheme": "static"}),
         "static activation scales"),
        (_with_config(qwen, tmp_path / "gptq", quantization_config={"quant_method": "gptq"}),
         r"quantised \(gptq, .* it reads int8, int4"),
        (_with_config(qwen, tmp_path / "mxq", quantization_config={"quant_method": "mxfp4"}),
         "does not read for qwen3_moe"),
        (_with_config(qwen, tmp_path / "bf", quantization_config=cfg),
         "stored in torch.float32, not float8_e4m3fn"),
    ]  # fmt: skip
    for path, message in cases:
        with pytest.raises(ExpertcacheError, match=message) as info:
            load(path, progress=False)
        assert "\n" not in str(info.value)
