"""An HTTP server that misbehaves on purpose, for the hostile-source tests.

`HostileServer` is a `DatasetServer` (a real dataset directory, Range, HEAD,
request log) whose GETs of paths containing `target` misbehave as `mode`
says; HEADs and every other path are served well, so a mount comes up and
other files still read. Modes:

- ``stacked-gzip``: a 206 with `Content-Encoding: gzip, gzip` whose ~12 KB
  body decodes to 1 GiB of zeros
- ``endless``: a right Content-Range, then a chunked body that never ends
- ``other-offset``: a 206 of the right length, from one byte further on (and
  a Content-Range that says so)
- ``bad-content-range``: the right bytes under a Content-Range of another length
- ``drip``: the right answer, one byte every 100 ms
- ``huge-error``: a 500 announcing and streaming a 100 MB body
- ``redirect``: a 302 (also for HEAD) to the same path on `redirect_to`
- ``repeat-token``, ``endless-tokens``, ``bad-names``: GCS `objects.list`
  pages whose next-page token never changes, always changes, or whose names
  are '..', '.', '', NUL, not UTF-8, outside the listed prefix or several
  segments deep (target such a mode at "/storage/v1/b/")

Every misbehaving answer is logged like a normal one, and every request is
recorded in `arrived` before it is answered; writers stop when the client
hangs up or the server is closed.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import urllib.parse
import zlib
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Iterable

from unshardfs.testing.http_servers import DatasetServer, Logged

MODES = ("stacked-gzip", "endless", "other-offset", "bad-content-range", "drip", "huge-error", "redirect",
         "repeat-token", "endless-tokens", "bad-names")
HUGE_ERROR_BYTES = 100 * 10**6
BOMB_BYTES = 1 << 30
WRITE_LIMIT_SECONDS = 60.0  # an unread endless answer gives up after this, whatever the client does


@functools.cache
def stacked_gzip_bomb() -> bytes:
    """gzip(gzip(1 GiB of zeros)): ~12 KB on the wire (computed once, ~2 s)."""
    inner = zlib.compressobj(1, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    once = b"".join([inner.compress(zeros) for _ in range(BOMB_BYTES >> 20)]) + inner.flush()
    outer = zlib.compressobj(9, zlib.DEFLATED, 31)
    return outer.compress(once) + outer.flush()


class HostileServer(DatasetServer):
    def __init__(self, root: Path, gcs_bucket: str | None = None, host: str = "127.0.0.1") -> None:
        super().__init__(root, gcs_bucket, host=host)
        self.mode: str | None = None
        self.target = ".shard"  # misbehave on paths containing this
        self.redirect_to = ""  # base URL the "redirect" mode sends clients to
        # Request targets as they arrive: complete once the client has an answer, unlike `log`,
        # which is written after the answer (so "nothing reached this server" is a sure check).
        self.arrived: list[str] = []
        self._closed = threading.Event()
        self._tokens = 0

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        super().__exit__(*exc)

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        with self._lock:
            self.arrived.append(h.path)
        mode = self.mode
        if mode is None or self.target not in h.path or (head and mode != "redirect"):
            return super()._handle(h, head)
        assert mode in MODES, mode
        getattr(self, "_" + mode.replace("-", "_"))(h)

    # -- helpers ---------------------------------------------------------------

    def _record(self, h: BaseHTTPRequestHandler, status: int, sent: int) -> None:
        with self._lock:
            self.log.append(Logged(h.command, h.path, h.headers.get("Range"), status, sent))

    def _start(self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str]) -> None:
        h.send_response(status)
        for name, value in headers.items():
            h.send_header(name, value)
        h.end_headers()

    def _stream(self, h: BaseHTTPRequestHandler, status: int, pieces: Iterable[bytes], chunked: bool = False,
                pause: float = 0.0) -> None:
        """Write `pieces` (after headers sent by the caller) until they end, the client hangs up,
        the server closes or WRITE_LIMIT_SECONDS pass; then log the answer."""
        sent = 0
        until = time.monotonic() + WRITE_LIMIT_SECONDS
        try:
            for piece in pieces:
                if self._closed.is_set() or time.monotonic() > until:
                    break
                h.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                h.wfile.flush()
                sent += len(piece)
                if pause and self._closed.wait(pause):
                    break
        except OSError:
            pass  # the client hung up: what these answers are for
        h.close_connection = True
        self._record(h, status, sent)

    def _object(self, h: BaseHTTPRequestHandler) -> tuple[bytes, int, int]:
        """The requested object's bytes and the (start, end) of its Range (the whole object without one)."""
        path = urllib.parse.unquote(urllib.parse.urlsplit(h.path).path).lstrip("/")
        data = (self.root / path).read_bytes()
        rng = h.headers.get("Range", "")
        if rng.startswith("bytes="):
            first, _, last = rng[6:].partition("-")
            if not first:  # a suffix: the last N bytes
                return data, max(len(data) - int(last), 0), len(data) - 1
            return data, int(first), min(int(last), len(data) - 1)
        return data, 0, len(data) - 1

    @staticmethod
    def _ranged(start: int, end: int, total: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"Content-Range": f"bytes {start}-{end}/{total}", "Accept-Ranges": "bytes", **(extra or {})}

    # -- misbehaviours -------------------------------------------------------------

    def _stacked_gzip(self, h: BaseHTTPRequestHandler) -> None:
        data, start, end = self._object(h)
        bomb = stacked_gzip_bomb()
        self._start(h, 206, self._ranged(start, end, len(data), {
            "Content-Encoding": "gzip, gzip", "Content-Length": str(len(bomb))}))
        self._stream(h, 206, [bomb])

    def _endless(self, h: BaseHTTPRequestHandler) -> None:
        if h.headers.get("Range"):
            data, start, end = self._object(h)
            status, headers = 206, self._ranged(start, end, len(data))
        else:  # a listing, say
            status, headers = 200, {"Content-Type": "application/json"}
        self._start(h, status, {**headers, "Transfer-Encoding": "chunked"})
        self._stream(h, status, iter(lambda: bytes(64 << 10), None), chunked=True)

    def _other_offset(self, h: BaseHTTPRequestHandler) -> None:
        data, start, end = self._object(h)
        body = data[start + 1:end + 2]
        self._start(h, 206, self._ranged(start + 1, start + len(body), len(data),
                                         {"Content-Length": str(len(body))}))
        self._stream(h, 206, [body])

    def _bad_content_range(self, h: BaseHTTPRequestHandler) -> None:
        data, start, end = self._object(h)
        body = data[start:end + 1]
        self._start(h, 206, self._ranged(start, end - 1, len(data), {"Content-Length": str(len(body))}))
        self._stream(h, 206, [body])

    def _drip(self, h: BaseHTTPRequestHandler) -> None:
        data, start, end = self._object(h)
        body = data[start:end + 1]
        self._start(h, 206, self._ranged(start, end, len(data), {"Content-Length": str(len(body))}))
        self._stream(h, 206, (body[i:i + 1] for i in range(len(body))), pause=0.1)

    def _huge_error(self, h: BaseHTTPRequestHandler) -> None:
        self._start(h, 500, {"Content-Length": str(HUGE_ERROR_BYTES), "Retry-After": "0"})
        block = bytes(1 << 20)
        self._stream(h, 500, (block[:min(len(block), HUGE_ERROR_BYTES - i)]
                              for i in range(0, HUGE_ERROR_BYTES, len(block))))

    def _redirect(self, h: BaseHTTPRequestHandler) -> None:
        self._start(h, 302, {"Location": self.redirect_to + h.path, "Content-Length": "0"})
        self._record(h, 302, 0)

    def _listing_page(self, h: BaseHTTPRequestHandler, page: dict[str, Any]) -> None:
        # ensure_ascii: lone surrogates (names that are not UTF-8) travel as \\udXXX escapes.
        body = json.dumps(page, ensure_ascii=True).encode()
        self._start(h, 200, {"Content-Type": "application/json", "Content-Length": str(len(body))})
        self._stream(h, 200, [body])

    def _listed_prefix(self, h: BaseHTTPRequestHandler) -> str:
        return urllib.parse.parse_qs(urllib.parse.urlsplit(h.path).query).get("prefix", [""])[0]

    def _repeat_token(self, h: BaseHTTPRequestHandler) -> None:
        prefix = self._listed_prefix(h)
        self._listing_page(h, {"items": [{"name": prefix + "x", "size": "1"}], "nextPageToken": "again"})

    def _endless_tokens(self, h: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self._tokens += 1
            token = f"t{self._tokens}"
        self._listing_page(h, {"items": [], "nextPageToken": token})

    def _bad_names(self, h: BaseHTTPRequestHandler) -> None:
        p = self._listed_prefix(h)
        items = [p + name for name in ("..", ".", "a\0b", "bad\udcff", "sub/deeper", "good")] + ["elsewhere/x"]
        prefixes = [p + name for name in ("../", "./", "/", "a\0/", "dir/")] + ["other/"]
        self._listing_page(h, {"items": [{"name": name, "size": "3"} for name in items], "prefixes": prefixes})
