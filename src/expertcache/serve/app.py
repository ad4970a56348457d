"""``expertcache serve``: an OpenAI-compatible HTTP server over an offloaded model (FastAPI, uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``
as server-sent events in OpenAI's chunk format, ending ``data: [DONE]``), ``GET /health`` and
``GET /metrics`` (Prometheus). Every error is OpenAI's JSON error object with a 4xx status (503 when the
queue is full); one bad request never disturbs the others. The generation loop is ``serve.batcher``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from expertcache.engine.generation import render
from expertcache.errors import ExpertcacheError
from expertcache.serve.batcher import Batcher, QueueFull
from expertcache.serve.metrics import CONTENT_TYPE, Metrics
from expertcache.serve.schemas import ChatRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 256


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


def create_app(
    model, name: str, api_key: str | None = None, max_queue: int = 64, kv_tokens: int | None = None
) -> FastAPI:
    """The app serving ``model`` (an ``OffloadedModel``) under the model id ``name``; ``max_queue``
    requests running or waiting at most, a KV cache of ``kv_tokens`` (see ``Batcher``)."""
    metrics = Metrics(model)
    state: dict[str, Batcher] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["batcher"] = app.state.batcher = Batcher(model, max_queue, metrics, kv_tokens)
        yield
        state.pop("batcher").close()

    app = FastAPI(title="expertcache", lifespan=lifespan)
    limit = getattr(model.config, "max_position_embeddings", None)

    async def check_key(request: Request) -> None:
        """A dependency of every /v1 route, not a middleware: Starlette's HTTP middleware would hide a
        client's disconnect from the endpoint, which cancels a request whose client went away."""
        if api_key:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise ApiError(401, "invalid or missing API key", "authentication_error", "invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        metrics.answered(request.url.path, exc.status)
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        metrics.answered(request.url.path, 400)
        if first.get("type") == "json_invalid":
            why = first.get("ctx", {}).get("error", "")
            return _error(ApiError(400, f"the body is not valid JSON ({why})"))
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        param = where if where != "body" else None
        return _error(ApiError(400, f"{where}: {first.get('msg')}", code="invalid_value", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return _error(ApiError(exc.status_code, str(exc.detail), "invalid_request_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok" if "batcher" in state else "starting"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "expertcache"}],
        }

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        ids = model.tokenizer(req.prompt).input_ids
        echo = req.prompt if req.echo else ""
        return await _generate(req, request, ids, "text_completion", req.max_tokens, echo)

    @v1.post("/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            text = render(model.tokenizer, messages, True)
        except (ValueError, ExpertcacheError) as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None
        ids = model.tokenizer(text, add_special_tokens=False).input_ids
        return await _generate(req, request, ids, "chat.completion", req.limit)

    async def _generate(req, request: Request, ids: list[int], kind: str, max_tokens: int | None, echo=""):
        if req.model != name:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here; this server serves {name!r}",
                code="model_not_found",
            )
        max_tokens = max_tokens or DEFAULT_MAX_TOKENS
        if limit is not None and len(ids) + max_tokens > limit:
            raise ApiError(
                400,
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's "
                f"context of {limit}",
                code="context_length_exceeded",
            )
        batcher = state.get("batcher")
        if batcher is None:
            raise ApiError(503, "the server is starting or stopping", "server_error")
        try:
            stop = tuple(req.stop or ())
            job = batcher.submit(ids, max_tokens, req.temperature, req.top_p, req.top_k, stop, req.seed)
        except QueueFull as exc:
            raise ApiError(503, str(exc), "server_error", "queue_full") from None
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
            return Response(status_code=499)  # nobody is listening
        if last.error:
            metrics.answered(_path(kind), 500)
            return _error(ApiError(500, last.error, "server_error"))
        usage = _usage(job, last)
        metrics.answered(_path(kind), 200, usage["prompt_tokens"], usage["completion_tokens"])
        choice = {"index": 0, "finish_reason": last.finish}
        if kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {**head, "object": kind, "choices": [choice], "usage": usage}

    async def _stream(batcher, job, kind, head, include_usage: bool, echo: str):
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        first, last = True, None
        async for piece in batcher.pieces(job):
            last = piece
            if piece.error:
                yield {"data": json.dumps({"error": {"message": piece.error, "type": "server_error"}})}
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
            metrics.answered(_path(kind), 200, usage["prompt_tokens"], usage["completion_tokens"])
            if include_usage:
                yield {"data": json.dumps({**head, "object": chunk_kind, "choices": [], "usage": usage})}
        yield {"data": "[DONE]"}

    app.include_router(v1)
    return app


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


def _error(exc: ApiError) -> JSONResponse:
    body = {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status)
