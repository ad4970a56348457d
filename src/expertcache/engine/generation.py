"""Text in, text out: prompts (plain or chat) in left-padded batches, greedy or sampled, stop strings,
and the timing of a transformers-style generate (TTFT, TPOT, tokens/s).

A prompt is text, or with ``chat`` a conversation (a list of ``{"role", "content"}`` messages; text is
one user message) rendered by the tokenizer's chat template. A batch is padded on the left, so every
row's new tokens start at the same position (right padding would put pad tokens between a prompt and
its continuation). Greedy is the default and gives the reference model's tokens.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria

from expertcache.config import SamplingConfig
from expertcache.errors import ExpertcacheError, did_you_mean, first_line

Prompt = str | list[dict[str, str]]
ROLES = ("system", "user", "assistant")


@dataclass
class Generation:
    """One prompt's result: tokens, text, why it ended, timings and the cache's work during its batch."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    total_s: float
    stats: dict[str, object] = field(default_factory=dict)
    finish_reason: str = "length"  # "eos", "stop" (a stop string) or "length" (max_new_tokens)
    seed: int | None = None  # the sampling seed (None: greedy)
    batch_size: int = 1  # prompts generated together; timings and stats are the batch's

    def __repr__(self) -> str:
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        hits, misses = self.stats.get("hits", 0), self.stats.get("misses", 0)
        # a batch's timings and counts are the batch's, each of its prompts the same: said (a trial)
        shared = f" (the batch of {self.batch_size}'s)" if self.batch_size > 1 else ""
        return (
            f"<Generation {text!r}: {len(self.tokens)} tokens ({self.finish_reason}), "
            f"TTFT {self.ttft_s * 1e3:.1f} ms, TPOT {self.tpot_s * 1e3:.1f} ms, {hits} hits, {misses} misses"
            f"{shared}>"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.tokens),
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s if len(self.tokens) > 1 else None,  # no decode step: none to time, not 0
            "tokens_per_s": self.tokens_per_s,
            "total_s": self.total_s,
            "seed": self.seed,
            "batch_size": self.batch_size,
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
    tokens per second over the whole call (row 0's), and the whole ``output`` (all rows)."""
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
        "output": out,
    }


# ------------------------------------------------------------------------------------ prompts
# ``generate_text``'s own arguments and the ones it sets: not passed through
_OWN = {"input_ids", "inputs", "attention_mask", "max_new_tokens", "pad_token_id", "streamer"}
# transformers' sampling settings, and SamplingConfig's stop strings and seed: ``SamplingConfig``'s
# (``generate_text(sampling=...)``), which sets them; given by name, each is said to go there
_SAMPLING = {"do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "stop", "seed"}
# transformers' settings that change what ``generate`` returns (not one text a prompt) or its length
# (``max_new_tokens`` is the length): each a refusal, with what to use instead
_FOR_GENERATE = "use generate() on the model (transformers' own generate) for that"
_NOT_HERE = {
    "num_beams": f"generate_text decodes one sequence a prompt, not beam search; {_FOR_GENERATE}",
    "num_beam_groups": f"generate_text does not run beam search; {_FOR_GENERATE}",
    "num_return_sequences": f"generate_text returns one result a prompt; {_FOR_GENERATE}",
    "return_dict_in_generate": f"generate_text returns its own results (text, timing); {_FOR_GENERATE}",
    "output_scores": f"generate_text returns no scores; {_FOR_GENERATE}",
    "output_logits": f"generate_text returns no logits; {_FOR_GENERATE}",
    "output_attentions": f"generate_text returns no attentions; {_FOR_GENERATE}",
    "output_hidden_states": f"generate_text returns no hidden states; {_FOR_GENERATE}",
    "max_length": "generate_text's length is max_new_tokens (new tokens, not counting the prompt)",
    "min_length": "generate_text counts new tokens: give min_new_tokens",
}
_HARMLESS = {"num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1}  # values that change nothing


def check_streamer(streamer: object) -> None:
    """A streamer transformers can call (``put`` and ``end``), or one line: another object failed deep in
    the first step (a new user's trial)."""
    if streamer is not None and not (
        callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))
    ):
        raise ExpertcacheError(
            f"streamer must be a transformers streamer (put() and end(): TextStreamer), got "
            f"{type(streamer).__name__}"
        )


