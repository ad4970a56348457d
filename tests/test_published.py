"""Checkpoints quantised by other tools, read in their own format (``engine.packed``: mxfp4, fp8).

- The writers (``tools.published``) round as the formats define: MXFP4 to the nearest e2m1 (ties to the
  even code) under a power-of-two scale per 32 columns, FP8 e4m3 under ``absmax / 448`` per block.
- The packed kernels for both (numba) equal a float32 product with the expanded matrices, one token and
  several, with row blocks split between two checkpoint tensors (gate, up) and columns a block does not
  divide. So do Triton's (on a GPU; and in Triton's interpreter on a CPU wherever Triton is installed),
  fp8 in a bfloat16 model with each weight rounded to bfloat16 first; a slot past the pool gives zeros and
  a pair's output is the same bits alone as in a batch.
- Against transformers, which reads the same checkpoints on a CPU by dequantising them (the reference):
  every expert the engine expands and every dense weight it dequantises is bit-identical to transformers'
  parameter; the greedy tokens are the same and the logits within float32 rounding (the kernels sum in
  another order); and the engine gives the same bits at any budget, tier and miss path.
- Errors are one line: a method or family the engine does not read, fp8 without block scales or with
  static activation scales, a --format with --bits.
"""

from __future__ import annotations

import importlib.util
import json
import os

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import (
    assert_experts_are,
    assert_same_everywhere,
    engine_load,
    greedy,
    run_interpreted,
    with_config,
)

from expertcache.engine.packed import (
    MATRICES,
    Packed,
    PackedKernels,
    SiluExperts,
    dequantize_fp8,
    pack_int4,
    pack_int8,
)
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
        elif p.format in ("int8", "int4"):  # expertcache's own (the interpreter runs their kernels too)
            for key, t in (pack_int8(w) if p.format == "int8" else pack_int4(w, p.group)).items():
                pool.views[slot][f"{name}.{key}"].copy_(t)
        else:
            parts = dict(p.parts)[name]
            qs, ss = zip(*(quantize_fp8(part, p.block) for part in w.split(parts)), strict=True)
            pool.views[slot][f"{name}.q"].copy_(torch.cat(qs).view(torch.uint8))
            pool.views[slot][f"{name}.scale"].copy_(torch.cat(ss).unsqueeze(-1).view(torch.uint8))


def test_the_kernels_decode_as_torch_does():
    """The kernels' table-free decodes: every e4m3fn code (NaN included) and e2m1 code is torch's value,
    and the rounding to bfloat16 is torch's (ties to even)."""
    from expertcache.engine import _packed_jit as jit

    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).to(torch.float32)
    got = torch.tensor([jit._e4m3(np.uint8(c)) for c in range(256)])
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().sum() == 2
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert [jit._fp4(np.uint8(c)) for c in range(16)] == e2m1 + [-v for v in e2m1]
    values = torch.randn(4096) * 1000
    values[:3] = torch.tensor([1.00390625, 1.01171875, -3.0078125])  # ties: to even, both ways
    got = torch.tensor([jit._round_bf16(np.float32(v)) for v in values.tolist()])
    assert torch.equal(got, values.to(torch.bfloat16).to(torch.float32))


@pytest.mark.parametrize(("fmt", "dtype"), [("mxfp4", torch.float32), ("fp8", torch.float32),
                                            ("fp8", torch.bfloat16)])  # fmt: skip
