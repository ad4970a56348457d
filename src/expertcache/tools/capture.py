"""Gate inputs and outputs of a model at work: the training and evaluation data of the predictors.

``capture(model, tokenizer, prompts, max_new_tokens)`` runs a transformers MoE model (every expert
resident: ``engine.loader.load_reference``) greedily over each prompt and records, for every token
of every forward step and every MoE layer, what the layer's router saw and chose: its input
(the gate input, [T, H]), its logits [T, E] and its top-k [T, K]. Forward hooks on the routers
(``engine.routing.moe_routers``) observe without changing anything. Prompts run one at a time, so
one forward step = one prefill step per prompt, then one step per generated token.

Shape letters: N tokens captured, L MoE layers, H hidden size, E experts, K top-k.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from expertcache.engine.routing import moe_routers, router_parts
from expertcache.errors import ExpertcacheError
from expertcache.paths import output_file

_ARRAYS = ("gate_input", "logits", "experts", "token_ids", "step", "prefill", "sequence")


@dataclass
class Captured:
    """Per token (rows, in run order): every MoE layer's gate input, logits and chosen experts."""

    gate_input: np.ndarray  # [N, L, H] float32: the router's input
    logits: np.ndarray  # [N, L, E] float32: the router's logits
    experts: np.ndarray  # [N, L, K] int64: the experts chosen, best first
    token_ids: np.ndarray  # [N] int64: the input token of the row
    step: np.ndarray  # [N] int64: forward step (0, 1, ... over the whole capture)
    prefill: np.ndarray  # [N] bool: the row belongs to a prefill step
    sequence: np.ndarray  # [N] int64: prompt index

    @property
    def num_layers(self) -> int:
        return self.gate_input.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.gate_input.shape[2]

    @property
    def num_experts(self) -> int:
        return self.logits.shape[2]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    def steps(self) -> list[slice]:
        """The rows of each forward step, in order (steps are contiguous runs of ``step``)."""
        if len(self.step) == 0:
            return []
        cuts = np.flatnonzero(np.diff(self.step)) + 1
        bounds = [0, *cuts.tolist(), len(self.step)]
        return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def save(self, path: str | Path) -> None:
        with output_file(path, "captured routing") as target, open(target, "wb") as f:
            np.savez_compressed(f, **{name: getattr(self, name) for name in _ARRAYS})

    @classmethod
    def load(cls, path: str | Path) -> Captured:
        with np.load(path) as z:
            return cls(*(z[name] for name in _ARRAYS))


class _Recorder:
    """Forward hooks on every router; ``rows`` collects one (inputs, logits, experts) per call."""

    def __init__(self, routers: Sequence[torch.nn.Module]) -> None:
        self.calls: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in routers]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def hook(module, args, output) -> None:
            x = args[0]
            at = router_parts(output, module, layer)
            logits, index = output[at[0]], output[at[2]]
            self.calls[layer].append(
                (
                    _np(x.reshape(-1, x.shape[-1])),  # [T, H]
                    _np(logits.reshape(-1, logits.shape[-1])),  # [T, E]
                    index.reshape(-1, index.shape[-1]).detach().cpu().numpy().astype(np.int64),
                )
            )

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


@torch.no_grad()
def capture(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int = 32,
    progress: bool = False,
) -> Captured:
    """Greedy generation of ``max_new_tokens`` after each prompt, with every router's traffic recorded.

    A prompt longer than the model's context less ``max_new_tokens`` keeps its first tokens.
    ``progress``: a progress bar of the prompts on stderr.
    """
    if max_new_tokens < 1:
        raise ExpertcacheError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not prompts:
        raise ExpertcacheError("no prompts to capture")
    routers = moe_routers(model)
    device = next(model.parameters()).device
    context = getattr(model.config, "max_position_embeddings", None)
    max_prompt_tokens = max(1, context - max_new_tokens) if context else None
    parts: list[Captured] = []
    step0 = 0
    for seq, prompt in enumerate(_bar(prompts, progress)):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"][:, :max_prompt_tokens].to(device)
        rec = _Recorder(routers)
        try:
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            )
        finally:
            rec.remove()
        parts.append(_assemble(rec.calls, out[0].cpu().numpy(), ids.shape[1], seq, step0))
        if not (np.isfinite(parts[-1].gate_input).all() and np.isfinite(parts[-1].logits).all()):
            # a router given NaN picks the same experts every time: a "perfect" predictor was trained on it
            raise ExpertcacheError(
                "the model's hidden states are not finite (NaN or infinite) at its routers: the "
                "checkpoint's weights or config.json hold a NaN or an infinity, or the dtype overflows "
                "(try --dtype float32)"
            )
        step0 = int(parts[-1].step[-1]) + 1
    return Captured(*(np.concatenate([getattr(p, n) for p in parts]) for n in _ARRAYS))


def _bar(prompts: Sequence[str], show: bool):
    if not show:
        return prompts
    from tqdm.auto import tqdm

    return tqdm(prompts, desc="capturing routing", unit="prompt", leave=False, file=sys.stderr)


def _assemble(calls, sequence: np.ndarray, prompt_len: int, seq: int, step0: int) -> Captured:
    """One prompt's router calls -> rows; step j > 0 fed the token generated at step j - 1."""
    lengths = [c[0].shape[0] for c in calls[0]]
    if lengths[0] != prompt_len or any(n != 1 for n in lengths[1:]):
        raise ExpertcacheError(
            f"capture expects one prefill step of {prompt_len} tokens then one token per step, "
            f"got steps of {lengths[:4]}... tokens"
        )
    if any(len(c) != len(lengths) for c in calls):
        raise ExpertcacheError("MoE layers saw different numbers of forward steps")
    num = sum(lengths)
    stack = [np.stack([np.concatenate([c[j] for c in layer]) for layer in calls], axis=1) for j in range(3)]
    steps = np.repeat(np.arange(len(lengths)), lengths)
    return Captured(
        gate_input=stack[0],  # [N, L, H]
        logits=stack[1],  # [N, L, E]
        experts=stack[2],  # [N, L, K]
        token_ids=sequence[:num].astype(np.int64),
        step=steps + step0,
        prefill=steps == 0,
        sequence=np.full(num, seq, dtype=np.int64),
    )


def capture_model(path: str | Path, prompts: Sequence[str], max_new_tokens: int = 32) -> Captured:
    """``capture`` on the checkpoint at ``path``, loaded by transformers with every expert resident."""
    model, tokenizer = load_for_capture(path)
    return capture(model, tokenizer, prompts, max_new_tokens)


def load_for_capture(path: str | Path):
    """The reference model (eager experts, all resident, CPU) and its tokenizer, one-line errors."""
    from expertcache.engine.loader import load_reference
    from expertcache.engine.offloaded import load_tokenizer

    tokenizer = load_tokenizer(path)  # before the model: a folder without one is refused at once
    return load_reference(path), tokenizer
