"""Where a request's head and body end, read as strictly as RFC 9112 writes it.

A server behind a proxy must find every request boundary exactly where the
proxy found it, or bytes one of them took for a body become a request to the
other ("request smuggling"). So anything a lenient reader would have to guess
at is refused and the connection closed, never repaired:

- lines end in CRLF; a bare LF or a CR elsewhere is a 400;
- the request line is `method SP target SP HTTP/d.d`, nothing more or less;
- a field line is `name ":" OWS value OWS`; whitespace before the colon, a
  line starting with whitespace (obs-fold) and control characters in a value
  are a 400;
- HTTP/1.1 needs one Host field, no request may carry two;
- Transfer-Encoding and Content-Length together, Transfer-Encoding in an
  HTTP/1.0 request, any coding list whose last coding is not `chunked` or
  that names it twice, and two Content-Length field lines or one that is not
  digits are a 400; a coding other than chunked before it is a 501;
- a chunked body follows the chunk grammar exactly: hex sizes, extensions as
  `; name[=token or quoted string]`, CRLF after each chunk's data, trailer
  fields as strict as header fields.

Bodies are read only to be dropped (no method served here takes one), and only
up to BODY_BYTES on the wire: a larger one is a 413 before its bytes are read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BODY_BYTES = 64 << 10  # a request body is read and dropped up to this many bytes on the wire; more: 413

_TCHAR = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]"
_TOKEN = re.compile(_TCHAR + rb"+")
_REQUEST_LINE = re.compile(rb"(" + _TCHAR + rb"+) ([\x21-\x7e]+) HTTP/([0-9]\.[0-9])")
# A field line: a token, a colon, then VCHAR, obs-text, SP and HTAB only (no other control character).
_FIELD_LINE = re.compile(rb"(" + _TCHAR + rb"+):([\t\x20-\x7e\x80-\xff]*)")
_HOST = re.compile(rb"(\[[0-9A-Za-z:._~!$&'()*+,;=-]+\]|[0-9A-Za-z._~!$&'()*+,;=%-]*)(:[0-9]*)?")
_QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
_CHUNK_EXT = rb"(?:[ \t]*;[ \t]*" + _TCHAR + rb"+(?:[ \t]*=[ \t]*(?:" + _TCHAR + rb"+|" + _QUOTED + rb"))?)*"
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]+)" + _CHUNK_EXT)
_SIZE_DIGITS = 8  # hex digits past leading zeros that can still be within BODY_BYTES


class Refusal(Exception):
    """A request that cannot be framed or served: answer `status` and close the connection."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class Head:
    """A request head that passed every check, and how its body is framed."""

    method: bytes
    target: bytes
    version: bytes  # b"1.1"
    fields: tuple[tuple[bytes, bytes], ...]  # (name as sent, value without surrounding whitespace)
    size: int  # bytes the head took in the buffer, empty lines before it included
    content_length: int  # 0 when there is no body or it is chunked
    chunked: bool

    @property
    def has_body(self) -> bool:
        return self.chunked or self.content_length > 0

    def values(self, name: bytes) -> list[bytes]:
        """The values of every field line called `name` (lower case), in order."""
        return [v for k, v in self.fields if k.lower() == name]

    def expects_continue(self) -> bool:
        return self.version != b"1.0" and any(
            part.strip().lower() == b"100-continue" for v in self.values(b"expect") for part in v.split(b","))

    def without_framing(self) -> bytes:
        """The head without its body's framing fields: what a reader that must see no body is given."""
        lines = [b"%s %s HTTP/%s\r\n" % (self.method, self.target, self.version)]
        lines += [b"%s: %s\r\n" % (k, v) for k, v in self.fields
                  if k.lower() not in (b"content-length", b"transfer-encoding")]
        return b"".join(lines) + b"\r\n"


