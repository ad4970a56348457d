"""Shared pieces of the engine tests: a tiny tokenizer, tiny checkpoints of every family, references.

Everything here is built once per session in a temporary directory (nothing from the network, no
embedded model needed): a byte-level BPE tokenizer trained on a few lines, and random-weight
checkpoints made with ``expertcache.engine.random_checkpoint.make_checkpoint``. Import the fixtures into
a test module (``from engine_fixtures import ...``) to use them.
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

FAMILIES = tuple(ENGINE_FAMILIES)  # every family the engine supports
ONLINE = [name for name in POLICIES if not is_offline(name)]
OFFLINE = [name for name in POLICIES if is_offline(name)]
NEEDS_PROFILE = ("static", "static-dist")

# EXPERTCACHE_TEST_DEVICE=cuda runs the engine tests (engine and reference alike) on a GPU
DEVICE = os.environ.get("EXPERTCACHE_TEST_DEVICE", "cpu")
TOP_K = 2
NEW = 6  # new tokens per greedy generation
PROMPT = [5, 17, 42, 99, 120, 7, 250, 33]  # 8 token ids below the tiny vocabulary's 300
PROMPT_B = [61, 3, 200, 148, 9]  # a shorter second prompt (left-padded in a batch)

# Small shapes; deepseek's first layer is dense, so 3 layers give 2 MoE layers there too.
SPECS: dict[str, dict[str, int]] = {
    "mixtral": dict(hidden=32, layers=2, experts=8, intermediate=32),
    "qwen2_moe": dict(hidden=32, layers=2, experts=6, intermediate=32),
    "qwen3_moe": dict(hidden=32, layers=2, experts=6, intermediate=32),
    "olmoe": dict(hidden=32, layers=2, experts=6, intermediate=32),
    "deepseek_v2": dict(hidden=32, layers=3, experts=6, intermediate=32),
    "deepseek_v3": dict(hidden=32, layers=3, experts=6, intermediate=32),
    "gpt_oss": dict(hidden=32, layers=2, experts=8, intermediate=32),
    "granitemoe": dict(hidden=32, layers=2, experts=6, intermediate=32),
}

_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts models route every token to a few experts.",
    "Experts that are not resident are loaded from the slow tier.",
    "hello world, hello experts, hello cache",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? ; :",
]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Tiny matmuls on a loaded 2-core machine run ~50x faster on one thread than fighting for two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer (vocab ~300, ``<|endoftext|>`` as bos/eos/pad) saved to a directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_LINES * 5, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Callable[..., Path]:
    """``make_ckpt(family, **overrides)``: a tiny checkpoint, built once per (family, overrides)."""
    from expertcache.engine.random_checkpoint import make_checkpoint

    built: dict[tuple, Path] = {}

    def make(family: str, **overrides: object) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            kwargs = {**SPECS[family], "top_k": TOP_K, "heads": 4, "seed": 0, **overrides}
            out = tmp_path_factory.mktemp(f"ckpt-{family}")
            built[key] = make_checkpoint(out, family, tokenizer=tokenizer_dir, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def ckpt(make_ckpt: Callable[..., Path]) -> Callable[[str], Path]:
    """``ckpt(family)``: the family's default tiny checkpoint."""
    return lambda family: make_ckpt(family)


def moe_layers(family: str) -> int:
    layers = SPECS[family]["layers"]
    return layers - 1 if family.startswith("deepseek") else layers


def total_experts(family: str) -> int:
    return moe_layers(family) * SPECS[family]["experts"]


def capacities(family: str, policy: str) -> list[int]:
    """The smallest capacity the policy runs with, a middle one, and every expert."""
    name, params = parse_policy(policy)
    low = min_capacity(name, moe_layers(family), params, min_room=TOP_K)
    high = total_experts(family)
    return sorted({low, (low + high) // 2, high})


def engine_load(path: Path, capacity: int | None = None, policy: str = "lru", **kwargs):
    """``expertcache.engine.load`` on the test device; ``capacity`` experts as bytes (default: all)."""
    from expertcache.engine import load

    budget = kwargs.pop("expert_memory", "100%") if capacity is None else capacity * _slot_bytes(path)
    if policy in NEEDS_PROFILE and "profile" not in kwargs:
        kwargs["profile"] = profile_for(path)
    kwargs.setdefault("device", DEVICE)
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


def greedy(model, ids: torch.Tensor, mask: torch.Tensor | None = None, new: int = NEW):
    """Greedy generation of exactly ``new`` tokens -> (sequences, logits [new, B, V]), on the CPU."""
    device = model.device
    with torch.inference_mode():
        out = model.generate(
            ids.to(device),
            attention_mask=(torch.ones_like(ids) if mask is None else mask).to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences.cpu(), torch.stack(out.logits).cpu()


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
                models[path] = load_reference(path, device=DEVICE)
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


def prompt_ids(*prompts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch of prompts (pad id 0) and its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


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
