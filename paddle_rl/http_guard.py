"""The connection rules of the HTTP servers (the reward server, the rollout server), below the application: what a
client may do before its request reaches the API-key check (http_auth.py) and the endpoints.

uvicorn's HTTP/1.1 protocol (h11) serves each connection; the subclass `guarded_protocol` builds adds:
- a header deadline: a connection must deliver a complete request head within `header_timeout` seconds of opening,
  or of the first byte of a later request's head (uvicorn has no such limit: a client trickling a header a byte at
  a time held its connection for ever; between requests uvicorn's keep-alive timer closes a silent connection). Past it the connection is closed, with HTTP 408 when it had sent part of a request;
- a header size: a request head of more than `max_header_bytes` is answered HTTP 431 and the connection closed;
- a connection cap that idle connections cannot fill: when a connection beyond `max_connections` opens, the open
  connection that has waited longest for its first request head (sending nothing, or a head byte by byte), for
  more than `idle_grace` seconds, is closed to make room; only when there is none is the newcomer answered HTTP
  503 at its request head (uvicorn's own `limit_concurrency` answers 503 to every request, those of connections already
  open included, as soon as enough idle connections are open: a flood of idle connections shut everyone out).
A request's body has its own deadline, kept by the servers' request gates (`http_auth.read_body`).
"""
import argparse
import signal
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_HEADER_TIMEOUT = 10.0      # seconds for a request head
DEFAULT_MAX_HEADER_BYTES = 16384   # h11's default largest incomplete event
DEFAULT_BODY_TIMEOUT = 30.0        # seconds for a body, plus one per `min_body_rate` MiB received
DEFAULT_MIN_BODY_RATE = 1.0        # MiB/s


@dataclass
class ConnectionLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    # what the rules did since the server started (its /health reports them)
    stats: dict = field(default_factory=lambda: dict.fromkeys(
        ("header_timeouts", "header_too_large", "evicted_idle", "refused_busy"), 0))

    def problems(self) -> list:
        """Each value out of range, named by its command-line flag."""
        out = []
        if self.max_connections < 1:
            out.append(f"--max-connections: must be >= 1, got {self.max_connections}")
        if not self.header_timeout > 0:
            out.append(f"--header-timeout: must be > 0, got {self.header_timeout}")
        if self.max_header_bytes < 1024:
            out.append(f"--max-header-kb: must be >= 1, got {self.max_header_bytes / 1024:g}")
        return out

    @property
    def idle_grace(self) -> float:
        """Seconds a connection waits for a request before it may be closed to make room for another."""
        return min(1.0, self.header_timeout / 4)

    def uvicorn_options(self) -> dict:
        """Keyword arguments of uvicorn.run / uvicorn.Config for these limits (no `limit_concurrency`: the cap is
        the protocol's)."""
        return {"http": guarded_protocol(self), "h11_max_incomplete_event_size": self.max_header_bytes}


def _plain(status: int, reason: str, message: str) -> bytes:
    body = (message + "\n").encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def _refusing_app(message: str):
    """An ASGI application answering every request 503 with `message` and closing the connection."""
    body = (message + "\n").encode()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(body)).encode()), (b"retry-after", b"1"),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    return app


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The servers' flags for these rules and the body deadline (the same on both)."""
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                        help=f"Open connections at once (default {DEFAULT_MAX_CONNECTIONS}). One more closes the "
                             "connection that has waited longest without a request in progress; when all have one, "
                             "the newcomer gets HTTP 503.")
    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, metavar="S",
                        help=f"Seconds a connection may take to send a request head, from its opening or from a "
                             f"later head's first byte (default {DEFAULT_HEADER_TIMEOUT:g}); then it is closed "
                             "(HTTP 408).")
    parser.add_argument("--max-header-kb", type=float, default=DEFAULT_MAX_HEADER_BYTES / 1024, metavar="KB",
                        help=f"Largest request head (default {DEFAULT_MAX_HEADER_BYTES // 1024} KiB; HTTP 431 "
                             "beyond).")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT, metavar="S",
                        help=f"Seconds a request body may take, plus 1 s per --min-body-rate MiB received (default "
                             f"{DEFAULT_BODY_TIMEOUT:g}); then HTTP 408 and the connection is closed.")
    parser.add_argument("--min-body-rate", type=float, default=DEFAULT_MIN_BODY_RATE, metavar="MIB_PER_S",
                        help=f"Slowest average rate of a large body, in MiB/s (default {DEFAULT_MIN_BODY_RATE:g}).")


