"""Shared pieces of the engine tests: a tiny tokenizer, tiny checkpoints of every family, references.

Everything here is built once per session in a temporary directory (nothing from the network, no
embedded model needed) by the library's own helpers, which ``expertcache selftest`` uses too: the tiny
tokenizer and checkpoints of ``expertcache.tools.tiny``, greedy runs of ``expertcache.tools.compare``.
Import the fixtures into a test module (``from engine_fixtures import ...``) to use them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from expertcache.engine.families import FAMILIES as ENGINE_FAMILIES
from expertcache.policy import POLICIES, is_offline
from expertcache.policy.registry import min_capacity, parse_policy
from expertcache.tools.compare import NEW, greedy, prompt_ids  # noqa: F401  (used by the test modules)
from expertcache.tools.tiny import (  # noqa: F401
    PROMPT,
    PROMPT_B,
    SPECS,
    TOP_K,
    make_tiny,
    make_tokenizer,
    moe_layers,
    total_experts,
)

FAMILIES = tuple(ENGINE_FAMILIES)  # every family the engine supports
# families whose experts normalise each one's output before its routing weight (Muse Spark's
# ``has_post_expert_norm``): the engine computes them one at a time (the eager kernel), the grouped and
# compiled kernels refuse them in one line
NORMALISED = ("muse_spark_text",)


def path_signature(family: str) -> tuple:
    """What a miss path, a tier or a copy plan can see of a family: how its checkpoint stores each slot
    tensor (per expert or fused, transposed or not, other layouts), how its router is called, whether
    dense layers come before the MoE ones (the MoE layers' numbering), whether the decoder layer is the
    MoE block (Gemma 4's) and whether each expert's output is normalised. The rest of a family (its
    attention, norms, activation, routing rule) is the same code under every path, and its own tests run
    it: the record, the engine's exactness from the minimum budget to all experts, every kernel, the
    dense layers quantised, eager attention, the self-test."""
    rec = ENGINE_FAMILIES[family]
    return (
        tuple(sorted((name, tuple(src.fused for src in srcs)) for name, srcs in rec.sources.items())),
        (rec.router, rec.router_inputs, rec.router_batched),
        rec.transposed_ok,
        bool(rec.layouts),
        rec.dense_first > 0,
        rec.block == "",
        family in NORMALISED,
    )


# The miss-path, tier and copy-plan cross products run one family of each ``path_signature``, the first
# in FAMILIES' order (17 of 55 families): across all families they were a third of the test command's
# time. ``EXPERTCACHE_TEST_ALL_FAMILIES=1`` runs them on every family (before a release, or after a
# change to how the engine reads or routes a family).
_FIRST: dict[tuple, str] = {}  # signature -> its first family
for _family in FAMILIES:
    _FIRST.setdefault(path_signature(_family), _family)
REPRESENTS = {  # family -> the family whose runs stand for it
    f: f if os.environ.get("EXPERTCACHE_TEST_ALL_FAMILIES") == "1" else _FIRST[path_signature(f)]
    for f in FAMILIES
}
PATH_FAMILIES = tuple(f for f in FAMILIES if REPRESENTS[f] == f)

ONLINE = [name for name in POLICIES if not is_offline(name)]
OFFLINE = [name for name in POLICIES if is_offline(name)]
NEEDS_PROFILE = ("static", "static-dist")

# EXPERTCACHE_TEST_DEVICE=cuda runs the engine tests (engine and reference alike) on a GPU
DEVICE = os.environ.get("EXPERTCACHE_TEST_DEVICE", "cpu")
# e.g. eager: the engine tests on one experts kernel, against the reference that kernel is exact against
KERNEL = os.environ.get("EXPERTCACHE_TEST_KERNEL")
REFERENCE = {"eager": "eager", "grouped": "grouped_mm"}.get(KERNEL or "")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Tiny matmuls on a loaded 2-core machine run ~50x faster on one thread than fighting for two.
    conftest starts every test process on one (``OMP_NUM_THREADS``); this puts it back to one for each
    module, whatever thread count an earlier test left behind."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer (vocab ~300, ``<|endoftext|>`` as bos/eos/pad) saved to a directory."""
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Callable[..., Path]:
    """``make_ckpt(family, **overrides)``: a tiny checkpoint, built once per (family, overrides)."""
    built: dict[tuple, Path] = {}

    def make(family: str, **overrides: object) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:  # quietly: which test builds it first depends on how xdist shares them out,
            from transformers.utils import logging as hf_logging  # and a test may read its own stderr

            shown = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()
            try:
                built[key] = make_tiny(
                    tmp_path_factory.mktemp(f"ckpt-{family}"), family, tokenizer_dir, **overrides
                )
            finally:
                if shown:
                    hf_logging.enable_progress_bar()
        return built[key]

    return make


@pytest.fixture(scope="session")
def ckpt(make_ckpt: Callable[..., Path]) -> Callable[[str], Path]:
    """``ckpt(family)``: the family's default tiny checkpoint."""
    return lambda family: make_ckpt(family)


def capacities(family: str, policy: str) -> list[int]:
    """The smallest capacity the policy runs with, a middle one, and every expert."""
    name, params = parse_policy(policy)
    low = min_capacity(name, moe_layers(family), params, min_room=TOP_K)
    high = total_experts(family)
    return sorted({low, (low + high) // 2, high})


def with_config(src: Path, dst: Path, **entries: object) -> Path:
    """A copy of the checkpoint ``src`` at ``dst`` whose config.json has ``entries`` set."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(entries)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def without_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint ``src`` at ``dst`` without its tokenizer's files (a model saved by
    ``save_pretrained`` alone)."""
    import shutil

    shutil.copytree(src, dst)
    for f in dst.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt") or f.suffix == ".jinja":
            f.unlink()
    return dst


# a smaller budget from disk, experts computed on the host, a host tier with prefetching
# (on a GPU without the host miss path: experts computed on the host round as its CPU does, within rounding
# of the GPU's bits, as test_miss checks there)
EVERYWHERE = tuple(
    kw for kw in (dict(expert_memory="30%", slow_tier="disk"), dict(expert_memory="30%", miss="host"),
                  dict(expert_memory="40%", slow_tier="host", prefetch="next-gate"))
    if DEVICE == "cpu" or kw.get("miss") != "host"
)  # fmt: skip


def assert_same_everywhere(path: Path, ids: torch.Tensor, full, **options) -> None:
    """The checkpoint at ``path`` gives ``full`` (``greedy``'s tokens and logits, every expert resident)
    bit for bit under each of ``EVERYWHERE`` (with ``options`` for the engine)."""
    for kwargs in EVERYWHERE:
        with engine_load(path, **kwargs, **options) as model:
            got = greedy(model, ids)
        assert got[0].tolist() == full[0].tolist() and torch.equal(got[1], full[1]), kwargs


def engine_load(path: Path, capacity: int | None = None, policy: str = "lru", **kwargs):
    """``expertcache.engine.load`` on the test device; ``capacity`` experts as bytes (default: all).
    Without prefetching unless asked (the engine's default, ``auto``, prefetches in the steps where its
    wall-clock measurements say it pays: tests of something else must not depend on that)."""
    from expertcache.engine import load

    kwargs.setdefault("prefetch", "none")
    budget = kwargs.pop("expert_memory", "100%") if capacity is None else capacity * _slot_bytes(path)
    if policy in NEEDS_PROFILE and "profile" not in kwargs:
        kwargs["profile"] = profile_for(path)
    kwargs.setdefault("device", DEVICE)
    if KERNEL is not None:
        kwargs.setdefault("kernel", KERNEL)
    return load(path, expert_memory=budget, policy=policy, progress=False, **kwargs)


_SLOT_BYTES: dict[Path, int] = {}


def _slot_bytes(path: Path) -> int:
    if path not in _SLOT_BYTES:
        from expertcache.engine import load

        with load(path, expert_memory="100%", device="cpu", progress=False) as m:
            _SLOT_BYTES[path] = m.layout.slot_bytes
    return _SLOT_BYTES[path]


def profile_for(path: Path):
    """A usage profile with the model's (layers, experts), for the static policies."""
    import json

    from expertcache.trace import synthesize

    cfg = json.loads((Path(path) / "config.json").read_text())
    family = cfg["model_type"]
    return synthesize(
        "sticky",
        tokens=200,
        layers=moe_layers(family),
        experts=SPECS[family]["experts"],
        top_k=TOP_K,
        seed=3,
        sequences=2,
        prompt_len=8,
    )


@pytest.fixture(scope="session")
def reference() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``reference(path, ids, mask=None)``: transformers' eager run of the checkpoint (cached)."""
    from expertcache.engine.loader import load_reference

    models: dict[Path, torch.nn.Module] = {}
    runs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(path: Path, ids: torch.Tensor, mask: torch.Tensor | None = None):
        key = (
            path,
            tuple(ids.reshape(-1).tolist()),
            None if mask is None else tuple(mask.reshape(-1).tolist()),
        )
        if key not in runs:
            if path not in models:
                models[path] = load_reference(path, device=DEVICE, experts=REFERENCE)
            runs[key] = greedy(models[path], ids, mask)
        return runs[key]

    return run


def assert_exact(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Identical token ids and bit-identical logits at every generated step."""
    seq, logits = got
    ref_seq, ref_logits = want
    assert seq.tolist() == ref_seq.tolist()
    assert logits.shape == ref_logits.shape
    for step in range(logits.shape[0]):
        assert torch.equal(logits[step], ref_logits[step]), f"logits differ at step {step}"


def floor_share(total: int, percent: float) -> int:
    return math.floor(total * percent / 100)


MISSING_EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
WRONG_SHAPE = "model.layers.0.block_sparse_moe.experts.5.w1.weight"


@pytest.fixture(scope="session")
def bad_ckpt(
    tmp_path_factory: pytest.TempPathFactory, make_ckpt: Callable[..., Path]
) -> Callable[[str], Path]:
    """``bad_ckpt(kind)``: a directory that is not a usable checkpoint, in one of several ways."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    built: dict[str, Path] = {}

    def copy_of(kind: str) -> Path:
        out = tmp_path_factory.mktemp(f"bad-{kind}")
        shutil.copytree(make_ckpt("mixtral"), out, dirs_exist_ok=True)
        return out

    def make(kind: str) -> Path:
        if kind in built:
            return built[kind]
        if kind == "missing_dir":
            path = tmp_path_factory.mktemp("gone") / "no-such-model"
        elif kind == "a_file":
            path = tmp_path_factory.mktemp("file") / "model.txt"
            path.write_text("not a checkpoint\n")
        elif kind == "no_config":
            path = copy_of(kind)
            (path / "config.json").unlink()
        elif kind == "unsupported":
            path = copy_of(kind)
            cfg = json.loads((path / "config.json").read_text())
            cfg["model_type"] = "llama"
            (path / "config.json").write_text(json.dumps(cfg))
        elif kind == "corrupt":
            path = copy_of(kind)
            (path / "model.safetensors").write_bytes(b"\x17garbage, not a safetensors header" * 100)
        elif kind == "truncated":
            path = copy_of(kind)
            data = (path / "model.safetensors").read_bytes()
            (path / "model.safetensors").write_bytes(data[: len(data) // 2])
        elif kind == "missing_expert":
            path = copy_of(kind)
            state = load_file(str(path / "model.safetensors"))
            del state[MISSING_EXPERT]
            save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        elif kind == "wrong_shape":  # an expert other than expert 0 with half the rows it needs
            path = copy_of(kind)
            state = load_file(str(path / "model.safetensors"))
            state[WRONG_SHAPE] = state[WRONG_SHAPE][: state[WRONG_SHAPE].shape[0] // 2].clone()
            save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        elif kind == "missing_dense":
            path = copy_of(kind)
            state = load_file(str(path / "model.safetensors"))
            del state["model.norm.weight"]
            save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        elif kind == "bad_json":
            path = copy_of(kind)
            (path / "config.json").write_text("{ not json")
        elif kind == "no_weights":
            path = copy_of(kind)
            (path / "model.safetensors").unlink()
        elif kind in ("missing_shard", "bad_index"):
            path = tmp_path_factory.mktemp(f"bad-{kind}")
            shutil.copytree(make_ckpt("mixtral", max_shard_size="40KB"), path, dirs_exist_ok=True)
            index = path / "model.safetensors.index.json"
            if kind == "bad_index":
                index.write_text('{"metadata": {}}')
            else:
                shard = sorted(set(json.loads(index.read_text())["weight_map"].values()))[1]
                (path / shard).unlink()
        else:
            raise ValueError(kind)
        built[kind] = path
        return path

    return make


def run_interpreted(test_file: str, passed: int) -> None:
    """The ``interpreted_`` tests of ``test_file`` in a process with Triton's interpreter on (it must be on
    before triton is imported; no GPU needed), where Triton is installed: all ``passed`` of them pass."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process is the interpreter's: the tests run here")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-k", "interpreted_", "-o", "addopts=", "-p", "no:xdist",
         "-q", "-p", "no:cacheprovider"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parents[1], capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    if run.returncode != 0 and "only 0-dimensional arrays can be converted to Python scalars" in run.stdout:
        import numpy
        import triton

        # seen with Triton 3.6 and NumPy 2.5 on a GPU machine: the interpreter's failure, not the kernels'
        pytest.skip(
            f"Triton {triton.__version__}'s interpreter cannot run under NumPy {numpy.__version__}: it takes "
            "int() of one-element arrays, which NumPy 2.5 refuses"
        )
    assert run.returncode == 0 and f"{passed} passed" in run.stdout, run.stdout[-5000:] + run.stderr[-2000:]


def assert_experts_are(sk, mods: list[torch.nn.Module]) -> None:
    """Every expert of the skeleton ``sk``'s checkpoint, read from its store and expanded (a transposed
    family's biases too), is the parameter of transformers' experts module ``mods[layer]``, bit for bit."""
    from expertcache.engine.memory import SlotPool
    from expertcache.engine.packed import MATRICES

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
                    assert torch.equal(sk.packed.bias(scratch, name), getattr(mod, name)[e]), (layer, e, name)
