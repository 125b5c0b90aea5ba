"""`serve`'s request framing against the request-smuggling catalog, over real sockets, differentially.

Every case is a byte stream sent on one connection to a running `unshardfs serve`. What the server
answers (the statuses, in order, and whether it then closes the connection) is compared with what
`strict_framing` below derives from the same bytes. That reference is written here from RFC 9112's
grammar (the ABNF transcribed as regular expressions over whole heads and chunk lines), not from
the server's incremental reader, so the two meet only in the RFC. h11 could not be the reference: it
is lenient where a strict reader must refuse (it takes both Content-Length and Transfer-Encoding,
unfolds obs-fold, ends lines at a bare LF).

The reference refuses what RFC 9112 lets a server refuse, as the server does: any line not ended by
CRLF, obs-fold, whitespace before a colon, two or no Host fields (HTTP/1.1), Transfer-Encoding with
Content-Length or in HTTP/1.0, a coding list not ending in a single chunked (400; another coding
before it: 501), a Content-Length that is not one number, a chunk line off the grammar. A body (no
method served takes one) is read and dropped up to 64 KiB on the wire, a larger one is a 413.
"""

from __future__ import annotations

import http.client
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.profiles import examples
from tests.support.served import served
from unshardfs.http.framing import HeadReader, Refusal, body_reader
from unshardfs.testing.precomputed import Scale, sharding, write_volume

pytestmark = pytest.mark.timeout(300)

BODY_LIMIT = 64 << 10
TCHAR = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]"
VCHAR = rb"[\x21-\x7e\x80-\xff]"
REQUEST_LINE = re.compile(rb"(" + TCHAR + rb"+) ([\x21-\x7e]+) HTTP/([0-9]\.[0-9])\r\n")
VALUE = rb"(?:" + VCHAR + rb"(?:[ \t\x21-\x7e\x80-\xff]*" + VCHAR + rb")?)?"
FIELD_LINE = re.compile(rb"(" + TCHAR + rb"+):[ \t]*(" + VALUE + rb")[ \t]*\r\n")
HEAD = re.compile(rb"(?:\r\n)*" + REQUEST_LINE.pattern + rb"((?:" + TCHAR + rb"+:[ \t]*" + VALUE
                  + rb"[ \t]*\r\n)*)\r\n")
QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]+)(?:[ \t]*;[ \t]*" + TCHAR + rb"+(?:[ \t]*=[ \t]*(?:" + TCHAR + rb"+|" + QUOTED
                        + rb"))?)*\r\n")
HOST = re.compile(rb"(?:\[[0-9A-Za-z:._~!$&'()*+,;=-]+\]|[0-9A-Za-z._~!$&'()*+,;=%-]*)(?::[0-9]*)?")

GET = b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n"
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"  # a 404 if it is ever answered
SMUGGLED_LENGTH = b"Content-Length: %d" % len(SMUGGLED)


# -- the reference ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Framing:
    statuses: tuple[int, ...]  # the final answers, in order
    closes: bool  # the server closes after them; else it waits for more bytes


class _Refused(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


def strict_framing(data: bytes) -> Framing:
    """The answers a strict HTTP/1.1 server of this tree owes `data`, sent on one connection."""
    statuses: list[int] = []
    pos = 0
    while True:
        try:
            found = _message(data, pos)
        except _Refused as e:
            return Framing((*statuses, e.status), True)
        if found is None:
            return Framing(tuple(statuses), False)
        pos, status, close = found
        statuses.append(status)
        if close:
            return Framing(tuple(statuses), True)


def _message(data: bytes, pos: int) -> tuple[int, int, bool] | None:
    """(where the next message starts, the answer's status, whether the connection then closes),
    None while the message is incomplete."""
    head = HEAD.match(data, pos)
    if head is None:
        _check_partial_head(data[pos:])
        return None
    method, target, version, blob = head.groups()
    fields = [(m.group(1).lower(), m.group(2)) for m in FIELD_LINE.finditer(blob)]

    def values(name: bytes) -> list[bytes]:
        return [v for k, v in fields if k == name]

    hosts = values(b"host")
    if len(hosts) > 1 or (version == b"1.1" and not hosts) or not all(HOST.fullmatch(h) for h in hosts):
        raise _Refused(400)
    codings, lengths = values(b"transfer-encoding"), values(b"content-length")
    end = head.end()
    if codings:
        if version == b"1.0" or lengths:
            raise _Refused(400)
        listed = [c.strip(b" \t").lower() for c in b",".join(codings).split(b",")]
        if listed[-1] != b"chunked" or listed.count(b"chunked") != 1 \
                or not all(re.fullmatch(TCHAR + rb"+", c) for c in listed):
            raise _Refused(400)
        if len(listed) > 1:
            raise _Refused(501)
        found = _chunked_body(data, end)
        if found is None:
            return None
        end = found
    elif lengths:
        if len(lengths) > 1 or not re.fullmatch(rb"[0-9]+", lengths[0]):
            raise _Refused(400)
        if int(lengths[0]) > BODY_LIMIT:
            raise _Refused(413)
        if len(data) < end + int(lengths[0]):
            return None
        end += int(lengths[0])
    close = version == b"1.0" or any(t.strip(b" \t").lower() == b"close"
                                     for v in values(b"connection") for t in v.split(b","))
    return end, _status(method, target), close


def _status(method: bytes, target: bytes) -> int:
    """What the tree served answers an accepted request."""
    if method == b"OPTIONS":
        return 204
    if method not in (b"GET", b"HEAD"):
        return 405
    return 200 if target == b"/info" else 404


def _check_partial_head(rest: bytes) -> None:
    """An incomplete head waits for more only while every line so far keeps to the grammar."""
    *lines, partial = rest.split(b"\n")
    if b"\r" in partial[:-1]:
        raise _Refused(400)
    requested = False
    for line in lines:
        line += b"\n"
        if requested:
            if not FIELD_LINE.fullmatch(line):
                raise _Refused(400)
        elif line != b"\r\n":
            if not REQUEST_LINE.fullmatch(line):
                raise _Refused(400)
            requested = True


def _chunked_body(data: bytes, start: int) -> int | None:
    """Where a chunked body starting at `start` ends, None while incomplete."""
    pos = start
    while True:
        line = CHUNK_LINE.match(data, pos)
        if line is None:
            return _incomplete_line(data, pos, start)
        if line.end() - start > BODY_LIMIT:
            raise _Refused(413)
        size = int(line.group(1), 16)
        pos = line.end()
        if size == 0:
            break
        if pos + size + 2 - start > BODY_LIMIT:
            raise _Refused(413)
        after = data[pos + size:pos + size + 2]
        if not b"\r\n".startswith(after):
            raise _Refused(400)
        if len(after) < 2:
            return None
        pos += size + 2
    while True:  # the trailer section, then an empty line
        end = data.find(b"\n", pos)
        if end < 0:
            return _incomplete_line(data, pos, start)
        if end + 1 - start > BODY_LIMIT:
            raise _Refused(413)
        if data[pos:end + 1] == b"\r\n":
            return end + 1
        if not FIELD_LINE.fullmatch(data, pos, end + 1):
            raise _Refused(400)
        pos = end + 1


def _incomplete_line(data: bytes, pos: int, start: int) -> None:
    end = data.find(b"\n", pos)
    if end >= 0:  # complete, and not what the grammar allows here
        if end + 1 - start > BODY_LIMIT:
            raise _Refused(413)
        raise _Refused(400)
    if len(data) - start > BODY_LIMIT:
        raise _Refused(413)
    if b"\r" in data[pos:-1]:
        raise _Refused(400)
    return None


def test_the_reference_agrees_with_the_rfc_on_plain_cases():
    assert strict_framing(GET + GET) == Framing((200, 200), False)
    assert strict_framing(b"GET /info HTTP/1.1\nHost: x\n\n") == Framing((400,), True)
    assert strict_framing(b"GET /info HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked"
                          b"\r\n\r\n0\r\n\r\n" + SMUGGLED) == Framing((400,), True)
    assert strict_framing(b"POST /info HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
                          + SMUGGLED) == Framing((405, 404), False)
    assert strict_framing(b"GET /info HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nabc") == Framing((), False)


# -- the catalog --------------------------------------------------------------------------------


def _request(*fields: bytes, method: bytes = b"POST", line: bytes | None = None) -> bytes:
    head = line or method + b" /info HTTP/1.1"
    return head + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n"


def _te(value: bytes, *more: bytes, method: bytes = b"POST") -> bytes:
    return _request(b"Host: x", b"Transfer-Encoding: " + value, *more, method=method)


CHUNKED_EMPTY = b"0\r\n\r\n"
CHUNKED_SMUGGLING = b"3\r\nabc\r\n0\r\n\r\n" + SMUGGLED  # a strict reader answers the smuggled 404 as well

CATALOG: dict[str, bytes] = {
    # CL.TE: a front end that frames by Content-Length forwards the rest as the body.
    "cl.te": _request(b"Host: x", b"Content-Length: 6", b"Transfer-Encoding: chunked") + b"0\r\n\r\nG" + SMUGGLED,
    "cl.te get": _request(b"Host: x", b"Content-Length: 5", b"Transfer-Encoding: chunked", method=b"GET")
    + CHUNKED_EMPTY + SMUGGLED,
    "te.cl": _request(b"Host: x", b"Transfer-Encoding: chunked", b"Content-Length: 4")
    + b"%x\r\n" % (len(SMUGGLED) + 3) + b"XX\r\n" + SMUGGLED + b"\r\n0\r\n\r\n",
    "cl zero and te": _request(b"Host: x", b"Content-Length: 0", b"Transfer-Encoding: chunked") + CHUNKED_SMUGGLING,
    # TE.TE: Transfer-Encoding obfuscated so that one reader honours it and the other does not.
    "te xchunked": _te(b"xchunked") + CHUNKED_SMUGGLING,
    "te xchunked with cl": _te(b"xchunked", b"Content-Length: 3") + CHUNKED_SMUGGLING,
    "te space before colon": _request(b"Host: x", b"Transfer-Encoding : chunked") + CHUNKED_SMUGGLING,
    "te tab before colon": _request(b"Host: x", b"Transfer-Encoding\t: chunked") + CHUNKED_SMUGGLING,
    "te extra spaces": _te(b"  chunked") + CHUNKED_SMUGGLING,  # OWS: a valid chunked
    "te tab": _request(b"Host: x", b"Transfer-Encoding:\tchunked\t") + CHUNKED_SMUGGLING,  # OWS too
    "te upper case": _te(b"CHUNKED") + CHUNKED_SMUGGLING,  # coding names are case-insensitive
    "te vertical tab": _te(b"\x0bchunked") + CHUNKED_SMUGGLING,
    "te form feed": _te(b"chunked\x0c") + CHUNKED_SMUGGLING,
    "te nul": _te(b"chunk\x00ed") + CHUNKED_SMUGGLING,
    "te quoted": _te(b'"chunked"') + CHUNKED_SMUGGLING,
    "te chunked identity": _te(b"chunked, identity") + CHUNKED_SMUGGLING,
    "te identity chunked": _te(b"identity, chunked") + CHUNKED_SMUGGLING,
    "te gzip chunked": _te(b"gzip, chunked") + CHUNKED_SMUGGLING,
    "te chunked twice": _te(b"chunked, chunked") + CHUNKED_SMUGGLING,
    "te empty element": _te(b"chunked,") + CHUNKED_SMUGGLING,
    "te parameter": _te(b"chunked;q=1") + CHUNKED_SMUGGLING,
    "te two lines": _te(b"chunked", b"Transfer-Encoding: chunked") + CHUNKED_SMUGGLING,
    "te two lines, other last": _te(b"chunked", b"Transfer-Encoding: x") + CHUNKED_SMUGGLING,
    "te two lines, other first": _te(b"x", b"Transfer-Encoding: chunked") + CHUNKED_SMUGGLING,
    "te empty then chunked": _te(b"", b"Transfer-Encoding: chunked") + CHUNKED_SMUGGLING,
    "te obs-fold": _request(b"Host: x", b"Transfer-Encoding:", b" chunked") + CHUNKED_SMUGGLING,
    "te folded under another": _request(b"Host: x", b"X: y", b"\tTransfer-Encoding: chunked") + CHUNKED_SMUGGLING,
    "te misspelt name": _request(b"Host: x", b"Transfer_Encoding: chunked") + CHUNKED_SMUGGLING,
    "te in http/1.0": _request(b"Transfer-Encoding: chunked", line=b"POST /info HTTP/1.0") + CHUNKED_SMUGGLING,
    # CL.CL: two lengths, or one a reader could read two ways.
    "cl twice, different": _request(b"Host: x", b"Content-Length: 0", SMUGGLED_LENGTH, method=b"GET") + SMUGGLED,
    "cl twice, same": _request(b"Host: x", SMUGGLED_LENGTH, SMUGGLED_LENGTH, method=b"GET") + SMUGGLED,
    "cl list": _request(b"Host: x", SMUGGLED_LENGTH + b", %d" % len(SMUGGLED), method=b"GET") + SMUGGLED,
    "cl plus": _request(b"Host: x", b"Content-Length: +%d" % len(SMUGGLED), method=b"GET") + SMUGGLED,
    "cl negative": _request(b"Host: x", b"Content-Length: -1", method=b"GET") + SMUGGLED,
    "cl hex": _request(b"Host: x", b"Content-Length: 0x%x" % len(SMUGGLED), method=b"GET") + SMUGGLED,
    "cl space inside": _request(b"Host: x", b"Content-Length: 3 5", method=b"GET") + SMUGGLED,
    "cl empty": _request(b"Host: x", b"Content-Length:", method=b"GET") + SMUGGLED,
    "cl with ows": _request(b"Host: x", b"Content-Length:\t%d " % len(SMUGGLED), method=b"GET") + SMUGGLED + GET,
    "cl leading zeros": _request(b"Host: x", b"Content-Length: 000%d" % len(SMUGGLED), method=b"GET") + SMUGGLED + GET,
    "cl obs-fold": _request(b"Host: x", b"Content-Length:", b" %d" % len(SMUGGLED), method=b"GET") + SMUGGLED,
    "cl huge": _request(b"Host: x", b"Content-Length: 99999999999999999999999999", method=b"GET") + SMUGGLED,
    "cl past the bound": _request(b"Host: x", b"Content-Length: %d" % (BODY_LIMIT + 1), method=b"GET") + SMUGGLED,
    "cl at the bound": _request(b"Host: x", b"Content-Length: %d" % BODY_LIMIT, method=b"GET")
    + b"x" * BODY_LIMIT + GET,
    "cl longer than sent": _request(b"Host: x", b"Content-Length: 100", method=b"GET") + SMUGGLED,
    # Bodies on methods that take none: read and dropped, never read as requests.
    "get body is a request": _request(b"Host: x", SMUGGLED_LENGTH, method=b"GET") + SMUGGLED + GET,
    "head body is a request": _request(b"Host: x", SMUGGLED_LENGTH, method=b"HEAD") + SMUGGLED + GET,
    "options body": _request(b"Host: x", SMUGGLED_LENGTH, method=b"OPTIONS") + SMUGGLED + GET,
    "get cl zero": _request(b"Host: x", b"Content-Length: 0", method=b"GET") + GET,
    "get chunked": _te(b"chunked", method=b"GET") + CHUNKED_SMUGGLING,
    "expect continue": _request(b"Host: x", b"Expect: 100-continue", b"Content-Length: 5", method=b"GET")
    + b"abcde" + GET,
    # Chunk-size games.
    "chunk extensions": _te(b"chunked") + b"3;a=b;c ; d = \"q\\\"x\"\r\nabc\r\n0;e\r\n\r\n" + SMUGGLED,
    "chunk extension without a name": _te(b"chunked") + b"3;\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk extension without a value": _te(b"chunked") + b"3;a=\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk extension with a space": _te(b"chunked") + b"3;a=b c\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk extension unterminated quote": _te(b"chunked") + b"3;a=\"b\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk extension nul": _te(b"chunked") + b"3;a\x00\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk extension huge": _te(b"chunked") + b"3;" + b"a" * (BODY_LIMIT + 10) + b"\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk size trailing space": _te(b"chunked") + b"3 \r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk size leading space": _te(b"chunked") + b" 3\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk size negative": _te(b"chunked") + b"-3\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk size 0x": _te(b"chunked") + b"0x3\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk size plus": _te(b"chunked") + b"+3\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk size leading zeros": _te(b"chunked") + b"0000000000000000000003\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk size overflowing 64 bits": _te(b"chunked") + b"10000000000000003\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk size huge": _te(b"chunked") + b"f" * 40 + b"\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk past the bound": _te(b"chunked") + b"10000\r\n" + b"a" * 10 + SMUGGLED,
    "chunks past the bound": _te(b"chunked") + b"1\r\na\r\n" * (BODY_LIMIT // 6 + 1) + b"0\r\n\r\n" + SMUGGLED,
    "chunk longer than its size": _te(b"chunked") + b"3\r\nabcd\r\n0\r\n\r\n" + SMUGGLED,
    "chunk shorter than its size": _te(b"chunked") + b"5\r\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "chunk data then no crlf": _te(b"chunked") + b"3\r\nabcXY0\r\n\r\n" + SMUGGLED,  # two bytes skipped unseen
    "chunk data bare lf": _te(b"chunked") + b"3\r\nabc\n0\r\n\r\n" + SMUGGLED,
    "chunk line bare lf": _te(b"chunked") + b"3\nabc\r\n0\r\n\r\n" + SMUGGLED,
    "last chunk without its empty line": _te(b"chunked") + b"3\r\nabc\r\n0\r\n" + SMUGGLED,
    "trailer fields": _te(b"chunked") + b"3\r\nabc\r\n0\r\nX-T: 1\r\nY: 2\r\n\r\n" + SMUGGLED,
    "trailer obs-fold": _te(b"chunked") + b"0\r\nX-T: 1\r\n 2\r\n\r\n" + SMUGGLED,
    "trailer smuggled framing": _te(b"chunked") + b"0\r\nContent-Length: 37\r\n\r\n" + SMUGGLED,
    # Line endings, folding and request lines.
    "bare lf everywhere": b"GET /info HTTP/1.1\nHost: x\n\n" + GET,
    "bare lf once": b"GET /info HTTP/1.1\r\nHost: x\n\r\n" + GET,
    "bare cr": b"GET /info HTTP/1.1\r\nHost: x\rX: y\r\n\r\n" + GET,
    "bare cr incomplete": b"GET /info HTTP/1.1\r\nHost: x\rX",
    "cr cr lf": b"GET /info HTTP/1.1\r\r\nHost: x\r\n\r\n" + GET,
    "leading empty lines": b"\r\n\r\n" + GET + b"\r\n" + GET,
    "leading bare lf": b"\n" + GET,
    "whitespace before the first field": b"GET /info HTTP/1.1\r\n Host: x\r\n\r\n" + GET,
    "obs-fold": _request(b"Host: x", b"X: a", b" b", method=b"GET") + GET,
    "field without colon": _request(b"Host: x", b"X a", method=b"GET") + GET,
    "field with empty name": _request(b"Host: x", b": a", method=b"GET") + GET,
    "field name with a space": _request(b"Host: x", b"X Y: a", method=b"GET") + GET,
    "field value with a nul": _request(b"Host: x", b"X: a\x00b", method=b"GET") + GET,
    "no host": _request(method=b"GET") + GET,
    "two hosts": _request(b"Host: x", b"Host: y", method=b"GET") + GET,
    "host with a space": _request(b"Host: x y", method=b"GET") + GET,
    "http/1.0 without host": _request(line=b"GET /info HTTP/1.0") + GET,
    "request line extra version": _request(b"Host: x", line=b"GET /info HTTP/1.1 HTTP/1.1") + GET,
    "request line two spaces": _request(b"Host: x", line=b"GET  /info HTTP/1.1") + GET,
    "request line tab": _request(b"Host: x", line=b"GET\t/info HTTP/1.1") + GET,
    "request line trailing space": _request(b"Host: x", line=b"GET /info HTTP/1.1 ") + GET,
    "request line lower-case version": _request(b"Host: x", line=b"GET /info http/1.1") + GET,
    "request line no version": _request(b"Host: x", line=b"GET /info") + GET,
    "request target with a space": _request(b"Host: x", line=b"GET /in fo HTTP/1.1") + GET,
    "request target obs-text": _request(b"Host: x", line=b"GET /\xffinfo HTTP/1.1") + GET,
    # Pipelining and connection ends.
    "pipelined": GET + b"HEAD /info HTTP/1.1\r\nHost: x\r\n\r\n" + SMUGGLED + GET,
    "connection close": _request(b"Host: x", b"Connection: close", method=b"GET") + GET,
    "connection close in a list": _request(b"Host: x", b"Connection: keep-alive, CLOSE", method=b"GET") + GET,
    "http/1.0 pipelined": b"GET /info HTTP/1.0\r\n\r\n" + GET,
    "post then get": _request(b"Host: x", b"Content-Length: 3") + b"abc" + GET,
    "incomplete head": GET + b"GET /info HTTP/1.1\r\nHost: x\r\n",
}


def _answers(stream: bytes) -> list[int]:
    """The final statuses in `stream`, answers to HEAD (no body after a Content-Length) included."""
    statuses: list[int] = []
    pos = 0
    while (end := stream.find(b"\r\n\r\n", pos)) >= 0:
        head = stream[pos:end].decode("latin-1")
        status = int(head.split(" ", 2)[1])
        length = re.search(r"(?im)^content-length:\s*(\d+)", head)
        pos = end + 4
        if status >= 200:
            statuses.append(status)
        if length and not stream.startswith(b"HTTP/1.1 ", pos) and pos < len(stream):
            pos += int(length.group(1))
    return statuses


def exchange(url: str, data: bytes, expected: Framing, quiet: float = 0.5, limit: float = 20) -> Framing:
    """What the server at `url` answers `data`: read until it closes, or until the answers `expected`
    are in and nothing more comes for `quiet` seconds; never longer than `limit`."""
    parts = urlsplit(url)
    stream = b""
    closes = False
    with socket.create_connection((parts.hostname, parts.port), timeout=limit) as s:
        try:
            s.sendall(data)
        except OSError:  # refused before all was sent: what came back says how
            pass
        deadline = time.monotonic() + limit
        while (left := deadline - time.monotonic()) > 0:
            enough = len(_answers(stream)) >= len(expected.statuses) and not expected.closes
            s.settimeout(min(left, quiet) if enough else left)
            try:
                piece = s.recv(1 << 16)
            except socket.timeout:
                if enough:
                    break
                continue
            except ConnectionResetError:
                closes = True
                break
            if not piece:
                closes = True
                break
            stream += piece
    return Framing(tuple(_answers(stream)), closes)


def _alive(url: str) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", "/info")
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("framing")
    volume = write_volume(root / "volume", [Scale((32, 32, 16), (16, 16, 8), sharding(minishard=1, shard=1))],
                          "uint8")
    (volume["sharded"] / "empty.bin").write_bytes(b"")
    (volume["sharded"] / "one.bin").write_bytes(b"z")
    with served(str(volume["sharded"])) as url:
        yield url


@pytest.mark.mount  # starts `unshardfs serve`
def test_the_smuggling_catalog_is_framed_as_a_strict_reader_frames_it(url):
    def one(name: str) -> tuple[str, Framing, Framing, int]:
        expected = strict_framing(CATALOG[name])
        return name, expected, exchange(url, CATALOG[name], expected), _alive(url)

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, CATALOG))
    wrong = {name: (expected, got) for name, expected, got, _ in outcomes if got != expected}
    assert not wrong, "\n".join(f"{n}: strict {e}, served {g}" for n, (e, g) in wrong.items())
    assert all(alive == 200 for *_, alive in outcomes)
    # The catalog reaches every kind of answer: refusals, smuggled requests answered only where a strict
    # reader frames them as requests, and connections left open.
    kinds = {e for _, expected, _, _ in outcomes for e in expected.statuses}
    assert {200, 204, 400, 404, 405, 413, 501} <= kinds
    assert any(not expected.closes for _, expected, _, _ in outcomes)


def test_the_catalog_cases_that_matter_most_say_what_they_should():
    """The reference itself, pinned on the cases the issue names (so a reference bug cannot hide one)."""
    refused = {"cl.te": 400, "cl.te get": 400, "te.cl": 400, "te xchunked": 400, "te chunked identity": 400,
               "te identity chunked": 501, "te two lines": 400, "te obs-fold": 400, "te in http/1.0": 400,
               "cl twice, different": 400, "cl twice, same": 400, "obs-fold": 400, "bare lf everywhere": 400,
               "chunk size huge": 413, "chunk size negative": 400, "chunk size trailing space": 400,
               "request line extra version": 400, "two hosts": 400, "cl past the bound": 413}
    for name, status in refused.items():
        assert strict_framing(CATALOG[name]) == Framing((status,), True), name
    assert strict_framing(CATALOG["get body is a request"]) == Framing((200, 200), False)
    assert strict_framing(CATALOG["te extra spaces"]) == Framing((405, 404), False)
    assert strict_framing(CATALOG["te misspelt name"]) == Framing((405, 400), True)  # "3" is no request line
    assert strict_framing(CATALOG["connection close"]) == Framing((200,), True)


# -- differential, generated ------------------------------------------------------------------

_LINES = [b"GET /info HTTP/1.1", b"POST /info HTTP/1.1", b"HEAD /info HTTP/1.1", b"GET /info HTTP/1.0",
          b"GET /x HTTP/1.1 ", b"GET /info HTTP/1.1\n", b"\r\nGET /info HTTP/1.1"]
_FIELDS = [b"Host: x", b"Host: y", b"Content-Length: 3", b"Content-Length: 0", b"Content-Length: 5",
           b"Content-Length:  3 ", b"Content-Length: 3,3", b"Transfer-Encoding: chunked", b"Transfer-Encoding: x",
           b"Transfer-Encoding: x, chunked", b"Transfer-Encoding : chunked", b"Transfer-Encoding:\tchunked",
           b" chunked", b"\tX: y", b"Connection: close", b"X: a\rb", b"X: a\nb", b"Expect: 100-continue",
           b"Transfer-Encoding: chunked, chunked", b"X-Y: \x7f", b"Z:"]
_BODIES = [b"", b"abc", b"abcde", b"0\r\n\r\n", b"3\r\nabc\r\n0\r\n\r\n", b"3;x=y\r\nabc\r\n0\r\n\r\n",
           b"3 \r\nabc\r\n0\r\n\r\n", b"0\r\nT: 1\r\n\r\n", b"3\r\nabc\r\n", b"1\r\n", b"\r\n", b"\n",
           b"ffffffffffff\r\n", b"3\r\nab\r\n\r\n0\r\n\r\n", SMUGGLED]

_message_bytes = st.builds(
    lambda line, fields, body: line + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n" + body,
    st.sampled_from(_LINES), st.lists(st.sampled_from(_FIELDS), max_size=4), st.sampled_from(_BODIES))


@pytest.mark.mount
@settings(max_examples=examples(500), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(_message_bytes, min_size=1, max_size=3).map(b"".join))
def test_generated_streams_are_framed_as_a_strict_reader_frames_them(url, data):
    """Half-closed after sending, so the server ends every exchange itself: at a refusal, or when it
    needs bytes that will not come. Its answers must be the reference's, in order."""
    expected = strict_framing(data)
    parts = urlsplit(url)
    stream = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=20) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            while piece := s.recv(1 << 16):
                stream += piece
        except ConnectionResetError:
            pass
    assert tuple(_answers(stream)) == expected.statuses, data


@pytest.mark.mount  # starts `unshardfs serve`
def test_a_client_that_waits_for_100_continue_gets_it(url):
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(_request(b"Host: x", b"Expect: 100-continue", b"Content-Length: 5", method=b"GET"))
        interim = b""
        while not interim.endswith(b"\r\n\r\n") and (piece := s.recv(1 << 16)):
            interim += piece
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"abcde" + GET)
        stream = b""
        while len(_answers(stream)) < 2:
            piece = s.recv(1 << 16)
            assert piece, stream
            stream += piece
        assert _answers(stream) == [200, 200]


