"""Packed experts (``engine.packed``): int8 and int4 checkpoints stored, moved and computed packed.

- Packing: a weight comes back within half a quantisation step (the stored scale's), for shapes whose
  rows a group does not divide too.
- The packed kernels (numba) equal a float32 product with the expanded matrix, for a shared input row,
  for one row per expert, and for several tokens through one expert (a prefill's); on a GPU, Triton's.
- A packed checkpoint (``write_checkpoint``) runs through the engine with the same tokens and bit-identical
  logits whatever the budget, slow tier or miss path (the packed computation does not depend on where
  an expert was computed), and close to transformers running the same checkpoint with its experts
  expanded (the dequantised model): the accuracy reference.
- GPT-OSS (transposed matrices, biases) and a Qwen-style family run packed as well.
- Errors are one line: a kernel or miss path a packed checkpoint cannot run, the packed kernel on a
  full-precision checkpoint, an unknown format in a config, a bad --bits or a non-empty folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import engine_fixtures
import numpy as np
import pytest
import torch
from engine_fixtures import engine_load, greedy

from expertcache.engine.packed import MATRICES, Packed, PackedKernels, SiluExperts, pack_int4, pack_int8
from expertcache.errors import ExpertcacheError
from expertcache.tools.quantize import write_checkpoint

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir


@pytest.mark.parametrize("cols", [160, 256])
def test_int4_weights_come_back_within_half_a_step(cols):
    torch.manual_seed(0)
    w = torch.randn(6, cols)
    p = Packed("int4", 64, {"gate_up_proj": (6, cols), "down_proj": (cols, 3)}, torch.float32, False)
    stored = {f"gate_up_proj.{k}": v for k, v in pack_int4(w, 64).items()}
    back = p.expand(stored, "gate_up_proj")
    groups = -(-cols // 64)
    step = stored["gate_up_proj.scale"].view(torch.bfloat16).float().view(6, groups)
    bound = step.repeat_interleave(64, dim=1)[:, :cols] / 2 + 1e-6
    assert back.shape == w.shape
    assert ((back - w).abs() <= bound * 1.01).all()
    assert (back - w).abs().max() > 0  # it is a quantisation


def test_int8_weights_come_back_within_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(8, 96) * torch.linspace(0.1, 4, 8)[:, None]
    p = Packed("int8", 0, {"gate_up_proj": (8, 96), "down_proj": (96, 4)}, torch.float32, False)
    stored = {f"gate_up_proj.{k}": v for k, v in pack_int8(w).items()}
    back = p.expand(stored, "gate_up_proj")
    scale = stored["gate_up_proj.scale"].view(torch.float32)
    assert torch.allclose(scale, w.abs().amax(1) / 127)
    assert ((back - w).abs() <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize(("fmt", "group"), [("int8", 0), ("int4", 64), ("int4", 32)])
def test_the_packed_kernels_equal_the_product_with_the_expanded_matrices(fmt, group):
    from expertcache.engine.memory import SlotPool

    torch.manual_seed(2)
    H, F = 160, 48  # 160: int4's last group of a gate_up row is shorter (at group 64)
    p = Packed(fmt, group, {"gate_up_proj": (2 * F, H), "down_proj": (H, F)}, torch.float32, False)
    k = PackedKernels(p)
    pool = SlotPool(k.layout, 3, torch.device("cpu"))
    for s in range(3):
        full = {"gate_up_proj": torch.randn(2 * F, H), "down_proj": torch.randn(H, F)}
        for name, t in p.pack(full).items():
            pool.views[s][name].copy_(t)
    arr = pool.buffer.numpy()
    slots = np.array([2, 0], dtype=np.int64)
    for x in (torch.randn(1, H), torch.randn(2, H)):  # one row for both, one each
        got = k.project("gate_up_proj", arr, slots, x)
        for i, s in enumerate(slots):
            w = p.expand(pool.views[int(s)], "gate_up_proj")
            want = x[0 if x.shape[0] == 1 else i] @ w.T
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
    # several tokens through one expert (a prefill's share): each row unpacked once for all of them
    x = torch.randn(13, H)
    for name, inputs in (("gate_up_proj", x), ("down_proj", torch.randn(13, F))):
        got = k.project_tokens(name, arr, 1, inputs)
        want = inputs @ p.expand(pool.views[1], name).T
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")
@pytest.mark.parametrize(("fmt", "group"), [("int8", 0), ("int4", 64), ("int4", 32)])
@pytest.mark.parametrize("cols", [160, 200])  # 200: int4's last group is shorter
def test_the_gpu_kernels_equal_the_product_and_do_not_depend_on_their_batch(fmt, group, cols):
    """Triton's kernels: within float32 rounding of the expanded product, a slot past the pool gives zeros,
    and a pair's output is the same bits alone (a miss's ``expert``) as in a batch (resident experts)."""
    pytest.importorskip("triton")
    from expertcache.engine.memory import SlotPool

    dev = torch.device("cuda")
    torch.manual_seed(3)
    H, F = cols, 48
    p = Packed(fmt, group, {"gate_up_proj": (2 * F, H), "down_proj": (H, F)}, torch.bfloat16, False)
    k = PackedKernels(p)
    pool = SlotPool(k.layout, 3, dev)
    for s in range(3):
        full = {"gate_up_proj": torch.randn(2 * F, H), "down_proj": torch.randn(H, F)}
        for name, t in p.pack(full).items():
            pool.views[s][name].copy_(t)
    slots = torch.tensor([2, 0, 3, 1], device=dev)  # 3: past the pool
    x = torch.randn(4, H, device=dev)
    got = k.project("gate_up_proj", pool.buffer, slots, x)
    for i, s in enumerate(slots.tolist()):
        if s >= 3:
            assert not got[i].any()
            continue
        want = p.expand(pool.views[s], "gate_up_proj") @ x[i]
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-3)

    Module = SiluExperts  # what the kernels read of an experts module

    xb = x.to(torch.bfloat16)
    batch = k.rows(Module, pool.buffer, slots[[0, 1, 3]], xb[[0, 1, 3]])
    for row, (s, i) in enumerate(((2, 0), (0, 1), (1, 3))):
        alone = k.expert(Module, pool.views[s], xb[i : i + 1])
        assert torch.equal(alone[0], batch[row])


@pytest.fixture(scope="module")
def packed_ckpts(tmp_path_factory):
    """The embedded model packed in int8 and int4 (a second or two each)."""
    out = {}
    for bits in (8, 4):
        out[bits] = tmp_path_factory.mktemp("packed") / f"int{bits}"
        write_checkpoint(None, bits, out[bits], progress=False)
    return out


def _dequantised_reference(packed_dir, tmp_path):
    """transformers' model of the source checkpoint, its experts replaced by the packed ones expanded."""
    from expertcache.engine.hub import DEFAULT_MODEL
    from expertcache.engine.loader import build_skeleton, load_reference
    from expertcache.engine.memory import SlotPool

    ref = load_reference(DEFAULT_MODEL, experts="eager")
    sk = build_skeleton(packed_dir)
    scratch = SlotPool(sk.layout, 1, torch.device("cpu")).views[0]
    mods = [
        m
        for m in ref.modules()
        if hasattr(m, "has_gate") and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
    ]
    assert len(mods) == len(sk.experts)
    with torch.no_grad():
        for layer, mod in enumerate(mods):
            for e in range(sk.num_experts):
                sk.store.read((layer, e), scratch)
                for name in MATRICES:
                    getattr(mod, name)[e] = sk.packed.expand(scratch, name).to(getattr(mod, name).dtype)
    return ref


