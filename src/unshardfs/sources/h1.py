"""A small HTTP/1.1 client for a byte source: h11 on trio streams and a connection pool of our own.

Why not httpx's transport: a sharded read is a few large ranged GETs, and
httpx/httpcore receive a body 64 KiB at a time through anyio, h11's receive
buffer and a join, copying it four times, and their pool scans every
connection (a readability syscall each) per request and per response
closed. Measured on this machine (loopback, one connection): a 4 MiB body
cost 12 ms of CPU through httpx's transport, 8 ms through httpcore alone and
3 ms here. So h11 (httpx's own dependency) parses and validates what it is
good at -- the request we send (no header injection) and the response head
(status line, header syntax, conflicting Content-Length, chunked framing) --
and a body whose length the head declares is received straight into
buffers of that length (pieces of at most 1 MiB) with `recv_into`.

What a hostile server can do here is what `HttpSource` bounds: a declared
length over the caller's limit is refused before any of it is read, a body
cut short is an error, bytes beyond the declared length are never read as
the next answer (the connection is dropped), every wait for a byte has a
timeout, and a pooled connection the server closed or wrote to while idle is
dropped before reuse.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, cast
from urllib.parse import quote, urlsplit

import h11
import trio

KEEPALIVE = 5.0  # seconds an idle connection is kept (as httpx does)
HEAD_LIMIT = 64 << 10  # bytes of a response head (status line and headers)
RECEIVE_SIZE = 256 << 10  # bytes asked of the stream per receive where `recv_into` cannot be used
BODY_PIECE = 1 << 20  # a body is received into buffers of at most this size, each once its turn comes
# A request target keeps what is already valid URL syntax (our paths arrive percent-quoted);
# anything else (a space or non-ASCII in a redirect's Location) is quoted rather than refused.
TARGET_SAFE = "!#$%&'()*+,/:;=?@[]~"


class TransportError(Exception):
    """A request failed on the wire: connecting, a protocol error, a cut connection or a timeout."""


class ConnectError(TransportError):
    pass


class ConnectTimeout(TransportError):
    pass


class ReadTimeout(TransportError):
    pass


class WriteTimeout(TransportError):
    pass


class RemoteProtocolError(TransportError):
    pass


@dataclass
class Request:
    """An outgoing request; `authorize` hooks may add headers (credentials, signatures)."""

    method: str
    url: str
    headers: dict[str, str]


@dataclass(frozen=True)
class Endpoint:
    """Where a URL's request goes, and what it asks for there."""

    scheme: str
    host: str
    port: int
    authority: str  # the Host header
    target: str  # path and query

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


@lru_cache(maxsize=1024)
def endpoint(url: str) -> Endpoint:
    """The endpoint of an http(s) URL (cached: a source asks for the same few shard URLs again and again)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConnectError(f"not an http(s) URL: {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise ConnectError(f"invalid port in {url!r}: {e}") from None
    target = quote(parts.path or "/", safe=TARGET_SAFE) + (f"?{quote(parts.query, safe=TARGET_SAFE)}"
                                                           if parts.query else "")
    return Endpoint(parts.scheme, parts.hostname, port, parts.netloc.rpartition("@")[2], target)


def headers_of(fields: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """Header fields as a dict of lower-case names; repeated fields joined with ", " (RFC 9110 5.3)."""
    out: dict[str, str] = {}
    for name, value in fields:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        out[key] = f"{out[key]}, {text}" if key in out else text
    return out


def default_ssl_context() -> ssl.SSLContext:
    """Certificates verified as httpx does: SSL_CERT_FILE / SSL_CERT_DIR if set, else certifi's
    bundle if installed, else the system's."""
    cafile, capath = os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")
    if not cafile and not capath:
        try:
            import certifi

            cafile = certifi.where()
        except ImportError:
            pass
    context = ssl.create_default_context(cafile=cafile or None, capath=capath or None)
    context.set_alpn_protocols(["http/1.1"])
    return context


