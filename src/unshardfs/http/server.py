"""A small HTTP/1.1 server (h11 on trio) for one ASGI-style app, built to hold its ground against its clients.

`serve` binds to networks where it will meet clients that stop reading,
hold connections open, drip their headers or send oversized ones. Every
resource a client can tie up here has a bound and a clock:

- connections: at most `ServerLimits.max_connections` (kept well below the file
  descriptor limit by `serve`); a new connection over the limit closes the
  one that has waited longest for a request (idle keep-alive, or still
  sending its head), so idle and dripping clients cannot lock others out;
  when every connection is busy answering, the newcomer gets a 503.
- request heads: `max_header_bytes` in all, whether they arrive in pieces
  (h11's incomplete-event limit) or in one piece (counted here); a head must
  arrive whole within `header_seconds` of its first byte; an idle
  connection closes after `keep_alive_seconds`. Request bodies are never
  read: a request that declares one is a 413 and ends its connection.
- responses: a client that takes no byte of its answer for
  `send_timeout_seconds` is dropped; the bytes held
  for clients that have not taken them yet are bounded in total by
  `buffer_bytes`, and when a new piece would pass that bound the
  connection blocked longest is dropped instead.

No HTTP/2, upgrades or WebSockets: each is a further surface with its own
state per connection, and a plain HTTP/1.1 reader needs none of them.

The app is called like an ASGI application (scope, receive, send) with
`http` scopes only; `send` never returns to an app whose client is gone: the
connection is cancelled (trio.Cancelled, which `except Exception` lets pass).
"""

from __future__ import annotations

import email.utils
import logging
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache, partial
from http import HTTPStatus
from typing import Awaitable, Callable, Sequence

import h11
import trio

log = logging.getLogger(__name__)

App = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

RECEIVE = 1 << 16  # bytes per receive: what h11 may hold beyond a head in progress
COALESCE = 1 << 16  # a response head and body pieces up to this size go out in one write


@dataclass(frozen=True)
class ServerLimits:
    """What one client may hold of the server, and for how long."""

    max_connections: int = 512
    max_header_bytes: int = 16 << 10  # request line and headers together (431 beyond)
    max_target_bytes: int = 8 << 10  # the request target (414 beyond)
    keep_alive_seconds: float = 30  # idle between requests
    header_seconds: float = 10  # from a head's first byte to its end (slow senders)
    send_timeout_seconds: float = 30  # a client that takes no byte for this long is dropped
    buffer_bytes: int = 64 << 20  # response bytes held for slow clients, all connections together
    graceful_seconds: float = 2  # answers in progress may finish this long after a stop



# The client's state once a request without a body is read (HTTP/1.0, or an upgrade we will decline).
_REQUEST_READ = (h11.DONE, h11.MUST_CLOSE, h11.MIGHT_SWITCH_PROTOCOL)


