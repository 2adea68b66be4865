"""The ASGI app (FastAPI): OpenAI's endpoints, vLLM's tokenizer endpoints, ``/health``, ``/metrics``.

Streaming responses are server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``. Every error, including a malformed body, an unknown route and a wrong key, is
OpenAI's error JSON with the matching status. Requests become :class:`~splitspec.serve.choices.Job`
lists (one per prompt) run by a :class:`~splitspec.serve.choices.Runner`; this module only
translates, :mod:`splitspec.serve.chat_request` decides prompts, tool formats and grammars.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from splitspec import __version__
from splitspec.decoding.grammar import GrammarCompiler
from splitspec.decoding.processors import LogitsProcessor
from splitspec.exceptions import ConfigError
from splitspec.serve import schemas
from splitspec.serve.chat_request import plan_chat, template_kwargs, template_messages
from splitspec.serve.choices import Item, Job, Runner, bad_word_ids, processors, sampling, stop_ids
from splitspec.serve.disconnect import DisconnectPoll
from splitspec.serve.errors import ApiError, internal_error, invalid, unsupported
from splitspec.serve.logprobs import TextOffsets, chat_logprobs, completion_logprobs, prompt_logprobs_json, triples
from splitspec.serve.prompt_budget import kept_prompt, token_budget
from splitspec.serve.responses import (
    ResponsesRequest,
    chat_request,
    fitted,
    item_id,
    logprob_entries,
    response_events,
    response_object,
    responses_param,
    whole_response,
)
from splitspec.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from splitspec.serve.state import ServeState
from splitspec.serve.structured import output_grammar
from splitspec.serve.tokenization import detokenize, tokenize, tokenizer_info

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
    compilers: list[GrammarCompiler] = []

    def compiler() -> GrammarCompiler:
        """The grammar compiler, made on first use (a tokenizer llguidance cannot wrap: 400)."""
        if not compilers:
            try:
                compilers.append(GrammarCompiler(state.tokenizer, state.vocab_size))
            except ConfigError as exc:
                raise invalid(str(exc), "response_format", code="grammar_unsupported") from None
        return compilers[0]

    async def prepare_grammar(stops: frozenset[int]) -> None:
        """The compiler's tokenizer for ``stops``, wrapped off the event loop (a new set takes a while); 400 when
        llguidance cannot read the tokenizer."""
        try:
            await compiler().prepare(stops)
        except ConfigError as exc:
            raise invalid(str(exc), "response_format", code="grammar_unsupported") from None

    def count(request: Request, status: int) -> None:
        # the matched route's template ("/v1/models/{model_id}"), not the URL: a scanner's paths must not each make
        # a new metric series
        route = getattr(request.scope.get("route"), "path", None)
        state.metrics.requests.labels(route if isinstance(route, str) else "unmatched", str(status)).inc()

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

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback and re-raises after sending this (its server error middleware)
        return error_response(request, internal_error(exc))

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

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{name}'.",
                           param="model", code="model_not_found")  # fmt: skip

    def logits_processors(
        body: ChatCompletionRequest | CompletionRequest, grammar: str | None, stops: frozenset[int]
    ) -> Callable[[], LogitsProcessor | None]:
        words = bad_word_ids(
            lambda text: list(state.tokenizer.encode(text, add_special_tokens=False)), body.bad_words or ()
        )
        return processors(body, grammar, stops, state.vocab_size, compiler, state.sampling_defaults, words)

    def check_common(body: ChatCompletionRequest | CompletionRequest) -> None:
        check_model(body.model)
        refused = body.refused_field()
        if refused is not None:
            raise unsupported(refused, "it would change the output")
        body.log_unknown_fields()
        if body.user:
            log.debug("request for end user %r", body.user)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, "sessions_active": state.pool.active,
                "sessions_idle": len(state.pool.cache), "pid": os.getpid()}  # fmt: skip  # pid: which worker answered

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}  # vLLM's /version: unauthenticated, as /health

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models(request: Request) -> dict[str, Any]:
        count(request, 200)
        return {"object": "list", "data": [schemas.model_card(name, created, state.max_positions)]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])  # a hub id has a "/"
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        check_model(model_id)
        count(request, 200)
        return schemas.model_card(name, created, state.max_positions)

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize_route(request: Request, body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        messages = None if body.messages is None else template_messages(body.messages)
        tools = [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools or []]
        kwargs = template_kwargs(state.tokenizer, body.chat_template_kwargs)
        count(request, 200)
        return tokenize(state.tokenizer, state.max_positions, body, messages, tools, kwargs)

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize_route(request: Request, body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        count(request, 200)
        return detokenize(state.tokenizer, state.vocab_size, body.tokens)

    @app.get("/tokenizer_info", dependencies=[Depends(authorize)])
    async def tokenizer_info_route(request: Request) -> dict[str, Any]:
        count(request, 200)
        return tokenizer_info(state.tokenizer, state.max_positions)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await respond(request, body, [await chat_job(body)], chat=True)

    @app.post("/v1/responses", dependencies=[Depends(authorize)])
    async def responses(request: Request, body: ResponsesRequest) -> Response:
        chat = chat_request(body)
        try:
            chat, job = await fitted(chat, body.truncation == "auto", chat_job)
        except ApiError as err:  # a 400 of the chat request it runs as names the Responses field
            err.param = responses_param(err.param)
            raise
        runner = Runner(state, [job], 1, disconnect_check(request, body.stream))
        await runner.first()
        response = response_object(body, item_id("resp"), schemas.now(), name, chat)
        entries = logprob_entries(state.token_bytes) if chat.logprobs else None
        count(request, 200)
        if body.stream:
            return RunnerStream(response_events(runner, response, entries), runner.close)
        try:
            return JSONResponse(await whole_response(runner, response, entries))
        finally:
            await runner.close()

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], dependencies=[Depends(authorize)])
    async def stored_response(response_id: str) -> Response:
        raise ApiError(404, f"No response '{response_id:.64}': splitspec serve stores no responses (every response "
                       "says store: false).", param="response_id", code="not_found")  # fmt: skip

    async def chat_job(body: ChatCompletionRequest) -> Job:
        """The generation a chat request asks for (400s name the field)."""
        check_common(body)
        if not state.templated:
            raise invalid(
                "this model's tokenizer has no chat template: use /v1/completions, or start the server "
                "with --chat-template FILE",
                param="messages",
                code="no_chat_template",
            )
        if body.top_logprobs and not body.logprobs:  # OpenAI's and vLLM's rule
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        plan = plan_chat(body, state.tokenizer, state.config.tool_call_parser, compiler)
        stops = stop_ids(body, state.chat_stop_ids, state.vocab_size)
        if plan.grammar is not None:
            await prepare_grammar(stops)
        prompt_ids = kept_prompt(plan.prompt_ids, body.truncate_prompt_tokens, state.max_positions)
        return Job(
            prompt_ids=prompt_ids,
            max_tokens=token_budget(
                len(prompt_ids),
                body.token_limit(),
                state.sampling_defaults.max_tokens,
                state.max_positions,
                "messages",
            ),
            params=sampling(body, state.sampling_defaults),
            stops=body.stop_strings(),
            stop_ids=stops,
            make_processor=logits_processors(body, plan.grammar, stops),
            tool_format=plan.tool_format,
            tools=plan.tools,
            parallel=plan.parallel,
            call_finish=plan.call_finish,
            logprobs=body.logprob_alternatives(),
            min_tokens=body.min_tokens,
            include_stop=body.include_stop_str_in_output,
            skip_special=body.skip_special_tokens,
            prompt_logprobs=body.prompt_logprobs,
            echo=body.echoed(),
        )

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request, body: CompletionRequest) -> Response:
        check_common(body)
        stops = stop_ids(body, state.eos_token_ids, state.vocab_size)
        grammar = output_grammar(body, compiler)
        if grammar is not None:
            await prepare_grammar(stops)
        make = logits_processors(body, grammar, stops)
        asks = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        scored = max(asks) if asks else None  # alternatives scored for the prompt, for echo and vLLM's field
        params = sampling(body, state.sampling_defaults)  # frozen: every prompt's choices share it
        jobs = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompt_ids = list(state.tokenizer.encode(prompt))
            else:  # token ids: sent as they are, no BOS added
                prompt_ids = prompt
                bad = [t for t in prompt_ids if not 0 <= t < state.vocab_size]
                if bad:
                    last = state.vocab_size - 1
                    raise invalid(f"token ids {bad[:5]} are outside the vocabulary (0..{last})", "prompt")
            kept = kept_prompt(prompt_ids, body.truncate_prompt_tokens, state.max_positions)
            if not body.echo:
                echo = ""
            elif isinstance(prompt, str) and len(kept) == len(prompt_ids):
                echo = prompt  # a text prompt kept whole is echoed as it was sent
            else:
                echo = state.decode(kept, body.skip_special_tokens)
            prompt_ids = kept
            budget = token_budget(
                len(prompt_ids), body.token_limit(), state.sampling_defaults.max_tokens, state.max_positions, "prompt"
            )
            jobs.append(Job(prompt_ids, budget, params, body.stop_strings(), stops, make, echo=echo,
                            logprobs=body.logprobs, prompt_logprobs=scored,
                            min_tokens=body.min_tokens, continues_prompt=True,
                            include_stop=body.include_stop_str_in_output,
                            skip_special=body.skip_special_tokens))  # fmt: skip
        return await respond(request, body, jobs, chat=False)

    async def respond(
        request: Request, body: ChatCompletionRequest | CompletionRequest, jobs: list[Job], chat: bool
    ) -> Response:
        runner = Runner(state, jobs, body.n, disconnect_check(request, bool(body.stream)))
        await runner.first()
        rid = schemas.new_id("chatcmpl" if chat else "cmpl")
        now = schemas.now()
        wants = body.logprob_alternatives() if isinstance(body, ChatCompletionRequest) else body.logprobs
        token_bytes = None if wants is None else state.token_bytes
        if token_bytes is not None and not body.skip_special_tokens:  # text_offset counts special tokens' text
            token_bytes = token_bytes.showing_special()
        if body.stream:
            count(request, 200)
            events = sse_events(runner, rid, now, name, body.include_usage, body.continuous_usage, chat, token_bytes)
            return RunnerStream(events, runner.close)
        try:
            choices = await runner.collect()
        finally:
            await runner.close()
        use = runner.tally.usage()
        count(request, 200)
        shape = chat_logprobs if chat else completion_logprobs
        lps = [None if token_bytes is None else shape(triples(c.tokens), token_bytes) for c in choices]
        if chat:
            out = [
                schemas.chat_choice(c.index, c.text if c.text or not c.calls else None, c.finish,
                                    [schemas.tool_call_json(t.id, t.name, t.arguments) for t in c.calls], lp)
                for c, lp in zip(choices, lps, strict=True)
            ]  # fmt: skip
            whole = schemas.envelope(rid, "chat.completion", now, name, out, use)
            if body.prompt_logprobs is not None:  # vLLM's: the conversation's, once for the response
                whole["prompt_logprobs"] = prompt_logprobs_json(
                    choices[0].prompt, body.prompt_logprobs, state.token_bytes
                )
            return JSONResponse(whole)
        out = [schemas.text_choice(c.index, c.text, c.finish, lp) for c, lp in zip(choices, lps, strict=True)]
        if body.prompt_logprobs is not None:  # vLLM's: each choice carries its prompt's
            for c, item in zip(choices, out, strict=True):
                item["prompt_logprobs"] = prompt_logprobs_json(c.prompt, body.prompt_logprobs, state.token_bytes)
        return JSONResponse(schemas.envelope(rid, "text_completion", now, name, out, use))

    return app


async def _still_there() -> bool:
    """A streamed generation's disconnect check: never (its response watches the connection)."""
    return False