@pytest.mark.parametrize("bits", [8, 4])
def test_a_packed_checkpoint_runs_the_same_at_any_budget_tier_and_miss_path(bits, packed_ckpts, tmp_path):
    from expertcache.engine.offloaded import model_info

    path = packed_ckpts[bits]
    info = model_info(path)
    assert info["expert_format"] == ("int8" if bits == 8 else "int4-g64")
    with engine_load(path) as model:
        want = greedy(model, IDS)
        stats = model.stats
        full = model.layout.nbytes
    assert stats["kernel"] == "packed" and stats["expert_bytes"] == info["expert_bytes"] == full
    runs = [
        dict(expert_memory="30%", slow_tier="disk"),
        dict(expert_memory="30%", slow_tier="host", prefetch="next-gate"),
        dict(expert_memory="30%", miss="host"),
        dict(expert_memory=f"{2 * 6 * full}B", miss="fetch"),  # the minimum: top-2 of 6 layers
    ]
    for kwargs in runs:
        with engine_load(path, **kwargs) as model:
            got = greedy(model, IDS)
            moved = model.stats["bytes_transferred"]
        assert got[0].tolist() == want[0].tolist(), kwargs
        if kwargs.get("miss") == "host" and engine_fixtures.DEVICE != "cpu":  # the host's loops, the GPU's
            top = float((got[1] - want[1]).abs().max())  # kernels: each sums in its own order
            assert top <= 1e-5 * float(want[1].abs().max()), (kwargs, top)
        else:
            assert torch.equal(got[1], want[1]), kwargs
        assert moved % full == 0  # whole packed experts move
    # against transformers running the dequantised model: close, the same tokens
    ref = greedy(_dequantised_reference(path, tmp_path), IDS)
    assert ref[0].tolist() == want[0].tolist()
    torch.testing.assert_close(want[1], ref[1], rtol=0, atol=2e-3 * float(ref[1].abs().max()))