def check_generate_kwargs(kwargs: dict[str, object], model) -> None:
    """Keyword arguments for transformers' ``generate``: its own parameters, its generation settings
    (``GenerationConfig``'s fields) and the model's forward arguments; anything else (a misspelt name) is
    one error naming it and the nearest known names, before any work."""
    if not kwargs:
        return
    import inspect

    from transformers import GenerationConfig
    from transformers.generation.utils import GenerationMixin

    known = set(GenerationConfig().to_dict()) | set(inspect.signature(GenerationMixin.generate).parameters)
    known |= set(inspect.signature(model.forward).parameters)
    known -= {"self", "kwargs", "args"}
    for name in kwargs:
        if name in _SAMPLING:
            field = "temperature" if name == "do_sample" else name
            raise ExpertcacheError(
                f"{name} is a sampling setting: give sampling=SamplingConfig({field}=...) (from "
                "expertcache.config; greedy by default), which also seeds the run and reports the seed"
            )
        if name in _OWN:
            raise ExpertcacheError(f"generate_text sets {name} itself; leave it out")
        if name in _NOT_HERE and kwargs[name] not in (None, False, _HARMLESS.get(name)):
            raise ExpertcacheError(f"{name}={kwargs[name]!r}: {_NOT_HERE[name]}")
        if name not in known:
            hint = did_you_mean(name, (known | {"max_new_tokens"}) - _SAMPLING)  # (those are said above)
            raise ExpertcacheError(
                f"generate_text got an unknown argument {name!r}{hint}: it takes transformers' generation "
                "settings"
            )
        value = kwargs[name]
        # values transformers takes without a look and fails on deep in a step (a new user's trial)
        if name.endswith("token_id") and value is not None:
            ids = value if isinstance(value, list | tuple) else [value]
            if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise ExpertcacheError(f"{name} must be a token id (a whole number >= 0) or a list of them, "
                                       f"got {value!r}")  # fmt: skip


def render(tokenizer, prompt: Prompt, chat: bool, where: str = "the prompt") -> str:
    """The text the model sees: the prompt, or with ``chat`` the conversation through the template."""
    if not chat:
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            raise ExpertcacheError(f"{where} is a conversation (a list of messages): it needs chat mode")
        if not isinstance(prompt, str):  # None, token ids, a number: not a conversation either
            raise ExpertcacheError(f"{where} must be text, got {type(prompt).__name__} {prompt!r:.40}")
        if not prompt:
            raise ExpertcacheError(f"{where} is empty")
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    check_messages(messages, where)
    if not getattr(tokenizer, "chat_template", None):
        raise ExpertcacheError(
            f"{tokenizer.name_or_path}: the tokenizer has no chat template; drop chat mode (--chat) or "
            "give a template (--chat-template FILE.jinja)"
        )
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:
        raise ExpertcacheError(f"the chat template does not render: {first_line(exc)}") from None


def check_messages(messages: object, where: str = "the conversation") -> None:
    if not isinstance(messages, list) or not messages:
        raise ExpertcacheError(f"{where} must be a non-empty list of messages")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ExpertcacheError(
                f'{where}: each message is {{"role": one of {", ".join(ROLES)}, "content": text}}, got {m!r}'
            )


