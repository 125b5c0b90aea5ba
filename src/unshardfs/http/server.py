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
  or in one piece (`framing.HeadReader` counts them); a head must
  arrive whole within `header_seconds` of its first byte; an idle
  connection closes after `keep_alive_seconds`.
- request framing: heads and bodies are read as strictly as RFC 9112 writes
  them (`framing`): whatever a lenient reader, such as a proxy in front, could
  frame differently is refused with a 400 (or 501, 413) and the connection
  closed, so no byte of one request is ever read as another. A body is read
  only to be dropped (no method here takes one), up to `framing.BODY_BYTES`;
  head and body must arrive whole within `header_seconds` of the first byte.
- closing: after its last answer a connection stops sending and takes what
  the client still sends for up to LINGER_SECONDS (LINGER_BYTES), so the
  kernel does not reset it and discard that answer unread.
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
from typing import Any, Awaitable, Callable, Sequence

import h11
import trio

from unshardfs.http.framing import BodyReader, HeadReader, Refusal, body_reader

log = logging.getLogger(__name__)

Message = dict[str, Any]
App = Callable[[Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

RECEIVE = 1 << 16  # bytes per receive: what a connection may hold beyond a head in progress
COALESCE = 1 << 16  # a response head and body pieces up to this size go out in one write
LINGER_SECONDS = 1.0  # after the last answer, what the client still sends is taken this long...
LINGER_BYTES = 256 << 10  # ...and up to this much
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


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


class _Gone(Exception):
    """The client closed its side, or stopped taking an interim answer: the connection ends unanswered."""


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
        self.waiting: OrderedDict[_ServedConnection, None] = OrderedDict()  # oldest first: evicted first
        self.sending: OrderedDict[_ServedConnection, int] = OrderedDict()  # bytes held, longest without progress first
        self.held = 0
        self.stopping = False
        self.date = _Date()
        self.counters = {"connections": 0, "refused": 0, "evicted_idle": 0, "dropped_slow": 0,
                         "dropped_for_memory": 0, "bad_requests": 0, "head_timeouts": 0}

    def stats(self) -> dict[str, int]:
        return {**self.counters, "open": self.open, "held_bytes": self.held,
                "max_connections": self.limits.max_connections}

    async def serve(self, listeners: Sequence[trio.abc.Listener[trio.SocketStream]], stop: trio.Event) -> None:
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as accepting:
                accepting.start_soon(self._accept_until, listeners, connections, stop, accepting.cancel_scope)
            # Stopping: no new requests; idle connections close now, answers in progress get a grace period.
            self.stopping = True
            for conn in list(self.waiting):
                conn.scope.cancel()
            connections.cancel_scope.deadline = trio.current_time() + self.limits.graceful_seconds

    async def _accept_until(self, listeners: Sequence[trio.abc.Listener[trio.SocketStream]],
                            connections: trio.Nursery, stop: trio.Event, scope: trio.CancelScope) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.serve_listeners, self._handle, list(listeners), handler_nursery=connections))
            await stop.wait()
            scope.cancel()

    # -- connection slots -----------------------------------------------------------

    async def _handle(self, stream: trio.SocketStream) -> None:
        if self.open >= self.limits.max_connections and not self._evict_waiting():
            self.counters["refused"] += 1
            await _ServedConnection(self, stream).refuse(503, "too many connections", linger=False)
            await stream.aclose()
            return
        conn = _ServedConnection(self, stream)
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

    def _release(self, conn: _ServedConnection) -> None:
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

    def _drop(self, conn: _ServedConnection) -> None:
        conn.scope.cancel()
        self._release(conn)

    # -- response memory ----------------------------------------------------------

    def hold(self, conn: _ServedConnection, size: int) -> None:
        """Account `size` bytes `conn` is about to write; past the budget, drop the writers whose clients
        have taken nothing for longest (`progressed`)."""
        self.sending[conn] = size
        self.held += size
        while self.held > self.limits.buffer_bytes:
            oldest = next(iter(self.sending))
            if oldest is conn:
                break  # alone over budget: one piece per connection is the floor
            self.counters["dropped_for_memory"] += 1
            self._drop(oldest)

    def progressed(self, conn: _ServedConnection) -> None:
        """`conn`'s client took bytes: its writer goes behind every writer blocked longer, so the budget
        drops the clients that take nothing before one that reads, however slowly."""
        if conn in self.sending:
            self.sending.move_to_end(conn)

    def unhold(self, conn: _ServedConnection) -> None:
        self.held -= self.sending.pop(conn, 0)


