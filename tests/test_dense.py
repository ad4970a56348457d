"""Dense layers quantised at load (``engine.dense``, ``--quantize-dense int8``): opt-in, lossy, said so.

- A ``QuantizedLinear`` keeps each weight within half its row's step, and its product equals a float32
  product with the weight its int8 values stand for, at every number of rows (the one-token loops, the
  expanded weight beyond them), with and without a bias, in float32 and bfloat16;
  a row's output is the same bits alone as in a batch of the one-token loops. So does Triton's kernel (in
  Triton's interpreter on a CPU wherever Triton is installed).
- Every family runs through the engine with its dense layers quantised, at a small budget from disk: tokens
  and logits bit-identical to transformers running the same checkpoint with the same layers quantised by
  ``quantize_dense`` (the experts and routers stay as stored), and the same bits at every budget, tier and
  miss path. Everything but the routers, the experts, the embeddings and the norms is quantised.
- The stats, ``generate`` and ``quality`` say the model is lossy and how; a format the engine does not
  quantise to is one line (exit 2 from the CLI).
"""

from __future__ import annotations

import importlib.util
import json
import os

import engine_fixtures
import pytest
import torch
from engine_fixtures import FAMILIES, assert_exact, engine_load, greedy, moe_layers
from torch.nn import functional as F

from expertcache.engine.dense import DENSE_FORMATS, QuantizedLinear, quantize_dense
from expertcache.engine.packed import CPU_ROWS, PREFILL_ROWS
from expertcache.errors import ExpertcacheError

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir

ROWS = sorted({1, 3, CPU_ROWS["int8"], CPU_ROWS["int8"] + 1, 40, PREFILL_ROWS, PREFILL_ROWS + 1, 150})


def _linear(cols: int, rows: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(cols, rows, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.2, 3, rows)[:, None])  # rows of different scales
    return lin.to(dtype)


def test_a_weight_comes_back_within_half_its_row_s_step():
    lin = _linear(96, 70, False, torch.float32)
    q = QuantizedLinear(lin)
    scale = q.pool[0, q.soff :].view(torch.float32)
    back = q.weight_expanded()
    assert back.shape == lin.weight.shape and back.dtype == lin.weight.dtype
    assert torch.allclose(scale, lin.weight.detach().abs().amax(1) / 127)
    assert ((back - lin.weight).abs() <= scale[:, None] / 2 + 1e-6).all()
    assert (back - lin.weight).abs().max() > 0  # it is a quantisation
    assert q.nbytes < lin.weight.numel() * 4 / 3  # a byte a weight, and the scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compiled_expansion_gives_torch_s_bits(dtype):
    q = QuantizedLinear(_linear(200, 70, False, dtype, seed=2))
    got, want = q.weight_expanded(), q.weight_expanded_torch()
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_equals_the_expanded_weight_s_at_every_number_of_rows(dtype, bias):
    lin = _linear(96, 70, bias, dtype)  # 70 rows: a block of 64 and a shorter one
    q = QuantizedLinear(lin)
    w = q.weight_expanded().to(torch.float32)
    b = None if lin.bias is None else lin.bias.detach().to(torch.float32)
    for t in ROWS:
        x = torch.randn(t, 96).to(dtype)
        got = q(x)
        want = F.linear(x.to(torch.float32), w, b)
        assert got.shape == (t, 70) and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # one rounding to bfloat16 of a float32 sum (beyond the kernels: torch's bfloat16 linear)
            torch.testing.assert_close(got.to(torch.float32), want, rtol=2**-7, atol=2e-2)
    x = torch.randn(2, 3, 96).to(dtype)  # any leading shape
    assert q(x).shape == (2, 3, 70) and torch.equal(q(x)[1, 2], q(x[1, 2][None])[0])