def encode(tokenizer, texts: Sequence[str], chat: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask ``[B, P]``, padded on the left. A chat template writes its own
    special tokens; plain text gets the tokenizer's (the embedded model's ``<|endoftext|>`` in front)."""
    if len(texts) > 1 and tokenizer.pad_token_id is None:
        raise ExpertcacheError(
            f"{tokenizer.name_or_path}: the tokenizer has no pad or eos token to batch with"
        )
    tokenizer.padding_side = "left"
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=not chat)
    if enc.input_ids.shape[1] == 0:
        raise ExpertcacheError("the prompt has no tokens")
    return enc.input_ids, enc.attention_mask


# ------------------------------------------------------------------------------------ decoding
def sampling_kwargs(sampling: SamplingConfig, tokenizer) -> tuple[dict[str, object], int | None]:
    """``generate`` keyword arguments for ``sampling``, and the seed (drawn when sampling without one).
    Cut-offs not given are off (``top_p`` 1, ``top_k`` 0), not the checkpoint's defaults."""
    kw: dict[str, object] = {"do_sample": not sampling.greedy}
    seed = None
    if not sampling.greedy:
        seed = sampling.seed if sampling.seed is not None else secrets.randbelow(2**31)
        kw.update(
            temperature=float(sampling.temperature), top_p=sampling.top_p or 1.0, top_k=sampling.top_k or 0
        )
    if sampling.repetition_penalty is not None:
        kw["repetition_penalty"] = float(sampling.repetition_penalty)
    return kw, seed


class StopOnText(StoppingCriteria):
    """A generate() stopping criterion: a row is done when its new text (never the prompt's) holds a stop
    string. transformers' own ``stop_strings`` also match across the prompt's end, which would stop a
    row before it wrote anything of the stop string."""

    def __init__(self, tokenizer, stop: Sequence[str], prompt_width: int) -> None:
        self.tokenizer, self.stop, self.width = tokenizer, tuple(stop), prompt_width
        self.tail = max(len(s) for s in stop) + 2  # tokens enough to hold any stop string whole

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new = input_ids[:, self.width :]
        done = [
            any(s in self.tokenizer.decode(row[-self.tail :], skip_special_tokens=True) for s in self.stop)
            for row in new.tolist()
        ]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def finish(tokens: list[int], decode: Callable[[list[int]], str], eos: set[int], stop: Sequence[str]):
    """A row's new tokens cut where it ended (its first eos, kept; or the token that completed a stop
    string, whose text is cut before the stop string), its text, and why it ended."""
    reason = "length"
    for i, t in enumerate(tokens):
        if t in eos:
            tokens, reason = tokens[: i + 1], "eos"
            break
    text = decode(tokens)
    hits = [(text.find(s), s) for s in stop if s in text]
    if hits:
        at = min(hits)[0]
        for k in range(1, len(tokens) + 1):  # the shortest prefix holding a stop string (decode is cheap)
            piece = decode(tokens[:k])
            if any(s in piece for s in stop):
                tokens = tokens[:k]
                break
        text, reason = text[:at], "stop"
    return tokens, text, reason


class StopFinder:
    """Stop strings found in a text as it grows, each new character looked at once per stop string
    (Knuth-Morris-Pratt): the cost of a step does not grow with the text or the stop strings' length.
    ``feed`` the whole text so far; it answers where the first stop string found begins (None: none
    yet), and how many characters at the end could still begin one (a stream holds them back)."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.fail = [_failure(s) for s in self.stop]
        self.state = [0] * len(self.stop)  # the longest prefix of each stop string the text ends with
        self.pos = 0

    def feed(self, text: str) -> tuple[int | None, int]:
        found = None
        for i in range(self.pos, len(text)):
            c = text[i]
            for k, s in enumerate(self.stop):
                q, fail = self.state[k], self.fail[k]
                while q and s[q] != c:
                    q = fail[q - 1]
                if s[q] == c:
                    q += 1
                if q == len(s):
                    start = i + 1 - q
                    found = start if found is None else min(found, start)
                    q = fail[q - 1]
                self.state[k] = q
        self.pos = len(text)
        return found, max(self.state, default=0)


def _failure(s: str) -> list[int]:
    """KMP's table: for each prefix of ``s``, the length of its longest proper prefix that is a suffix."""
    fail, q = [0] * len(s), 0
    for i in range(1, len(s)):
        while q and s[i] != s[q]:
            q = fail[q - 1]
        if s[i] == s[q]:
            q += 1
        fail[i] = q
    return fail


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string (a stream holds
    them back until the next piece says): the definition ``StopFinder`` computes as the text grows."""
    return max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def eos_ids(model, tokenizer) -> set[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    return set(ids if isinstance(ids, list) else [] if ids is None else [ids])
