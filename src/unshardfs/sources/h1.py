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
dropped before reuse (over TLS also when bytes wait decrypted or still
encrypted inside the stream, where the socket's readability cannot see them).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from typing import Callable, Iterable, Iterator, cast
from urllib.parse import quote, urlsplit

import h11
import trio

from unshardfs.util.rawbytes import fresh_bytes
from unshardfs.util.triofast import tls_holds_bytes

KEEPALIVE = 5.0  # seconds an idle connection is kept (as httpx does)
HEAD_LIMIT = 64 << 10  # bytes of a response head (status line and headers)
# Header fields of one answer (Python's http.client allows 100). h11 bounds a head's bytes only
# while it is incomplete: one arriving whole in a receive may be up to RECEIVE_SIZE.
MAX_FIELDS = 256
RECEIVE_SIZE = 256 << 10  # bytes asked of the stream per receive where `recv_into` cannot be used
# 1xx answers (100 Continue, 103 Early Hints) skipped before the response: a server sends one or
# two; one sending them without end would hold the request until its deadline.
MAX_INFORMATIONAL = 8
BODY_PIECE = 1 << 20  # a body is received into buffers of at most this size, each once its turn comes
# Pieces kept for the next bodies: a fresh piece is zeroed and page-faulted in (about 14 faults per
# 32 KiB chunk prefetched, a tenth of the daemon's CPU over HTTP), a kept one is neither. Bodies
# under SPARE_MIN are small enough for the allocator's own free lists.
SPARES = 8
SPARE_MIN = 64 << 10
# Bodies of IN_PLACE_MIN to IN_PLACE_MAX bytes are received into the bytes object returned (no
# pieces, no join: `rawbytes`); a larger declared length is received piecewise, as its bytes
# arrive. The object is allocated before its bytes arrive but not written: the pages of a large
# one become resident as bytes land in them.
IN_PLACE_MIN = SPARE_MIN
IN_PLACE_MAX = 32 << 20
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
class ClientRequest:
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
    values: dict[str, list[str]] = {}
    for name, value in fields:
        values.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))
    return {key: ", ".join(texts) for key, texts in values.items()}


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


def _pieces(count: int, kept: list[bytes | bytearray | memoryview] | None,
            spare: list[bytearray] | None = None) -> Iterator[memoryview]:
    """Buffers for the next `count` body bytes, each made when its turn comes: pieces of at most
    BODY_PIECE bytes appended to `kept` (from SPARE_MIN on, whole pieces, taken from `spare` where
    one is left), or (`kept` None: bytes to drop) one reused buffer."""
    scratch = memoryview(bytearray(min(count, RECEIVE_SIZE))) if kept is None and count > 0 else None
    while count > 0:
        if scratch is not None:
            view = scratch[:count]
        else:
            assert kept is not None
            if count < SPARE_MIN:
                view = memoryview(bytearray(count))
            else:  # a whole piece, even for a body's last bytes, so that it can be kept
                view = memoryview(spare.pop() if spare else bytearray(BODY_PIECE))[:count]
            kept.append(view)
        count -= len(view)
        yield view