def test_the_int8_loops_give_the_same_bits_in_either_task_order():
    """``rows_int8``'s ``by_block`` (a block for every pair first: pairs sharing a slot read it once) only
    reorders the tasks: every value the same bits, for a shared slot and for distinct ones."""
    import numpy as np

    from expertcache.engine import _packed_jit

    rng = np.random.default_rng(0)
    rows, cols = 200, 96
    pool = rng.integers(0, 256, (3, rows * cols + 4 * rows), dtype=np.uint8)
    pool[:, rows * cols :] = np.full((3, rows), 0.01, np.float32).view(np.uint8)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    for slots in (np.zeros(5, np.int64), np.array([2, 0, 1, 0, 2])):
        outs = []
        for by_block in (False, True):
            out = np.empty((5, rows), np.float32)
            _packed_jit.rows_int8(pool, 0, rows * cols, rows, cols, slots, x, out, by_block)
            outs.append(out)
        assert np.array_equal(outs[0], outs[1])


def test_a_row_is_the_same_bits_alone_as_in_a_batch():
    q = QuantizedLinear(_linear(128, 200, True, torch.bfloat16, seed=3))
    x = torch.randn(CPU_ROWS["int8"], 128).to(torch.bfloat16)
    batch = q(x)
    for row in range(x.shape[0]):
        assert torch.equal(q(x[row : row + 1])[0], batch[row])