@pytest.mark.mount  # starts `unshardfs serve`
def test_a_body_that_does_not_arrive_in_time_is_a_408(tmp_path):
    volume = write_volume(tmp_path / "volume", [Scale((16, 16, 8), (16, 16, 8), sharding(minishard=1, shard=1))],
                          "uint8")
    with served(str(volume["sharded"]), "--header-timeout", "1") as url:
        request = _request(b"Host: x", b"Content-Length: 5", method=b"GET") + b"ab"
        got = exchange(url, request, Framing((408,), True), limit=10)
        assert got == Framing((408,), True)
        assert _alive(url) == 200


@pytest.mark.mount  # starts `unshardfs serve`
def test_ranges_of_empty_and_one_byte_files_over_the_wire(url):
    """Through the real server: a suffix of an empty file is the whole (empty) file, never `bytes 0--1/0`."""
    parts = urlsplit(url)
    for path, size in (("/empty.bin", 0), ("/one.bin", 1)):
        for value in ("bytes=-5", "bytes=0-", "bytes=-1", "bytes=0-0", "bytes=1-"):
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
            try:
                conn.request("GET", path, headers={"Range": value})
                response = conn.getresponse()
                body = response.read()
            finally:
                conn.close()
            content_range = response.getheader("Content-Range")
            if response.status == 206:
                first, last, total = map(int, re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", content_range).groups())
                assert 0 <= first <= last < total == size and len(body) == last - first + 1, (path, value)
            elif response.status == 416:
                assert content_range == f"bytes */{size}", (path, value)
            else:
                assert response.status == 200 and content_range is None and len(body) == size, (path, value)
        assert _alive(url) == 200


def _framed_in_pieces(data: bytes, cuts: list[int]) -> Framing:
    """What the server's readers make of `data` arriving in pieces cut at `cuts`: its reading loop,
    in-process, with the statuses the tree would answer."""
    pieces = iter([data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])])
    buffer = bytearray()
    statuses: list[int] = []

    def more() -> bool:
        piece = next(pieces, None)
        buffer.extend(piece or b"")
        return piece is not None

    try:
        while True:
            reader = HeadReader(16 << 10, 8 << 10)
            while (head := reader.read(buffer)) is None:
                if not more():
                    return Framing(tuple(statuses), False)
            del buffer[:head.size]
            body = body_reader(head)
            while body is not None:
                taken, done = body.read(buffer)
                del buffer[:taken]
                if done:
                    break
                if not more():
                    return Framing(tuple(statuses), False)
            statuses.append(_status(head.method, head.target))
            if head.version == b"1.0" or any(t.strip().lower() == b"close" for v in head.values(b"connection")
                                             for t in v.split(b",")):
                return Framing(tuple(statuses), True)
    except Refusal as e:
        return Framing((*statuses, e.status), True)


@settings(max_examples=examples(3000), deadline=None)
@given(st.one_of(st.sampled_from(sorted(CATALOG.values())), st.lists(_message_bytes, min_size=1, max_size=3)
                 .map(b"".join)), st.lists(st.integers(0, 1 << 17), max_size=12), st.booleans())
def test_any_split_of_the_bytes_frames_the_same(data, cuts, bytewise):
    """However the bytes arrive (cut anywhere, or one at a time), the server's readers frame them as
    the reference frames them whole."""
    if bytewise and len(data) > 4096:
        bytewise = False
    points = list(range(1, len(data))) if bytewise else sorted({c % (len(data) + 1) for c in cuts})
    assert _framed_in_pieces(data, points) == strict_framing(data), (data[:300], points[:20])