class HeadReader:
    """Reads one request head from the start of a growing buffer, each line checked once as it completes."""

    def __init__(self, max_bytes: int, max_target: int) -> None:
        self.max_bytes = max_bytes
        self.max_target = max_target
        self.pos = 0  # the end of the last complete line
        self.request: tuple[bytes, bytes, bytes] | None = None
        self.fields: list[tuple[bytes, bytes]] = []

    def read(self, data: bytes | bytearray) -> Head | None:
        """The head once `data` holds all of it, None while more is needed; raises Refusal."""
        if not self.pos and not data.startswith(b"\r\n") and (head := self._whole(data)) is not None:
            return head
        while True:
            end = data.find(b"\n", self.pos)
            if end < 0:
                _no_bare_cr(data, self.pos)
                if len(data) > self.max_bytes:
                    raise (Refusal(431, "request headers too large") if self.request
                           else Refusal(414, "request target too long"))
                return None
            line = bytes(data[self.pos:end + 1])
            self.pos = end + 1
            if self.pos > self.max_bytes:
                raise Refusal(431, "request headers too large")
            text = _line(line)
            if self.request is None:
                if text:
                    self.request = self._request_line(text)
                continue  # empty lines before a request line are skipped (RFC 9112 section 2.2)
            if not text:
                return self._head()
            self.fields.append(_field(text))

    def _whole(self, data: bytes | bytearray) -> Head | None:
        """The head read at once, when all of it is in `data` and every line ends in CRLF (the usual
        case); None leaves it to the reading line by line. Lines are checked in the same order."""
        end = data.find(b"\r\n\r\n")
        if end < 0 or end + 4 > self.max_bytes:
            return None
        block = bytes(data[:end])
        lines = block.split(b"\r\n")
        if block.count(b"\r") != len(lines) - 1 or block.count(b"\n") != len(lines) - 1:
            return None  # a bare CR or LF: refused where the line-by-line reading meets it
        self.request = self._request_line(lines[0])
        self.fields = [_field(line) for line in lines[1:]]
        self.pos = end + 4
        return self._head()

    def _request_line(self, text: bytes) -> tuple[bytes, bytes, bytes]:
        match = _REQUEST_LINE.fullmatch(text)
        if match is None:
            raise Refusal(400, "malformed request line")
        method, target, version = match.groups()
        if len(target) > self.max_target:
            raise Refusal(414, "request target too long")
        return method, target, version

    def _head(self) -> Head:
        assert self.request is not None
        method, target, version = self.request
        fields = tuple(self.fields)
        named: dict[bytes, list[bytes]] = {}
        for name, value in fields:
            named.setdefault(name.lower(), []).append(value)
        hosts = named.get(b"host", [])
        needs_host = version.startswith(b"1.") and version != b"1.0"
        if len(hosts) > 1 or (needs_host and not hosts) or any(not _HOST.fullmatch(h) for h in hosts):
            raise Refusal(400, "one valid Host field is required")
        length, chunked = _framing(version, named.get(b"transfer-encoding"), named.get(b"content-length"))
        return Head(method, target, version, fields, self.pos, length, chunked)


def _framing(version: bytes, codings: list[bytes] | None, lengths: list[bytes] | None) -> tuple[int, bool]:
    """(content length, chunked) of a request's body, from its Transfer-Encoding and Content-Length fields."""
    if codings is not None:
        if version == b"1.0":
            raise Refusal(400, "Transfer-Encoding in an HTTP/1.0 request")
        if lengths is not None:
            raise Refusal(400, "both Transfer-Encoding and Content-Length")
        names = [c.strip(b" \t").lower() for c in b",".join(codings).split(b",")]
        if any(not _TOKEN.fullmatch(n) for n in names) or names[-1] != b"chunked" or names.count(b"chunked") > 1:
            raise Refusal(400, "Transfer-Encoding must end in chunked, once")
        if len(names) > 1:
            raise Refusal(501, "transfer codings other than chunked are not implemented")
        return 0, True
    if lengths is None:
        return 0, False
    if len(lengths) > 1 or not lengths[0].isdigit():
        raise Refusal(400, "Content-Length must be one decimal number")
    digits = lengths[0].lstrip(b"0")
    if len(digits) > 18 or int(digits or b"0") > BODY_BYTES:
        raise Refusal(413, "request body too large")
    return int(digits or b"0"), False