class _Attention(torch.nn.Module):
    """Three sibling projections of one input and an output projection, quantised: as an attention's."""

    def __init__(self, cols: int, widths: tuple[int, int, int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        for i, (name, rows) in enumerate(zip(("q_proj", "k_proj", "v_proj"), widths, strict=True)):
            setattr(self, name, _linear(cols, rows, bias, dtype, seed=10 + i))
        self.o_proj = _linear(widths[0], cols, bias, dtype, seed=13)


def _quantized(module: torch.nn.Module, siblings: bool) -> int:
    """``quantize_dense``'s replacement on a module without a model's config -> sibling groups made."""
    from expertcache.engine.dense import fuse_siblings

    for name, child in list(module.named_children()):
        setattr(module, name, QuantizedLinear(child))
    return fuse_siblings(module) if siblings else 0


def _pair(cols=70, widths=(64, 32, 40), bias=False, dtype=torch.bfloat16):
    """The same quantised layers twice: alone, and with the siblings grouped (``fuse_siblings``)."""
    alone, grouped = (_Attention(cols, widths, bias, dtype) for _ in range(2))
    _quantized(alone, False)
    assert _quantized(grouped, True) == 1
    return alone, grouped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cols", [70, 128])
def test_sibling_projections_in_one_pass_give_each_layer_s_own_bits(dtype, bias, cols):
    """q, k and v computed in one loop over a shared pool: every output the bits of the layer alone, at
    every number of rows and in any order the members are called; fewer loop calls."""
    from unittest import mock

    from expertcache.engine import _packed_jit
    from expertcache.engine.dense import SiblingGroup

    alone, grouped = _pair(cols, bias=bias, dtype=dtype)
    assert isinstance(grouped.q_proj.group, SiblingGroup)
    assert grouped.q_proj.pool is grouped.v_proj.pool and grouped.o_proj.group is None
    names = ("q_proj", "k_proj", "v_proj")
    for a, b in ((getattr(alone, n), getattr(grouped, n)) for n in names):  # the same weights, regrouped
        assert torch.equal(a.weight_expanded(), b.weight_expanded()) and a.nbytes <= b.nbytes + 64
    inner = _packed_jit.rows_int8
    for t in ROWS:
        x = torch.randn(2, t, cols).to(dtype) if t <= 40 else torch.randn(t, cols).to(dtype)
        want = [getattr(alone, n)(x) for n in names]
        for order in (names, names[::-1], ("k_proj", "q_proj", "v_proj")):
            with mock.patch.object(_packed_jit, "rows_int8", side_effect=inner) as loops:
                got = {n: getattr(grouped, n)(x) for n in order}
            for n, w in zip(names, want, strict=True):
                assert got[n].shape == w.shape and got[n].dtype == w.dtype and torch.equal(got[n], w), (t, n)
            assert loops.call_count == (1 if 2 * t <= CPU_ROWS["int8"] else 0), t
        assert grouped.q_proj.last.group is None  # all three taken: nothing held


def test_a_sibling_product_is_taken_only_right_after_it_is_made():
    """Any other quantised layer run in between, or another input, and a member computes its own."""
    alone, grouped = _pair()
    x, y = (torch.randn(1, 70).to(torch.bfloat16) for _ in range(2))
    want_k, want_v = alone.k_proj(x), alone.v_proj(y)
    grouped.q_proj(x)
    grouped.o_proj(torch.randn(1, 64).to(torch.bfloat16))  # another layer ran: the product is gone
    assert grouped.q_proj.last.x is None
    assert torch.equal(grouped.k_proj(x), want_k)
    assert torch.equal(grouped.v_proj(y), want_v)  # another input: its own rows


def test_siblings_that_read_other_inputs_are_computed_alone():
    alone, grouped = _pair()
    group = grouped.q_proj.group
    for _ in range(3):  # k and v on another input every time: two products left untaken, then alone
        x, y = (torch.randn(1, 70).to(torch.bfloat16) for _ in range(2))
        assert torch.equal(grouped.q_proj(x), alone.q_proj(x))
        assert torch.equal(grouped.k_proj(y), alone.k_proj(y))
        assert torch.equal(grouped.v_proj(y), alone.v_proj(y))
    assert not group.on


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_s_siblings_in_one_pass_give_the_same_tokens_and_logits(family, ckpt):
    """The model with its sibling projections grouped equals the same model with every layer alone."""
    from expertcache.engine.loader import load_reference

    path = ckpt(family)
    alone = load_reference(path, device="cpu", experts=engine_fixtures.REFERENCE)
    quantize_dense(alone, "int8", siblings=False)
    grouped = load_reference(path, device="cpu", experts=engine_fixtures.REFERENCE)
    report = quantize_dense(grouped, "int8")
    assert report.sibling_groups > 0, family  # every family has an attention of q, k and v or an MLP
    assert_exact(greedy(grouped, IDS), greedy(alone, IDS))


@pytest.mark.parametrize(
    "family", ["afmoe", "hunyuan_v1_moe", "phimoe"]
)  # routers that are, or hold, Linears
def test_the_routers_experts_embeddings_and_norms_stay_as_stored(family, ckpt):
    from expertcache.engine.loader import load_reference
    from expertcache.engine.routing import moe_routers

    model = load_reference(ckpt(family), device="cpu")
    in_routers = {id(m) for r in moe_routers(model) for m in r.modules() if isinstance(m, torch.nn.Linear)}
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert in_routers
    report = quantize_dense(model, "int8")
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert "lm_head" in quantized and any(n.endswith("self_attn.q_proj") for n in quantized)
    kept = {id(m) for n, m in model.named_modules() if n in linears - quantized}
    assert report.layers == len(quantized) and kept == in_routers
    assert not any(isinstance(m, QuantizedLinear) for n, m in model.named_modules() if ".experts" in n)
    assert isinstance(model.get_input_embeddings(), torch.nn.Embedding)
    assert report.bytes_after < report.bytes_before / 3  # float32 -> a byte a weight
    assert report.to_dict()["format"] == "int8"


def test_a_head_tied_to_the_embeddings_keeps_their_weight_and_says_so(ckpt):
    from expertcache.engine.loader import load_reference

    model = load_reference(ckpt("mixtral"), device="cpu")
    model.lm_head.weight = model.get_input_embeddings().weight  # tied, as the embedded model's
    tied = model.lm_head.weight
    report = quantize_dense(model, "int8")
    assert isinstance(model.lm_head, QuantizedLinear) and model.get_input_embeddings().weight is tied
    assert report.bytes_shared == tied.numel() * tied.element_size()
    assert "stay, shared with the embeddings" in report.describe()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_equals_transformers_with_the_same_layers_quantized(family, ckpt):
    from expertcache.engine.loader import load_reference

    path = ckpt(family)
    ref = load_reference(path, device=engine_fixtures.DEVICE, experts=engine_fixtures.REFERENCE)
    report = quantize_dense(ref, "int8")
    want = greedy(ref, IDS)
    with engine_load(path, moe_layers(family) * engine_fixtures.TOP_K, slow_tier="disk",
                     quantize_dense="int8") as model:  # fmt: skip
        got = greedy(model, IDS)
        stats = model.stats
    assert_exact(got, want)
    assert stats["dense"] == report.to_dict() and stats["lossy"] and not stats["experts_lossy"]
    assert report.layers > 0


@pytest.mark.parametrize("family,tied", [("granitemoe", False), ("qwen2_moe", False), ("qwen2_moe", True)])
def test_a_bfloat16_checkpoint_in_float32_quantises_its_dense_weights_as_stored(
    family, tied, make_ckpt, tmp_path
):
    """Run in float32, a bfloat16 checkpoint's dense weights are read as stored and quantised from there:
    the same int8 values and scales as from their float32 copies (so the same bits as transformers loading
    it in float32 and quantising), the layers computing in float32, and their bytes before counted so. An
    output head tied to the embeddings is the embeddings' float32 weight, as transformers ties it."""
    from expertcache.engine.loader import build_skeleton, load_reference

    path = make_ckpt(family, dtype="bfloat16")
    if tied:  # as save_pretrained writes a tied model: the head's weight not stored
        from safetensors.torch import load_file, save_file

        path = engine_fixtures.with_config(path, tmp_path / "tied", tie_word_embeddings=True)
        for f in path.glob("*.safetensors"):
            tensors = load_file(f)
            if tensors.pop("lm_head.weight", None) is not None:
                save_file(tensors, f, metadata={"format": "pt"})
    sk = build_skeleton(path, "float32", quantized_dense=True)
    kept = {n for n, p in sk.model.named_parameters() if p.dtype == torch.bfloat16}
    assert kept and all(n.endswith(".weight") for n in kept)  # the dense linears' weights alone, as stored
    assert not any("embed" in n or "norm" in n or ".gate." in n or "router" in n for n in kept)
    assert ("lm_head.weight" in kept) != tied
    device, experts = engine_fixtures.DEVICE, engine_fixtures.REFERENCE
    ref = load_reference(path, dtype="float32", device=device, experts=experts)
    report = quantize_dense(ref, "int8")
    want = greedy(ref, IDS)
    with engine_load(path, dtype="float32", quantize_dense="int8", slow_tier="disk") as model:
        got = greedy(model, IDS)
        stats = model.stats
        layers = [m for m in model.model.modules() if isinstance(m, QuantizedLinear)]
    assert_exact(got, want)
    assert stats["dense"] == report.to_dict()  # bytes before in float32, as the reference had them
    assert stats["dtype"] == "float32"
    assert layers and all(m.dtype == torch.float32 for m in layers)
    assert all(p.dtype == torch.float32 for p in model.model.parameters())


def test_the_same_bits_at_every_budget_tier_and_miss_path(ckpt):
    path = ckpt("mixtral")
    with engine_load(path, quantize_dense="int8") as model:
        full = greedy(model, IDS)
    for kwargs in engine_fixtures.EVERYWHERE:
        with engine_load(path, quantize_dense="int8", **kwargs) as model:
            got = greedy(model, IDS)
        assert got[0].tolist() == full[0].tolist() and torch.equal(got[1], full[1]), kwargs


def test_an_unknown_format_is_one_line(ckpt, capsys):
    from expertcache.cli import main
    from expertcache.cli.generate import DENSE_FORMATS as CLI_FORMATS
    from expertcache.engine import load

    assert list(DENSE_FORMATS) == CLI_FORMATS  # the CLI's copy (no torch before its checks)
    with pytest.raises(ExpertcacheError, match="dense format 'int4' .* is not one .*: int8"):
        load(ckpt("mixtral"), quantize_dense="int4", progress=False)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(ckpt("mixtral")), "--prompt", "a", "--quantize-dense", "int4"])
    assert exit_.value.code == 2 and "--quantize-dense" in capsys.readouterr().err


