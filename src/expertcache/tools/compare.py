"""Greedy runs of a model and how they differ from another run (the engine against transformers' eager).

``greedy`` generates exactly ``new`` tokens and keeps every step's logits, on the CPU; ``compare``
says whether two such runs chose the same tokens, where they first differ, and how far their logits
are apart. The self-test and the engine tests compare the engine with ``engine.loader.load_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEW = 6  # new tokens per greedy run

Run = tuple[torch.Tensor, torch.Tensor]  # (sequences [B, P + N], logits [N, B, V]) on the CPU


def greedy(model, ids: torch.Tensor, mask: torch.Tensor | None = None, new: int = NEW) -> Run:
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


def prompt_ids(*prompts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch of prompts (pad id 0) and its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@dataclass(frozen=True)
class Comparison:
    """How a run differs from the one it should equal."""

    tokens_equal: bool
    first_diff: tuple[int, int] | None  # (row, new-token position) of the first differing token
    max_dlogit: float  # largest |logit difference| over every step, row and vocabulary entry

    def within(self, atol: float | None) -> bool:
        """Tokens equal, and logits within ``atol`` (0: bit-equal; None: logits not compared)."""
        return self.tokens_equal and (atol is None or self.max_dlogit <= atol)


def compare(got: Run, want: Run) -> Comparison:
    """Tokens and logits of ``got`` against ``want`` (runs of ``greedy`` on the same prompt)."""
    seq, logits = got
    ref_seq, ref_logits = want
    if seq.shape != ref_seq.shape or logits.shape != ref_logits.shape:
        return Comparison(False, (0, 0), float("inf"))
    prompt = seq.shape[1] - logits.shape[0]
    differ = (seq[:, prompt:] != ref_seq[:, prompt:]).nonzero()  # [D, 2] (row, position)
    first = None
    if len(differ):
        row, pos = min(differ.tolist(), key=lambda rp: (rp[1], rp[0]))  # earliest position first
        first = (int(row), int(pos))
    dlogit = float((logits.double() - ref_logits.double()).abs().max()) if logits.numel() else 0.0
    return Comparison(first is None, first, dlogit)