def test_the_kernels_equal_the_product_with_the_expanded_matrices(fmt, dtype):
    """Each weight the kernels multiply is the expanded matrix's in the model's dtype: fp8 in a bfloat16
    model rounds each ``fp8 * scale`` to bfloat16 first, as transformers' dequantised weights are."""
    from expertcache.engine.memory import SlotPool

    torch.manual_seed(2)
    H, F = 160, 96  # fp8 at blocks of 64 x 128: gate and up of 96 rows each take two row blocks, the
    shapes = {"gate_up_proj": (2 * F, H), "down_proj": (H, F)}  # second one shorter; 160 columns: 2 blocks
    if fmt == "mxfp4":
        p = Packed("mxfp4", 32, shapes, dtype, False, method="mxfp4")
    else:
        parts = (("gate_up_proj", (F, F)), ("down_proj", (H,)))
        p = Packed("fp8", 0, shapes, dtype, False, block=(64, 128), parts=parts, method="fp8")
    k = PackedKernels(p)
    k.warm_host()  # the loops run on a zero slot at load (a packed model below 100 % on a CPU)
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

    def weights(slot: int, name: str) -> torch.Tensor:  # the model's weights, in float32
        return p.expand(pool.views[slot], name).to(dtype).to(torch.float32)

    for x in (torch.randn(1, H), torch.randn(2, H)):  # one row for both, one each
        got = k.project("gate_up_proj", arr, slots, x)
        for i, s in enumerate(slots):
            want = x[0 if x.shape[0] == 1 else i] @ weights(int(s), "gate_up_proj").T
            torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
            if dtype == torch.bfloat16:  # the rounding is the kernel's, not within the tolerance
                unrounded = x[0 if x.shape[0] == 1 else i] @ p.expand(pool.views[int(s)], "gate_up_proj").T
                assert (got[i] - unrounded).abs().max() > 100 * (got[i] - want).abs().max()
    for name, inputs in (("gate_up_proj", torch.randn(13, H)), ("down_proj", torch.randn(13, F))):
        got = k.project_tokens(name, arr, 1, inputs)
        torch.testing.assert_close(got, inputs @ weights(1, name).T, rtol=1e-5, atol=1e-4)


# Triton's kernels: (gate_up rows, hidden, intermediate[, fp8 block]); the second of each an odd row count
# (mxfp4), or rows and columns no block divides with gate and up of different sizes (fp8)
TRITON_SHAPES = {"mxfp4": [(128, 160, 64, None), (47, 96, 32, None)],
                 "fp8": [(192, 200, 96, (64, 128)), (301, 200, 150, (128, 128))],
                 "int8": [(128, 160, 64, None), (47, 96, 30, None)],
                 "int4": [(128, 160, 64, None), (48, 96, 32, None)]}  # fmt: skip


