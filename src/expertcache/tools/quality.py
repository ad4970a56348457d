"""``expertcache quality``: what a lossy miss path, or a kernel not bit-equal to transformers (``compiled``),
costs in accuracy, measured as generation sees it.

Held-out texts are fed token by token (teacher forcing, one forward step per token with the KV cache, so
every token is a decode step as in generation, and each text its own request) through transformers'
reference (every expert resident, full precision) and through the offloaded model under the miss
path being measured. Reported: perplexity of both on the same tokens and its relative change, top-1
agreement (the share of positions where both predict the same next token), the share of expert uses
served at low precision or skipped, and how far the logits are from the reference's (the share of
positions whose logits are bit-identical, the largest difference), token by token and with each text fed
as one prompt (a prefill: steps of many tokens, which a decode step of one does not exercise). By default the
texts are the embedded model's held-out files (the standard-library files of its validation split that its
default trace's prompts come from, stored with it); ``texts`` takes any list of strings.

Shape letters: N tokens of a text, V vocabulary.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from expertcache.config import REFERENCE_IMPLEMENTATIONS
from expertcache.errors import ExpertcacheError, first_line, option, say_notes
from expertcache.units import values_of, whole_number

DEFAULT_TOKENS = 2048  # tokens measured in all, split over the texts
DEFAULT_TEXTS = 8


def heldout_texts(count: int = DEFAULT_TEXTS, chars: int = 4000) -> list[str]:
    """The first ``chars`` characters of the embedded model's held-out standard-library files, as stored
    with it (``trace.default.heldout_texts``: the same text on every Python)."""
    from expertcache.trace.default import heldout_texts as stored

    return [text for _, text in stored(count, chars)]


def _stream(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits at every position of ids [N], one decode step per token. -> [N, V] (float32)"""
    past, out = None, []
    device = next(p for p in model.parameters() if not p.is_meta).device
    # the KV cache's argument and output field: ``cache`` from transformers 5.24, ``past_key_values`` before
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        for t in range(ids.shape[0]):
            res = model(input_ids=ids[t : t + 1].view(1, 1).to(device), use_cache=True, **{name: past})
            past = res[name]
            out.append(res.logits[0, -1].float().cpu())
    return torch.stack(out)


def _prefill(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits at every position of ids [N] from one forward of all of them, a prompt's prefill step (a
    step of many tokens: what a decode step of one does not exercise). -> [N, V] (float32)"""
    device = next(p for p in model.parameters() if not p.is_meta).device
    with torch.inference_mode():
        return model(input_ids=ids.view(1, -1).to(device), use_cache=True).logits[0].float().cpu()


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1:] given logits[:-1], and the number of tokens."""
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return float(-logp.gather(1, ids[1:, None]).sum()), ids.shape[0] - 1


