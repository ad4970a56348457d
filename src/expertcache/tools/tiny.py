"""Tiny random models of every supported family, built in a directory in well under a second each.

For the self-test (``expertcache selftest``) and the engine tests: nothing from the network and no
embedded model needed. A byte-level BPE tokenizer (vocabulary ~300) is trained on a few lines, and
random-weight checkpoints of a few dozen kilobytes are saved with ``engine.random_checkpoint``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from expertcache.engine.families import FAMILIES

TOP_K = 2
TINY_HEADS = 4  # attention heads of every tiny model
PROMPT = [5, 17, 42, 99, 120, 7, 250, 33]  # 8 token ids below the tiny vocabulary's 300
PROMPT_B = [61, 3, 200, 148, 9]  # a shorter second prompt (left-padded in a batch)

# Each family's tiny shape, from its record (``engine.families.Tiny``): make_checkpoint's arguments
SPECS: dict[str, dict[str, int]] = {name: asdict(f.tiny) for name, f in FAMILIES.items()}

_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts models route every token to a few experts.",
    "Experts that are not resident are loaded from the slow tier.",
    "hello world, hello experts, hello cache",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? ; :",
]


def moe_layers(family: str) -> int:
    return SPECS[family]["layers"] - FAMILIES[family].dense_first


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

    kwargs = {**SPECS[family], "top_k": TOP_K, "heads": TINY_HEADS, "seed": 0, **overrides}
    return make_checkpoint(out, family, tokenizer=tokenizer, **kwargs)