class ChunkedReader:
    """Reads a chunked body off the front of a buffer as it arrives, keeping none of it."""

    def __init__(self, limit: int = BODY_BYTES) -> None:
        self.left = limit  # body bytes on the wire still allowed
        self.data = 0  # bytes of chunk data still to come
        self.crlf = 0  # bytes of the CRLF after them still to come
        self.trailer = False  # the last chunk is read: trailer fields, then an empty line

    def read(self, data: bytes | bytearray) -> tuple[int, bool]:
        """(bytes of `data` taken, whether the body is complete); raises Refusal."""
        taken = 0
        while True:
            step = min(self.data, len(data) - taken)
            taken += step
            self.data -= step
            while self.crlf and taken < len(data):
                if data[taken] != b"\r\n"[2 - self.crlf]:
                    raise Refusal(400, "chunk data not followed by CRLF")
                taken += 1
                self.crlf -= 1
            if self.data or self.crlf:
                return taken, False
            end = data.find(b"\n", taken)
            if end < 0:
                _no_bare_cr(data, taken)
                if len(data) - taken > self.left:
                    raise Refusal(413, "request body too large")
                return taken, False
            size = end + 1 - taken
            if size > self.left:
                raise Refusal(413, "request body too large")
            self.left -= size
            text = _line(bytes(data[taken:end + 1]))
            taken = end + 1
            if self.trailer:
                if not text:
                    return taken, True
                _field(text)
                continue
            match = _CHUNK_LINE.fullmatch(text)
            if match is None:
                raise Refusal(400, "malformed chunk size line")
            digits = match.group(1).lstrip(b"0")
            if not digits:
                self.trailer = True
                continue
            if len(digits) > _SIZE_DIGITS or int(digits, 16) + 2 > self.left:
                raise Refusal(413, "request body too large")
            self.data = int(digits, 16)
            self.crlf = 2
            self.left -= self.data + 2


def _line(line: bytes) -> bytes:
    """A line's content without its CRLF; a bare LF or CR in it is a 400."""
    if not line.endswith(b"\r\n") or b"\r" in line[:-2]:
        raise Refusal(400, "a line not ended by CRLF, or a bare CR")
    return line[:-2]


def _no_bare_cr(data: bytes | bytearray, start: int) -> None:
    """An incomplete line must not hold a CR that is not the very last byte so far."""
    cr = data.find(b"\r", start)
    if 0 <= cr < len(data) - 1:
        raise Refusal(400, "a bare CR")


def _field(text: bytes) -> tuple[bytes, bytes]:
    """(name, value) of a field line; obs-fold, whitespace before the colon, no name or a control
    character in the value are a 400."""
    match = _FIELD_LINE.fullmatch(text)
    if match is None:
        raise Refusal(400, "malformed field line")
    return match.group(1), match.group(2).strip(b" \t")


class LengthReader:
    """Reads a body of a given length off the front of a buffer as it arrives, keeping none of it."""

    def __init__(self, length: int) -> None:
        self.left = length

    def read(self, data: bytes | bytearray) -> tuple[int, bool]:
        """(bytes of `data` taken, whether the body is complete)."""
        taken = min(self.left, len(data))
        self.left -= taken
        return taken, not self.left


BodyReader = ChunkedReader | LengthReader  # takes a body off the front of a buffer: read(data) -> (taken, done)


def body_reader(head: Head) -> BodyReader | None:
    """What reads (and drops) the body of `head`; None when it has none."""
    if head.chunked:
        return ChunkedReader()
    return LengthReader(head.content_length) if head.content_length else None