class _ServedConnection:
    """One client: requests read one at a time (framed here, then parsed by h11), each answered by the app
    before the next is read."""

    def __init__(self, server: Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.limits = server.limits
        self.stream = stream
        # h11 is given each head once it is checked and its body dropped, without the body's framing fields.
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        self.buffer = bytearray()  # received, not yet taken: the head in progress, then pipelined requests
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
                if not self.complete:
                    return  # cut short
                if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                    await self._linger()  # Connection: close, HTTP/1.0, or an upgrade declined
                    return
                self.h11.start_next_cycle()

    # -- reading ------------------------------------------------------------------

    async def _next_request(self) -> h11.Request | None:
        """The next request once its head is read and checked and its body dropped; None once the
        connection is to end (refused, timed out, or closed by the client)."""
        server = self.server
        server.waiting[self] = None
        deadline = trio.current_time() + self.limits.keep_alive_seconds
        if self.buffer:
            deadline = min(deadline, trio.current_time() + self.limits.header_seconds)
        try:
            reader = HeadReader(self.limits.max_header_bytes, self.limits.max_target_bytes)
            while (head := reader.read(self.buffer)) is None:
                started = bool(self.buffer)
                if not await self._receive_until(deadline):
                    await self._timed_out(started)
                    return None
                if not started:
                    deadline = min(deadline, trio.current_time() + self.limits.header_seconds)
            del self.buffer[:head.size]
            body = body_reader(head)
            if body is not None and not self._drop_body(body):
                if head.expects_continue():  # the client waits for this before it sends the body
                    await self._interim(CONTINUE)
                while not self._drop_body(body):
                    if not await self._receive_until(deadline):
                        await self._timed_out(True)
                        return None
        except Refusal as e:
            server.counters["bad_requests"] += 1
            await self.refuse(e.status, str(e))
            return None
        except (trio.BrokenResourceError, trio.ClosedResourceError, _Gone):
            return None
        finally:
            server.waiting.pop(self, None)
        self.h11.receive_data(head.without_framing())
        try:
            request, end = self.h11.next_event(), self.h11.next_event()
        except h11.RemoteProtocolError:  # not after the checks above: h11 is the more lenient reader
            request = end = h11.NEED_DATA
        if not isinstance(request, h11.Request) or not isinstance(end, h11.EndOfMessage):
            server.counters["bad_requests"] += 1
            await self.refuse(400, "malformed request")
            return None
        return request

    async def _receive_until(self, deadline: float) -> bool:
        """More bytes onto the buffer; False once `deadline` passes; _Gone when the client has closed."""
        with trio.move_on_at(deadline):
            data = await self.stream.receive_some(RECEIVE)
            if not data:
                raise _Gone
            self.buffer += data
            return True
        return False

    def _drop_body(self, body: BodyReader) -> bool:
        """Take what of the body the buffer holds; whether it is all taken."""
        taken, done = body.read(self.buffer)
        del self.buffer[:taken]
        return done

    async def _timed_out(self, started: bool) -> None:
        """A request that did not arrive in time is a 408; an idle keep-alive connection closes without a word."""
        if started:
            self.server.counters["head_timeouts"] += 1
            await self.refuse(408, "request too slow")

    async def _interim(self, head: bytes) -> None:
        """An interim (1xx) response, sent on its own: h11 only knows final ones."""
        with trio.move_on_after(self.limits.send_timeout_seconds) as timer:
            await self.stream.send_all(head)
        if timer.cancelled_caught:
            raise _Gone

    async def refuse(self, status: int, text: str, linger: bool = True) -> None:
        """Answer `status` without h11 (there is no request it could answer) and have the connection end."""
        with trio.move_on_after(1) as timer:
            try:
                await self.stream.send_all(_bare(status, text))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
        if linger and not timer.cancelled_caught:  # a client that takes no answer is not waited for
            await self._linger()
        return None

    async def _linger(self) -> None:
        """Stop sending and take what the client still sends, for a moment: closing a socket with
        unread bytes resets the connection, and a reset can discard the answer before it is read."""
        with trio.move_on_after(LINGER_SECONDS):
            try:
                await self.stream.send_eof()
                taken = 0
                while taken < LINGER_BYTES and (data := await self.stream.receive_some(RECEIVE)):
                    taken += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

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
        self.closing = self.server.stopping
        try:
            await self.server.app(scope, self._receive, self._send)
        except Exception:  # noqa: BLE001 - the app's own bug (it answers its failures): end this connection only
            log.exception("request %r failed", target[:200])
            self.complete = False
            if not self.wrote:
                await self.refuse(500, "internal error")

    async def _receive(self) -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def _send(self, message: Message) -> None:
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
                        self.server.progressed(self)
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