def limits_from_args(args) -> tuple:
    """(ConnectionLimits, body_timeout, min_body_rate) of the flags; ValueError naming each flag out of range."""
    limits = ConnectionLimits(args.max_connections, args.header_timeout, int(args.max_header_kb * 1024))
    problems = limits.problems()
    if not args.body_timeout > 0:
        problems.append(f"--body-timeout: must be > 0, got {args.body_timeout}")
    if not args.min_body_rate > 0:
        problems.append(f"--min-body-rate: must be > 0, got {args.min_body_rate}")
    if problems:
        raise ValueError("; ".join(problems))
    return limits, args.body_timeout, args.min_body_rate


def guarded_protocol(limits: ConnectionLimits) -> type:
    """uvicorn's h11 protocol class with `limits` kept per connection (see the module's docstring)."""
    # deferred: uvicorn loads with a server, not with the command lines that declare its flags (paddle-rl --help)
    from uvicorn.protocols.http.h11_impl import H11Protocol

    first_heads = OrderedDict()   # the server's connections waiting for their first request head, oldest first

    class GuardedH11Protocol(H11Protocol):
        stats = limits.stats

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._waiting_since = None   # monotonic time since when no request is in progress (None: one is)
            self._head_bytes = 0         # bytes received while waiting
            self._head_timer = None
            self._refused = False
            self._answered = 0           # requests answered on this connection
            self._wait_for_head()
            if len(self.connections) > limits.max_connections and not self._make_room():
                # every other connection has a request in progress (or is about to): this one gets 503 at its
                # head, which it has idle_grace seconds to send
                self.stats["refused_busy"] += 1
                self._refused = True
                self.app = _refusing_app(
                    f"server busy: {len(self.connections) - 1} connections open (the cap, max_connections "
                    f"{limits.max_connections}), each with a request in progress or just opened; retry later")
                self._wait_for_head(limits.idle_grace)
            else:
                first_heads[self] = None

        def _make_room(self) -> bool:
            """Close the connection that has waited longest for its first request head, if it has waited over
            idle_grace: a client's keep-alive connection between its requests is kept (uvicorn closes it after
            timeout_keep_alive), and one that has just opened is about to send its request (a burst of clients
            then gets 503s, not closed connections). `first_heads` is in opening order: the first is the oldest."""
            settled = time.monotonic() - limits.idle_grace
            while first_heads:
                oldest = next(iter(first_heads))
                if oldest.transport.is_closing():
                    first_heads.pop(oldest)
                    continue
                if oldest._waiting_since > settled:
                    return False
                oldest._evict()
                return True
            return False

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            first_heads.pop(self, None)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._waiting_since is not None:
                if self._head_timer is None and not self.transport.is_closing():   # a later request's first byte
                    self._head_timer = self.loop.call_later(limits.header_timeout, self._head_deadline)
                self._head_bytes += len(data)
                if self._head_bytes > limits.max_header_bytes and self._head_too_large(data):
                    return
            super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            # h11 stops reading a request head past its largest incomplete event (max_header_bytes); uvicorn
            # answers every parse error with a bare 400: this one is named
            if self._waiting_since is not None and len(self.conn.trailing_data[0]) > limits.max_header_bytes:
                self.stats["header_too_large"] += 1
                return self._close_with(_plain(431, "Request Header Fields Too Large", f"request head over "
                                               f"{limits.max_header_bytes} bytes (max_header_bytes)"))
            super().send_400_response(msg)

        def handle_events(self) -> None:
            super().handle_events()
            if self._waiting_since is not None and self.cycle is not None and not self.cycle.response_complete:
                self._waiting_since = None   # a request head arrived: its body, if any, has the gate's deadline
                self._cancel_head_timer()
                first_heads.pop(self, None)

        def on_response_complete(self) -> None:
            self._answered += 1
            if not self.transport.is_closing():
                # between two requests uvicorn's keep-alive timer closes a silent connection; the head deadline
                # starts with the next head's first byte (data_received)
                self._wait_for_head(arm=False)
            super().on_response_complete()

        # ------------------------------------------------------------------------------------------ helpers
        def _head_too_large(self, data: bytes) -> bool:
            """The request head now read (what h11 holds and `data`) ends past max_header_bytes, or has not ended
            within them: answered 431 and closed (h11 alone lets a head that arrives whole in one read through)."""
            pending = self.conn.trailing_data[0] + data
            end = pending.find(b"\r\n\r\n")
            if (end + 4 if end >= 0 else len(pending)) <= limits.max_header_bytes:
                return False
            self.stats["header_too_large"] += 1
            self._close_with(_plain(431, "Request Header Fields Too Large",
                                    f"request head over {limits.max_header_bytes} bytes (max_header_bytes)"))
            return True

        def _wait_for_head(self, timeout: Optional[float] = None, arm: bool = True) -> None:
            self._waiting_since, self._head_bytes = time.monotonic(), 0
            self._cancel_head_timer()
            if arm:
                self._head_timer = self.loop.call_later(timeout or limits.header_timeout, self._head_deadline)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_deadline(self) -> None:
            self._head_timer = None
            if self._waiting_since is None or self.transport.is_closing():
                return
            if self._refused:   # over the cap, and no whole head within idle_grace
                return self._close_with(_plain(503, "Service Unavailable", f"server busy: over the cap of "
                                               f"{limits.max_connections} connections (max_connections)")
                                        if self._head_bytes else b"")
            self.stats["header_timeouts"] += 1
            if self._head_bytes:
                self._close_with(_plain(408, "Request Timeout", f"request head not complete after "
                                        f"{limits.header_timeout:g} s (header_timeout)"))
            else:
                self._close_with(b"")

        def _evict(self) -> None:
            """Closed to make room for a new connection: no request was in progress."""
            self.stats["evicted_idle"] += 1
            if self._head_bytes:
                self._close_with(_plain(503, "Service Unavailable", f"connection closed: over the cap of "
                                        f"{limits.max_connections} connections (max_connections), and this one "
                                        "had the oldest unfinished request head"))
            else:
                self._close_with(b"")

        def _close_with(self, answer: bytes) -> None:
            self._cancel_head_timer()
            first_heads.pop(self, None)
            self._waiting_since = None
            if answer:
                self.transport.write(answer)
            self.transport.close()

    return GuardedH11Protocol


def _exit(signum, frame):
    raise SystemExit(0)


def serve(app, host: str, port: int, **options) -> None:
    """uvicorn.run, with a stop by SIGTERM ending as a normal exit. uvicorn shuts the server down on SIGTERM (the
    app's shutdown runs: the reward server's workers stop) and then raises the signal again under the handler it
    found; Python's default one ends the process at once, before its exit handlers, so multiprocessing's folder
    (`pymp-*` in TMPDIR, its forkserver's socket) stayed behind. The handler it finds here exits through them."""
    # deferred: uvicorn loads with a server, not with the parsers that import this module
    import uvicorn
    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        uvicorn.run(app, host=host, port=port, **options)
    finally:
        signal.signal(signal.SIGTERM, previous)
