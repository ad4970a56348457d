"""Random-weight MoE checkpoints of any supported family and size, saved the way transformers saves.

For tests (tiny configs of every family), benchmarks (a larger generated model; real dimensions on a
GPU) and users who want to try a shape before downloading it. The tokenizer is copied from a given
checkpoint (default: the embedded model), so the result works with ``expertcache generate``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from expertcache.config import CHECKPOINT_DTYPES
from expertcache.engine.families import FAMILIES, NOT_SUPPORTED, Shape
from expertcache.errors import ExpertcacheError, did_you_mean, first_line, option
from expertcache.paths import as_umask_allows, writable_dir
from expertcache.units import whole_number

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_CHECKPOINT_FILES = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "pytorch_model*.bin", "pytorch_model*.bin.index.json",
)  # fmt: skip


MARK = "expertcache-random.json"  # what a random checkpoint was made with; only such a folder is replaced


def _draw_padding_row(model, pad: int | None) -> None:
    """The input embedding's row of the padding token drawn as the others are: transformers leaves it at
    0, and where the tokenizer's padding token is its BOS as well (the embedded model's, Granite's), every
    random model then gave the first position all-zero logits, which `quality` counted as bit-identical
    and agreeing between any two models (a new user's trial). Padded positions are masked: no output
    changes but the first position's."""
    emb = model.get_input_embeddings()
    if pad is None or emb is None or not 0 <= pad < emb.weight.shape[0]:
        return
    with torch.no_grad():
        row, others = emb.weight[pad], emb.weight[pad + 1 if pad + 1 < emb.weight.shape[0] else pad - 1]
        if not row.any():
            row.normal_(0.0, float(others.float().std()) or 0.02)


def _prepare_out(out: Path, tok_dir: Path) -> None:
    """Refuse an output folder that is a file, holds anything but a random checkpoint written here before
    (which is replaced: a user's own checkpoint, or one ``quantize`` wrote, is never overwritten), or is
    the folder the tokenizer comes from (the embedded model, by default)."""
    if out.exists() and not out.is_dir():
        raise ExpertcacheError(f"{out}: exists and is not a directory")
    if not out.exists() and not out.absolute().parent.is_dir():  # the folder is made, not its parents
        raise ExpertcacheError(f"{out}: directory {out.absolute().parent} does not exist")
    if out.is_dir() and tok_dir.is_dir() and out.resolve() == tok_dir.resolve():
        raise ExpertcacheError(f"{out}: is the checkpoint the tokenizer comes from; choose another folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARK).is_file():
        what = (
            "a checkpoint not made by model synth" if (out / "config.json").is_file() else "not a checkpoint"
        )
        raise ExpertcacheError(f"{out}: not empty and {what}; choose a new or empty folder")


def _clear_checkpoint(out: Path) -> None:
    """Remove an older checkpoint's weights, index and config, so that no stale shard or index stays
    beside the new files (transformers reads an index before a single file)."""
    if not out.is_dir():
        return
    for pattern in (*_CHECKPOINT_FILES, *_TOKENIZER_FILES, MARK):
        for f in out.glob(pattern):
            if f.is_file():
                f.unlink()


def make_checkpoint(
    out: str | Path,
    family: str = "mixtral",
    *,
    hidden: int = 64,
    layers: int = 2,
    experts: int = 8,
    top_k: int = 2,
    intermediate: int = 64,
    heads: int = 4,
    kv_heads: int | None = None,
    max_positions: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: int | str | None = None,
    tokenizer: str | Path | None = None,
) -> Path:
    """Build a random model of ``family`` and ``save_pretrained`` it (sharded if ``max_shard_size``)."""
    from transformers import AutoConfig, AutoTokenizer

    from expertcache.engine.causal import causal_lm_class

    if isinstance(family, str) and family not in FAMILIES and family.lower() in FAMILIES:
        family = family.lower()  # model_type is lower case; "Mixtral" can only mean one family
    if family in NOT_SUPPORTED:  # a family transformers has that the engine cannot run: why, as model info
        raise ExpertcacheError(
            f"unsupported family {family!r}: {NOT_SUPPORTED[family]} (docs/ENGINE.md, families not supported)"
        )
    if family not in FAMILIES:
        hint = did_you_mean(repr(family), map(repr, FAMILIES), n=1)  # quoted as the message names it
        raise ExpertcacheError(
            f"unsupported family {family!r}{hint}; supported: {', '.join(sorted(FAMILIES))}"
        )
    sizes = dict(hidden=hidden, layers=layers, experts=experts, top_k=top_k, intermediate=intermediate,
                 heads=heads, max_positions=max_positions)  # fmt: skip
    hidden, layers, experts, top_k, intermediate, heads, max_positions = (
        whole_number(v, k) for k, v in sizes.items()
    )
    kv_heads = None if kv_heads is None else whole_number(kv_heads, "kv_heads")
    if kv_heads is not None and heads % kv_heads:
        raise ExpertcacheError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    seed = whole_number(seed, "seed", 0)
    if dtype not in CHECKPOINT_DTYPES:
        raise ExpertcacheError(f"dtype must be one of {', '.join(CHECKPOINT_DTYPES)}, got {dtype!r}")
    if isinstance(max_shard_size, str):  # "500MB": transformers' spelling, which save_pretrained reads
        from transformers.utils.hub import convert_file_size_to_int

        try:
            convert_file_size_to_int(max_shard_size)
        except ValueError:
            raise ExpertcacheError(
                f"max_shard_size {max_shard_size!r} is not a size (a whole number and a unit: 500MB, 2GiB)"
            ) from None
    elif max_shard_size is not None:
        max_shard_size = whole_number(max_shard_size, "max_shard_size")
    hid, hd, k, ex = (option(f"--{n}", n.replace("-", "_")) for n in ("hidden", "heads", "top-k", "experts"))
    if hidden % heads:
        raise ExpertcacheError(f"{hid} {hidden} is not a multiple of {hd} {heads}")
    if (hidden // heads) % 2:  # rotary embeddings turn pairs of a head's values (transformers fails later)
        raise ExpertcacheError(
            f"{hid} {hidden} over {hd} {heads} is {hidden // heads} values a head: rotary position "
            "embeddings need an even number"
        )
    if top_k < 1:
        raise ExpertcacheError(f"{k} must be at least 1, got {top_k}")
    if top_k > experts:  # (--experts 1 said "top_k must be in 1..1, got 2", of the top-k not given)
        raise ExpertcacheError(f"{k} {top_k} needs at least {top_k} experts a layer, and {ex} is {experts}")
    from expertcache.engine.offloaded import DEFAULT_MODEL

    tok_dir = Path(tokenizer) if tokenizer is not None else DEFAULT_MODEL
    _prepare_out(Path(out), tok_dir)
    if not (tok_dir / "tokenizer.json").is_file():
        raise ExpertcacheError(f"{tok_dir}: no tokenizer.json to copy the tokenizer from")
    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception as exc:
        raise ExpertcacheError(f"{tok_dir}: cannot load the tokenizer ({exc})") from None
    rec = FAMILIES[family]
    if layers < rec.min_layers:
        why = (
            "an attention layer among its linear-attention, Mamba or convolution ones"
            if rec.min_tiny and rec.min_layers > rec.dense_first + 1
            else f"{rec.dense_first} without experts before its first MoE one"
        )
        raise ExpertcacheError(f"{family} needs at least {rec.min_layers} layers ({why}), got {layers}")
    args = rec.config(Shape(experts, top_k, intermediate, hidden, heads, layers))
    if "vocab_size_per_layer_input" in args:  # Gemma 4's per-layer inputs: one row a token
        args["vocab_size_per_layer_input"] = len(tok)
    fixed = args.get("num_key_value_heads")  # a family whose attention fixes it (GLM-5-Next's MLA)
    if kv_heads is not None and fixed is not None and kv_heads != fixed:
        raise ExpertcacheError(f"{family} takes {fixed} key-value heads (one a query head), not {kv_heads}")
    base = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    try:
        config = AutoConfig.for_model(family, **(base | args))
    except Exception as exc:  # transformers' own check of the sizes (a head of 9 values where 2 divide it)
        raise ExpertcacheError(f"{family}: transformers refuses these sizes ({first_line(exc)})") from None
    torch.manual_seed(seed)
    model = causal_lm_class(config).from_config(config, dtype=getattr(torch, dtype))
    _draw_padding_row(model, tok.pad_token_id)
    out = Path(out)
    _clear_checkpoint(out)
    writable_dir(out, "the checkpoint")  # the folder is made, its parent must exist
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    for name in _TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, out / name)
    for f in out.glob("*.safetensors"):
        as_umask_allows(f)
    made = dict(family=family, hidden=hidden, layers=layers, experts=experts, top_k=top_k,
                intermediate=intermediate, heads=heads, kv_heads=kv_heads, seed=seed,
                dtype=dtype)  # fmt: skip
    (out / MARK).write_text(json.dumps({"made_by": "expertcache model synth", **made}, indent=1) + "\n")
    return out
