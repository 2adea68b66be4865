"""OpenAI request schemas (pydantic) and the response objects and stream chunks we send back.

Requests forbid unknown fields, and fields we know but do not implement accept only their
neutral value: anything else is a 400 naming the parameter, never a silent ignore.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4  # OpenAI's limit


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False  # one last chunk with the usage and no choices


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Generation(_Strict):
    """Fields shared by both completion endpoints."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default: sampling at T = 1
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # an end-user id; accepted and logged, as OpenAI does not act on it either
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("unsupported: only n=1 is supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("unsupported: penalties would change the model's law; only 0 is supported")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("unsupported: logit_bias is not supported")
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool) -> bool:
        if value:
            raise ValueError("unsupported: logprobs are not supported")
        return value

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int = 1
    suffix: str | None = None
    logprobs: int | None = None
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
        if isinstance(value, str):
            return value
        if all(isinstance(v, int) for v in value):
            if not value:
                raise ValueError("the prompt must hold at least one token")
            return [int(v) for v in value]  # type: ignore[arg-type]
        raise ValueError("unsupported: batched prompts (a list of prompts) are not supported; send one")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("unsupported: echo is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int) -> int:
        if value != 1:
            raise ValueError("unsupported: only best_of=1 is supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("unsupported: suffix (insertion) is not supported")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("unsupported: logprobs are not supported")
        return value

    def token_limit(self) -> int | None:
        return self.max_tokens


# -- responses -----------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` counts prompt tokens reused from a kept session."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _response(
    rid: str,
    obj: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    use: dict[str, Any] | None,
    with_usage: bool,
) -> dict[str, Any]:
    """The envelope every completion object and stream chunk shares."""
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if with_usage:
        body["usage"] = use
    return body


def chat_completion(
    rid: str, created: int, model: str, content: str, finish: FinishReason, use: dict[str, Any]
) -> dict[str, Any]:
    message = {"role": "assistant", "content": content}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    return _response(rid, "chat.completion", created, model, [choice], use, True)


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, str] | None,
    finish: FinishReason | None = None,
    use: dict[str, Any] | None = None,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` is the usage-only chunk (no choices)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return _response(rid, "chat.completion.chunk", created, model, choices, use, with_usage_field)


def text_completion(
    rid: str,
    created: int,
    model: str,
    text: str | None,
    finish: FinishReason | None,
    use: dict[str, Any] | None,
    with_usage_field: bool = True,
) -> dict[str, Any]:
    """A ``text_completion`` response or stream chunk; ``text=None`` is the usage-only chunk."""
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    return _response(rid, "text_completion", created, model, choices, use, with_usage_field)


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "splitspec"}