def _triton_pool(fmt: str, dtype: torch.dtype, device, G: int, H: int, F: int, block):
    from expertcache.engine.memory import SlotPool

    torch.manual_seed(4)
    shapes = {"gate_up_proj": (G, H), "down_proj": (H, F)}
    if fmt == "mxfp4":
        p = Packed("mxfp4", 32, shapes, dtype, False, method="mxfp4")
    elif fmt in ("int8", "int4"):
        p = Packed(fmt, 64 if fmt == "int4" else 0, shapes, dtype, False)
    else:
        parts = (("gate_up_proj", (G // 2, G - G // 2)), ("down_proj", (H,)))
        p = Packed("fp8", 0, shapes, dtype, False, block=block, parts=parts, method="fp8")
    k = PackedKernels(p)
    pool = SlotPool(k.layout, 3, device)
    for s in range(3):
        _fill(p, pool, s, {"gate_up_proj": torch.randn(G, H), "down_proj": torch.randn(H, F)})
    return p, k, pool


def _check_triton_pairs(p: Packed, k: PackedKernels, pool) -> None:
    """``k.project`` over a torch pool (Triton's kernels): each pair within float32 rounding of the expanded
    product (fp8 in bfloat16: of the weights rounded to bfloat16, as transformers has them), a slot past the
    pool zeros, a pair alone (a one-slot pool) the same bits as in the batch, and a row shared by all."""
    from expertcache.engine.packed import slot_bytes

    dev = pool.buffer.device
    slots = torch.tensor([2, 0, 3, 1], device=dev)  # 3: past the pool
    for name in MATRICES:
        rows, cols = p.matrix(name)
        x = torch.randn(4, cols, device=dev).to(p.dtype)
        got = k.project(name, pool.buffer, slots, x)
        shared = k.project(name, pool.buffer, slots, x[:1])
        assert got.shape == (4, rows) and got.dtype == torch.float32
        for i, s in enumerate(slots.tolist()):
            if s >= 3:
                assert not got[i].any() and not shared[i].any()
                continue
            w = p.expand(pool.views[s], name)
            if p.format == "fp8" and p.dtype == torch.bfloat16:
                rounded = w.to(torch.bfloat16).to(torch.float32)
                assert not torch.equal(rounded, w)  # the rounding is seen
                w = rounded
            torch.testing.assert_close(got[i], w @ x[i].float(), rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(shared[i], w @ x[0].float(), rtol=1e-4, atol=1e-3)
            one = slot_bytes(pool.views[s], k.layout)
            alone = k.project(name, one, torch.zeros(1, dtype=torch.int64, device=dev), x[i : i + 1])
            assert torch.equal(alone[0], got[i]), (name, s)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_kernels_equal_the_product_and_do_not_depend_on_their_batch(fmt, dtype):
    """Triton's mxfp4 and fp8 kernels (``_check_triton_pairs``), and an expert computed alone (a miss's
    ``expert``) gives the same bits as in a batch of resident ones (``rows``)."""
    pytest.importorskip("triton")
    from expertcache.engine.packed import gpu_kernels

    dev = torch.device("cuda")
    for G, H, F, block in TRITON_SHAPES[fmt]:
        p, k, pool = _triton_pool(fmt, dtype, dev, G, H, F, block)
        assert gpu_kernels(dev, p)
        _check_triton_pairs(p, k, pool)
    G, H, F, block = TRITON_SHAPES[fmt][0]
    p, k, pool = _triton_pool(fmt, dtype, dev, G, H, F, block)
    k.warm(pool.buffer)

    Module = SiluExperts  # what the kernels read of an experts module

    slots = torch.tensor([2, 0, 3, 1], device=dev)
    x = torch.randn(4, H, device=dev).to(dtype)
    batch = k.rows(Module, pool.buffer, slots[[0, 1, 3]], x[[0, 1, 3]])
    for row, (s, i) in enumerate(((2, 0), (0, 1), (1, 3))):
        alone = k.expert(Module, pool.views[s], x[i : i + 1])
        assert torch.equal(alone[0], batch[row])


# Triton's interpreter runs the kernels on a CPU, with CPU tensors, where Triton is installed; it must be on
# (TRITON_INTERPRET=1) before triton is imported, so its tests run in a process of their own, which
# test_the_triton_kernels_in_triton_s_interpreter starts
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
if INTERPRETED:  # kernels of the decoders alone (a kernel reads its module's names)
    import triton
    import triton.language as tl

    from expertcache.engine import _packed_triton

    @triton.jit
    def _decode_codes(src, out):
        i = tl.arange(0, 256)
        code = tl.load(src + i).to(tl.int32)
        tl.store(out + i, _packed_triton._e4m3(code))
        tl.store(out + 256 + i, _packed_triton._e8m0(code))
        tl.store(out + 512 + i, _packed_triton._e2m1(code & 15))

    @triton.jit
    def _to_bf16(src, out, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out + i, _packed_triton._round_bf16(tl.load(src + i)))


def test_the_triton_kernels_in_triton_s_interpreter():
    """The ``interpreted_`` tests below, in a process with Triton's interpreter on (where Triton is
    installed; no GPU needed)."""
    run_interpreted(__file__, 9)


interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="run by test_the_triton_kernels_in_triton_s_interpreter"
)


@interpreted
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_triton_kernels_equal_the_product(fmt, dtype):
    """Triton's mxfp4, fp8, int8 and int4 kernels in Triton's interpreter: ``_check_triton_pairs``, and
    within float32 rounding of numba's loops (the reference)."""
    cpu = torch.device("cpu")
    for G, H, F, block in TRITON_SHAPES[fmt]:
        p, k, pool = _triton_pool(fmt, dtype, cpu, G, H, F, block)
        _check_triton_pairs(p, k, pool)
        for name in MATRICES:
            x = torch.randn(2, p.matrix(name)[1]).to(dtype)
            slots = torch.tensor([2, 0])
            got = k.project(name, pool.buffer, slots, x)
            want = k.project(name, pool.buffer.numpy(), slots.numpy(), x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@interpreted
def test_interpreted_triton_decoders_give_every_code_its_value():
    """Every e4m3fn and e8m0 byte and every e2m1 code decoded by the kernels' bit arithmetic (NaNs
    included) as torch and the formats define it, and float32 rounded to bfloat16 as torch rounds it."""
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(768)
    _decode_codes[(1,)](codes, out)
    e4m3 = codes.view(torch.float8_e4m3fn).to(torch.float32)
    e8m0 = torch.tensor([2.0 ** (s - 127) for s in range(255)] + [float("nan")])
    torch.testing.assert_close(out[:256], e4m3, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out[256:512], e8m0, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out[512:].view(16, 16), torch.cat([E2M1, -E2M1]).repeat(16, 1))
    assert torch.equal(out[512:].signbit().view(16, 16), (torch.arange(16) >= 8).repeat(16, 1))
    w = torch.randn(4096) * torch.logspace(-30, 30, 4096)
    w[:6] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-9, 3.4e38, -0.0])  # ties to even
    got = torch.empty_like(w)
    _to_bf16[(1,)](w, got, N=4096)
    assert torch.equal(got, w.to(torch.bfloat16).to(torch.float32))


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
    assert_experts_are(sk, mods)
    theirs = ref.state_dict()
    for name, t in sk.model.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    # the tokens of transformers' forward, the logits within float32 rounding of it
    want = greedy(ref, IDS)
    info = model_info(path)
    # the dense layers as stored (fp8: a byte a weight and its scales) beside their dequantised bytes in
    # memory (dense_bytes: a new user's trial read it as the file's); every tensor's bytes in all
    from safetensors import safe_open

    files = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            files += sum(h.get_tensor(k).nbytes for k in h.keys())  # noqa: SIM118 (not iterable)
    assert info["dense_stored_bytes"] + info["all_experts_bytes"] == files
    assert (info["dense_stored_bytes"] < info["dense_bytes"]) is (fmt == "fp8")
    # torch 2.11's cuDNN attention fails on this tiny MLA's heads in bfloat16 on an H200 ("mha_graph.execute
    # ... is_good()", pytorch#134001; transformers alone too): the eager attention there
    options = {"attention": "eager"} if engine_fixtures.DEVICE != "cpu" and family == "deepseek_v3" else {}
    with engine_load(path, **options) as model:
        full = greedy(model, IDS)
        stats = model.stats
    assert stats["kernel"] == "packed" and stats["expert_format"] == info["expert_format"]
    assert stats["experts_as_stored"]  # the weights are transformers' (fp8 in bfloat16: rounded as it does)
    made = str(make_ckpt(family, dtype=dtype).resolve())  # yet made from that one, as both say
    assert stats["made_from"] == info["made_from"] == made
    assert stats["lossy"] is stats["experts_lossy"] is True  # and so lossy, as expertcache's own formats
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
    assert_same_everywhere(path, IDS, full, **options)


@pytest.mark.parametrize(("family", "fmt", "dtype"), [CASES[1], CASES[3]])
def test_the_reference_dequantises_on_a_gpu_machine_too(family, fmt, dtype, published, monkeypatch):
    """Where a GPU is present transformers keeps FP8 (and MXFP4, given its kernels) packed and computes
    with its own kernels; the reference asks it to dequantise, so it is the same model on every machine
    (a GPU machine found FP8 experts left packed, and DeepSeek's attention expecting scales)."""
    from expertcache.engine.loader import build_skeleton, load_reference

    path = published(family, fmt, dtype)
    want = load_reference(path, experts="eager").state_dict()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what transformers asks first
    got = load_reference(path, experts="eager")
    assert got.state_dict().keys() == want.keys()
    assert all(torch.equal(t, want[name]) for name, t in got.state_dict().items())
    mods = [m for m in got.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)]
    assert mods and all(m.gate_up_proj.dtype == getattr(torch, dtype) for m in mods)
    assert_experts_are(build_skeleton(path), [m for m in mods if hasattr(m, "has_gate")])


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
        (["quantize", "--format", "mxfp4", "--checkpoint", str(tmp_path / "a")],
         "not mixtral's: write --format fp8, or --bits 4"),
        # a family of fused experts is not sent to fp8, which refuses it (a new user's trial)
        (["quantize", str(make_ckpt("granitemoe")), "--format", "mxfp4", "--checkpoint", str(tmp_path / "e")],
         "not granitemoe's: write --bits 4 for expertcache's int4"),
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


def test_quantisations_it_cannot_read_are_one_line(published, make_ckpt, tmp_path):
    from expertcache.engine import load

    fp8 = published("qwen3_moe", "fp8", "float32")
    cfg = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    qwen = make_ckpt("qwen3_moe")
    cases = [
        (with_config(fp8, tmp_path / "noblock", quantization_config={**cfg, "weight_block_size": None}),
         "without block scales"),
        (with_config(fp8, tmp_path / "static", quantization_config={**cfg, "activation_scheme": "static"}),
         "static activation scales"),
        (with_config(qwen, tmp_path / "gptq", quantization_config={"quant_method": "gptq"}),
         r"quantised \(gptq, .* it reads int8, int4"),
        (with_config(qwen, tmp_path / "mxq", quantization_config={"quant_method": "mxfp4"}),
         "does not read for qwen3_moe"),
        (with_config(qwen, tmp_path / "bf", quantization_config=cfg),
         "stored in torch.float32, not float8_e4m3fn"),
    ]  # fmt: skip
    for path, message in cases:
        with pytest.raises(ExpertcacheError, match=message) as info:
            load(path, progress=False)
        assert "\n" not in str(info.value)


def test_writing_fp8_says_where_transformers_would_misread_a_partial_block(tmp_path):
    """A new user's fp8 copy of the embedded model (sizes 160, 96, 32) measured -3.3 % perplexity against
    transformers' reading of it, without a word: a matrix of several 128-blocks, the last partial, is
    split otherwise by transformers. The note names it; a matrix of one block alone is read right."""
    from expertcache.engine.random_checkpoint import make_checkpoint

    lines: list[str] = []
    small = make_checkpoint(tmp_path / "small", "mixtral", hidden=64, intermediate=96)
    assert "partial_blocks" not in write_published(small, "fp8", tmp_path / "small-fp8", log=lines.append)
    assert not any("partial" in line for line in lines)
    wide = make_checkpoint(tmp_path / "wide", "mixtral", hidden=160, intermediate=96)
    record = write_published(wide, "fp8", tmp_path / "wide-fp8", log=lines.append)
    assert record["partial_blocks"] > 0
    assert any("are larger than 128 and not a multiple of it" in line for line in lines)


def test_quality_refuses_transformers_dequantising_partial_fp8_blocks_otherwise(tmp_path, capsys):
    """The embedded model's FP8 (hidden 160: a whole block of 128 and a partial one of 32) has no
    full-precision source once its record is gone: transformers' Fp8Dequantize derives its block from the
    scale grid (160 / 2 = 80), not the checkpoint's 128, and its run was 3.5 off the engine's in the logits
    (a reference that is not one). It is refused, as is the checkpoint given as its own reference."""
    import json

    from expertcache.tools.published import write_published
    from expertcache.tools.quality import measure
    from expertcache.tools.quantize import SOURCE_KEY

    out = tmp_path / "fp8"
    write_published(None, "fp8", out)
    config = json.loads((out / "config.json").read_text())
    del config[SOURCE_KEY]
    (out / "config.json").write_text(json.dumps(config))
    why = r"\[96, 160\] is not whole blocks of \[128, 128\], which transformers dequantises"
    with pytest.raises(ExpertcacheError, match=why):
        measure(out, "fetch", "100%", tokens=8)
    with pytest.raises(ExpertcacheError, match=why):
        measure(out, "fetch", "100%", tokens=8, reference_model=out)


def test_quality_against_the_checkpoint_itself_measures_the_engine_not_the_quantisation(published, capsys):
    """``quality --reference-model`` naming the checkpoint itself said "lossy" and noted "the figures compare
    with another model"; a copy without a recorded source said "exact" beside logits not all bit-identical
    (a new user's trial). Against its own checkpoint the figures are the engine's run of it: not lossy,
    noted as transformers' own run, and labelled exact weights summed within rounding (the packed kernel
    sums in float32, transformers dequantises and multiplies)."""
    from expertcache.tools.quality import format_quality, measure

    path = published("qwen3_moe", "fp8", "bfloat16")
    texts = ["The quick brown fox jumps over the lazy dog.", "hello world, hello experts, hello cache"]
    r = measure(path, "fetch", "100%", texts=texts, tokens=24, reference_model=path)
    err = capsys.readouterr().err
    assert "the reference is transformers' own run of" in err and "another model" not in err, err
    assert r["lossy"] is False
    assert "(exact weights: kernel packed sums them in float32, within rounding of this reference)" in (
        format_quality(r)
    )
    # against the checkpoint it was made from, the quantisation's cost: lossy
    assert measure(path, "fetch", "100%", texts=texts, tokens=24)["lossy"] is True
