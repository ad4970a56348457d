"""``expertcache serve``: an OpenAI-compatible HTTP server over an offloaded model (FastAPI, uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``
as server-sent events in OpenAI's chunk format, ending ``data: [DONE]``), ``GET /health``,
``GET /metrics`` (Prometheus) and ``GET /stats`` (``model.stats`` as JSON). Every error is OpenAI's JSON
error object with a 4xx status (503 with ``Retry-After`` when the queue is full or the server is
stopping; 500 with an incident id the log repeats, never raw exception text); one bad request never
disturbs the others. Every request first
passes ``serve.gate`` (Host, key, body size and time); the generation loop is ``serve.batcher``.

A request is checked against the model before it reaches the loop: ``top_k`` at most the vocabulary,
the prompt's characters against what the context can hold (before tokenising, which runs off the event
loop), and prompt plus ``max_tokens`` against both the context and the KV cache (400 naming the limit).
"""

from __future__ import annotations

import asyncio
import email.message
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from expertcache.config import ServeConfig
from expertcache.engine.generation import render
from expertcache.errors import ExpertcacheError
from expertcache.serve.batcher import Batcher, QueueFull, Restarting, Unavailable
from expertcache.serve.gate import KNOWN_PATHS, Gate, error_object, internal_error
from expertcache.serve.metrics import CONTENT_TYPE, Metrics
from expertcache.serve.schemas import ChatRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 256
log = logging.getLogger("expertcache.serve")
RETRY_AFTER_S = 1  # a full queue frees a slot within about a request's time: ask again soon
# prompts up to this many characters are tokenised on the event loop (tens of microseconds); longer ones
# on a worker thread, so that a long prompt does not hold the loop. A handoff to a worker waits for the
# GIL, which the generation thread holds in Python code for up to the 5 ms switch interval at each turn
INLINE_CHARS = 4096


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param