def disconnect_check(request: Request, stream: bool) -> Callable[[], Awaitable[bool]]:
    """How a generation asks whether its client left: a stream never asks (Starlette's StreamingResponse listens
    and cancels it, and its close ends the runner: asking between tokens too would only cost the event loop); a
    whole reply polls the connection."""
    return _still_there if stream else DisconnectPoll(request.is_disconnected)


class RunnerStream(StreamingResponse):
    """SSE response that gives its session back however the response ends, even unsent."""

    def __init__(self, events: AsyncIterator[str], close: Callable[[], Any]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def validation_error(exc: RequestValidationError) -> ApiError:
    """A pydantic error as OpenAI's 400, naming the offending parameter."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    kind, msg = first.get("type", ""), str(first.get("msg", "invalid request"))
    if kind == "json_invalid":
        return invalid(f"We could not parse the JSON body of your request: {msg}", code="invalid_json")
    if "unsupported:" in msg:
        return ApiError(
            400,
            f"Unsupported parameter: '{param}' is not supported by splitspec serve"
            f" ({msg.split('unsupported:', 1)[1].strip()}).",
            param=param,
            code="unsupported_parameter",
        )
    where = ".".join(loc) or "body"
    return invalid(f"Invalid value for '{where}': {msg}", param=param, code="invalid_value")


def _event(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def sse_events(
    runner: Runner,
    rid: str,
    created: int,
    model: str,
    include_usage: bool,
    continuous: bool,
    chat: bool,
    token_bytes: Callable[[int], bytes] | None = None,
) -> AsyncIterator[str]:
    """The SSE stream of a request's choices: chunks, closing chunks, the usage chunk, ``[DONE]``.

    Chat tool calls stream as OpenAI's deltas: index, id, type and name first, then the arguments.
    ``continuous``: every chunk carries the usage so far (vLLM's ``continuous_usage_stats``).
    ``token_bytes`` (logprobs asked for): each chunk carries the logprobs of the tokens behind it;
    completions' ``text_offset`` counts on across a choice's chunks.
    """
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]]) -> str:
        use = runner.tally.usage(runner.running()) if continuous else None
        return _event(schemas.envelope(rid, obj, created, model, choices, use))

    offsets: dict[int, TextOffsets] = {}  # choice index -> where its next token starts in its text (completions)

    def logprobs(item: Item) -> dict[str, Any] | None:
        if token_bytes is None or not item.tokens:
            return None
        entries = triples(item.tokens)
        if chat:
            return chat_logprobs(entries, token_bytes)
        at = offsets.setdefault(item.index, TextOffsets(token_bytes))
        return completion_logprobs(entries, token_bytes, at)

    started: set[int] = set()
    calls: dict[int, int] = {}  # choice index -> tool calls streamed
    try:
        async for item in runner.events():
            index, event, finish = item.index, item.event, item.finish
            if chat and index not in started:
                started.add(index)
                yield chunk([schemas.chat_delta(index, {"role": "assistant", "content": ""})])
            lp = logprobs(item)
            if event is not None and event.call is not None:
                k = calls.get(index, 0)
                calls[index] = k + 1
                head = {"index": k, "id": event.call.id, "type": "function",
                        "function": {"name": event.call.name, "arguments": ""}}  # fmt: skip
                yield chunk([schemas.chat_delta(index, {"tool_calls": [head]}, logprobs=lp)])
                args = {"index": k, "function": {"arguments": event.call.arguments}}
                yield chunk([schemas.chat_delta(index, {"tool_calls": [args]})])
            elif event is not None and (event.content or (lp is not None and finish is None)):
                piece = (
                    schemas.chat_delta(index, {"content": event.content}, logprobs=lp)
                    if chat
                    else schemas.text_choice(index, event.content, None, lp)
                )
                yield chunk([piece])
                lp = None
            if finish is not None:
                yield chunk(
                    [schemas.chat_delta(index, {}, finish, lp) if chat else schemas.text_choice(index, "", finish, lp)]
                )
    except ApiError as err:
        yield _event(err.body())
        yield _event("[DONE]")
        return
    except Exception as exc:  # a failure of our own mid-stream: the client still gets an error event and [DONE]
        log.exception("a stream failed")
        yield _event(internal_error(exc).body())
        yield _event("[DONE]")
        return
    if include_usage:
        yield _event(schemas.envelope(rid, obj, created, model, [], runner.tally.usage()))
    yield _event("[DONE]")