def test_a_packed_checkpoint_costs_little_accuracy(packed_ckpts):
    """The packed model's greedy tokens against the full-precision model's (the reference of quality)."""
    from expertcache.engine.hub import DEFAULT_MODEL

    with engine_load(DEFAULT_MODEL) as model:
        full = greedy(model, IDS)
    with engine_load(packed_ckpts[8]) as model:
        int8 = greedy(model, IDS)
    top = float(full[1].abs().max())
    assert (int8[1] - full[1]).abs().max() < 0.05 * top
    assert (int8[1].argmax(-1) == full[1].argmax(-1)).float().mean() >= 0.75


def test_serve_says_what_makes_its_model_lossy(packed_ckpts):
    """serve prints one note at start (a new user found generate saying it and serve silent)."""
    from expertcache.cli.util import lossy_note
    from expertcache.engine.hub import DEFAULT_MODEL

    with engine_load(DEFAULT_MODEL) as model:
        assert lossy_note(model.stats, model.miss.lossy) is None
    with engine_load(packed_ckpts[4], quantize_dense="int8") as model:
        note = lossy_note(model.stats, model.miss.lossy)
    assert note.startswith("note: lossy, not the full-precision model's outputs: experts packed (int4-g64, ")
    assert "dense layers int8" in note and "miss path" not in note
    with engine_load(DEFAULT_MODEL, kernel="compiled", device="cpu") as model:  # not bit-equal: said
        note = lossy_note(model.stats, model.miss.lossy)
    assert ": the compiled kernel (its sums in another order) (expertcache quality with" in note


@pytest.mark.parametrize("family", ["gpt_oss", "qwen2_moe"])
def test_families_run_packed(family, ckpt, tmp_path):
    path = ckpt(family)
    out = tmp_path / "int8"
    write_checkpoint(path, 8, out, progress=False)
    with engine_load(out) as model:
        want = greedy(model, IDS)
        assert model.stats["expert_format"] == "int8"
    with engine_load(out, expert_memory="30%") as model:
        got = greedy(model, IDS)
    assert got[0].tolist() == want[0].tolist() and torch.equal(got[1], want[1])
    with engine_load(path) as model:  # full precision: close
        full = greedy(model, IDS)
    assert (want[1] - full[1]).abs().max() < 0.05 * float(full[1].abs().max()) + 1e-3


@pytest.mark.parametrize("existed", [False, True])
def test_a_checkpoint_cut_off_while_written_leaves_no_folder_behind(tmp_path, monkeypatch, existed):
    """Ctrl-C during ``quantize --checkpoint`` left a config marked packed and no weights: the rerun was
    refused (not empty) and the engine could not read it. What the writing made goes, for every writer."""
    from expertcache.tools import published, quantize

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(quantize.Shards, "save", cut)
    for name, write in (("int8", lambda out: write_checkpoint(None, 8, out, progress=False)),
                        ("fp8", lambda out: published.write_published(None, "fp8", out))):  # fmt: skip
        out = tmp_path / name
        if existed:
            out.mkdir()
        with pytest.raises(KeyboardInterrupt):
            write(out)
        assert out.is_dir() == existed and not (existed and any(out.iterdir())), list(tmp_path.rglob("*"))
    monkeypatch.undo()
    assert write_checkpoint(None, 8, tmp_path / "int8", progress=False)["experts"] > 0  # the rerun runs


