"""Connections: what uvicorn leaves open, bounded here (slowloris, idle floods, the open-file limit).

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``, our ``--idle-timeout``) but has no
bound on the time a client takes to send its headers, and none on the number of connections: 500
connections trickling a header byte at a time stay open for good, and 20 000 exhaust the open-file
limit, after which every accept fails. ``guarded_protocol`` makes uvicorn's h11 protocol class with both:

- **header timeout:** from the connection (or the end of its last response) to the end of the next
  request's headers, at most ``--header-timeout``; else the connection is closed;
- **a connection cap** (``--max-connections``): beyond it, the connection idle longest (no request in
  progress: a trickling header, a keep-alive wait) is closed to make room; if every connection is
  busy, the newcomer gets 503 with ``Retry-After`` and is closed. So a slowloris crowd cannot lock out
  clients that send their requests promptly, and the process never runs out of file descriptors;
- **a lingering close:** a response sent before the request's body was read (413, 401, 408) is followed
  by a half-close, and what the client still sends is read and dropped (``--body-timeout`` and 128 MiB
  at most) before the connection closes. Closed at once, the kernel would answer the unread bytes with
  a reset, and a client still sending its body would lose the response (nginx's ``lingering_close``).

``raise_file_limit`` lifts the soft open-file limit to the hard one at start, and the default cap stays
below it. ``quiet_accept_errors`` makes the event loop log a repeated error (an accept failing for want
of descriptors, say) once per interval with a count, not once per connection.

The h11 protocol is pinned, whether or not httptools is installed: one implementation to guard and test.
"""

from __future__ import annotations

import json
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from expertcache.serve.gate import error_object

log = logging.getLogger("expertcache.serve")
DEFAULT_CONNECTIONS = 4096
RESERVED_FILES = 256  # descriptors kept for the model, the checkpoint, logs and the event loop
LINGER_BYTES = 128 * 2**20  # read and dropped at most after an early response, before closing


def raise_file_limit() -> int | None:
    """Lift the soft open-file limit to the hard one; the soft limit now (None where unknown)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(asked: int | None, file_limit: int | None) -> int:
    """The connections served at once: ``asked`` (default 4096), below the open-file limit."""
    cap = asked or DEFAULT_CONNECTIONS
    if file_limit is not None:
        cap = min(cap, max(16, file_limit - RESERVED_FILES))
    return cap


class Tally:
    """What the guard did, for the log and the tests: connections closed for each reason."""

    def __init__(self) -> None:
        self.header_timeouts = self.evicted = self.refused = 0


class _Lingering:
    """The transport as uvicorn sees it: ``close`` while the client is still sending its body lingers."""

    def __init__(self, transport, protocol) -> None:
        self.raw, self.protocol = transport, protocol

    def __getattr__(self, name: str):
        return getattr(self.raw, name)

    def is_closing(self) -> bool:
        return self.protocol._lingered is not None or self.raw.is_closing()

    def close(self) -> None:
        p = self.protocol
        if p._lingered is not None:
            return  # the linger's own timer closes it
        if p.conn.their_state is h11.SEND_BODY and not self.raw.is_closing() and self.raw.can_write_eof():
            p._linger()
        else:
            self.raw.close()


def guarded_protocol(cap: int, header_timeout: float, linger: float = 30.0) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header timeout, a connection cap and a lingering close of at most
    ``linger`` seconds (one class per server)."""
    tally = Tally()

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            self._lingered = None  # bytes dropped since the lingering close began
            super().connection_made(_Lingering(transport, self))
            self._idle_since = time.monotonic()
            self._timer = None
            if len(self.connections) > cap and not self._make_room():
                tally.refused += 1
                self._refuse()
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._lingered is None:
                return super().data_received(data)
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.transport.raw.close()

        def _linger(self) -> None:
            self._lingered = 0
            raw = self.transport.raw
            raw.write_eof()  # the response is out; the client reads it, then sees the end
            raw.resume_reading()
            self.loop.call_later(linger, raw.close)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._idle_since = time.monotonic()
                self._arm()

        # ------------------------------------------------------------------------------------------
        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(header_timeout, self._expire, self.cycle)

        def _expire(self, cycle) -> None:
            """No request began since the timer was armed (the same cycle, and it is over): close."""
            self._timer = None
            if self.cycle is cycle and self._idle() and not self.transport.is_closing():
                tally.header_timeouts += 1
                self.transport.close()

        def _make_room(self) -> bool:
            idle = [
                c for c in self.connections
                if c is not self and c._idle() and not c.transport.is_closing()
            ]  # fmt: skip
            if not idle:
                return False
            victim = min(idle, key=lambda c: c._idle_since)
            tally.evicted += 1
            victim.transport.close()
            return True

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse (no Host, a bad length, a header too long): OpenAI's JSON error."""
            message = f"{msg[:-1]}: not valid HTTP/1.1"
            self._reply(b"400 Bad Request", error_object(message, "invalid_request_error", "invalid_http"))

        def _refuse(self) -> None:
            message = "the server has too many connections open (--max-connections)"
            error = error_object(message, "server_error", "too_many_connections")
            self._reply(b"503 Service Unavailable", error, b"retry-after: 1\r\n")

        def _reply(self, status: bytes, error: dict, extra: bytes = b"") -> None:
            """A whole response written below h11 (no request to answer through it), then close."""
            body = json.dumps(error).encode()
            head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n%sconnection: close\r\n" % (
                status,
                extra,
            )
            self.transport.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
            self.transport.raw.close()

    GuardedH11Protocol.tally = tally
    return GuardedH11Protocol


def quiet_accept_errors(loop, interval: float = 10.0) -> None:
    """The loop's error handler logs a message once per ``interval``, then how often it came meanwhile."""
    last: dict[str, list] = {}  # message -> [time logged, repeats since]

    def handler(loop, context) -> None:
        message = str(context.get("message", "error"))
        exc = context.get("exception")
        key = f"{message}: {type(exc).__name__}: {exc}" if exc else message
        now = time.monotonic()
        seen = last.get(key)
        if seen is not None and now - seen[0] < interval:
            seen[1] += 1
            return
        repeats = seen[1] if seen else 0
        last[key] = [now, 0]
        more = f" (and {repeats} more times in the last {interval:g} s)" if repeats else ""
        log.error("%s%s", key, more, exc_info=exc)

    loop.set_exception_handler(handler)