class _Connection:
    """One keep-alive connection: a trio stream over `socket`; with `into`, bodies are received
    straight into their buffer (plain TCP), else through the stream (TLS)."""

    def __init__(self, stream: trio.abc.Stream, socket: trio.socket.SocketType, into: bool) -> None:
        self.stream = stream
        self.socket = socket
        self.into = into
        self.idle_since = 0.0

    async def receive_into(self, view: memoryview) -> int:
        if self.into:
            return await self.socket.recv_into(view, len(view))
        data = await self.stream.receive_some(min(len(view), RECEIVE_SIZE))
        view[:len(data)] = data
        return len(data)

    def stale(self, now: float) -> bool:
        """Whether an idle connection must not be reused: kept too long, or the server wrote to it
        (a close, or bytes nobody asked for) while it was idle."""
        return now - self.idle_since > KEEPALIVE or self.socket.is_readable()

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


class Response:
    """A response whose head has been read; `read` its body, then `aclose` (which pools the connection
    when the exchange ended cleanly)."""

    def __init__(self, pool: Pool, key: tuple[str, str, int], conn: _Connection, protocol: h11.Connection,
                 head: h11.Response, method: str, timeout: float) -> None:
        self.status = head.status_code
        self.headers = headers_of(head.headers)
        self._pool = pool
        self._key = key
        self._conn: _Connection | None = conn
        self._protocol = protocol
        self._timeout = timeout
        self._bodiless = method == "HEAD" or self.status in (204, 304)
        self._keep_alive = head.http_version == b"1.1" and "close" not in self.headers.get("connection", "").lower()
        self._reusable = False

    async def read(self, limit: int) -> bytes | None:
        """The body, or None as soon as it proves longer than `limit` bytes: a declared length says so
        before anything is read, an undeclared one after at most one receive more."""
        if self._conn is None:
            raise RemoteProtocolError("body already read")
        length = self.headers.get("content-length")
        if self._bodiless or length is None or "transfer-encoding" in self.headers:
            return await self._read_framed(limit)
        size = int(length)  # h11 accepted the head: one run of digits
        if size > limit:
            return None
        return await self._read_exact(size)

    async def _read_exact(self, size: int) -> bytes:
        """A body of a declared length, received in place into pieces of at most BODY_PIECE bytes:
        a declared length costs memory only as its bytes arrive (a server announcing the whole
        allowed size and then stalling holds one piece, not all of it)."""
        conn = self._conn
        assert conn is not None
        early, _closed = self._protocol.trailing_data  # what came with the head
        parts: list[bytes | bytearray] = [early[:size]] if early else []
        got = min(len(early), size)
        scope = trio.CancelScope()
        with scope:
            while got < size:
                piece = bytearray(min(BODY_PIECE, size - got))
                parts.append(piece)
                view = memoryview(piece)
                filled = 0
                while filled < len(piece):
                    scope.deadline = trio.current_time() + self._timeout
                    try:
                        received = await conn.receive_into(view[filled:])
                    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                        raise RemoteProtocolError(f"connection lost after {got} of {size} body bytes: {e}") from None
                    if not received:
                        raise RemoteProtocolError(f"server closed the connection after {got} of {size} body bytes")
                    filled += received
                    got += received
        if scope.cancelled_caught:
            raise ReadTimeout(f"no body bytes for {self._timeout:g} s ({got} of {size} received)")
        # More than the declared length already here: never read that as the next answer.
        self._reusable = self._keep_alive and len(early) <= size
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)

    async def _read_framed(self, limit: int) -> bytes | None:
        """A chunked, undeclared (until close) or absent body, framed by h11."""
        protocol, conn = self._protocol, self._conn
        assert conn is not None
        parts: list[bytes] = []
        got = 0
        while True:
            event = await self._pool.next_event(conn, protocol, self._timeout)
            if type(event) is h11.Data:
                got += len(event.data)
                if got > limit:
                    return None
                parts.append(bytes(event.data))
            elif type(event) is h11.EndOfMessage:
                break
            else:
                raise RemoteProtocolError(f"unexpected {type(event).__name__} in a response body")
        self._reusable = (protocol.our_state is h11.DONE and protocol.their_state is h11.DONE
                          and not protocol.trailing_data[0])
        return b"".join(parts)

    async def aclose(self) -> None:
        if self._bodiless and not self._reusable and self._conn is not None:
            # A HEAD (or 204/304) answer ends with its head: h11 says so without receiving
            # anything, and the connection can serve the next request (stats are HEADs).
            try:
                await self._read_framed(0)
            except TransportError:
                pass
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._reusable:
            self._pool.release(self._key, conn)
        else:
            await conn.aclose()