class Reference:
    """The full-precision reference's logits for token sequences, computed once and kept (a benchmark
    measures many miss paths on the same tokens)."""

    def __init__(
        self,
        model_path: str | Path | None,
        device: str = "cpu",
        experts: str | None = None,
        attention: str | None = None,
        dtype=None,
    ) -> None:
        from expertcache.engine.hub import resolve_model
        from expertcache.engine.loader import default_reference, load_reference, read_config, resolve_dtype

        self.path = resolve_model(model_path)
        # transformers' experts implementation
        self.experts = experts or default_reference(device, resolve_dtype(dtype, read_config(self.path)))
        self.attention = attention  # transformers' attention implementation (None: its default)
        self.model = load_reference(
            self.path, dtype=dtype, device=device, experts=self.experts, attention=attention
        )  # in ``dtype`` (None: the checkpoint's)
        self._done: dict[tuple[bool, tuple[int, ...]], torch.Tensor] = {}

    def logits(self, ids: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        """Next-token logits at every position: one decode step a token, or (``prefill``) one forward of
        all of them."""
        key = (prefill, tuple(ids.tolist()))
        if key not in self._done:
            logits = (_prefill if prefill else _stream)(self.model, ids)
            if not torch.isfinite(logits).all():  # a perplexity of NaN, "+nan%" and JSON's NaN were printed
                raise ExpertcacheError(
                    f"the reference's outputs are not finite (NaN or infinite logits): {self.path}'s weights "
                    "or config.json hold a NaN or an infinity, or the dtype overflows (try --dtype float32)"
                )
            self._done[key] = logits
        return self._done[key]


def measure(
    model_path: str | Path | None,
    miss: str,
    expert_memory: str = "25%",
    policy: str = "lru",
    texts: Sequence[str] | None = None,
    tokens: int = DEFAULT_TOKENS,
    device: str = "cpu",
    reference: Reference | None = None,
    progress: bool = False,
    prefetch: str = "auto",
    prefetch_when: str = "always",
    kernel: str | None = None,
    reference_implementation: str | None = None,
    reference_model: str | Path | None = None,
    quantize_dense: str | None = None,
    attention: str | None = None,
    dtype=None,
) -> dict[str, object]:
    """Perplexity, its change and top-1 agreement of ``miss`` (computed by ``kernel``: ``engine.kernels``)
    against the full-precision reference: transformers with ``reference_implementation`` (its
    ``experts_implementation``; by default the one the kernel is exact against, and for the compiled
    kernel, which is exact against none, the default kernel's: ``grouped_mm``); ``reference``: one to
    reuse across calls on the same model and texts. A packed checkpoint (``engine.packed``) is measured
    against the full-precision checkpoint it was made from: ``reference_model``, by default the one its
    config names (``expertcache quantize --checkpoint`` writes it there). ``quantize_dense``: the dense
    layers quantised at load (``engine.dense``), measured against the model's own. ``attention``:
    transformers' attention implementation, for the engine and the reference alike (``engine.loader``);
    ``dtype``: the compute dtype, likewise for both (None: each checkpoint's own).

    Which experts miss, and so which a lossy path serves at low precision or skips, depends on the
    prefetcher: by default it predicts in every step and the run is deterministic (the same numbers on
    every run); ``prefetch_when="pays"`` measures the engine as ``generate`` runs it by default, where
    the prefetch governor follows measured times and the numbers vary from run to run (``varies_by``)."""
    from expertcache.config import PrefetchConfig
    from expertcache.engine import load

    tokens = whole_number(tokens, option("--tokens", "tokens"), 2)
    if reference_implementation not in (None, *REFERENCE_IMPLEMENTATIONS):
        raise ExpertcacheError(
            f"reference_implementation must be one of {', '.join(REFERENCE_IMPLEMENTATIONS)} (transformers' "
            f"experts implementations) or None, got {reference_implementation!r}"
        )
    when = None if prefetch == "none" else prefetch_when
    pf = PrefetchConfig(prefetch, when=when, deterministic=when != "pays")
    model = load(
        model_path, expert_memory=expert_memory, policy=policy, device=device, miss=miss, prefetch=pf,
        progress=False, kernel=kernel, quantize_dense=quantize_dense, attention=attention, dtype=dtype,
    )  # fmt: skip
    for note in model.notes:  # e.g. expert memory capped at all experts
        print(f"note: {note}", file=sys.stderr)
    try:
        texts = values_of(texts, "texts", str) if texts is not None else heldout_texts()  # one text: one
        tok = model.tokenizer
        # a text of n tokens gives n - 1 predictions: `tokens` predictions in all, spread over the texts
        share = [tokens // len(texts) + (i < tokens % len(texts)) for i in range(len(texts))]
        context = getattr(model.config, "max_position_embeddings", None)  # a text is one request: within it
        if isinstance(context, int) and context >= 2:
            share = [min(n, context - 1) for n in share]
        seqs = [tok(t, return_tensors="pt", truncation=True, max_length=n + 1).input_ids[0]
                for t, n in zip(texts, share, strict=True) if n > 0]  # fmt: skip
        if isinstance(context, int) and any(s.shape[0] >= context for s in seqs):  # cut there, not by tokens
            say_notes([f"a text is measured on its first {context} tokens at most, the model's context"])
        seqs = [s for s in seqs if s.shape[0] >= 2]
        if sum(s.shape[0] - 1 for s in seqs) < 2:  # as --tokens: a figure over one token is no measure
            raise ExpertcacheError(
                "the texts give fewer than 2 tokens to predict: give a longer text (at least 3 tokens)"
            )
        from expertcache.engine.kernels import default_kernel
        from expertcache.engine.loader import in_dtype

        # the implementation the kernel computes as, bit for bit (the compiled kernel: as none; the default's)
        matched = in_dtype(model.kernel.reference or default_kernel(device).reference, model.dtype)
        impl = reference_implementation or matched
        if reference is not None and reference.experts != impl:
            raise ExpertcacheError(f"the reference given runs transformers {reference.experts}, not {impl}")
        ran = model.stats["attention"]  # the default resolved: sdpa (on a GPU sdpa_no_cudnn), or eager
        if reference is not None and reference.model.config._attn_implementation != ran:
            raise ExpertcacheError(
                f"the reference given runs attention {reference.model.config._attn_implementation}, not {ran}"
            )
        if reference is not None and dtype is not None and reference.model.dtype != model.dtype:
            raise ExpertcacheError(f"the reference given runs in {reference.model.dtype}, not {model.dtype}")
        ref = reference
        if ref is None:
            path = _reference_path(model, reference_model)
            try:
                ref = Reference(path, device, impl, attention, dtype)
            except ExpertcacheError as exc:
                if reference_model is not None or model.packed is None or path != model.path:
                    raise
                # transformers' own run of a checkpoint quantised elsewhere stood for the reference: a
                # full-precision checkpoint of the model can stand instead (a tied compressed-tensors one
                # failed in transformers 5.24, with no word of the way round it: a new user's trial)
                raise ExpertcacheError(
                    f"{first_line(exc)}; give a full-precision checkpoint of the model to measure against "
                    f"({option('--reference-model DIR', 'reference_model=')})"
                ) from None
        nll = {"reference": 0.0, "measured": 0.0}
        count = agree = identical = positions = 0
        largest = 0.0
        before = model.stats
        for i, ids in enumerate(seqs):
            want, got = ref.logits(ids), _stream(model.model, ids)
            for name, logits in (("reference", want), ("measured", got)):
                nll[name] += _nll(logits, ids)[0]
            count += ids.shape[0] - 1
            agree += int((want[:-1].argmax(-1) == got[:-1].argmax(-1)).sum())
            identical += int((want == got).all(-1).sum())
            positions += ids.shape[0]
            largest = max(largest, float((want - got).abs().max()))
            if progress:
                print(f"text {i + 1}/{len(seqs)}: {count} tokens", file=sys.stderr, flush=True)
        if count < tokens:
            say_notes(
                [
                    f"the texts hold {count} tokens to predict: measured on those, not the {tokens} of "
                    f"{option('--tokens', 'tokens')} ({option('--text FILE', 'texts=')} for more)"
                ]
            )
        after = model.stats
        # the same texts, each as one prompt: prefill's steps of many tokens, where an expert's rows are
        # grouped and computed together (after the counts: the shares are decode's, as generation's)
        pre_identical = pre_positions = 0
        pre_largest = 0.0
        for ids in seqs:
            want, got = ref.logits(ids, prefill=True), _prefill(model.model, ids)
            pre_identical += int((want == got).all(-1).sum())
            pre_positions += ids.shape[0]
            pre_largest = max(pre_largest, float((want - got).abs().max()))
        uses = after["requests"] - before["requests"]
        low = after["low_precision"] - before["low_precision"]
        skipped = after["skipped"] - before["skipped"]
        ppl_ref, ppl = math.exp(nll["reference"] / count), math.exp(nll["measured"] / count)
        return {
            "miss": model.miss.describe(),
            "copies": [p["copies"] for p in model.stats["parts"].values() if "copies" in p],  # which file
            "kernel": model.kernel.name,
            "expert_format": model.stats["expert_format"],
            "dense_format": quantize_dense or "as stored",
            "dense": model.stats["dense"],
            "attention": model.stats["attention"],
            "dtype": model.stats["dtype"],
            "reference_dtype": str(ref.model.dtype).removeprefix("torch."),
            # against another checkpoint (the full-precision one a packed checkpoint was made from), the
            # figures measure a loss even where the engine computes this checkpoint's own weights exactly
            "lossy": _lossy_against(model, ref.path),
            "reference_model": str(ref.path),
            "reference": f"transformers {impl}",
            # the kernel rounds as this implementation: against another one, last bits differ however exact
            "kernel_computes_as": matched,
            "policy": policy,
            "expert_memory": expert_memory,
            "tokens": count,
            "texts": len(seqs),
            "perplexity_reference": ppl_ref,
            "perplexity": ppl,
            "perplexity_change": ppl / ppl_ref - 1.0,
            "top1_agreement": agree / count,
            "logits_identical": identical / positions,  # positions whose logits are bit-identical
            "logits_max_difference": largest,
            "prefill_logits_identical": pre_identical / pre_positions,  # each text as one prompt
            "prefill_logits_max_difference": pre_largest,
            "expert_uses": uses,
            "low_precision_share": low / uses if uses else 0.0,
            "skipped_share": skipped / uses if uses else 0.0,
            "prefetch": after["prefetch"],
            "prefetch_when": after["prefetch_when"],
            "deterministic": after["deterministic"],
            "varies_by": after["varies_by"],
        }
    finally:
        model.close()


_OWN_RUN = (
    "note: the reference is transformers' own run of {path} (it dequantises the experts): the figures say "
    "how the engine runs this checkpoint, not what its quantisation costs, which needs the full-precision "
    "checkpoint (--reference-model DIR)"
)


def _reference_path(model, given: str | Path | None) -> Path:
    """The checkpoint the reference runs: ``given``, else the model's own, else (a packed checkpoint, which
    transformers cannot run) the full-precision one it was made from, as ``expertcache quantize`` recorded
    it (refused where that checkpoint changed since: its fingerprint differs). A reference that is packed
    (transformers would run it with experts it never read) or another model is refused."""
    import json

    from expertcache.engine.packed import CONFIG_KEY
    from expertcache.engine.quantized import fingerprint
    from expertcache.tools.quantize import SOURCE_KEY

    if given is None and model.packed is None:
        return model.path
    config = json.loads((model.path / "config.json").read_text()) if model.path is not None else {}
    recorded = config.get(SOURCE_KEY) or {"path": (config.get(CONFIG_KEY) or {}).get("source")}
    if given is not None:
        path = Path(given)
        if not (path / "config.json").is_file():
            raise ExpertcacheError(
                f"--reference-model {given}: no config.json there (not a checkpoint directory)"
            )
        _check_reference(model, path)  # one line for a reference that cannot be this model, before any note
        made_from = recorded.get("fingerprint")
        if not _other_checkpoint(model, path):  # the checkpoint itself, run by transformers
            print(_OWN_RUN.format(path=model.path), file=sys.stderr)
        elif model.packed is not None and made_from is not None and made_from != fingerprint(path):
            print(
                f"note: --reference-model {given} is not the checkpoint {model.path} was made from (its "
                f"config or weights differ from {recorded.get('path')}'s when it was): the figures compare "
                "with another model",
                file=sys.stderr,
            )
    else:
        source = recorded.get("path")
        if (source is None or not (Path(source) / "config.json").is_file()) and _transformers_reads(config):
            # a checkpoint quantised by another tool (FP8, MXFP4, compressed-tensors), as downloaded
            partial = _partial_fp8_block(model.path, config["quantization_config"])
            if partial is not None:
                raise ExpertcacheError(
                    f"{model.path} has no full-precision checkpoint named, and transformers cannot stand in "
                    f"for one: {partial}; give the full-precision checkpoint (--reference-model DIR)"
                )
            print(_OWN_RUN.format(path=model.path), file=sys.stderr)
            return model.path
        if source is None or not (Path(source) / "config.json").is_file():
            raise ExpertcacheError(
                f"{model.path} stores its experts packed and names no full-precision checkpoint that exists "
                f"({source or 'none'}): give the one it was made from (--reference-model DIR)"
            )
        path = Path(source)
        if recorded.get("fingerprint") not in (None, fingerprint(path)):
            raise ExpertcacheError(
                f"{path} changed since {model.path} was made from it (its config or weights differ): give "
                "the checkpoint it was made from (--reference-model DIR)"
            )
        _check_reference(model, path)
    return path


def _transformers_reads(config: dict) -> bool:
    """A checkpoint transformers runs itself, dequantising its experts (a ``quantization_config`` of its
    own), not one only the engine reads (its own packed format alone)."""
    from expertcache.engine.packed import CONFIG_KEY

    return isinstance(config.get("quantization_config"), dict) and CONFIG_KEY not in config


def _partial_fp8_block(path: Path, packing: dict) -> str | None:
    """Where transformers dequantises a block-FP8 checkpoint otherwise than it was quantised: a weight
    whose sides are not multiples of the block (DeepSeek's layout: a partial last block, as the engine
    reads it) is dequantised with a block derived from its scale grid (transformers 5's
    ``Fp8Dequantize``: 160 columns in 2 scales read as blocks of 80). None where no side has a partial
    block after a whole one."""
    from safetensors import safe_open

    from expertcache.tools.published import partial_blocks

    block = packing.get("weight_block_size") if packing.get("quant_method") == "fp8" else None
    if not block:
        return None
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names = set(f.keys())
            for name in sorted(names):
                weight = name.removesuffix("_scale_inv")
                if name.endswith("_scale_inv") and weight in names:
                    shape = f.get_slice(weight).get_shape()[-2:]
                    if len(shape) == 2 and partial_blocks(shape, block):
                        return (
                            f"{weight} {list(shape)} is not whole blocks of {list(block)}, which "
                            "transformers dequantises with another block than it was quantised with"
                        )
    return None


def _lossy_against(model, path: str | Path) -> bool:
    """Whether the figures against the reference ``path`` measure a loss: against another checkpoint (the
    full-precision one a packed checkpoint was made from) whatever the engine computes; against the model's
    own checkpoint (transformers' run of it), only what the engine changes in running it (a lossy miss
    path, dense layers quantised at load, a kernel that rounds), not how the checkpoint was made."""
    if _other_checkpoint(model, path):
        return True
    return bool(model.miss.lossy or model.dense is not None or model.kernel.rounds)


def _other_checkpoint(model, path: str | Path) -> bool:
    """Whether the reference ``path`` is another checkpoint than the model's own."""
    return model.path is None or Path(path).resolve() != Path(model.path).resolve()


def _check_reference(model, path: Path) -> None:
    """One line where the reference cannot stand for ``model``: packed, or of another shape."""
    import json

    from expertcache.engine.loader import read_config
    from expertcache.engine.packed import CONFIG_KEY

    read_config(path)  # its config.json read as the engine reads one (broken JSON in one line)

    theirs = json.loads((path / "config.json").read_text())
    mine = json.loads((model.path / "config.json").read_text()) if model.path is not None else {}
    if isinstance(theirs.get("quantization_config"), dict):
        partial = _partial_fp8_block(path, theirs["quantization_config"])
        if partial is not None:
            raise ExpertcacheError(f"reference {path}: {partial}; give the full-precision checkpoint")
    if CONFIG_KEY in theirs:
        fmt = theirs[CONFIG_KEY].get("format", "packed") if isinstance(theirs[CONFIG_KEY], dict) else "packed"
        raise ExpertcacheError(
            f"reference {path} stores its experts packed ({fmt}): transformers cannot read them; give the "
            "full-precision checkpoint"
        )
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if key in mine and key in theirs and mine[key] != theirs[key]:
            raise ExpertcacheError(
                f"reference {path} is another model: its {key} is {theirs[key]!r}, "
                f"{model.path}'s {mine[key]!r}"
            )


def _lossy_path(miss: str) -> bool:
    """Whether miss path ``miss`` (a spec) may compute experts at low precision or skip them."""
    from expertcache.miss.registry import miss_class

    try:
        return bool(miss_class(miss.partition(":")[0]).lossy)
    except ExpertcacheError:
        return True  # not one of ours: say what it did


def _exact(r: dict[str, object]) -> str:
    """An exact path's label; against an implementation other than the one its kernel computes as (eager
    against grouped), that its last bits may still differ (it read "exact" alone)."""
    computes_as = r.get("kernel_computes_as")
    if r.get("kernel") == "packed":  # another tool's quantised weights read as stored: no kernel's sums
        return " (exact weights: kernel packed sums them in float32, within rounding of this reference)"
    if computes_as is None or f"transformers {computes_as}" == r.get("reference"):
        return " (exact)"
    return f" (exact path; kernel {r['kernel']} rounds as transformers {computes_as}, not as this reference)"


def format_quality(r: dict[str, object]) -> str:
    return (
        f"{r['miss']} ({r['policy']}, {r['expert_memory']}), {r['expert_format']} experts, "
        + (f"dense layers {r['dense_format']}, " if r.get("dense_format", "as stored") != "as stored" else "")
        + (f"in {r['dtype']}, " if r.get("dtype") else "")
        + f"kernel {r['kernel']}, attention {r.get('attention')}, against {r['reference']}"
        + (f" on {r['reference_model']}" if r.get("reference_model") else "")
        + (" (lossy)" if r.get("lossy") else _exact(r) if "lossy" in r else "")  # as the JSON's flag
        + ": "
        f"perplexity {r['perplexity']:.3f} against {r['perplexity_reference']:.3f} "
        f"({r['perplexity_change']:+.2%}) | top-1 agreement {r['top1_agreement']:.2%} over {r['tokens']} "
        f"tokens | logits bit-identical to the reference's at {r['logits_identical']:.2%} of positions, "
        f"largest difference {r['logits_max_difference']:.3g}"
        + (
            f"; in a prefill, at {r['prefill_logits_identical']:.2%}, largest difference "
            f"{r['prefill_logits_max_difference']:.3g}"
            if "prefill_logits_identical" in r
            else ""
        )
        + (
            f" | low precision {r['low_precision_share']:.1%}, skipped {r['skipped_share']:.1%} of "
            f"{r['expert_uses']} expert uses"
            if _lossy_path(str(r["miss"])) or r["low_precision_share"] or r["skipped_share"]
            else ""
        )
        + (f" | copies {', '.join(r['copies'])}" if r.get("copies") else "")
        + (f" | varies from run to run: follows {', '.join(r['varies_by'])}" if r.get("varies_by") else "")
    )