def test_empty_paths_are_refused_before_any_work(capsys, tmp_path, monkeypatch):
    from expertcache.cli import main

    monkeypatch.chdir(tmp_path)  # where an empty path would have written
    for flag in ("--checkpoint", "--out"):
        assert main(["quantize", "--bits", "8", flag, ""]) == 2
        assert f"{flag} is empty; give a value or leave the option out" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_packed_errors_are_one_line(packed_ckpts, tmp_path):
    from expertcache.engine import load
    from expertcache.engine.hub import DEFAULT_MODEL

    path = packed_ckpts[8]
    with pytest.raises(ExpertcacheError, match="run on the packed kernel only, not kernel='grouped'"):
        load(path, kernel="grouped", progress=False)
    with pytest.raises(ExpertcacheError, match="hobbit needs full-precision experts.*placement or batch"):
        load(path, miss="hobbit", progress=False)
    with pytest.raises(ExpertcacheError, match="experts kernel packed reads packed experts"):
        load(DEFAULT_MODEL, kernel="packed", progress=False)
    with pytest.raises(ExpertcacheError, match="not an empty directory"):
        write_checkpoint(None, 8, path)
    with pytest.raises(ExpertcacheError, match="^bits 2: a packed checkpoint is one of 8, 4"):
        write_checkpoint(None, 2, tmp_path / "two")
    with pytest.raises(ExpertcacheError, match="packed already"):
        write_checkpoint(path, 4, tmp_path / "again")
    with pytest.raises(ExpertcacheError, match="--group applies to int4 only"):
        write_checkpoint(None, 8, tmp_path / "g", group=32)
    # a format this version does not run: named, with what it runs
    odd = tmp_path / "mx"
    odd.mkdir()
    for f in path.iterdir():
        (odd / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((odd / "config.json").read_text())
    cfg["expertcache_experts"]["format"] = "mxfp4"
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ExpertcacheError, match=r"packed experts in format 'mxfp4': this expertcache runs int8, int4"
    ):
        load(odd, progress=False)
    # another tool's quantisation it does not read (GPTQ; MXFP4 outside GPT-OSS) is named and refused
    for method in ("mxfp4", "gptq"):
        other = tmp_path / method
        other.mkdir()
        for f in DEFAULT_MODEL.iterdir():
            if f.is_file():
                (other / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((other / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": method}
        (other / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ExpertcacheError, match=rf"weights are quantised \({method}, .*int8, int4"):
            load(other, progress=False)


def test_quantize_checkpoint_and_generate_from_the_cli(tmp_path, capsys):
    import os
    import stat

    from expertcache.cli import main

    out = tmp_path / "int4"
    old = os.umask(0o022)
    try:
        assert main(["quantize", "--bits", "4", "--checkpoint", str(out), "--json"]) == 0
    finally:
        os.umask(old)
    # every file as the umask allows (safetensors alone writes 0600: unreadable to a server's other user)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in out.iterdir()), sorted(
        (f.name, oct(f.stat().st_mode)) for f in out.iterdir()
    )
    record = json.loads(capsys.readouterr().out)
    assert record["format"] == "int4-g64" and record["bytes_per_expert"] < record["full_bytes_per_expert"] / 4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["expertcache_experts"]["format"] == "int4" and (out / "tokenizer.json").is_file()
    code = main(["generate", "--model", str(out), "--prompt", "def f(x):", "--max-new-tokens", "4",
                 "--expert-memory", "40%", "--json"])  # fmt: skip
    assert code == 0
    run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert run["expert_format"] == "int4-g64" and run["kernel"] == "packed" and run["lossy"]
    assert run["dtype_own"]
    # in another dtype than the checkpoint's (float32), the quality command it suggests measures in that
    # dtype (it left --dtype out, and quality would have measured in the checkpoint's: a new user's trial)
    code = main(["generate", "--model", str(out), "--prompt", "def f(x):", "--max-new-tokens", "2",
                 "--expert-memory", "40%", "--dtype", "bfloat16"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0 and f"expertcache quality --model {out} --dtype bfloat16 says how far" in err, err
    assert main(["quantize", "--bits", "8", "4", "--checkpoint", str(tmp_path / "two")]) == 2
    assert "give one --bits" in capsys.readouterr().err


def test_the_cpu_loops_are_loaded_at_load_not_in_the_first_request(packed_ckpts, ckpt, monkeypatch, tmp_path):
    """Below 100 % on a CPU (no warm-up generation), a packed checkpoint's loops and a low-precision
    miss path's are run once at load (numba's import and cached code: 0.3-0.6 s the first request paid)."""
    from expertcache.engine import load
    from expertcache.tools.quantize import quantize_model

    calls = []
    real = PackedKernels.warm_host

    def counted(self):
        calls.append(self.packed.format)
        real(self)

    monkeypatch.setattr(PackedKernels, "warm_host", counted)
    for bits in (8, 4):
        with load(packed_ckpts[bits], expert_memory="50%", device="cpu", progress=False):
            pass
    assert calls == ["int8", "int4"]
    calls.clear()
    with load(packed_ckpts[8], device="cpu", progress=False):  # 100 %: the warm-up generation runs them
        pass
    with load(packed_ckpts[8], expert_memory="50%", device="cpu", warmup=False, progress=False) as model:
        assert not any("changes nothing here" in n for n in model.notes)  # --no-warmup: neither, as asked
    assert calls == []
    with load(ckpt("mixtral"), expert_memory="50%", device="cpu", warmup=False, progress=False) as model:
        # nothing to warm up below 100 % without packed or low-precision experts: said, as other options
        assert "warmup=False changes nothing here: the warm-up runs with every expert" in model.notes[-1]
    path = tmp_path / "mixtral"  # its copies beside a checkpoint of its own
    shutil.copytree(ckpt("mixtral"), path)
    quantize_model(path, bits=(4,), group=16, progress=False)
    with load(path, expert_memory="50%", miss="hobbit:bits=4,group=16", device="cpu", progress=False):
        pass
    assert calls == ["int4"]


def test_quality_refuses_a_reference_that_cannot_stand_for_the_packed_model(tmp_path, capsys):
    """A packed reference (transformers would run it with experts it never read), another model, or the
    source checkpoint changed since (the same shapes, new weights) gave meaningless figures and exit 0
    (a new user found all three); hobbit's copies of a changed checkpoint were used too."""
    from expertcache.cli import main

    def synth(out, family="mixtral", seed=0, hidden=64):
        argv = [
            "model",
            "synth",
            "--family",
            family,
            "-o",
            str(out),
            "--hidden",
            str(hidden),
            "--seed",
            str(seed),
        ]
        assert main(argv) == 0, capsys.readouterr().err
        capsys.readouterr()

    def quality(*extra):
        code = main(["quality", "--model", str(packed), "--tokens", "8", "--expert-memory", "100%", *extra])
        return code, capsys.readouterr()

    src, packed, other = tmp_path / "src", tmp_path / "int8", tmp_path / "other"
    synth(src)
    assert main(["quantize", str(src), "--bits", "8", "--checkpoint", str(packed)]) == 0
    assert main(["quantize", str(src), "--bits", "4"]) == 0  # hobbit's copies, beside it
    capsys.readouterr()
    code, out = quality()
    assert code == 0 and "top-1 agreement" in out.out and f"on {src} (lossy):" in out.out  # named, and lossy
    twin = tmp_path / "twin"  # the same shapes, other weights: allowed when named, and said
    synth(twin, seed=3)
    code, out = quality("--reference-model", str(twin))
    assert (
        code == 0
        and f"note: --reference-model {twin} is not the checkpoint {packed} was made from" in out.err
    )
    code, out = quality("--reference-model", str(src))  # the source itself, named: nothing to say
    assert code == 0 and "note: --reference-model" not in out.err
    code, out = quality("--reference-model", str(packed))
    assert code == 2 and "stores its experts packed (int8): transformers cannot read them" in out.err
    synth(other, "qwen2_moe", hidden=32)
    code, out = quality("--reference-model", str(other))
    assert code == 2 and "is another model: its model_type is 'qwen2_moe'" in out.err
    assert out.err.count("\n") == 1  # the error alone: no note first that the figures compare another model
    fp8 = tmp_path / "fp8"  # a published layout: the engine computes its own weights exactly
    assert main(["quantize", str(src), "--format", "fp8", "--checkpoint", str(fp8)]) == 0
    capsys.readouterr()
    code = main(["quality", "--model", str(fp8), "--tokens", "8", "--expert-memory", "100%", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["lossy"] is True  # but measured against its source: a loss
    from expertcache.tools.quality import format_quality

    assert "low precision" not in format_quality(report)  # nothing a fetching path does
    assert "low precision 0.0%, skipped 0.0%" in format_quality({**report, "miss": "hobbit"})
    synth(src, seed=7)  # the same shapes, new weights, in the same place (its old copies beside it)
    code, out = quality()
    assert code == 2 and "changed since" in out.err and out.err.count("\n") == 1
    argv = ["generate", "--model", str(src), "--prompt", "x", "--max-new-tokens", "2", "--miss", "hobbit"]
    assert main([*argv, "--expert-memory", "50%"]) == 2
    assert "made for another checkpoint" in capsys.readouterr().err


def test_the_packed_loops_run_on_torch_s_threads_in_the_thread_that_generates(tmp_path):
    """numba keeps its thread count per thread, starting at its pool's size: a generation on another
    thread than the load's, after ``torch.set_num_threads(1)``, runs its packed loops on one thread, not
    on numba's pool of two (``kernels.follow_torch_threads``, at each step)."""
    code = (
        "import sys, threading, torch\n"
        "from expertcache.engine.offloaded import load\n"
        "from expertcache.tools.quantize import write_checkpoint\n"
        f"write_checkpoint(None, 8, {str(tmp_path / 'int8')!r}, progress=False)\n"
        "torch.set_num_threads(1)\n"
        f"model = load({str(tmp_path / 'int8')!r}, expert_memory='30%', device='cpu')\n"  # on a GPU: Triton's
        "from expertcache.jit import numba\n"
        "seen = []\n"
        "def run():\n"
        "    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)\n"
        "    seen.append(numba.get_num_threads())\n"
        "t = threading.Thread(target=run); t.start(); t.join()\n"
        "print(numba.config.NUMBA_NUM_THREADS, model.stats['kernel'], *seen)\n"
    )
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    env.pop("OMP_NUM_THREADS", None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["2", "packed", "1"]


def test_quantize_of_a_model_without_a_tokenizer_does_not_say_to_run_what_cannot_run(ckpt, tmp_path, capsys):
    """It said "run it with: expertcache generate --model OUT", which then refused it for its tokenizer."""
    from expertcache.cli import main

    bare = engine_fixtures.without_tokenizer(ckpt("mixtral"), tmp_path / "bare")
    assert main(["quantize", str(bare), "--bits", "8", "--checkpoint", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "run it with" not in out and "it has no tokenizer, as the model had none" in out


def test_a_new_user_s_quantisation_trial_gets_one_line_and_copies_where_they_can_be_made(tmp_path, capsys):
    """Trial 29: ``--format mxfp4`` of a model whose rows are not blocks of 32 raised a traceback; a
    packed config's group that is not a whole number raised one in every command, and an int8 config with
    a group named an option never given; HOBBIT's int8 copies were refused for a shape whose element count
    a group of 64 does not divide (int8 has no groups) and its int4 copies for a partial group the packed
    checkpoint takes; ``--group 4096`` on 64 columns was written as ``int4-g4096``; a synthetic model with
    an odd head size was written and then crashed generate; a folder without a tokenizer said its prompt
    had no tokens."""
    from expertcache.cli import main
    from expertcache.engine import load
    from expertcache.engine.random_checkpoint import make_checkpoint

    def one_line(argv: list[str], words: str) -> None:
        capsys.readouterr()  # the models' writing before
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err

    gpt = make_checkpoint(tmp_path / "gpt", "gpt_oss", hidden=64, intermediate=40, layers=2, experts=4)
    one_line(
        ["quantize", str(gpt), "--format", "mxfp4", "--checkpoint", str(tmp_path / "mx")],
        "mxfp4 scales blocks of 32 of a matrix's inputs",
    )
    assert not (tmp_path / "mx").exists()
    # HOBBIT's copies in the packed formats: no group over a matrix's elements to divide
    odd = make_checkpoint(
        tmp_path / "odd", "mixtral", hidden=52, intermediate=34, heads=2, layers=2, experts=4
    )
    assert main(["quantize", str(odd), "--bits", "8", "4"]) == 0
    capsys.readouterr()
    with load(odd, "50%", miss="hobbit:bits=8", progress=False) as model:
        assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape == (1, 5)
    one_line(
        ["quantize", str(odd), "--bits", "4", "--group", "4096", "--checkpoint", str(tmp_path / "g")],
        "--group 4096 is more than the 52 input columns",
    )
    # a packed checkpoint's own record: what is wrong with it, not with an option
    packed = tmp_path / "q4"
    write_checkpoint(odd, 4, packed)
    cfg = json.loads((packed / "config.json").read_text())
    for group, words in [("abc", "group is not a whole number"), ([64], "group is not a whole number")]:
        cfg["expertcache_experts"]["group"] = group
        (packed / "config.json").write_text(json.dumps(cfg))
        one_line(["model", "info", str(packed)], words)
    cfg["expertcache_experts"].update(format="int8", group=64)
    (packed / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ExpertcacheError, match="q4: config's expertcache_experts: int8 .* group applies"
    ) as e:
        load(packed, progress=False)
    assert "--group" not in str(e.value)
    # sizes synth can write are sizes generate can run
    one_line(
        [
            "model",
            "synth",
            "--family",
            "mixtral",
            "-o",
            str(tmp_path / "h25"),
            "--hidden",
            "50",
            "--heads",
            "2",
        ],
        "25 values a head: rotary position embeddings need an even number",
    )
    # no tokenizer files: said, whatever transformers would build from the config alone
    bare = tmp_path / "bare"
    bare.mkdir()
    q3 = make_checkpoint(tmp_path / "q3", "qwen3_moe", layers=2)
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((q3 / name).read_bytes())
    one_line(["generate", "--model", str(bare), "--prompt", "hello world"], "no tokenizer beside the weights")


def test_batch_generate_and_chat_say_a_packed_model_is_lossy(packed_ckpts, tmp_path, capsys, monkeypatch):
    """A new user's trial: `serve` and a single prompt's `generate` said a packed model's outputs are not
    the full-precision model's; `generate --prompts` and `chat` said nothing."""
    import io
    import sys

    from expertcache.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nimport os\n")
    argv = ["--model", str(packed_ckpts[8]), "--max-new-tokens", "2", "--device", "cpu"]
    assert main(["generate", "--prompts", str(prompts), *argv]) == 0
    said = "note: lossy, not the full-precision model's outputs: experts packed (int8"
    assert capsys.readouterr().err.count(said) == 1
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", *argv]) == 0
    assert capsys.readouterr().err.count(said) == 1


def test_a_share_and_the_same_bytes_give_the_same_slots_where_a_slot_outgrows_the_expert(tmp_path, capsys):
    """An FP8 expert's tensors (weights and block scales) each start at an aligned offset in its slot, so a
    slot is a few bytes more than the expert moves. ``model info`` gave the expert's bytes and a total of
    them, and ``25%`` (a share of the slots) took 6 slots where the same bytes took 5 (a new user's trial)."""
    from expertcache.cli import main
    from expertcache.engine.offloaded import model_info

    src, fp8 = tmp_path / "src", tmp_path / "fp8"
    synth = ["model", "synth", "--family", "qwen3_moe", "-o", str(src), "--hidden", "64"]
    assert main([*synth, "--intermediate", "48"]) == 0
    assert main(["quantize", str(src), "--format", "fp8", "--checkpoint", str(fp8)]) == 0
    capsys.readouterr()
    info = model_info(fp8)
    slot, total = info["expert_slot_bytes"], info["moe_layers"] * info["experts_per_layer"]
    assert slot > info["expert_bytes"]  # the case: padding in the slot
    assert info["all_experts_bytes"] == total * info["expert_bytes"]  # as stored
    assert info["min_expert_memory_bytes"] == info["top_k"] * slot
    quarter = total * slot // 4
    for budget in ("25%", f"{quarter}B"):
        with engine_load(fp8, expert_memory=budget) as model:
            assert model.stats["capacity_experts"] == quarter // slot, budget