class _ClientConnection:
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
        (a close, or bytes nobody asked for) while it was idle or with the last answer."""
        return now - self.idle_since > KEEPALIVE or self.socket.is_readable() or self.buffered()

    def buffered(self) -> bool:
        """Whether TLS holds bytes received but not read: the socket's readability misses them.
        A body's last record may carry more (a second answer, written with the first), and the
        stream reads the socket in large pieces, so whole records can wait in its incoming
        buffer (`tls_holds_bytes`) and decrypted bytes in `pending`."""
        stream = self.stream
        return isinstance(stream, trio.SSLStream) and tls_holds_bytes(stream)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


class Response:
    """A response whose head has been read; `read` its body, then `aclose` (which pools the connection
    when the exchange ended cleanly)."""

    def __init__(self, pool: Pool, key: tuple[str, str, int], conn: _ClientConnection, protocol: h11.Connection,
                 head: h11.Response, method: str, timeout: float) -> None:
        self.status = head.status_code
        self.headers = headers_of(head.headers)
        self._pool = pool
        self._key = key
        self._conn: _ClientConnection | None = conn
        self._protocol = protocol
        self._timeout = timeout
        self._bodiless = method == "HEAD" or self.status in (204, 304)
        # Framed two ways (RFC 9112 6.1: a sign of response splitting): h11 reads it as chunked, and
        # whoever sent it may frame the next answer otherwise, so the connection ends with it.
        self._keep_alive = (head.http_version == b"1.1" and "close" not in self.headers.get("connection", "").lower()
                            and not ("transfer-encoding" in self.headers and "content-length" in self.headers))
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

    async def read_part(self, start: int, size: int) -> bytes:
        """Bytes [start, start+size) of the body, holding no more than those: the bytes before
        them are received and dropped, the ones after are never read (the connection is dropped
        with them). Fewer bytes only where a body whose end is known (a declared length, a last
        chunk) ends sooner; a body delimited by the connection's close (no length, not chunked)
        that ends sooner is an error, because a connection cut (over TLS, without close_notify)
        looks the same as that end. For an answer that ignored a Range request."""
        if self._conn is None:
            raise RemoteProtocolError("body already read")
        length = self.headers.get("content-length")
        if self._bodiless or length is None or "transfer-encoding" in self.headers:
            return await self._read_framed_part(start, start + size)
        total = int(length)
        skip = min(start, total)
        return await self._read_exact(min(start + size, total) - skip, skip, total)

    async def _read_exact(self, size: int, skip: int = 0, declared: int | None = None) -> bytes:
        """`size` bytes of a body of a declared length (`declared`, default `size`) after its
        first `skip`, received in place into pieces of at most BODY_PIECE bytes: a declared
        length costs memory only as its bytes arrive (a server announcing the whole allowed
        size and then stalling holds one piece, not all of it); skipped bytes pass through one
        reused buffer."""
        declared = size if declared is None else declared
        early, _closed = self._protocol.trailing_data  # what came with the head
        if not skip and declared == size and IN_PLACE_MIN <= size <= IN_PLACE_MAX and len(early) <= size:
            made = fresh_bytes(size)
            if made is not None:
                return await self._read_in_place(size, early, *made)
        dropped = min(len(early), skip)
        parts: list[bytes | bytearray | memoryview] = [early[dropped:skip + size]] if len(early) > dropped else []
        kept = len(parts[0]) if parts else 0
        await self._receive(chain(_pieces(skip - dropped, None), _pieces(size - kept, parts, self._pool.spare)),
                            skip + size, dropped + kept, declared)
        # The body's end not reached, or more than it already here (never read that as the next
        # answer): the connection ends with this exchange.
        self._reusable = self._keep_alive and skip + size == declared and len(early) <= declared
        body = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        self._pool.keep_spares(parts)
        return body

    async def _read_in_place(self, size: int, early: bytes | bytearray, body: bytes, view: memoryview) -> bytes:
        """`_read_exact` of a whole body received straight into the object returned (no join)."""
        view[:len(early)] = early
        await self._receive((view[len(early):],), size, len(early), size)
        self._reusable = self._keep_alive
        return body

    async def _receive(self, views: Iterable[memoryview], end: int, got: int, declared: int) -> None:
        """Fill each of `views` in turn with body bytes, up to byte `end` (`got` already here; for
        messages), each receive within the timeout."""
        conn = self._conn
        assert conn is not None
        scope = trio.CancelScope()
        with scope:
            for view in views:
                filled = 0
                while filled < len(view):
                    scope.deadline = trio.current_time() + self._timeout
                    try:
                        received = await conn.receive_into(view[filled:])
                    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                        raise RemoteProtocolError(f"connection lost after {got} of {declared} body bytes: {e}"
                                                  ) from None
                    if not received:
                        raise RemoteProtocolError(f"server closed the connection after {got} of {declared} body "
                                                  "bytes")
                    filled += received
                    got += received
        if scope.cancelled_caught:
            raise ReadTimeout(f"no body bytes for {self._timeout:g} s ({got} of {end} wanted received)")

    async def _read_framed(self, limit: int) -> bytes | None:
        """A chunked, undeclared (until close) or absent body, framed by h11."""
        protocol, conn = self._protocol, self._conn
        assert conn is not None
        # One buffer, not a list of pieces: a chunk may be one byte, and a bytes object per byte
        # held ~40 bytes of memory per body byte (a 64 MiB whole-object answer became ~3 GB).
        body = bytearray()
        while True:
            event = await self._pool.next_event(conn, protocol, self._timeout)
            if type(event) is h11.Data:
                if len(body) + len(event.data) > limit:
                    return None
                body += event.data
            elif type(event) is h11.EndOfMessage:
                break
            else:
                raise RemoteProtocolError(f"unexpected {type(event).__name__} in a response body")
        self._reusable = (self._keep_alive and protocol.our_state is h11.DONE and protocol.their_state is h11.DONE
                          and not protocol.trailing_data[0])
        return bytes(body)

    async def _read_framed_part(self, start: int, end: int) -> bytes:
        """`read_part` of a chunked, undeclared or absent body: bytes before `start` dropped as
        they come, none read past `end`."""
        protocol, conn = self._protocol, self._conn
        assert conn is not None
        body = bytearray()
        at = 0  # body bytes seen so far
        while at < end:
            event = await self._pool.next_event(conn, protocol, self._timeout)
            if type(event) is h11.Data:
                data = event.data
                if at + len(data) > start:
                    body += data[max(0, start - at):end - at]
                at += len(data)
            elif type(event) is h11.EndOfMessage:
                if not self._bodiless and "transfer-encoding" not in self.headers:
                    raise RemoteProtocolError(f"a body of unknown length ended after {at} bytes, before byte "
                                              f"{end} asked for: cut short or not, it cannot be told")
                self._reusable = (self._keep_alive and protocol.our_state is h11.DONE
                                  and protocol.their_state is h11.DONE and not protocol.trailing_data[0])
                break
            else:
                raise RemoteProtocolError(f"unexpected {type(event).__name__} in a response body")
        return bytes(body)

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
        self._idle: dict[tuple[str, str, int], list[_ClientConnection]] = {}
        self._idle_count = 0
        self._ssl_factory = ssl_context
        self._ssl: ssl.SSLContext | None = None
        self.connections = 0  # opened so far (`unshardfs stats`: how well keep-alive holds)
        self.spare: list[bytearray] = []  # BODY_PIECE buffers to receive bodies into (SPARES at most)

    def keep_spares(self, parts: Iterable[object]) -> None:
        """Keep the whole pieces among a body's `parts` (once copied out) for the next bodies."""
        for part in parts:
            if len(self.spare) >= SPARES:
                return
            if isinstance(part, memoryview) and isinstance(part.obj, bytearray) and len(part.obj) == BODY_PIECE:
                self.spare.append(part.obj)

    async def send(self, request: ClientRequest, timeout: float) -> Response:
        """Send `request` and read the response head (1xx answers skipped)."""
        where = endpoint(request.url)
        conn = await self._connection(where, timeout)
        protocol = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)
        try:
            # Values as latin-1 bytes (h11 would encode a str as ASCII): a field value may hold obs-text,
            # and one the server sent us (an ETag, sent back in If-Match) must go back as it came.
            headers = [(name.encode("ascii"), value.encode("latin-1"))
                       for name, value in [("Host", where.authority), *request.headers.items()]]
            data = protocol.send(h11.Request(method=request.method, target=where.target, headers=headers))
            data += protocol.send(h11.EndOfMessage())
            with trio.move_on_after(timeout) as scope:
                await conn.stream.send_all(data)
            if scope.cancelled_caught:
                raise WriteTimeout(f"request not sent within {timeout:g} s")
            for _ in range(MAX_INFORMATIONAL + 1):
                event = await self.next_event(conn, protocol, timeout)
                if isinstance(event, (h11.Response, h11.InformationalResponse)) and len(event.headers) > MAX_FIELDS:
                    raise RemoteProtocolError(f"more than {MAX_FIELDS} header fields in an answer")
                if type(event) is h11.Response:
                    return Response(self, where.key, conn, protocol, event, request.method, timeout)
                if type(event) is not h11.InformationalResponse:
                    raise RemoteProtocolError(f"unexpected {type(event).__name__} instead of a response")
            raise RemoteProtocolError(f"more than {MAX_INFORMATIONAL} informational (1xx) answers before the response")
        except BaseException as e:
            await conn.aclose()
            if isinstance(e, h11.ProtocolError):
                raise RemoteProtocolError(str(e)) from None
            if isinstance(e, UnicodeEncodeError):
                raise TransportError(f"request not sendable in HTTP/1.1: {e}") from None
            if isinstance(e, (OSError, trio.BrokenResourceError, trio.ClosedResourceError)):
                raise RemoteProtocolError(f"connection lost: {e}" if str(e) else "connection lost") from None
            raise

    async def next_event(self, conn: _ClientConnection, protocol: h11.Connection, timeout: float) -> object:
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

    async def _connection(self, where: Endpoint, timeout: float) -> _ClientConnection:
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
                return _ClientConnection(tcp, tcp.socket, into=True)
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
            return _ClientConnection(tls, tcp.socket, into=False)
        raise ConnectTimeout(f"no connection to {where.host}:{where.port} within {timeout:g} s")

    def release(self, key: tuple[str, str, int], conn: _ClientConnection) -> None:
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
