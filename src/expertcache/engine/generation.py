"""One generate() call's result, and the timing of a transformers-style generate: TTFT, TPOT, tokens/s."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Generation:
    """One generate() call: tokens, text, timings and the cache's work during it."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    total_s: float
    stats: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.tokens),
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "tokens_per_s": self.tokens_per_s,
            "total_s": self.total_s,
            **self.stats,
        }


class TokenTimer:
    """A generate() streamer that timestamps every new token (``times``), forwarding to another one."""

    def __init__(self, inner=None) -> None:
        self.inner, self.times, self._prompt_seen = inner, [], False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


def timed_generate(generate, ids: torch.Tensor, streamer=None, **kwargs) -> dict[str, object]:
    """Run ``generate(ids, streamer=..., **kwargs)`` (a transformers-style generate) and time it:
    the new tokens of row 0, TTFT (start to first new token), TPOT (mean gap between new tokens),
    tokens per second over the whole call."""
    timer = TokenTimer(streamer)
    start = time.perf_counter()
    out = generate(ids, streamer=timer, **kwargs)
    total = time.perf_counter() - start
    new = out[0, ids.shape[1] :].tolist()
    times = timer.times
    return {
        "tokens": new,
        "prompt_tokens": int(ids.shape[1]),
        "new_tokens": len(new),
        "ttft_s": (times[0] - start) if times else total,
        "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0,
        "tokens_per_s": len(new) / total if total > 0 else 0.0,
        "total_s": total,
    }