def test_generate_and_quality_say_what_it_costs(ckpt, capsys, tmp_path):
    from expertcache.cli import main
    from expertcache.tools.quality import format_quality, measure

    path = ckpt("qwen3_moe")
    code = main(["generate", "--model", str(path), "--prompt", "def f(x):", "--max-new-tokens", "3",
                 "--quantize-dense", "int8", "--device", "cpu", "--json"])  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    run = json.loads(captured.out.strip().splitlines()[-1])
    assert run["lossy"] and run["dense"]["format"] == "int8" and run["dense"]["layers"] > 0
    code = main(["generate", "--model", str(path), "--prompt", "def f(x):", "--max-new-tokens", "2",
                 "--quantize-dense", "int8", "--device", "cpu"])  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err  # a note at load, as chat and serve print it too
    assert "note: dense layers int8, quantised at load" in err and "lossy" in err
    assert f"expertcache quality --model {path} --quantize-dense int8 says how far" in err
    r = measure(path, "fetch", "100%", texts=["def f(x):\n    return x + 1\n" * 4], tokens=24,
                quantize_dense="int8")  # fmt: skip
    assert r["dense_format"] == "int8" and 0 <= r["top1_agreement"] <= 1 and r["logits_identical"] < 1
    assert r["lossy"] and r["dense"]["format"] == "int8"
    assert "dense layers int8" in format_quality(r)


