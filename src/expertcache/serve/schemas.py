"""The OpenAI requests the server takes, validated by pydantic: a bad field is a 400 naming it.

Fields OpenAI clients send that change nothing here (``user``, ``stream_options``) are taken; fields whose
meaning the server does not implement (``n`` > 1, ``logprobs``, penalties other than 0, ``best_of``,
``suffix``, tools) are refused rather than ignored. ``temperature`` defaults to 0: greedy, the full
model's tokens (OpenAI's own default is 1; pass it to sample).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP = 4  # as OpenAI


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"at most {MAX_STOP} non-empty stop strings")
        return stops

    @model_validator(mode="after")
    def _no_unsupported(self):
        unsupported = {"logprobs", "top_logprobs", "best_of", "suffix", "tools", "functions", "logit_bias"}
        given = sorted(
            k for k, v in (self.model_extra or {}).items() if k in unsupported and v not in (None, False)
        )
        if given:
            raise ValueError(f"not supported by this server: {', '.join(given)}")
        return self

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(Sampling):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        prompts = [v] if isinstance(v, str) else v
        if len(prompts) != 1 or not prompts[0]:
            raise ValueError("one non-empty prompt per request")
        return prompts[0]


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = [p.get("text") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content) or not all(isinstance(t, str) for t in parts):
            raise ValueError('message content parts must be text parts ({"type": "text", "text": ...})')
        return "".join(parts)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