def create_app(model, name: str, config: ServeConfig | None = None) -> FastAPI:
    """The app serving ``model`` (an ``OffloadedModel``) under the model id ``name``, as ``config`` says
    (``ServeConfig``: the queue, the KV cache, the key, the bounds on requests and the docs pages)."""
    config = config or ServeConfig()
    metrics = Metrics(model)
    card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "expertcache"}
    state: dict[str, Batcher] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher = Batcher(
            model, config.max_queue, metrics, config.kv_tokens, config.batch_tokens, config.schedule
        )
        state["batcher"] = app.state.batcher = batcher
        if batcher.kv_tokens:  # the KV cache's room in tokens, in whole pages (sized to what fits)
            metrics.kv_size(batcher.kv_tokens)
        yield
        state.pop("batcher")
        app.state.loop_stopped = batcher.close()

    docs = {} if config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="expertcache", lifespan=lifespan, **docs)
    app.add_middleware(Gate, config=config, metrics=metrics)
    limits = Limits(model)
    v1 = APIRouter(prefix="/v1")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        metrics.answered(request.url.path, exc.status)
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        if tuple(first.get("loc", ())) == ("body",) and first.get("type") != "json_invalid":
            # the body as a whole was not read as JSON: none, or a type FastAPI does not parse as JSON
            kind = request.headers.get("content-type", "")
            if not await request.body():
                metrics.answered(request.url.path, 400)
                return _error(ApiError(400, "the request has no body: send a JSON object"))
            if not _is_json(kind):  # curl -d sends a form by default
                metrics.answered(request.url.path, 415)
                got = f"this request's is {kind!r}" if kind else "this request has none"
                message = f"send the body as JSON with Content-Type: application/json ({got})"
                return _error(ApiError(415, message))
        metrics.answered(request.url.path, 400)
        if first.get("type") == "json_invalid":
            why = first.get("ctx", {}).get("error", "")
            return _error(ApiError(400, f"the body is not valid JSON ({why})"))
        # the field's path without pydantic's own steps (``function-after[...]``, a union's member type)
        steps = first.get("loc", ())[1:]
        loc = [str(p) for p in steps if isinstance(p, int) or p.isidentifier() and p not in _TYPES]
        fields = first.get("ctx", {}).get("fields")  # unknown or unsupported fields, named
        where = ".".join(loc) or fields or "body"
        param = ".".join(loc) if loc else fields.split(", ")[0] if fields else None
        msg = str(first.get("msg")).removeprefix("Value error, ")
        if first.get("type") in ("extra_forbidden", "unknown_field"):
            msg = "not a field this server takes (docs/SERVE.md lists them)"
        return _error(ApiError(400, f"{where}: {msg}", code="invalid_value", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        path = request.url.path  # a known route asked with another method counts as that route's
        metrics.answered(path if path in KNOWN_PATHS else "other", exc.status_code)
        if exc.status_code == 404:  # as OpenAI answers an unknown route
            message = f"Invalid URL ({request.method} {request.url.path})"
            return _error(ApiError(404, message, code="unknown_url"))
        if exc.status_code == 405:  # a route that exists, asked with another method: say which it takes
            allow = (exc.headers or {}).get("Allow", "")
            use = allow or "another method"
            message = f"{request.method} is not allowed on {request.url.path}; use {use}"
            response = _error(ApiError(405, message, code="method_not_allowed"))
            if allow:
                response.headers["Allow"] = allow
            return response
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):  # FastAPI's "error parsing"
            at = f"byte 0x{cause.object[cause.start]:02x} at {cause.start}"
            return _error(ApiError(400, f"the body is not valid JSON (not UTF-8 text: {at})"))
        if exc.status_code == 400 and isinstance(cause, RecursionError):  # FastAPI's "error parsing" too
            return _error(ApiError(400, "the body is not valid JSON (nested deeper than this server reads)"))
        return _error(ApiError(exc.status_code, str(exc.detail), "invalid_request_error"))

    @app.head("/health", include_in_schema=False)  # load balancers check with HEAD
    @app.get("/health")
    async def health():
        batcher = state.get("batcher")
        ok, why = batcher.health() if batcher is not None else (False, "starting or stopping")
        metrics.answered("/health", 200 if ok else 503)
        if ok:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "reason": why}, 503, {"Retry-After": "5"})

    @app.get("/metrics")
    async def prometheus():
        metrics.answered("/metrics", 200)  # this scrape counted in what it reads
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats():  # the expert cache's work since load, as ``model.stats`` (and generate --json) give it
        metrics.answered("/stats", 200)
        return JSONResponse(model.stats)

    @v1.get("/models")
    async def models():
        metrics.answered("/v1/models", 200)
        return {"object": "list", "data": [card]}  # created: when this server started

    @v1.get("/models/{model_id:path}")
    async def one_model(model_id: str):  # OpenAI's retrieve (client.models.retrieve)
        if model_id != name:
            metrics.answered("/v1/models/{model}", 404)
            return _error(
                ApiError(
                    404,
                    f"model {model_id!r} is not served here; this server serves {name!r}",
                    code="model_not_found",
                )
            )
        metrics.answered("/v1/models/{model}", 200)
        return card

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check(req, limits, name)
        limits.check_chars(len(req.prompt), "prompt")
        ids = await _off_loop(lambda: model.tokenizer(req.prompt).input_ids, len(req.prompt))
        echo = req.prompt if req.echo else ""
        return await _generate(req, request, ids, "text_completion", req.max_tokens, echo)

    @v1.post("/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        _check(req, limits, name)
        messages = [{"role": m.template_role, "content": m.text()} for m in req.messages]
        chars = sum(len(m["content"]) for m in messages)
        limits.check_chars(chars, "messages")

        def tokenize() -> list[int]:
            text = render(model.tokenizer, messages, True)
            return model.tokenizer(text, add_special_tokens=False).input_ids

        try:
            ids = await _off_loop(tokenize, chars)
        except (ValueError, ExpertcacheError) as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None
        return await _generate(req, request, ids, "chat.completion", req.limit)

    async def _generate(req, request: Request, ids: list[int], kind: str, max_tokens: int | None, echo=""):
        batcher = state.get("batcher")
        field = "messages" if kind == "chat.completion" else "prompt"
        max_tokens = limits.check_lengths(len(ids), max_tokens, batcher, field)
        if batcher is None:
            raise ApiError(503, "the server is starting or stopping", "server_error")
        stop = tuple(req.stop or ())
        for attempt in range(3):  # a loop that dies under a submit is started again: submit to the new one
            await batcher.ready()
            try:
                job = batcher.submit(ids, max_tokens, req.temperature, req.top_p, req.top_k, stop, req.seed)
                break
            except QueueFull as exc:
                raise ApiError(503, str(exc), "server_error", "queue_full") from None
            except Restarting as exc:
                if attempt == 2:
                    raise ApiError(503, str(exc), "server_error", "unavailable") from None
            except Unavailable as exc:
                raise ApiError(503, str(exc), "server_error", "unavailable") from None
        head = {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{job.id}",
            "created": int(time.time()),
            "model": name,
        }
        if req.stream:
            return EventSourceResponse(_stream(batcher, job, kind, head, req.include_usage, echo), ping=15)
        text, last = echo, None
        watcher = asyncio.create_task(_watch(request, batcher, job))
        try:
            async for piece in batcher.pieces(job):
                text += piece.text
                last = piece
        finally:
            watcher.cancel()
        if last.error == "cancelled":
            metrics.answered(_path(kind), 499)
            return Response(status_code=499)  # nobody is listening
        if last.error:
            status = 503 if last.shutdown else 500
            metrics.answered(_path(kind), status)
            code = "shutting_down" if last.shutdown else None
            return _error(ApiError(status, last.error, "server_error", code))
        usage = _usage(job, last)
        metrics.answered(_path(kind), 200)
        choice = {"index": 0, "finish_reason": last.finish}
        if kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {**head, "object": kind, "choices": [choice], "usage": usage}

    async def _stream(batcher, job, kind, head, include_usage: bool, echo: str):
        ended = False
        try:
            async for event in _events(batcher, job, kind, head, include_usage, echo):
                ended = event["data"] == "[DONE]"
                yield event
        except (GeneratorExit, asyncio.CancelledError):  # sse-starlette cancels the stream's task
            if not ended:  # the client went away mid-stream
                metrics.answered(_path(kind), 499)
            raise
        except Exception as exc:  # the response has begun: end it with an error event, not a cut
            incident = secrets.token_hex(4)
            log.error("stream of request %s failed (incident %s)", job.id, incident, exc_info=exc)
            metrics.answered(_path(kind), 500)
            yield {"data": json.dumps(error_object(internal_error(incident), "server_error"))}
            yield {"data": "[DONE]"}

    async def _events(batcher, job, kind, head, include_usage: bool, echo: str):
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        first, last = True, None
        async for piece in batcher.pieces(job):
            last = piece
            if piece.error:
                metrics.answered(_path(kind), 503 if piece.shutdown else 500)
                code = "shutting_down" if piece.shutdown else None
                yield {"data": json.dumps(error_object(piece.error, "server_error", code))}
                break
            text = (echo if first else "") + piece.text
            if kind == "chat.completion":
                delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": piece.finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": piece.finish, "logprobs": None}
            first = False
            yield {"data": json.dumps({**head, "object": chunk_kind, "choices": [choice]})}
        if last is not None and not last.error:
            usage = _usage(job, last)
            metrics.answered(_path(kind), 200)
            if include_usage:
                yield {"data": json.dumps({**head, "object": chunk_kind, "choices": [], "usage": usage})}
        yield {"data": "[DONE]"}

    app.include_router(v1)
    return app