@lru_cache(maxsize=64)
def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _bare(status: int, text: str = "") -> bytes:
    """A complete response that closes the connection, for when h11 has no request to answer."""
    body = (text + "\n").encode() if text else b""
    return (b"HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, _reason(status), len(body))) + body


class _Date:
    """The Date header, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def __call__(self) -> bytes:
        now = int(trio.current_time())  # only the change of second matters
        if now != self._second:
            self._second = now
            self._value = email.utils.formatdate(usegmt=True).encode()
        return self._value


class Server:
    """Serves `app` on listeners until `stop` is set; `stats()` counts what the limits did."""

    def __init__(self, app: App, limits: ServerLimits | None = None) -> None:
        self.app = app
        self.limits = limits or ServerLimits()
        self.open = 0  # connections holding a slot
        self.waiting: OrderedDict[_Connection, None] = OrderedDict()  # oldest first: evicted first
        self.sending: OrderedDict[_Connection, int] = OrderedDict()  # bytes held, longest blocked first
        self.held = 0
        self.stopping = False
        self.date = _Date()
        self.counters = {"connections": 0, "refused": 0, "evicted_idle": 0, "dropped_slow": 0,
                         "dropped_for_memory": 0, "bad_requests": 0, "head_timeouts": 0}

    def stats(self) -> dict:
        return {**self.counters, "open": self.open, "held_bytes": self.held,
                "max_connections": self.limits.max_connections}

    async def serve(self, listeners: Sequence[trio.abc.Listener], stop: trio.Event) -> None:
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as accepting:
                accepting.start_soon(self._accept_until, listeners, connections, stop, accepting.cancel_scope)
            # Stopping: no new requests; idle connections close now, answers in progress get a grace period.
            self.stopping = True
            for conn in list(self.waiting):
                conn.scope.cancel()
            connections.cancel_scope.deadline = trio.current_time() + self.limits.graceful_seconds

    async def _accept_until(self, listeners, connections, stop: trio.Event, scope: trio.CancelScope) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.serve_listeners, self._handle, listeners, handler_nursery=connections))
            await stop.wait()
            scope.cancel()

    # -- connection slots -----------------------------------------------------------

    async def _handle(self, stream: trio.SocketStream) -> None:
        if self.open >= self.limits.max_connections and not self._evict_waiting():
            self.counters["refused"] += 1
            await _Connection(self, stream).refuse(503, "too many connections")
            await stream.aclose()
            return
        conn = _Connection(self, stream)
        self.open += 1
        self.counters["connections"] += 1
        try:
            await conn.run()
        except Exception:  # noqa: BLE001 - a bug here ends this connection, never the server
            log.exception("connection failed")
        finally:
            self._release(conn)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    def _release(self, conn: _Connection) -> None:
        if not conn.evicted:
            self.open -= 1
            conn.evicted = True
        self.waiting.pop(conn, None)
        self.held -= self.sending.pop(conn, 0)

    def _evict_waiting(self) -> bool:
        """Close the connection that has waited longest for a request, freeing its slot now."""
        if not self.waiting:
            return False
        conn, _ = self.waiting.popitem(last=False)
        self.counters["evicted_idle"] += 1
        self._drop(conn)
        return True

    def _drop(self, conn: _Connection) -> None:
        conn.scope.cancel()
        self._release(conn)

    # -- response memory ----------------------------------------------------------

    def hold(self, conn: _Connection, size: int) -> None:
        """Account `size` bytes `conn` is about to write; drop the longest-blocked writers past the budget."""
        self.sending[conn] = size
        self.held += size
        while self.held > self.limits.buffer_bytes:
            oldest = next(iter(self.sending))
            if oldest is conn:
                break  # alone over budget: one piece per connection is the floor
            self.counters["dropped_for_memory"] += 1
            self._drop(oldest)

    def unhold(self, conn: _Connection) -> None:
        self.held -= self.sending.pop(conn, 0)


class _Connection:
    """One client: requests read with h11 one at a time, each answered by the app before the next is read."""

    def __init__(self, server: Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.limits = server.limits
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        self.scope = trio.CancelScope()
        self.evicted = False
        self.head: bytes = b""  # the response head, sent with the first body piece
        self.closing = False
        self.complete = False
        self.wrote = False  # any byte of the current response on the wire

    async def run(self) -> None:
        with self.scope:
            while not self.server.stopping:
                request = await self._next_request()
                if request is None:
                    return
                await self._answer(request)
                if not self.complete or self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                    return  # cut short, Connection: close, or a body we never read
                self.h11.start_next_cycle()

    # -- reading ------------------------------------------------------------------

    async def _next_request(self) -> h11.Request | None:
        server = self.server
        server.waiting[self] = None
        deadline = trio.current_time() + self.limits.keep_alive_seconds
        started = bool(self.h11.trailing_data[0])
        if started:
            deadline = min(deadline, trio.current_time() + self.limits.header_seconds)
        try:
            while True:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError as e:
                    server.counters["bad_requests"] += 1
                    await self.refuse(e.error_status_hint, "malformed request")
                    return None
                if isinstance(event, h11.Request):
                    self._end_of_head()
                    return await self._checked(event)
                if event is not h11.NEED_DATA:  # ConnectionClosed (PAUSED cannot happen between cycles)
                    return None
                with trio.move_on_at(deadline):
                    data = await self.stream.receive_some(RECEIVE)
                    if not started and data:
                        started = True
                        deadline = min(deadline, trio.current_time() + self.limits.header_seconds)
                    self.h11.receive_data(data)
                    continue
                if started:
                    server.counters["head_timeouts"] += 1
                    await self.refuse(408, "request head too slow")
                    return None
                return None  # idle keep-alive over
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return None
        finally:
            server.waiting.pop(self, None)

    def _end_of_head(self) -> None:
        """Take h11's EndOfMessage of a request without a body, so its state says DONE (a body leaves it not)."""
        try:
            self.h11.next_event()
        except h11.RemoteProtocolError:
            pass  # a malformed body (chunk size): never read; the request's state stays not DONE

    async def _checked(self, request: h11.Request) -> h11.Request | None:
        """The request, or None once refused: h11 bounds heads that arrive in pieces, this the rest."""
        size = len(request.method) + len(request.target) + 12 + sum(len(k) + len(v) + 4 for k, v in request.headers)
        if len(request.target) > self.limits.max_target_bytes:
            self.server.counters["bad_requests"] += 1
            await self.refuse(414, "request target too long")
            return None
        if size > self.limits.max_header_bytes:
            self.server.counters["bad_requests"] += 1
            await self.refuse(431, "request headers too large")
            return None
        return request

    async def refuse(self, status: int, text: str) -> None:
        """Answer `status` without h11 (there is no request it could answer) and have the connection end."""
        with trio.move_on_after(1):
            try:
                await self.stream.send_all(_bare(status, text))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        return None

    # -- answering ----------------------------------------------------------------

    async def _answer(self, request: h11.Request) -> None:
        target = request.target
        path, _, query = target.partition(b"?")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": request.http_version.decode(),
                 "method": request.method.decode("ascii", "replace").upper(),
                 "scheme": "http", "path": path.decode("latin-1"), "raw_path": target, "query_string": query,
                 "headers": list(request.headers), "client": None, "server": None}
        self.head = b""
        self.complete = False
        self.wrote = False
        if self.h11.their_state not in _REQUEST_READ:  # a body: a read-only server never reads one
            self.server.counters["bad_requests"] += 1
            await self.refuse(413, "request bodies are not accepted")
            return
        self.closing = self.server.stopping
        try:
            await self.server.app(scope, self._receive, self._send)
        except Exception:  # noqa: BLE001 - the app's own bug (it answers its failures): end this connection only
            log.exception("request %r failed", target[:200])
            self.complete = False
            if not self.wrote:
                await self.refuse(500, "internal error")

    async def _receive(self) -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def _send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = [(b"date", self.server.date()), *message.get("headers", [])]
            if self.closing:
                headers.append((b"connection", b"close"))
            status = message["status"]
            self.head = self.h11.send(h11.Response(status_code=status, headers=headers, reason=_reason(status)))
            return
        if kind != "http.response.body":
            return
        body = message.get("body", b"")
        parts = [self.head] if self.head else []
        self.head = b""
        if body:
            parts += self.h11.send_with_data_passthrough(h11.Data(data=body)) or []
        if not message.get("more_body", False):
            parts.append(self.h11.send(h11.EndOfMessage()))
            self.complete = True
        await self._write(parts)

    async def _write(self, parts: list[bytes]) -> None:
        size = sum(len(p) for p in parts)
        if size <= COALESCE:
            parts = [b"".join(parts)]
        self.server.hold(self, size)
        self.wrote = True
        sock = self.stream.socket
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    # Each send takes what the socket has room for: the timeout measures progress.
                    with trio.move_on_after(self.limits.send_timeout_seconds) as timer:
                        view = view[await sock.send(view):]
                    if timer.cancelled_caught:
                        self.server.counters["dropped_slow"] += 1
                        self._cancel()
                        await trio.lowlevel.checkpoint()  # raises Cancelled: the app does not go on
        except (OSError, trio.ClosedResourceError):  # the client is gone (reset, broken pipe)
            self._cancel()
            await trio.lowlevel.checkpoint()
        finally:
            self.server.unhold(self)

    def _cancel(self) -> None:
        self.scope.cancel()


def listen(bind: str, port: int, backlog: int = 4096) -> list[trio.SocketListener]:
    """Listening sockets for `bind`:`port` (port 0: a free one), as trio listeners.

    The backlog is long (the kernel caps it at net.core.somaxconn): when it is full the kernel drops
    new connections and their clients retry a second later, so a burst of connections from one client
    would delay every newcomer. Accepted, they cost little: the longest-waiting is closed at the cap.
    """
    import socket

    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return [trio.SocketListener(trio.socket.from_stdlib_socket(sock))]


def url_of(listener: trio.SocketListener) -> str:
    host, port = listener.socket.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

