"""`HttpSource` over `h1` against a raw server that writes whatever a test tells it to.

The answers here are the ones a well-formed HTTP library would never send:
a second answer hidden after the body inside the same TLS record, header
values that look like numbers to `str.isdigit` or hold thousands of digits,
bodies of one-byte chunks. Each must end in a `SourceError` (or a refused
connection reuse), never in another exception, a wrong body or memory out of
proportion to the bytes allowed.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
import tracemalloc
from pathlib import Path
from typing import Awaitable, Callable

import pytest
import trio

from unshardfs.sources import h1
from unshardfs.sources.http import HttpOptions, HttpSource
from unshardfs.util.errors import SourceError

pytestmark = pytest.mark.timeout(60)

# An answer: given the stream and the request's head (and its 1-based number on the connection),
# write something; return whether to keep the connection for another request.
Answer = Callable[[trio.abc.Stream, bytes, int], Awaitable[bool]]
FAST = HttpOptions(timeout=5.0, retries=1, backoff=0.0, deadline=10.0)


async def _serve(answer: Answer, tls: ssl.SSLContext | None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handler(tcp: trio.SocketStream) -> None:
        stream: trio.abc.Stream = tcp if tls is None else trio.SSLStream(tcp, tls, server_side=True)
        buffered, number = b"", 0
        try:
            while True:
                while b"\r\n\r\n" not in buffered:
                    got = await stream.receive_some(1 << 16)
                    if not got:
                        return
                    buffered += got
                request, _, buffered = buffered.partition(b"\r\n\r\n")
                number += 1
                if not await answer(stream, request, number):
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client hung up: what many of these answers are for
        finally:
            await trio.aclose_forcefully(stream)

    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


def against(answer: Answer, action: Callable[[HttpSource], Awaitable[object]], options: HttpOptions = FAST,
            tls: tuple[ssl.SSLContext, Path] | None = None) -> tuple[object, HttpSource]:
    """What `action` returned or raised with a source on a server answering with `answer`."""
    async def main() -> tuple[object, HttpSource]:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_serve, answer, tls[0] if tls else None)
            scheme = "https" if tls else "http"
            source = HttpSource(f"{scheme}://127.0.0.1:{port}/ds", options)
            if tls:
                source.pool()._ssl_factory = lambda: ssl.create_default_context(cafile=str(tls[1]))
            try:
                outcome: object = await action(source)
            except Exception as e:  # what the caller sees: anything but a SourceError is a bug
                outcome = e
            finally:
                await source.aclose()
                nursery.cancel_scope.cancel()
        return outcome, source
    return trio.run(main)


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[ssl.SSLContext, Path]:
    """A server context for 127.0.0.1 with a self-signed certificate (and that certificate's file)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context, cert


def _smuggler(size: int) -> Answer:
    """The first answer's head, then (later, so the client reads it apart from the head) its body
    and a whole second answer in one write, which TLS carries in one record: the client decrypts
    more than the body and must not keep that for the next request. Later connections are honest."""
    connections = []

    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        if number == 1:
            connections.append(stream)
        if len(connections) == 1:
            await stream.send_all(b"HTTP/1.1 206 X\r\nContent-Length: %d\r\nContent-Range: bytes 0-%d/%d\r\n\r\n"
                                  % (size, size - 1, size))
            await trio.sleep(0.05)
            await stream.send_all(b"a" * size + b"HTTP/1.1 206 X\r\nContent-Length: %d\r\n"
                                  b"Content-Range: bytes 0-%d/%d\r\n\r\n" % (size, size - 1, size) + b"!" * size)
            await trio.sleep_forever()  # keeps the connection open, as a keep-alive server does
        await stream.send_all(b"HTTP/1.1 206 X\r\nContent-Length: %d\r\nContent-Range: bytes 0-%d/%d\r\n\r\n"
                              % (size, size - 1, size) + b"b" * size)
        return True
    return answer


@pytest.mark.parametrize("size", [10, 5000, 100_000])
def test_an_answer_hidden_after_a_tls_body_is_never_read(tls, size):
    async def twice(source: HttpSource) -> tuple[list[bytes], int]:
        return [await source.read("x", 0, size), await source.read("x", 0, size)], source.pool().connections

    assert against(_smuggler(size), twice, tls=tls)[0] == ([b"a" * size, b"b" * size], 2)


def test_a_tls_connection_is_still_kept_alive(tls):
    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        await stream.send_all(b"HTTP/1.1 206 X\r\nContent-Length: 3\r\nContent-Range: bytes 0-2/9\r\n\r\nabc")
        return True

    async def thrice(source: HttpSource) -> tuple[list[bytes], int]:
        return [await source.read("x", 0, 3) for _ in range(3)], source.pool().connections

    assert against(answer, thrice, tls=tls)[0] == ([b"abc"] * 3, 1)


def _once(status: int, *fields: bytes, body: bytes = b"") -> Answer:
    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        head = b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n" % (status, len(body)) + b"".join(f + b"\r\n" for f in fields)
        await stream.send_all(head + b"\r\n" + body)
        return True
    return answer


@pytest.mark.parametrize("value", [b"\xb2", b"\xb9\xb3", b"9" * 5000, b"-1", b"1e9", b"Wed, 21 Oct 2015 07:28:00 GMT"])
def test_any_retry_after_is_a_source_error(value):
    outcome, _ = against(_once(503, b"Retry-After: " + value), lambda s: s.read("x", 0, 10))
    assert isinstance(outcome, SourceError) and "HTTP 503" in str(outcome)


@pytest.mark.parametrize("content_range", [
    b"bytes 0-9/" + b"1" * 5000,
    b"bytes " + b"0" * 5000 + b"-9/10",
    b"bytes 0-" + b"9" * 5000 + b"/*",
])
def test_a_content_range_of_thousands_of_digits_is_a_source_error(content_range):
    outcome, _ = against(_once(206, b"Content-Range: " + content_range, body=b"0123456789"),
                         lambda s: s.read("x", 0, 10))
    assert isinstance(outcome, SourceError)


def test_a_size_of_thousands_of_digits_is_a_source_error():
    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        if request.startswith(b"HEAD"):  # no length: the size is asked with a 1-byte GET
            await stream.send_all(b"HTTP/1.1 200 X\r\nTransfer-Encoding: chunked\r\n\r\n")
        else:
            await stream.send_all(b"HTTP/1.1 206 X\r\nContent-Length: 1\r\nContent-Range: bytes 0-0/"
                                  + b"1" * 5000 + b"\r\n\r\nx")
        return True

    outcome, _ = against(answer, lambda s: s.stat("x"))
    assert isinstance(outcome, SourceError)


def test_one_byte_chunks_cost_memory_as_bytes_not_as_objects():
    """A whole-object answer (200 to a ranged GET) in 1-byte chunks: the body must not hold a
    Python object per byte (~120 bytes of memory each were measured: 64 MiB allowed became GBs)."""
    size = 256 << 10
    block = b"1\r\na\r\n" * 4096

    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        await stream.send_all(b"HTTP/1.1 200 X\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(size // 4096):
            await stream.send_all(block)
        await stream.send_all(b"0\r\n\r\n")
        return True

    tracemalloc.start()
    try:
        outcome, _ = against(answer, lambda s: s.read("x", 0, 10), HttpOptions(timeout=30, retries=0, deadline=50))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert outcome == b"a" * 10
    # The body twice (received, then as bytes), what is in flight (h11's buffer, one receive) and slack.
    assert peak < 2 * size + (2 << 20), f"{peak:,} bytes for a {size:,}-byte body"


def test_an_answer_framed_two_ways_ends_its_connection():
    """Transfer-Encoding and Content-Length together (RFC 9112 6.1: a sign of response splitting, to
    be handled as an error): the chunked body is read, the connection is not used again."""
    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        await stream.send_all(b"HTTP/1.1 206 X\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n"
                              b"Content-Range: bytes 0-2/9\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        return True

    async def twice(source: HttpSource) -> tuple[list[bytes], int]:
        return [await source.read("x", 0, 3), await source.read("x", 0, 3)], source.pool().connections

    assert against(answer, twice)[0] == ([b"abc", b"abc"], 2)


def test_an_etag_beyond_ascii_is_sent_back_as_it_came():
    """Header values are latin-1 (obs-text) both ways: an ETag of such bytes is the version reads
    send back in If-Match (it was a UnicodeEncodeError out of every read of the file)."""
    seen = []

    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        seen.append(request)
        if request.startswith(b"HEAD"):
            await stream.send_all(b'HTTP/1.1 200 X\r\nContent-Length: 100\r\nETag: "\xe9t\xe9"\r\n\r\n')
        else:
            await stream.send_all(b"HTTP/1.1 206 X\r\nContent-Length: 3\r\nContent-Range: bytes 0-2/100\r\n\r\nabc")
        return True

    async def stat_and_read(source: HttpSource) -> bytes:
        stat = await source.stat("x")
        assert stat is not None
        return await source.read("x", 0, 3, stat.version)

    assert against(answer, stat_and_read)[0] == b"abc"
    assert b'\r\nif-match: "\xe9t\xe9"' in seen[1].lower()


# A whole object instead of the range asked for: position p holds byte p % 256.
PATTERN = bytes(range(256)) * 1024
WHOLE = 32 << 20


def _whole_object(framing: str) -> Answer:
    """A 200 with a 32 MiB object to every request, whatever its Range, framed by Content-Length,
    in chunks, or by the connection's close (no length)."""
    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        head = {"length": b"Content-Length: %d\r\n" % WHOLE, "chunked": b"Transfer-Encoding: chunked\r\n",
                "close": b"Connection: close\r\n"}[framing]
        await stream.send_all(b"HTTP/1.1 200 X\r\n" + head + b"\r\n")
        size = b"%x\r\n" % len(PATTERN)
        for _ in range(WHOLE // len(PATTERN)):
            if framing == "chunked":
                await stream.send_all(size)
            await stream.send_all(PATTERN)
            if framing == "chunked":
                await stream.send_all(b"\r\n")
        if framing == "chunked":
            await stream.send_all(b"0\r\n\r\n")
        return framing != "close"
    return answer


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
@pytest.mark.parametrize("offset, size", [(0, 10), ((16 << 20) + 5, 1 << 20), (WHOLE - 7, 7)])
def test_a_whole_object_for_a_range_holds_only_the_range(framing, offset, size):
    """A server ignoring Range answers 200 with the whole object: the read keeps the bytes asked
    for, drops those before as they arrive and never reads on (each read held up to 64 MiB)."""
    tracemalloc.start()
    try:
        outcome, source = against(_whole_object(framing), lambda s: s.read("x", offset, size),
                                  HttpOptions(timeout=30, retries=0, deadline=50))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    expected = (PATTERN * (WHOLE // len(PATTERN)))[offset:offset + size]
    assert outcome == expected and source.counters.whole_object_fallbacks == 1
    # The range twice (received, then as bytes), one reused buffer for what is dropped, what is
    # in flight (h11's buffer, one receive) and slack: never the object.
    assert peak < 2 * size + (2 << 20), f"{peak:,} bytes held for {size:,} of a {WHOLE:,}-byte object"


@pytest.mark.parametrize("secure", [False, True])
def test_a_length_less_whole_object_cut_short_is_an_error(tls, secure):
    """A 200 without length or chunks ends with the connection; cut before the end of the range
    asked (over TLS without close_notify, which looks the same), it is not the object's end."""
    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        await stream.send_all(b"HTTP/1.1 200 X\r\nConnection: close\r\n\r\n" + PATTERN[:1000])
        return False  # closed at once: over TLS, without close_notify

    outcome, source = against(answer, lambda s: s.read("x", 500, 1000), tls=tls if secure else None)
    assert isinstance(outcome, SourceError)
    assert str(outcome) == (f"GET {source.base_url}/x: RemoteProtocolError: a body of unknown length ended after "
                            "1000 bytes, before byte 1500 asked for: cut short or not, it cannot be told (after 2 "
                            "attempts)")


def _informational(count: int | None) -> Answer:
    """`count` 100 Continue answers (None: without end), then the range asked for."""
    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        sent = 0
        while count is None or sent < count:
            await stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            sent += 1
        await stream.send_all(b"HTTP/1.1 206 X\r\nContent-Length: 3\r\nContent-Range: bytes 0-2/9\r\n\r\nabc")
        return True
    return answer


def test_endless_informational_answers_end_the_request():
    """A server answering 100 Continue forever held the request until its deadline."""
    outcome, source = against(_informational(None), lambda s: s.read("x", 0, 3),
                              HttpOptions(timeout=2, retries=0, deadline=3))
    assert str(outcome) == (f"GET {source.base_url}/x: RemoteProtocolError: more than {h1.MAX_INFORMATIONAL} "
                            "informational (1xx) answers before the response (after 1 attempts)")


def test_a_few_informational_answers_are_skipped():
    assert against(_informational(h1.MAX_INFORMATIONAL), lambda s: s.read("x", 0, 3))[0] == b"abc"


def test_a_head_of_too_many_fields_is_refused():
    """h11 bounds a head's bytes only while it is incomplete: one arriving whole in a receive may
    be 256 KiB of short fields (65,000 of them)."""
    async def answer(stream: trio.abc.Stream, request: bytes, number: int) -> bool:
        await stream.send_all(b"HTTP/1.1 206 X\r\nContent-Length: 3\r\nContent-Range: bytes 0-2/9\r\n"
                              + b"a:\r\n" * 1000 + b"\r\nabc")
        return True

    outcome, source = against(answer, lambda s: s.read("x", 0, 3), HttpOptions(timeout=2, retries=0, deadline=3))
    assert str(outcome) == (f"GET {source.base_url}/x: RemoteProtocolError: more than {h1.MAX_FIELDS} header "
                            "fields in an answer (after 1 attempts)")
