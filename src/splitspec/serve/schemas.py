"""OpenAI request schemas (pydantic) and the response objects and stream chunks we send back.

Unknown request fields are ignored with one debug line, as vLLM does. Fields that would change
the output but are not honoured (:data:`REFUSED`) accept only their neutral value: anything else
is a 400 naming the parameter, never a silent ignore.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 64  # OpenAI allows 4, vLLM any number; lm-eval sends a task's whole list (humaneval: 6)
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key: no vocabulary has 10^10 tokens
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (chat top_logprobs, completions logprobs)
MAX_CHOICES = 128  # OpenAI's limit on n
MAX_BAD_WORDS = 128  # vLLM's limit on bad_words (MAX_NUM_BAD_WORDS)

# vLLM's older names for the constraints of structured_outputs (before 0.10.2), read as that
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "guided_whitespace_pattern": "whitespace_pattern"}  # fmt: skip

# fields clients send that we know but do not implement, with the value that changes nothing (a field an endpoint
# declares is never refused there)
REFUSED: dict[str, object] = {
    "functions": None,  # the legacy form of tools
    "function_call": None,
    "prediction": None,
    "audio": None,
    "length_penalty": 1.0,
    "use_beam_search": False,
}


class _Part(BaseModel):
    """Nested objects: unknown keys are dropped (clients echo back fields like ``refusal``)."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Part):
    include_usage: bool | None = False  # one last chunk with the usage and no choices
    continuous_usage_stats: bool | None = False  # vLLM: the running usage on every chunk


class TextPart(_Part):
    type: Literal["text"]
    text: str


class FunctionCall(_Part):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Part):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Part):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDef(_Part):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Part):
    name: str = Field(default="response", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(_Part):
    type: Literal["text"]


class JsonObjectFormat(_Part):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Part):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (its current name for guided decoding): exactly one constraint.

    Compiled as vLLM's ``guidance`` backend compiles it (:mod:`splitspec.serve.structured`). Keys that are not
    vLLM's are a 400, and so are the options that would change the output but are not honoured."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None  # Lark or GBNF
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False
    disable_any_whitespace: bool = False  # JSON never has free whitespace here (laid out as json.dumps writes it)
    disable_fallback: bool = False  # one backend, llguidance: nothing to fall back to

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        for key in ("structural_tag", "whitespace_pattern"):
            if getattr(self, key) is not None:
                raise ValueError(f"unsupported: its {key} is not supported")
        if self.disable_additional_properties:
            raise ValueError("unsupported: its disable_additional_properties is not supported")
        kinds = self.kinds()
        if len(kinds) != 1:
            got = ", ".join(kinds) or "none"
            raise ValueError(f"exactly one of json, regex, choice, grammar and json_object is needed, got {got}")
        return self

    def kinds(self) -> list[str]:
        """The constraints sent."""
        sent = {"json": self.json_ is not None, "regex": self.regex is not None, "choice": self.choice is not None,
                "grammar": self.grammar is not None, "json_object": bool(self.json_object)}  # fmt: skip
        return [k for k, on in sent.items() if on]


