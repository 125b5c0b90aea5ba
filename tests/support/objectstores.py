"""Object stores for the export tests: a fake GCS (JSON API uploads with generation preconditions and
x-goog-hash checks), and a proxy in front of moto's S3 that injects faults. Both always stopped."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import crc32c
import httpx

from unshardfs.testing.http_servers import delimited


@dataclass
class Fault:
    """Requests whose method is `method` and whose path contains `match` get `action` (an HTTP
    status, "reset": the connection dropped, "lie": a wrong checksum/ETag in a success), `times`
    times (-1: always)."""

    method: str
    match: str
    action: int | str
    times: int = -1


@dataclass
class Faults:
    rules: list[Fault] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)  # (method, path) of every request
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pick(self, method: str, path: str) -> int | str | None:
        with self.lock:
            self.seen.append((method, path))
            for rule in self.rules:
                if rule.method == method and rule.match in unquote(path) and rule.times != 0:
                    rule.times -= 1 if rule.times > 0 else 0
                    return rule.action
        return None


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@dataclass
class _Object:
    data: bytes
    generation: int

    def resource(self, bucket: str, name: str, lie: bool = False) -> dict[str, object]:
        crc = crc32c.crc32c(self.data) ^ (1 if lie else 0)
        return {"bucket": bucket, "name": name, "size": str(len(self.data)), "generation": str(self.generation),
                "crc32c": _b64(crc.to_bytes(4, "big")), "md5Hash": _b64(hashlib.md5(self.data).digest())}


_S = TypeVar("_S", bound="_Served")


class _Served:
    """A threaded HTTP server on 127.0.0.1 for the handler `_handler` makes, stopped on exit."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeGcs(_Served):
    """Buckets of objects behind the GCS JSON API subset export uses: list (paged, with delimiter),
    metadata, media download with Range, delete, media and resumable uploads honouring
    `ifGenerationMatch` and refusing a body whose `x-goog-hash` does not match (400)."""

    def __init__(self, buckets: tuple[str, ...] = ("bkt",), page: int = 50) -> None:
        self.buckets: dict[str, dict[str, _Object]] = {b: {} for b in buckets}
        self.sessions: dict[str, tuple[str, str, int | None, bytearray]] = {}
        self.faults = Faults()
        self.page = page
        self.generation = 1000
        self.lock = threading.Lock()
        self.delay = 0.0  # seconds each upload (POST) waits before it is taken
        # Requests being handled: one whose client has died may still be taken after.
        self.in_flight = 0
        super().__init__()

    def objects(self, bucket: str = "bkt") -> dict[str, bytes]:
        with self.lock:
            return {name: o.data for name, o in self.buckets[bucket].items()}

    def put(self, bucket: str, name: str, data: bytes) -> None:
        with self.lock:
            self.generation += 1
            self.buckets[bucket][name] = _Object(data, self.generation)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, status: int, doc: object) -> None:
                self._send(status, json.dumps(doc).encode(), {"Content-Type": "application/json"})

            def _error(self, status: int, message: str) -> None:
                self._json(status, {"error": {"code": status, "message": message}})

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", "0")))

            def _handle(self) -> None:
                with fake.lock:
                    fake.in_flight += 1
                try:
                    self._answer()
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

            def _answer(self) -> None:
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
                body = self._body() if self.command in ("PUT", "POST") else b""
                if self.command == "POST" and fake.delay:
                    time.sleep(fake.delay)
                action = fake.faults.pick(self.command, self.path)
                if action == "reset":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if isinstance(action, int):
                    return self._error(action, "injected")
                if action == "flip" and body:  # the body changed on the way: its x-goog-hash no longer matches
                    body = bytes([body[0] ^ 1]) + body[1:]
                lie = action == "lie"
                m = re.fullmatch(r"/storage/v1/b/([^/]+)/o(?:/(.+))?", url.path)
                u = re.fullmatch(r"/upload/storage/v1/b/([^/]+)/o", url.path)
                bucket_name = (m or u).group(1) if (m or u) else None
                if bucket_name is None or bucket_name not in fake.buckets:
                    return self._error(404, "The specified bucket does not exist.")
                bucket = fake.buckets[bucket_name]
                if m and m.group(2) is None and self.command == "GET":
                    return self._list(bucket, query)
                if m:
                    name = unquote(m.group(2))
                    with fake.lock:
                        found = bucket.get(name)
                    if self.command == "DELETE":
                        with fake.lock:
                            bucket.pop(name, None)
                        return self._send(204 if found else 404)
                    if found is None:
                        return self._error(404, "No such object")
                    if query.get("alt") == "media":
                        return self._media(found.data)
                    return self._json(200, found.resource(bucket_name, name, lie))
                if "upload_id" in query:
                    return self._session(bucket_name, query["upload_id"], body, lie)
                name = query.get("name", "")
                match = query.get("ifGenerationMatch")
                if query.get("uploadType") == "resumable":
                    sid = secrets.token_hex(8)
                    fake.sessions[sid] = (bucket_name, name, int(match) if match else None, bytearray())
                    location = f"{fake.endpoint}/upload/storage/v1/b/{bucket_name}/o?uploadType=resumable&upload_id={sid}"
                    return self._send(200, b"", {"Location": location})
                return self._store(bucket_name, name, int(match) if match else None, body, lie)

            def _store(self, bucket_name: str, name: str, match: int | None, data: bytes, lie: bool) -> None:
                hashes = dict(part.split("=", 1) for part in self.headers.get("x-goog-hash", "").split(",") if "=" in part)
                if "crc32c" in hashes and hashes["crc32c"] != _b64(crc32c.crc32c(data).to_bytes(4, "big")):
                    return self._error(400, "Provided CRC32C does not match the data")
                if "md5" in hashes and hashes["md5"] != _b64(hashlib.md5(data).digest()):
                    return self._error(400, "Provided MD5 hash does not match the data")
                with fake.lock:
                    bucket = fake.buckets[bucket_name]
                    current = bucket.get(name)
                    if match is not None and (current.generation if current else 0) != match:
                        return self._error(412, "conditionNotMet")
                    fake.generation += 1
                    bucket[name] = _Object(bytes(data), fake.generation)
                    resource = bucket[name].resource(bucket_name, name, lie)
                self._json(200, resource)

            def _session(self, bucket_name: str, sid: str, data: bytes, lie: bool) -> None:
                if sid not in fake.sessions:
                    return self._error(404, "No such upload")
                if self.command == "DELETE":
                    del fake.sessions[sid]
                    return self._send(499)
                _, name, match, held = fake.sessions[sid]
                span = re.fullmatch(r"bytes (?:(\d+)-(\d+)|\*)/(\d+|\*)", self.headers.get("Content-Range", ""))
                if span is None or (span.group(1) is not None and int(span.group(1)) != len(held)):
                    return self._error(400, "bad Content-Range")
                held += data
                if span.group(3) == "*":
                    return self._send(308, b"", {"Range": f"bytes=0-{len(held) - 1}"})
                if int(span.group(3)) != len(held):
                    return self._error(400, "size mismatch")
                del fake.sessions[sid]
                self._store(bucket_name, name, match, bytes(held), lie)

            def _media(self, data: bytes) -> None:
                rng = self.headers.get("Range")
                if not rng:
                    return self._send(200, data)
                suffix = re.fullmatch(r"bytes=-(\d+)", rng)
                if suffix:
                    start, end = max(0, len(data) - int(suffix.group(1))), len(data) - 1
                else:
                    a, b = re.fullmatch(r"bytes=(\d+)-(\d+)", rng).groups()  # type: ignore[union-attr]
                    start, end = int(a), min(int(b), len(data) - 1)
                if start >= len(data):
                    return self._send(416)
                self._send(206, data[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(data)}"})

            def _list(self, bucket: dict[str, _Object], query: dict[str, str]) -> None:
                prefix, delimiter = query.get("prefix", ""), query.get("delimiter")
                with fake.lock:
                    entries = delimited(sorted(bucket), prefix, delimiter)
                    start = int(query.get("pageToken", "0"))
                    page = entries[start:start + fake.page]
                    doc: dict[str, object] = {
                        "items": [bucket[n].resource("", n) for n, d in page if not d],
                        "prefixes": [n for n, d in page if d]}
                if start + fake.page < len(entries):
                    doc["nextPageToken"] = str(start + fake.page)
                self._json(200, doc)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler

class FaultyProxy(_Served):
    """A forwarding proxy to `upstream` (moto's S3) that applies `faults` first: an injected status,
    a dropped connection, or ("lie") a success whose ETag and checksum are not the body's."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.faults = Faults()
        self.delay = 0.0  # seconds each PUT waits before it is forwarded
        self.answered: list[tuple[str, str, int, dict[str, str]]] = []  # (method, path, status, request headers)
        # Requests being handled: one whose client has died may still reach the upstream after.
        self.in_flight = 0
        self.client = httpx.Client(timeout=30)
        super().__init__()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                with proxy.faults.lock:
                    proxy.in_flight += 1
                try:
                    self._forward()
                finally:
                    with proxy.faults.lock:
                        proxy.in_flight -= 1

            def _forward(self) -> None:
                declared = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(declared)
                if len(body) < declared:
                    # The client died mid-body. A store never keeps a body shorter than its
                    # Content-Length; forwarded, the stand-in behind this one (which does not
                    # check Content-MD5) would keep it, a truncated object no real store holds.
                    self.close_connection = True
                    return
                action = proxy.faults.pick(self.command, self.path)
                if action == "reset":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if isinstance(action, int):
                    payload = f"<Error><Code>Injected{action}</Code></Error>".encode()
                    self.send_response(action)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                if self.command == "PUT" and proxy.delay:
                    time.sleep(proxy.delay)
                answer = proxy.client.request(self.command, proxy.upstream + self.path, headers=headers, content=body)
                data = answer.content
                with proxy.faults.lock:
                    proxy.answered.append((self.command, self.path, answer.status_code, headers))
                self.send_response(answer.status_code)
                for k, v in answer.headers.items():
                    if k.lower() in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        continue
                    if action == "lie" and k.lower() == "etag":
                        v = '"' + hashlib.md5(b"not the body").hexdigest() + '"'
                    self.send_header(k, v)
                length = answer.headers.get("content-length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.client.close()