class Pool:
    """Keep-alive connections per endpoint, at most `max_idle` of them idle (the caller bounds how
    many are busy). Each wait -- connecting, sending, each receive -- times out after `timeout`."""

    def __init__(self, max_idle: int, ssl_context: Callable[[], ssl.SSLContext] = default_ssl_context) -> None:
        self.max_idle = max_idle
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._idle_count = 0
        self._ssl_factory = ssl_context
        self._ssl: ssl.SSLContext | None = None
        self.connections = 0  # opened so far (tests count reuse)

    async def send(self, request: Request, timeout: float) -> Response:
        """Send `request` and read the response head (1xx answers skipped)."""
        where = endpoint(request.url)
        conn = await self._connection(where, timeout)
        protocol = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)
        try:
            headers = [("Host", where.authority), *request.headers.items()]
            data = protocol.send(h11.Request(method=request.method, target=where.target, headers=headers))
            data += protocol.send(h11.EndOfMessage())
            with trio.move_on_after(timeout) as scope:
                await conn.stream.send_all(data)
            if scope.cancelled_caught:
                raise WriteTimeout(f"request not sent within {timeout:g} s")
            while True:
                event = await self.next_event(conn, protocol, timeout)
                if type(event) is h11.Response:
                    return Response(self, where.key, conn, protocol, event, request.method, timeout)
                if type(event) is not h11.InformationalResponse:
                    raise RemoteProtocolError(f"unexpected {type(event).__name__} instead of a response")
        except BaseException as e:
            await conn.aclose()
            if isinstance(e, h11.ProtocolError):
                raise RemoteProtocolError(str(e)) from None
            if isinstance(e, (OSError, trio.BrokenResourceError, trio.ClosedResourceError)):
                raise RemoteProtocolError(f"connection lost: {e}" if str(e) else "connection lost") from None
            raise

    async def next_event(self, conn: _Connection, protocol: h11.Connection, timeout: float) -> object:
        """h11's next event, receiving as it needs (each receive within `timeout`)."""
        while True:
            try:
                event = protocol.next_event()
            except h11.ProtocolError as e:
                raise RemoteProtocolError(str(e)) from None
            if event is not h11.NEED_DATA:
                return event
            with trio.move_on_after(timeout) as scope:
                try:
                    data = await conn.stream.receive_some(RECEIVE_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                    raise RemoteProtocolError(f"connection lost: {e}" if str(e) else "connection lost") from None
            if scope.cancelled_caught:
                raise ReadTimeout(f"no answer for {timeout:g} s")
            try:
                protocol.receive_data(cast(bytes, data))  # b"": the server closed the connection
            except RuntimeError as e:  # receive_data after EOF was already seen
                raise RemoteProtocolError(str(e)) from None

    async def _connection(self, where: Endpoint, timeout: float) -> _Connection:
        idle = self._idle.get(where.key)
        now = trio.current_time()
        while idle:
            conn = idle.pop()
            self._idle_count -= 1
            if not conn.stale(now):
                return conn
            await conn.aclose()
        self.connections += 1
        with trio.move_on_after(timeout) as scope:
            try:
                tcp = await trio.open_tcp_stream(where.host, where.port)
            except OSError as e:
                raise ConnectError(f"cannot connect to {where.host}:{where.port}: {e}") from None
            if where.scheme == "http":
                return _Connection(tcp, tcp.socket, into=True)
            if self._ssl is None:
                self._ssl = self._ssl_factory()
            tls = trio.SSLStream(tcp, self._ssl, server_hostname=where.host, https_compatible=True)
            try:
                await tls.do_handshake()
            except BaseException as e:  # a failed handshake, or the timeout: the socket is not kept
                await trio.aclose_forcefully(tcp)
                if isinstance(e, trio.BrokenResourceError):
                    raise ConnectError(f"TLS with {where.host}:{where.port} failed: {e.__cause__ or e}") from None
                raise
            return _Connection(tls, tcp.socket, into=False)
        raise ConnectTimeout(f"no connection to {where.host}:{where.port} within {timeout:g} s")

    def release(self, key: tuple[str, str, int], conn: _Connection) -> None:
        if self._idle_count >= self.max_idle:
            conn.socket.close()  # over the bound: dropped (a TLS stream without its close_notify)
            return
        conn.idle_since = trio.current_time()
        self._idle.setdefault(key, []).append(conn)
        self._idle_count += 1

    async def aclose(self) -> None:
        idle, self._idle, self._idle_count = self._idle, {}, 0
        for conns in idle.values():
            for conn in conns:
                await conn.aclose()