class Limits:
    """What one request may ask of the model: its vocabulary (``top_k``), its context, and the
    characters a prompt can have and still fit it (the context times the longest token's characters:
    a longer prompt cannot fit, and is refused before it is tokenised)."""

    def __init__(self, model) -> None:
        self.vocab = int(model.config.vocab_size)
        self.context = getattr(model.config, "max_position_embeddings", None)
        longest = max((len(t) for t in model.tokenizer.get_vocab()), default=16)
        self.chars = None if self.context is None else int(self.context) * max(longest, 1)

    def check_chars(self, chars: int, field: str) -> None:
        """``field``: the request's field that holds the prompt (``prompt``, ``messages``), the error's
        ``param`` as OpenAI names it."""
        if self.chars is not None and chars > self.chars:
            raise ApiError(
                400, f"the prompt's {chars} characters cannot fit the model's context of {self.context} "
                f"tokens (at most {self.chars} characters)", code="context_length_exceeded", param=field,
            )  # fmt: skip

    def check_lengths(self, prompt: int, max_tokens: int | None, batcher, field: str) -> int:
        """``max_tokens`` (None: up to 256, as room allows) after checking prompt + max_tokens against the
        context and the KV cache."""
        bounds = [(self.context, "the model's context")] if self.context is not None else []
        if batcher is not None:
            bounds.append((batcher.kv_tokens, "the server's KV cache (--kv-cache-tokens)"))
        room = min((b for b, _ in bounds), default=None)
        given = max_tokens is not None
        if max_tokens is None:
            max_tokens = (
                DEFAULT_MAX_TOKENS if room is None else max(1, min(DEFAULT_MAX_TOKENS, room - prompt))
            )
        for bound, what in bounds:
            if prompt + max_tokens > bound:
                asked = f"max_tokens {max_tokens}" if given else "a token to generate (max_tokens not given)"
                raise ApiError(
                    400, f"prompt of {prompt} tokens + {asked} exceeds {what} of {bound} tokens",
                    code="context_length_exceeded", param=field,
                )  # fmt: skip
        return max_tokens


async def _off_loop(fn, chars: int):
    """``fn()`` (a tokenisation), on the event loop for a short text, on a worker thread for a long one."""
    return fn() if chars <= INLINE_CHARS else await run_in_threadpool(fn)


def _check(req, limits: Limits, name: str) -> None:
    if req.model != name:
        raise ApiError(
            404,
            f"model {req.model!r} is not served here; this server serves {name!r}",
            code="model_not_found",
        )
    if req.top_k is not None and req.top_k > limits.vocab:
        raise ApiError(
            400, f"top_k: at most the vocabulary's {limits.vocab} tokens, got {req.top_k}",
            code="invalid_value", param="top_k",
        )  # fmt: skip


async def _watch(request: Request, batcher, job) -> None:
    """A non-streaming request whose client went away is cancelled (a stream notices by itself)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    batcher.cancel(job)


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat.completion" else "/v1/completions"


def _usage(job, last) -> dict[str, int]:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": last.tokens,
        "total_tokens": job.prompt_tokens + last.tokens,
    }


def _is_json(content_type: str) -> bool:
    """Whether FastAPI reads a body of ``content_type`` as JSON: application/json or application/*+json."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


_TYPES = frozenset(("str", "int", "float", "bool", "list", "dict", "none"))  # a union member's step in a loc


def _error(exc: ApiError) -> JSONResponse:
    body = error_object(exc.message, exc.kind, exc.code, exc.param)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return JSONResponse(body, status_code=exc.status, headers=headers)
