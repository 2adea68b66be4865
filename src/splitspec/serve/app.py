"""The ASGI app (FastAPI): OpenAI's endpoints, ``/health`` and ``/metrics``.

Streaming responses are server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``. Every error, including a malformed body, an unknown route and a wrong key, is
OpenAI's error JSON with the matching status.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from splitspec.chat_template import render
from splitspec.decoding.sampling import SamplingParams
from splitspec.serve import schemas
from splitspec.serve.engine import Generation
from splitspec.serve.errors import ApiError, invalid
from splitspec.serve.schemas import ChatCompletionRequest, CompletionRequest
from splitspec.serve.state import ServeState

log = logging.getLogger(__name__)


def create_app(state: ServeState) -> FastAPI:
    """The app serving ``state``'s model; closes the pooled sessions on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await state.close()

    app = FastAPI(title="splitspec serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    created = schemas.now()
    name = state.config.served_model_name

    def count(request: Request, status: int) -> None:
        state.metrics.requests.labels(request.url.path, str(status)).inc()

    def error_response(request: Request, err: ApiError) -> JSONResponse:
        count(request, err.status)
        if not err.counted:
            state.metrics.errors.labels(err.code or err.type).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(request, ApiError(exc.status_code, str(exc.detail), code=code))

    async def authorize(request: Request) -> None:
        key = state.config.api_key
        if key is None:
            return
        sent = request.headers.get("authorization", "")
        if not secrets.compare_digest(sent.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    def check_model(model: str) -> None:
        if model != name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{name}'.",
                           param="model", code="model_not_found")  # fmt: skip

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, "sessions_active": state.pool.active,
                "sessions_idle": len(state.pool.cache)}  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models(request: Request) -> dict[str, Any]:
        count(request, 200)
        return {"object": "list", "data": [schemas.model_card(name, created)]}

    @app.get("/v1/models/{model_id}", dependencies=[Depends(authorize)])
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        check_model(model_id)
        count(request, 200)
        return schemas.model_card(name, created)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        check_model(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        if not state.templated:
            raise invalid(
                "this model's tokenizer has no chat template: use /v1/completions, or start the server "
                "with --chat-template FILE",
                param="messages",
                code="no_chat_template",
            )
        try:
            prompt_ids = render(state.tokenizer, messages)
        except Exception as exc:  # the template's own Jinja raise_exception (e.g. roles out of order)
            raise invalid(f"the chat template refused these messages: {exc}", param="messages") from None
        return await respond(request, body, prompt_ids, "messages", chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request, body: CompletionRequest) -> Response:
        check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = list(state.tokenizer.encode(body.prompt))
        else:
            prompt_ids = list(body.prompt)
            bad = [t for t in prompt_ids if not 0 <= t < state.vocab_size]
            if bad:
                raise invalid(f"token ids {bad[:5]} are outside the vocabulary (0..{state.vocab_size - 1})", "prompt")
        return await respond(request, body, prompt_ids, "prompt", chat=False)

    async def respond(
        request: Request, body: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int], param: str, chat: bool
    ) -> Response:
        if body.stream_options is not None and not body.stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")
        if body.user:
            log.debug("request for end user %r", body.user)
        max_tokens = token_budget(len(prompt_ids), body.token_limit(), state.max_positions, param)
        params = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed)
        stop_ids = state.chat_stop_ids if chat else state.eos_token_ids
        gen = Generation(state, prompt_ids, max_tokens, params, body.stop_strings(), stop_ids, request.is_disconnected)
        await gen.start()
        rid = schemas.new_id("chatcmpl" if chat else "cmpl")
        now = schemas.now()
        if body.stream:
            count(request, 200)
            events = sse_events(gen, rid, now, name, body.include_usage, chat)
            return GenerationStream(events, gen)
        async with aclosing(gen.deltas()) as deltas:
            content = "".join([d async for d in deltas])
        out = gen.outcome
        use = schemas.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        count(request, 200)
        if chat:
            return JSONResponse(schemas.chat_completion(rid, now, name, content, out.finish_reason, use))
        return JSONResponse(schemas.text_completion(rid, now, name, content, out.finish_reason, use))

    return app


class GenerationStream(StreamingResponse):
    """SSE response that gives its session back however the response ends, even unsent."""

    def __init__(self, events: AsyncIterator[str], gen: Generation) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.generation.close()


def token_budget(prompt_tokens: int, requested: int | None, max_positions: int, param: str) -> int:
    """Tokens the completion may have: as requested, else what the context has left (400 if none)."""
    room = max_positions - prompt_tokens
    if requested is None:
        requested = room
    if requested > room or room < 1:
        raise invalid(
            f"This model's maximum context length is {max_positions} tokens. However, you requested "
            f"{prompt_tokens + max(requested, 1)} tokens ({prompt_tokens} in the {param}, "
            f"{max(requested, 1)} for the completion). Please reduce the length of the {param} or the completion.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def validation_error(exc: RequestValidationError) -> ApiError:
    """A pydantic error as OpenAI's 400, naming the offending parameter."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    kind, msg = first.get("type", ""), str(first.get("msg", "invalid request"))
    if kind == "json_invalid":
        return invalid(f"We could not parse the JSON body of your request: {msg}", code="invalid_json")
    if kind == "extra_forbidden" or "unsupported:" in msg:
        return ApiError(
            400,
            f"Unsupported parameter: '{'.'.join(loc)}' is not supported by splitspec serve"
            + (f" ({msg.split('unsupported:', 1)[1].strip()})." if "unsupported:" in msg else "."),
            param=param,
            code="unsupported_parameter",
        )
    where = ".".join(loc) or "body"
    return invalid(f"Invalid value for '{where}': {msg}", param=param, code="invalid_value")


def _event(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def sse_events(
    gen: Generation, rid: str, created: int, model: str, include_usage: bool, chat: bool
) -> AsyncIterator[str]:
    """The SSE stream of one generation: chunks, the closing chunk, the usage chunk, ``[DONE]``."""

    def chunk(piece: str | None, finish: schemas.FinishReason | None = None, use: dict[str, Any] | None = None) -> str:
        """``piece=None``: the usage-only chunk; with ``finish``: the closing chunk."""
        if chat:
            delta = None if piece is None else ({} if finish else {"content": piece})
            return _event(schemas.chat_chunk(rid, created, model, delta, finish, use, include_usage))
        return _event(schemas.text_completion(rid, created, model, piece, finish, use, include_usage))

    if chat:
        yield _event(
            schemas.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None, None, include_usage)
        )
    try:
        async with aclosing(gen.deltas()) as deltas:
            async for delta in deltas:
                yield chunk(delta)
    except ApiError as err:
        yield _event(err.body())
        yield _event("[DONE]")
        return
    out = gen.outcome
    yield chunk("", out.finish_reason)
    if include_usage:
        yield chunk(None, use=schemas.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens))
    yield _event("[DONE]")
