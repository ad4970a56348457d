"""Tiny random models of every supported family, built in a directory in well under a second each.

For the self-test (``expertcache selftest``) and the engine tests: nothing from the network and no
embedded model needed. A byte-level BPE tokenizer (vocabulary ~300) is trained on a few lines, and
random-weight checkpoints of a few dozen kilobytes are saved with ``engine.random_checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

TOP_K = 2
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


DENSE_FIRST = {"deepseek_v2": 1, "deepseek_v3": 1}  # dense layers before the MoE ones (random_checkpoint)


def moe_layers(family: str) -> int:
    return SPECS[family]["layers"] - DENSE_FIRST.get(family, 0)


def total_experts(family: str) -> int:
    return moe_layers(family) * SPECS[family]["experts"]


def make_tokenizer(out: str | Path) -> Path:
    """A byte-level BPE tokenizer (vocab ~300, ``<|endoftext|>`` as bos/eos/pad) saved to ``out``."""
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
    out = Path(out)
    fast.save_pretrained(str(out))
    return out


def make_tiny(out: str | Path, family: str, tokenizer: str | Path, **overrides: object) -> Path:
    """The family's tiny checkpoint (``SPECS``, top-2, 4 heads, seed 0; ``overrides`` change any of it)."""
    from expertcache.engine.random_checkpoint import make_checkpoint

    kwargs = {**SPECS[family], "top_k": TOP_K, "heads": 4, "seed": 0, **overrides}
    return make_checkpoint(out, family, tokenizer=tokenizer, **kwargs)
