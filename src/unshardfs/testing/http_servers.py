"""Real HTTP servers on 127.0.0.1 for the remote-source tests.

`DatasetServer` serves a directory with Range, HEAD, ETag/Last-Modified and
If-Match support, logs every request, and injects faults on demand: slow
responses, 500s, 429s, dropped connections, no Range support, 404s. It can
also answer the GCS JSON API's `objects.list` (with small pages, so page
tokens are exercised), standing in for storage.googleapis.com.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterable

from unshardfs.testing.latency import round_trips


def delimited(keys: Iterable[str], prefix: str, delimiter: str | None) -> list[tuple[str, bool]]:
    """A bucket listing's names in order, as the object stores give them: each key under `prefix`
    (False), and with a `delimiter` each common prefix once in its place (True) instead of the keys
    below it. `keys` sorted."""
    names: list[tuple[str, bool]] = []
    for key in keys:
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix):]
        if delimiter and delimiter in rest:
            common = prefix + rest.split(delimiter)[0] + delimiter
            if not names or names[-1] != (common, True):
                names.append((common, True))
        else:
            names.append((key, False))
    return names


@dataclass
class Faults:
    delay: float = 0.0  # seconds before every response: an object store's latency
    error_every: int = 0  # every Nth request answers `error_status` (0: never)
    error_status: int = 500
    drop_every: int = 0  # every Nth GET sends half its body, then closes the connection
    no_range: bool = False  # ignore Range headers (200 with the whole object)
    missing: set[str] = field(default_factory=set)  # paths answered with 404
    no_head: bool = False  # answer HEAD with 405
    moved: str | None = None  # paths under this prefix answer 301 to the same path without it
    no_if_match: bool = False  # ignore If-Match (answer from the object as it is now, as some servers do)
    weak_etags: bool = False  # send weak entity tags (W/"..."), as servers that compress on the fly do
    no_etags: bool = False  # send no ETag, only Last-Modified (and honour If-Unmodified-Since)


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    status: int
    sent: int
    start: float = 0.0  # time.monotonic() when the request had arrived
    end: float = 0.0  # ... and when its answer started going out


class DatasetServer:
    def __init__(self, root: Path, gcs_bucket: str | None = None, page_size: int = 3,
                 host: str = "127.0.0.1") -> None:
        self.root = root
        self.faults = Faults()
        self.log: list[Logged] = []
        self.gcs_bucket = gcs_bucket  # serve <root> as gs://<bucket>/ (media and list API)
        self.page_size = page_size
        self._count = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as separate writes

            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                server.handle(self, head=True)

            def do_GET(self) -> None:
                server.handle(self, head=False)

        class Threaded(ThreadingHTTPServer):
            # socketserver's default listen backlog (5) drops the SYNs of a client opening
            # more connections at once, which it resends a second later: a stall that is
            # the test server's, not the client's.
            request_queue_size = 128

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # clients hanging up early (a dropped fallback download) are expected here

        self.httpd = Threaded((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> "DatasetServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def reset_log(self) -> None:
        with self._lock:
            self.log.clear()

    def requests(self, method: str | None = None) -> list[Logged]:
        with self._lock:
            return [r for r in self.log if method is None or r.method == method]

    def round_trips(self) -> int:
        """The longest chain of logged requests each sent after the one before it was answered:
        the round trips a client waited for one after another, however many requests overlapped."""
        return round_trips((r.start, r.end) for r in self.requests())

    # -- request handling ------------------------------------------------------

    def _reply(self, h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str],
               head: bool, rng: str | None, drop: bool = False, length: int | None = None) -> None:
        answered = time.monotonic()
        dropping = drop and not head and len(body) > 1
        sent = 0 if head else len(body) // 2 if dropping else len(body)
        # Logged before the answer is written: a client that has its bytes may ask the log at
        # once, and must find this request there (logging after the write raced it).
        with self._lock:
            self.log.append(Logged("HEAD" if head else "GET", h.path, rng, status, sent,
                                   getattr(h, "arrived", answered), answered))
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body) if length is None else length))
        h.end_headers()
        if dropping:
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
        elif not head:
            h.wfile.write(body)

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        setattr(h, "arrived", time.monotonic())  # read back in `answer` (the request's arrival)
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self._handle(h, head)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        f = self.faults
        with self._lock:
            self._count += 1
            n = self._count
        if f.delay:
            time.sleep(f.delay)
        rng = h.headers.get("Range")
        url = urllib.parse.urlsplit(h.path)
        if f.error_every and n % f.error_every == 0:
            return self._reply(h, f.error_status, b"injected", {"Retry-After": "0"}, head, rng)
        if head and f.no_head:
            return self._reply(h, 405, b"", {}, head, rng)
        path = urllib.parse.unquote(url.path)
        if f.moved and path.startswith(f.moved + "/"):
            return self._reply(h, 301, b"", {"Location": url.path[len(f.moved):]}, head, rng)
        if self.gcs_bucket is not None:
            listing = f"/storage/v1/b/{self.gcs_bucket}/o"
            if path == listing:
                return self._gcs_list(h, urllib.parse.parse_qs(url.query), head, rng)
            prefix = f"/{self.gcs_bucket}/"
            if not path.startswith(prefix):
                return self._reply(h, 404, b"no such bucket", {}, head, rng)
            path = "/" + path[len(prefix):]
        target = (self.root / path.lstrip("/")).resolve()
        if path in f.missing or not target.is_file() or self.root.resolve() not in target.parents:
            return self._reply(h, 404, b"not found", {}, head, rng)
        st = target.stat()
        etag = '"' + hashlib.md5(f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest() + '"'
        if f.weak_etags:
            etag = "W/" + etag
        headers = {"ETag": etag, "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
                   "Accept-Ranges": "none" if f.no_range else "bytes"}
        if f.no_etags:
            del headers["ETag"]
            since = h.headers.get("If-Unmodified-Since")
            if since and int(st.st_mtime) > email.utils.parsedate_to_datetime(since).timestamp():
                return self._reply(h, 412, b"precondition failed", {}, head, rng)
        if self.gcs_bucket is not None:
            # GCS names an object's generation in every media answer, and honours a precondition on it.
            # Every write makes a new one: the file's change time (a rewrite that puts the mtime back too).
            generation = str(st.st_ctime_ns)
            headers["x-goog-generation"] = generation
            wanted = h.headers.get("x-goog-if-generation-match")
            if wanted is not None and wanted != generation:
                return self._reply(h, 412, b"precondition failed", {}, head, rng)
        match = h.headers.get("If-Match")
        # If-Match compares strongly (RFC 9110, 13.1.1): a weak tag matches nothing, not even itself.
        if match and (match != etag or etag.startswith("W/")) and not f.no_if_match:
            return self._reply(h, 412, b"precondition failed", {}, head, rng)
        drop = bool(f.drop_every) and not head and n % f.drop_every == 0
        size = st.st_size
        if rng and not f.no_range and rng.startswith("bytes="):
            first, _, last = rng[6:].partition("-")
            if first:
                start = int(first)
                end = min(int(last) if last else size - 1, size - 1)
            else:  # a suffix: the last N bytes (all of a shorter object; none of an empty one)
                start, end = max(size - int(last), 0), size - 1
            if start >= size:
                return self._reply(h, 416, b"", {"Content-Range": f"bytes */{size}"}, head, rng)
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            with open(target, "rb") as fh:
                fh.seek(start)
                part = fh.read(end + 1 - start)
            return self._reply(h, 206, part, headers, head, rng, drop)
        return self._reply(h, 200, b"" if head else target.read_bytes(), headers, head, rng, drop,
                           length=size)

    def _gcs_list(self, h: BaseHTTPRequestHandler, query: dict[str, Any], head: bool, rng: str | None) -> None:
        prefix = query.get("prefix", [""])[0]
        delimiter = query.get("delimiter", [""])[0]
        limit = min(int(query.get("maxResults", [self.page_size])[0]), self.page_size)
        start = int(query.get("pageToken", ["0"])[0])
        keys = sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())
        entries: list[tuple[str, dict[str, Any] | None]] = []
        for name, common in delimited(keys, prefix, delimiter):
            if common:
                entries.append((name, None))
                continue
            st = (self.root / name).stat()
            entries.append((name, {"name": name, "size": str(st.st_size),
                                   "updated": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(st.st_mtime)),
                                   "etag": hashlib.md5(name.encode()).hexdigest(),
                                   "generation": str(st.st_ctime_ns)}))
        page = entries[start:start + limit]
        body: dict[str, Any] = {"kind": "storage#objects"}
        items = [item for _, item in page if item is not None]
        prefixes = [name for name, item in page if item is None]
        if items:
            body["items"] = items
        if prefixes:
            body["prefixes"] = prefixes
        if start + limit < len(entries):
            body["nextPageToken"] = str(start + limit)
        self._reply(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head, rng)