class GenerationRequest(BaseModel):
    """Fields shared by both completion endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # None: the served model (vLLM's rule; OpenAI requires it)
    # None (not sent): the server's default, OpenAI's T = 1 and top_p 1 unless the checkpoint publishes others
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extension; 0 or -1 keeps every token
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's extension; 0 keeps every token
    # vLLM's extension (transformers'): seen tokens' logits divided by it where positive, times it otherwise; 1: off
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # a 64-bit integer, as vLLM and torch take
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension: more tokens that end the reply
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    user: str | None = None  # an end-user id; logged, as OpenAI does not act on it either
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM's extension: go on past end-of-sequence tokens
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extension: no stop token before this many
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension: response_format's kin
    allowed_token_ids: list[int] | None = None  # vLLM's extension: every other token is banned
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)  # vLLM's: words never generated
    include_stop_str_in_output: bool = False  # vLLM's extension: the stop string that ends the text stays in it
    skip_special_tokens: bool = True  # vLLM's extension: false shows special tokens' text (the stop token's never)
    # vLLM's extension: each prompt token's logprob and rank, with this many alternatives (not with stream)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's extension: keep the prompt's last k tokens (-1: as many as the model's positions)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    @model_validator(mode="before")
    @classmethod
    def _guided(cls, data: Any) -> Any:
        """vLLM's older ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar`` as the
        ``structured_outputs`` they became (``guided_decoding_backend`` chose an engine: ignored, one is here)."""
        if not isinstance(data, dict):
            return data
        sent = {key: data[key] for key in GUIDED if data.get(key) is not None}
        if not sent:
            return data
        if data.get("structured_outputs") is not None:
            raise ValueError("send structured_outputs or vLLM's older guided_* fields, not both")
        rest = {key: value for key, value in data.items() if key not in GUIDED}
        return {**rest, "structured_outputs": {GUIDED[key]: value for key, value in sent.items()}}

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            # "²" is a digit to str.isdigit, and not to int(); and int() refuses over 4,300 digits (a 500 before)
            if not (key.isascii() and key.isdigit()) or len(key) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"keys must be token ids, got {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's positions) or a number of tokens")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true (vLLM's rule)")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value: list[str] | None) -> list[str] | None:
        if any(not word.strip() for word in value or ()):
            raise ValueError("bad words must not be empty or only spaces")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not value:
            raise ValueError("allowed_token_ids must not be empty")  # vLLM's rule
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage or self.continuous_usage))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def refused_field(self) -> str | None:
        """The first field sent with a value that would change the output but is not honoured."""
        extra = self.model_extra or {}
        return next((k for k, neutral in REFUSED.items() if extra.get(k, neutral) not in (neutral, None)), None)

    def log_unknown_fields(self) -> None:
        unknown = sorted(set(self.model_extra or {}) - set(REFUSED))
        if unknown:
            log.debug("ignoring unknown request fields: %s", ", ".join(unknown))


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # vLLM's extensions, for the chat template
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (Qwen3's enable_thinking)
    echo: bool = False  # vLLM's: the reply starts with the last message's content when that has the reply's role

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, value: bool, info: ValidationInfo) -> bool:
        return _continue_final(value, info)

    def echoed(self) -> str:
        """What vLLM's ``echo`` puts before the reply: the last message's content (text parts joined by newlines)
        when its role is the reply's (the assistant's under ``add_generation_prompt``, else the last message's own,
        as vLLM names it), else nothing."""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        if not self.echo or last.role != role or last.content is None:
            return ""
        return last.content if isinstance(last.content, str) else "\n".join(p.text for p in last.content)

    def logprob_alternatives(self) -> int | None:
        """Alternatives per generated token when logprobs are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for this endpoint; 0 with echo
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: str | list[str] | list[int] | list[list[int]]) -> Any:
        if isinstance(value, list) and (not value or any(isinstance(v, list) and not v for v in value)):
            raise ValueError("a prompt must hold at least one token")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("unsupported: only best_of=1 is supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("unsupported: suffix (insertion) is not supported")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one choice group each, in order: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(v, int) for v in p):
            return [[int(v) for v in p]]  # type: ignore[arg-type]  # one token-id prompt
        return [v if isinstance(v, str) else [int(t) for t in v] for v in p]  # type: ignore[union-attr]

    def token_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tools: list[Tool] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, value: bool, info: ValidationInfo) -> bool:
        return _continue_final(value, info)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


def _continue_final(value: bool, info: ValidationInfo) -> bool:
    """vLLM's rule: a final message left open takes no assistant cue after it."""
    if value and info.data.get("add_generation_prompt", True):
        raise ValueError("continue_final_message needs add_generation_prompt: false")
    return value


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


# -- responses -----------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls"]


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


def envelope(
    rid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]], use: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The envelope every completion object and stream chunk shares; ``usage`` only when given."""
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if use is not None:
        body["usage"] = use
    return body


def tool_call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One entry of ``message.tool_calls``: ``arguments`` is the JSON text of the arguments."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_choice(
    index: int,
    content: str | None,
    finish: FinishReason,
    tool_calls: list[dict[str, Any]] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def text_choice(
    index: int, text: str, finish: FinishReason | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_delta(
    index: int, delta: dict[str, Any], finish: FinishReason | None = None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def model_card(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's ``max_model_len`` (prompt + completion tokens), which clients read for the
    context they may fill."""
    return {"id": name, "object": "model", "created": created, "owned_by": "splitspec", "max_model_len": max_model_len}
