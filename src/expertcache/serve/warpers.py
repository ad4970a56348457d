"""transformers' per-request top-k and top-p for continuous batching, with the same results and without
sorting every row's whole vocabulary twice at every step.

transformers' ``ContinuousBatchingTopKLogitsWarper`` sorts each row of the step's scores ``[B, V]``
(descending) to read its k-th largest score, whatever k is; ``ContinuousBatchingTopPLogitsWarper`` sorts
them again (ascending) for the cumulative probabilities. The server asks every request for both (a
greedy one with ``top_k=1, top_p=1``), so under 16 streaming clients the two sorts took about a fifth of
the generation thread (``py-spy``, docs/BENCHMARKS.md). ``install`` wraps both in place:

- **top-k**: a row whose k keeps the whole vocabulary is left as it is (the sort's threshold is then
  the row's least score, and nothing is below it); the others take their k-th largest score from
  ``torch.topk`` over the rows that need it (the same number a descending sort puts at k - 1, ties
  included), and mask what is below it as transformers does.
- **top-p**: a row whose top-p is 1 and whose top-k was 1 is left as it is: after top-k only its
  largest scores are finite, each with a probability above 0, and top-p at 1 masks only the tokens of
  probability 0, which are already ``-inf``. Every other row goes through transformers' own code.

Both give bit-identical scores for every row (``tests/test_serve.py`` checks them against
transformers' on rows of every kind); the top-p wrapper reads the k of the top-k call made just before
it in the same step, and where there was none (another order of processors) runs transformers' code on
every row.
"""

from __future__ import annotations

import torch


class _Wrapped:
    """A per-request processor around transformers' own: the same arguments, another ``__call__``."""

    def __init__(self, inner, seen: dict) -> None:
        self.inner, self.seen = inner, seen
        self.supported_kwargs, self.ignored_kwargs = inner.supported_kwargs, inner.ignored_kwargs

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        self.inner.fill_defaults(int32_tensor)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        return self.inner.prepare_tensor_args(requests_with_new_token)


class TopK(_Wrapped):
    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        k = tensor_arg[: scores.size(0)].clamp(max=scores.size(-1))  # [B], as transformers clamps it
        self.seen["top_k"] = k
        rows = torch.nonzero(k < scores.size(-1)).flatten()
        if rows.numel() == 0:
            return scores
        picked = scores if rows.numel() == scores.size(0) else scores[rows]
        ks = k[rows].to(torch.int64)
        top = torch.topk(picked, int(ks.max()), dim=-1).values  # [R, max k], descending
        thresholds = top.gather(-1, (ks - 1).unsqueeze(-1))  # [R, 1]: each row's k-th largest
        masked = picked.masked_fill(picked < thresholds, self.inner.filter_value)
        if rows.numel() == scores.size(0):
            return masked
        out = scores.clone()
        out[rows] = masked
        return out


class TopP(_Wrapped):
    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        k = self.seen.pop("top_k", None)
        args = tensor_arg[: scores.size(0)]
        if k is None or k.size(0) != scores.size(0):  # no top-k just before: transformers' own on all
            return self.inner(scores, args)
        unchanged = (args.view(torch.float32) >= 1.0) & (k == 1)
        rows = torch.nonzero(~unchanged).flatten()
        if rows.numel() == scores.size(0):
            return self.inner(scores, args)
        if rows.numel() == 0:
            return scores
        out = scores.clone()
        out[rows] = self.inner(scores[rows], args[rows])
        return out


def install(manager) -> int:
    """Wrap the top-k and top-p processors of ``manager`` (before ``manager.start()``); how many."""
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingTopKLogitsWarper,
        ContinuousBatchingTopPLogitsWarper,
    )

    ContinuousBatchingLogitsProcessor.register(_Wrapped)  # an ABC: a virtual subclass
    processors = manager.logit_processor.logits_processor
    seen: dict = {}
    wrapped = 0
    for i, processor in enumerate(processors):
        if type(processor) is ContinuousBatchingTopKLogitsWarper:
            processors[i] = TopK(processor, seen)
            wrapped += 1
        elif type(processor) is ContinuousBatchingTopPLogitsWarper:
            processors[i] = TopP(processor, seen)
            wrapped += 1
    return wrapped
