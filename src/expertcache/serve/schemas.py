"""The OpenAI requests the server takes, validated by pydantic: a bad field is a 400 naming it.

Nothing is ignored in silence. A field this server implements is checked; ``user`` and ``stream_options``
change nothing here but the usage chunk and are taken (``stream_options`` with ``stream: true`` only, as
OpenAI); a field of OpenAI's (or vLLM's) API whose meaning the server does not implement (``n`` > 1,
``logprobs``, ``best_of``, ``suffix``, tools and function calls, ``response_format``, ``logit_bias``,
penalties, ``min_tokens``, ``ignore_eos``, ``store``) is refused unless it has the value that asks for
nothing (``false``, ``0``, ``1`` for ``n``, ``"none"``, a text response format, a repetition penalty of
1); and a field nobody defined is refused, in ``stream_options`` and content parts too; ``best_of``,
``suffix`` and ``echo`` are completions' fields, unknown to chat, whose ``logprobs`` is a switch
(``false`` asks for nothing). ``null`` is the field left out (the openai client sends it for ``None``).
Stop strings have at most 1000 characters. Text must be valid Unicode (a lone surrogate such as
``"\\ud800"`` is refused, not handed to the tokenizer). ``temperature`` defaults to 0: greedy, the full
model's tokens (OpenAI's own default is 1; pass it to sample); below ``GREEDY_BELOW`` (1e-5) it is greedy
too; ``top_p`` 0 keeps the most likely token alone. ``seed`` is OpenAI's signed 64-bit integer. The
``developer`` role is OpenAI's current name for ``system``; a message's text parts are joined as they
are, nothing between them (vLLM puts a newline between): give the spaces or newlines you mean.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_STOP = 4  # as OpenAI
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (1e-45 would overflow the logits to inf)
MAX_STOP_CHARS = 1000  # a stop string's characters at most (each is matched as the text grows)
# fields of OpenAI's or vLLM's API this server does not implement, with the values that ask for nothing
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "n": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "store": (None, False),  # nothing is stored here: storing is refused, not storing taken
}
COMPLETIONS_ONLY = ("best_of", "suffix")  # OpenAI's completions fields that chat does not define


def _unicode(text: str) -> str:
    """Text that encodes as UTF-8: JSON lets a lone surrogate (``"\\ud800"``) through, tokenizers do not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise ValueError(
            f"not valid Unicode text: a lone surrogate (\\u{ord(bad):04x}) at {exc.start}"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: Text
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """``"temperature": null`` is what the openai client sends for ``temperature=None``: the default."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("an empty stop string would stop before the first token; leave it out")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return [_unicode(s) for s in stops]

    unsupported: ClassVar[dict[str, tuple]] = UNSUPPORTED

    @model_validator(mode="after")
    def _sampling_needs_a_temperature(self):
        """top_p below 1 or a top_k on a greedy request (no temperature, or one below ``GREEDY_BELOW``)
        would be ignored: refused, naming the field, as the command line refuses --top-p without
        --temperature (``seed`` is taken: a greedy answer is the same under every seed)."""
        if self.temperature < GREEDY_BELOW:
            given = [f for f in ("top_p", "top_k") if f in self.model_fields_set and getattr(self, f) != 1.0]
            if given:
                raise PydanticCustomError(
                    "greedy_sampling",
                    "is for sampling, and this request is greedy (temperature {temperature}; 0 is this "
                    "server's default): give a temperature above 0 too, or leave it out",
                    {"fields": given[0], "temperature": self.temperature},
                )
        return self

    @model_validator(mode="after")
    def _usage_with_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "stream_options_without_stream",
                "is for streaming: give stream true too, or leave it out (a whole answer carries its usage)",
                {"fields": "stream_options"},
            )
        return self

    @model_validator(mode="after")
    def _no_unsupported(self):
        extra = self.model_extra or {}
        table = self.unsupported
        unknown = sorted(k for k in extra if k not in table)
        if unknown:  # the fields named as the error's param (``serve.app``), as a field's own error is
            raise PydanticCustomError(
                "unknown_field", "not a field this server takes", {"fields": ", ".join(unknown)}
            )
        given = sorted(k for k, v in extra.items() if not _asks_nothing(v, table[k]))
        if given:
            raise PydanticCustomError(
                "unsupported_field", "not supported by this server", {"fields": ", ".join(given)}
            )
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _asks_nothing(value, defaults: tuple) -> bool:
    return value is None or any(value == d and type(value) is type(d) for d in defaults)


class CompletionRequest(Sampling):
    prompt: Text | list[Text]
    echo: bool = False
    # completions' ``logprobs`` is a count of alternatives, and 0 still asks for the chosen token's
    unsupported: ClassVar[dict[str, tuple]] = {**UNSUPPORTED, "logprobs": (None,)}

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        prompts = [v] if isinstance(v, str) else v
        if len(prompts) != 1 or not prompts[0]:
            raise ValueError("one non-empty prompt per request")
        return prompts[0]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[dict]
    name: Text | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        """Content parts are text parts, joined: the error names ``messages.N.content`` (the part's
        index too), as OpenAI's ``param`` would."""
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError('no content parts: give the text, or text parts ({"type": "text", "text": ...})')
        for i, part in enumerate(v):
            text = part.get("text")
            kind = part.get("type")
            if kind != "text":
                what = f"of type {kind!r}" if isinstance(kind, str) else "without a type"
            elif part.keys() != {"type", "text"}:
                what = f"a text part with other keys ({', '.join(sorted(set(part) - {'type', 'text'}))})"
            elif not isinstance(text, str):
                what = "a text part whose text is not a string"
            else:
                continue
            raise ValueError(
                f'part {i} is {what}: this server takes text parts ({{"type": "text", "text": ...}}, '
                "no other keys)"
            )
        return "".join(_unicode(p["text"]) for p in v)

    @field_validator("name")
    @classmethod
    def _no_name(cls, v):
        if v is not None:
            raise ValueError("not supported by this server (the chat template has no speaker names)")
        return v

    @property
    def template_role(self) -> str:
        """The role the chat template knows: ``developer`` is OpenAI's newer name for ``system``."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        return self.content  # text parts are joined when the request is read


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False  # chat's is a switch, a boolean (completions' a count)
    unsupported: ClassVar[dict[str, tuple]] = {
        k: v for k, v in UNSUPPORTED.items() if k not in (*COMPLETIONS_ONLY, "logprobs")
    }

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("not supported by this server")
        return v

    @model_validator(mode="after")
    def _one_limit(self):
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise PydanticCustomError(
                "two_limits",
                "differs from max_tokens ({max_tokens}): give one of them",
                {"fields": "max_completion_tokens", "max_tokens": self.max_tokens},
            )
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
