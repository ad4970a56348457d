"""The door of the server: what every HTTP request passes before a route sees it (a pure ASGI middleware).

In order, before a byte of the body is read:

1. the ``Host`` header must name this server (loopback names, ``--allowed-host``): a page in a browser
   cannot reach a loopback server through a name it controls (DNS rebinding); else 400;
2. with an API key, every path but ``/health`` (and ``/metrics`` with ``--metrics-open``) needs
   ``Authorization: Bearer KEY`` (the scheme in any case, RFC 7235; one such header); else 401,
   unknown paths too;
3. a declared ``Content-Length`` over ``--max-body`` is 413 at once, a compressed body 415; then the body
   is read here, at most ``--max-body`` bytes (413) within ``--body-timeout`` (408), and handed to the
   route from memory.

Then the route runs. An exception that escapes it is answered by a JSON 500 naming an incident id that
the server log repeats with the traceback: no raw exception text reaches the client, and the connection
stays usable (Starlette's own handler answers in plain text and closes it). A request the server's
shutdown cancels is answered 503 if nothing was sent yet.

A pure ASGI middleware rather than Starlette's ``BaseHTTPMiddleware``: that one hides a client's
disconnect from the route, which is how a request whose client went away is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets

from expertcache.config import ServeConfig, host_name

log = logging.getLogger("expertcache.serve")
OPEN_PATHS = ("/health",)


class Gate:
    def __init__(self, app, config: ServeConfig, metrics=None) -> None:
        self.app, self.config, self.metrics = app, config, metrics
        self.hosts = config.host_names()
        self.key = f"{config.api_key}".encode() if config.api_key else None
        self.open_paths = OPEN_PATHS + (("/metrics",) if config.metrics_open else ())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        path = scope.get("path", "")
        length = headers.get(b"content-length")
        unread = length not in (None, b"0") or b"transfer-encoding" in headers  # a body on its way
        if self.hosts is not None:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.hosts:
                shown = headers.get(b"host", b"").decode("latin-1")[:100]
                return await self._refuse(
                    send, path, 400, f"the Host header {shown!r} is not a name of this server "
                    "(add it with --allowed-host)", "invalid_request_error", "host_not_allowed", close=unread,
                )  # fmt: skip
        if self.key is not None and path not in self.open_paths and not self._authorised(headers):
            return await self._refuse(
                send, path, 401, "invalid or missing API key (Authorization: Bearer KEY)",
                "authentication_error", "invalid_api_key", close=unread,
            )  # fmt: skip
        if headers.get(b"content-encoding", b"identity").lower() != b"identity":
            return await self._refuse(
                send, path, 415, "compressed request bodies are not taken (Content-Encoding)",
                "invalid_request_error", "unsupported_encoding", close=unread,
            )  # fmt: skip
        limit = self.config.max_body_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await self._too_large(send, path)
        if unread:
            try:
                body = await asyncio.wait_for(_read_body(receive, limit), self.config.body_timeout_s)
            except TooLarge:
                return await self._too_large(send, path)
            except TimeoutError:
                return await self._refuse(
                    send, path, 408, f"the request body did not arrive within "
                    f"{self.config.body_timeout_s:g} s (--body-timeout)", "invalid_request_error", "timeout",
                )  # fmt: skip
            except Disconnected:
                return None
            except asyncio.CancelledError:  # the server stops while the body is still coming
                return await self._refuse(
                    send,
                    path,
                    503,
                    "the server is shutting down",
                    "server_error",
                    "shutting_down",
                    close=True,
                )
            twice = _given_twice(body) if b"json" in headers.get(b"content-type", b"").lower() else None
            if twice is not None:  # JSON leaves it open which one counts: not for the server to guess
                return await self._refuse(
                    send, path, 400, f"the body gives {twice!r} twice", "invalid_request_error",
                    "invalid_value", close=False, param=twice,
                )  # fmt: skip
            receive = _replay(body, receive)
        await self._run(scope, receive, send)

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        if headers.get(DUPLICATES, ()) and b"authorization" in headers[DUPLICATES]:
            return False  # two keys: which one is meant is not for the server to guess
        scheme, _, given = headers.get(b"authorization", b"").strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), self.key)

    async def _run(self, scope, receive, send) -> None:
        started = complete = False

        async def tracked(message) -> None:
            nonlocal started, complete
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:  # the server's shutdown cancels what still runs after its grace
            if not started:
                await send_error(
                    send, 503, "the server is shutting down", "server_error", "shutting_down", close=True
                )
        except Exception as exc:
            incident = secrets.token_hex(4)
            log.error("internal error %s on %s %s", incident, scope.get("method"), scope.get("path"),
                      exc_info=exc)  # fmt: skip
            if not started:
                path = scope.get("path", "")
                await self._refuse(send, path, 500, internal_error(incident), "server_error", close=False)
            elif not complete:
                raise  # a response half sent cannot be mended: the server closes the connection

    async def _too_large(self, send, path: str) -> None:
        size = self.config.max_body_bytes
        await self._refuse(
            send, path, 413, f"the request body is larger than {size} bytes (--max-body)",
            "invalid_request_error", "request_too_large", close=True,
        )  # fmt: skip

    async def _refuse(
        self, send, path: str, status: int, message: str, kind: str, code=None, close=True, param=None
    ):
        """An error before the route; ``close``: the request's body is not read, the connection cannot
        carry another request (and lingers, ``serve.connections``)."""
        if self.metrics is not None:
            self.metrics.answered(path if path in KNOWN_PATHS else "other", status)
        await send_error(send, status, message, kind, code, close=close, param=param)


KNOWN_PATHS = ("/health", "/metrics", "/stats", "/v1/models", "/v1/completions", "/v1/chat/completions")


def internal_error(incident: str) -> str:
    return f"internal server error (incident {incident}; the server log has the details)"


def error_object(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's JSON error object: every error the server sends, whichever layer sends it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def send_error(send, status: int, message: str, kind: str, code=None, param=None, close=False) -> None:
    """OpenAI's JSON error object as a whole response, sent at the ASGI level."""
    # as the routes' JSONResponse writes it (Starlette's separators, text as UTF-8)
    body = json.dumps(error_object(message, kind, code, param), separators=(",", ":"), ensure_ascii=False)
    body = body.encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    if close:  # the rest of the request is not read: the connection cannot carry another one
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _given_twice(body: bytes) -> str | None:
    """A key some object of the JSON ``body`` gives twice (the first found), else None; a body that is
    not JSON is the route's to name."""
    twice: list[str] = []

    def pairs(items: list[tuple[str, object]]) -> dict:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen and not twice:
                twice.append(key)
            seen.add(key)
        return dict(items)

    try:
        json.loads(body, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    return twice[0] if twice else None


class TooLarge(Exception):
    pass


class Disconnected(Exception):
    pass


async def _read_body(receive, limit: int) -> bytes:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive):
    """A ``receive`` that hands over the body read already, then the real one (for the disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


DUPLICATES = b"\x00duplicates"  # a key no header can have: the names that came more than once


def _headers(scope) -> dict[bytes, bytes]:
    out: dict = {}
    for k, v in scope.get("headers", ()):
        k = k.lower()
        if k in out:
            out.setdefault(DUPLICATES, set()).add(k)
        out[k] = v
    return out