def test_quality_measures_in_the_dtype_the_model_runs(make_ckpt, capsys):
    """A bfloat16 checkpoint run in float32: the note at load names the quality command with its dtype, and
    quality loads the model and the reference in it (exact where nothing lossy runs)."""
    from expertcache.cli import main
    from expertcache.tools.quality import format_quality, measure

    path = make_ckpt("qwen3_moe", dtype="bfloat16")
    code = main(["generate", "--model", str(path), "--prompt", "def f(x):", "--max-new-tokens", "2",
                 "--quantize-dense", "int8", "--dtype", "float32", "--device", "cpu"])  # fmt: skip
    assert code == 0
    named = f"expertcache quality --model {path} --dtype float32 --quantize-dense int8"
    assert named in capsys.readouterr().err
    text = ["def f(x):\n    return x + 1\n" * 4]
    exact = measure(path, "fetch", "100%", texts=text, tokens=24, dtype="float32")
    assert exact["dtype"] == exact["reference_dtype"] == "float32" and exact["logits_identical"] == 1
    r = measure(path, "fetch", "100%", texts=text, tokens=24, quantize_dense="int8", dtype="float32")
    assert r["dtype"] == r["reference_dtype"] == "float32" and r["logits_identical"] < 1
    assert "in float32, " in format_quality(r)
    code = main(["quality", "--model", str(path), "--expert-memory", "100%", "--tokens", "8",
                 "--dtype", "float8_e4m3fn"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "not a compute dtype" in err and "Traceback" not in err


# Triton's interpreter runs the kernel on a CPU where Triton is installed (no GPU needed); it must be on
# before triton is imported, so the test runs in a process of its own
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def test_triton_s_product_in_its_interpreter():
    engine_fixtures.run_interpreted(__file__, 1)


@pytest.mark.skipif(not INTERPRETED, reason="run by test_triton_s_product_in_its_interpreter")
def test_interpreted_triton_product_equals_the_numba_loops():
    q = QuantizedLinear(_linear(96, 70, False, torch.float32, seed=5))
    x = torch.randn(3, 96)
    torch.testing.assert_close(q.triton_product(x), q(x), rtol=1e-5, atol=1e-5)
