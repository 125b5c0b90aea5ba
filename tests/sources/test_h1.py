"""The HTTP/1.1 client of the HTTP sources (`sources/h1.py`) against answers written byte by byte.

A server task on the other end of a socket pair reads the request and writes
an answer in pieces: honest or lying about its length, chunked, delimited by
the close, with bytes after its end. Whatever the answer, the client returns
exactly the body or fails, never returns more than the limit, and pools the
connection only when the answer ended exactly where its framing said.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.memory import peak_rss, reset_peak_rss
from tests.support.profiles import examples
from unshardfs.sources import h1

URL = "http://127.0.0.1:9/ds/obj"  # nothing listens on port 9 (discard): a new connection is refused
KEY = h1.endpoint(URL).key


@dataclass
class Wire:
    """One answer on the wire, and what the client must make of it."""

    data: bytes  # everything the server writes
    pieces: list[int]  # where it splits its writes
    close: bool  # whether it closes its end after writing


async def _serve(sock: trio.socket.SocketType, wire: Wire, seen: list[bytes]) -> None:
    request = b""
    while b"\r\n\r\n" not in request:
        got = await sock.recv(4096)
        if not got:
            return  # the client gave up before asking
        request += got
    seen.append(request)
    cuts = sorted({0, len(wire.data), *(p for p in wire.pieces if 0 < p < len(wire.data))})
    try:
        for start, end in zip(cuts, cuts[1:]):
            piece = memoryview(wire.data)[start:end]
            while piece:
                piece = piece[await sock.send(piece):]
            await trio.sleep(0)
        if wire.close:
            sock.shutdown(trio.socket.SHUT_WR)
    except OSError:  # the client hung up early (an answer refused)
        pass


def exchange(wire: Wire, limit: int, plain: bool = True, method: str = "GET",
             timeout: float = 5.0) -> tuple[object, int, list[bytes]]:
    """(the body read or the TransportError raised, connections the pool would reuse once the server
    is done writing, the requests the server saw)."""
    seen: list[bytes] = []

    async def main() -> tuple[object, int]:
        ours, theirs = trio.socket.socketpair()
        pool = h1.Pool(max_idle=4)
        conn = h1._ClientConnection(trio.SocketStream(ours), ours, into=plain)
        pool.release(KEY, conn)  # the idle connection the request takes
        outcome: object
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve, theirs, wire, seen)
            try:
                response = await pool.send(h1.ClientRequest(method, URL, {"Range": "bytes=0-9"}), timeout)
                try:
                    outcome = await response.read(limit)
                finally:
                    await response.aclose()
            except h1.TransportError as e:
                outcome = e
        now = trio.current_time()
        pooled = sum(not conn.stale(now) for conns in pool._idle.values() for conn in conns)
        await pool.aclose()
        theirs.close()
        return outcome, pooled

    outcome, pooled = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return outcome, pooled, seen


def head(status: int = 206, **fields: str) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k.replace('_', '-')}: {v}" for k, v in fields.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes + [len(body)]:
        piece = body[at:at + max(1, size)]
        if piece:
            out += b"%x\r\n%s\r\n" % (len(piece), piece)
            at += len(piece)
    return out + b"0\r\n\r\n"


bodies = st.binary(max_size=3000)
splits = st.lists(st.integers(0, 4000), max_size=6)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, declared_delta=st.integers(-20, 20), extra=st.binary(max_size=200), pieces=splits,
       limit=st.integers(0, 4000), close=st.booleans(), plain=st.booleans(), in_place=st.booleans())
def test_declared_length_is_exactly_what_is_returned(body, declared_delta, extra, pieces, limit, close, plain,
                                                     in_place):
    """Content-Length framing, honest or not: the declared length or nothing, never the bytes after it
    (bodies received into the object returned, or in pieces joined after)."""
    declared = max(0, len(body) + declared_delta)
    wire = Wire(head(content_length=str(declared)) + body + extra, pieces, close=close or declared > len(body))
    sent = body + extra
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(h1, "IN_PLACE_MIN", 2 if in_place else h1.IN_PLACE_MAX + 1)
        outcome, pooled, _ = exchange(wire, limit, plain)
    if declared > limit:
        assert outcome is None and pooled == 0  # refused before reading: the rest is never read
    elif declared > len(sent):
        assert isinstance(outcome, h1.RemoteProtocolError) and pooled == 0  # cut short
    else:
        assert outcome == sent[:declared]
        # Reused only when nothing came beyond the declared end (bytes that came with the body
        # end the connection at once, later ones when it is next taken from the pool).
        assert pooled == (0 if wire.close or len(sent) > declared else 1)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, sizes=st.lists(st.integers(1, 700), max_size=8), pieces=splits,
       limit=st.integers(0, 4000), plain=st.booleans())
def test_chunked_bodies_are_capped(body, sizes, pieces, limit, plain):
    wire = Wire(head(transfer_encoding="chunked") + chunked(body, sizes), pieces, close=False)
    outcome, pooled, _ = exchange(wire, limit, plain)
    if len(body) > limit:
        assert outcome is None and pooled == 0
    else:
        assert outcome == body and pooled == 1


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, pieces=splits, limit=st.integers(0, 4000))
def test_bodies_delimited_by_the_close_are_capped_and_never_pooled(body, pieces, limit):
    outcome, pooled, _ = exchange(Wire(head(200) + body, pieces, close=True), limit)
    assert outcome == (body if len(body) <= limit else None)
    assert pooled == 0


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 206 X\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",  # two lengths
    b"HTTP/1.1 206 X\r\nContent-Length: -5\r\n\r\nhello",
    b"HTTP/1.1 206 X\r\nContent-Length: 5\r\nTransfer-Encoding: gzip\r\n\r\nhello",
    b"HTTP/1.1 2O6 X\r\n\r\n",
    b"NOT HTTP AT ALL\r\n\r\n",
    b"HTTP/1.1 206 X\r\nBad Header Name: 1\r\n\r\n",
    b"HTTP/1.1 206 X\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    b"HTTP/1.1 206 X\r\n" + b"X-Long: " + b"a" * (70 << 10) + b"\r\n\r\n",  # a head over HEAD_LIMIT...
    b"",  # closed without an answer
])
def test_malformed_answers_are_transport_errors(answer):
    # ... arriving in pieces, as a long head does (h11 bounds what it holds incomplete)
    outcome, pooled, _ = exchange(Wire(answer, list(range(0, len(answer), 4096)), close=True), 1 << 20)
    assert isinstance(outcome, h1.TransportError) and pooled == 0


def test_a_smuggled_second_answer_is_never_read():
    """Bytes after the declared end that look like the next answer end the connection instead."""
    smuggled = head(206, content_length="4", content_range="bytes 0-3/4") + b"evil"
    outcome, pooled, _ = exchange(Wire(head(content_length="3") + b"abc" + smuggled, [], close=False), 100)
    assert outcome == b"abc" and pooled == 0


def test_head_answers_have_no_body_whatever_they_declare():
    outcome, pooled, _ = exchange(Wire(head(200, content_length="1000"), [], close=False), 10, method="HEAD")
    assert outcome == b"" and pooled == 1


def test_interim_answers_are_skipped():
    wire = Wire(b"HTTP/1.1 100 Continue\r\n\r\n" + head(content_length="2") + b"ok", [], close=False)
    assert exchange(wire, 10)[:2] == (b"ok", 1)


def test_connection_close_is_not_pooled():
    assert exchange(Wire(head(content_length="2", connection="close") + b"ok", [], close=False), 10)[:2] == (b"ok", 0)


def test_requests_carry_host_and_the_exact_target():
    _, _, seen = exchange(Wire(head(content_length="0"), [], close=False), 10)
    assert seen[0].startswith(b"GET /ds/obj HTTP/1.1\r\n")
    assert b"\r\nhost: 127.0.0.1:9\r\n" in seen[0].lower() and b"\r\nrange: bytes=0-9\r\n" in seen[0].lower()


@pytest.mark.parametrize("answer", [b"", head(content_length="10") + b"abc"])
def test_a_silent_server_times_out(answer):
    """No head, or a body stalled halfway: a timeout of the wait, not a hang (mock clock)."""
    outcome, pooled, _ = exchange(Wire(answer, [], close=False), 100, timeout=3)
    assert isinstance(outcome, h1.ReadTimeout) and pooled == 0


def test_idle_connections_the_server_wrote_to_are_not_reused():
    async def main() -> int:
        ours, theirs = trio.socket.socketpair()
        pool = h1.Pool(max_idle=4)
        pool.release(KEY, h1._ClientConnection(trio.SocketStream(ours), ours, into=True))
        await theirs.send(b"HTTP/1.1 200 X\r\n\r\n")  # unasked: a stale or hostile connection
        with pytest.raises(h1.ConnectError):  # so a new one is opened (and refused)
            await pool.send(h1.ClientRequest("GET", URL, {}), 1.0)
        theirs.close()
        return pool.connections
    assert trio.run(main) == 1


@pytest.mark.parametrize("url, where", [
    ("http://h/a/b", ("http", "h", 80, "h", "/a/b")),
    ("https://H.example:8443", ("https", "h.example", 8443, "H.example:8443", "/")),
    ("http://[::1]:9000/x?a=1&b=%2F", ("http", "::1", 9000, "[::1]:9000", "/x?a=1&b=%2F")),
    ("http://user:pw@h/a b/\u00e9", ("http", "h", 80, "h", "/a%20b/%C3%A9")),
])
def test_endpoints(url, where):
    e = h1.endpoint(url)
    assert (e.scheme, e.host, e.port, e.authority, e.target) == where


@pytest.mark.parametrize("url", ["ftp://h/x", "http:///x", "http://h:99999/x"])
def test_bad_endpoints(url):
    with pytest.raises(h1.TransportError):
        h1.endpoint(url)


@given(st.lists(st.tuples(st.sampled_from(["ETag", "etag", "Content-Range", "X-A"]),
                          st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=8)), max_size=6))
def test_headers_join_repeated_fields(fields):
    got = h1.headers_of([(k.encode(), v.encode()) for k, v in fields])
    for name in {k.lower() for k, _ in fields}:
        assert got[name] == ", ".join(v for k, v in fields if k.lower() == name)


def test_a_source_reuses_one_connection_for_sequential_reads(tmp_path):
    """Keep-alive through `HttpSource`: a HEAD and 20 ranged reads, one request each, over one connection."""
    from unshardfs.sources.http import HttpSource
    from unshardfs.testing.http_servers import DatasetServer

    data = bytes(range(256)) * 64
    (tmp_path / "blob").write_bytes(data)

    async def main(url: str) -> int:
        source = HttpSource(url)
        try:
            stat = await source.stat("blob")
            assert stat is not None and stat.size == len(data)
            for i in range(20):
                assert await source.read("blob", i * 100, 1000) == data[i * 100:i * 100 + 1000]
            assert source._pool is not None
            return source.stats()["http"]["connections"]
        finally:
            await source.aclose()

    with DatasetServer(tmp_path) as server:
        assert trio.run(main, server.url) == 1
        assert len(server.requests()) == 21


@pytest.fixture
def tls_site(tmp_path):
    """An https server on 127.0.0.1 with a self-signed certificate (its file returned, to trust it)."""
    import shutil
    import ssl
    import subprocess

    from unshardfs.testing.http_servers import DatasetServer

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "blob").write_bytes(bytes(range(256)) * 256)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = DatasetServer(tmp_path / "site")
    server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True)
    with server:
        yield server.url.replace("http://", "https://"), cert, server


def _read_twice(url: str) -> tuple[bytes, int]:
    from unshardfs.sources.http import HttpOptions, HttpSource

    async def main() -> tuple[bytes, int]:
        source = HttpSource(url, HttpOptions(retries=0, timeout=10))
        try:
            data = await source.read("blob", 1000, 5000) + await source.read("blob", 6000, 10)
            assert source._pool is not None
            return data, source.stats()["http"]["connections"]
        finally:
            await source.aclose()
    return trio.run(main)


def test_https_is_verified_and_kept_alive(tls_site, monkeypatch):
    from unshardfs.util.errors import SourceError

    url, cert, server = tls_site
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    assert _read_twice(url) == ((bytes(range(256)) * 256)[1000:6010], 1)
    monkeypatch.delenv("SSL_CERT_FILE")  # certifi's or the system's roots: the certificate is refused
    with pytest.raises(SourceError, match="TLS with 127.0.0.1"):
        _read_twice(url)


def test_a_declared_length_costs_memory_only_as_it_arrives():
    """A 200 announcing 60 MiB (within the whole-object limit) and then stalling holds one piece."""
    import tracemalloc

    wire = Wire(head(200, content_length=str(60 << 20)) + b"x" * 1000, [], close=False)
    tracemalloc.start()
    try:
        outcome, pooled, _ = exchange(wire, 64 << 20, timeout=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(outcome, h1.ReadTimeout) and pooled == 0
    assert peak < h1.BODY_PIECE + (1 << 20), f"{peak:,} bytes held for a stalled answer"


def test_a_body_received_in_place_is_resident_only_as_it_arrives():
    """A 206 announcing 24 MiB (received into the object returned, allocated before its bytes
    come) and then stalling: the process's resident memory does not grow by the declared size."""
    assert h1.IN_PLACE_MIN <= 24 << 20 <= h1.IN_PLACE_MAX
    if not reset_peak_rss():
        pytest.skip("the peak resident set cannot be reset here")
    before = peak_rss()
    wire = Wire(head(206, content_length=str(24 << 20)) + b"x" * 1000, [], close=False)
    outcome, pooled, _ = exchange(wire, 24 << 20, timeout=3)
    grown = peak_rss() - before
    assert isinstance(outcome, h1.ReadTimeout) and pooled == 0
    assert grown < 8 << 20, f"{grown:,} bytes resident for a stalled answer"


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("size", [h1.BODY_PIECE - 1, h1.BODY_PIECE, 2 * h1.BODY_PIECE + 5])
def test_bodies_over_several_pieces_are_whole(size, in_place, monkeypatch):
    """Received into the object returned, or into pieces of BODY_PIECE bytes joined after."""
    monkeypatch.setattr(h1, "IN_PLACE_MIN", h1.IN_PLACE_MIN if in_place else h1.IN_PLACE_MAX + 1)
    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    outcome, pooled, _ = exchange(Wire(head(content_length=str(size)) + body, [1000, 70_000], close=False),
                                  size)
    assert outcome == body and pooled == 1
