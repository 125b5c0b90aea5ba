"""S3 and Google Cloud Storage as a byte sink: whole objects written under a prefix, never half.

What a writer may rely on:

- **An object appears under its key only complete.** A body of up to
  `PART` bytes is one PUT (atomic in both stores); a bigger one is an S3
  multipart upload or a GCS resumable upload, which the store assembles
  under the key only when it is completed; `Upload.abort` (also called on
  every failure) discards what was sent.
- **Nothing is created over an object unless asked.** Creation is
  conditional: S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`; when an
  object is already there the store answers 412 and `Exists` is raised. A
  replacement names the exact object it replaces (S3 `If-Match: ETAG`, GCS
  `ifGenerationMatch=N`). Stores without conditional writes (older
  S3-compatible servers) ignore the header and overwrite.
- **The store checks every body.** Each PUT carries its MD5 (`Content-MD5`,
  which S3 and GCS verify), its CRC-32C (S3 `x-amz-checksum-crc32c`, GCS
  `x-goog-hash`) and, signed, its SHA-256 (S3): a body changed on the way is
  refused (400). What the store answers is compared too: a checksum or ETag
  that is not the body's is `Corrupted`, the object is not trusted.
- **Nothing outside the prefix.** Keys are the prefix and a relative path
  whose segments are checked first ('', '.', '..', NUL, non-UTF-8 are
  refused, as are keys over 1,024 bytes): no request is sent for them.
- **Bounded.** Every request is retried on connection errors, timeouts, 408,
  429 and 5xx with exponential backoff, at most `retries` times within one
  deadline; error bodies are read up to 64 KiB, listings up to 8 MiB a page.

The client is synchronous (httpx, pooled, thread-safe): writers call it from
worker threads.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any, Iterator
from urllib.parse import quote, unquote_plus, urlencode

import crc32c
import httpx

from unshardfs.sources.http import ERROR_BODY_LIMIT, MAX_OBJECT_SIZE, RETRY_STATUS, origin, path_problem
from unshardfs.sources.cloud import (GCS_ENDPOINT, GCS_WRITE, LISTING_PAGE_LIMIT, S3_NS, aws_region, aws_signature,
                                     check_bucket, google_credentials, google_token, s3_bucket_url)
from unshardfs.util.backoff import Backoff
from unshardfs.util.errors import ConfigError, one_line
from unshardfs.util.paging import PageTokens

log = logging.getLogger(__name__)

PART = 8 << 20  # bytes of one PUT, and of each part of a bigger object (S3: >= 5 MiB; GCS: 256 KiB multiple)
MAX_KEY = 1024  # bytes of a key (UTF-8), both stores' limit
MAX_PARTS = 10_000  # S3's limit: 80 GiB objects at PART bytes
_MAX_PAGES = 100_000


def _page_tokens(what: str) -> PageTokens:
    return PageTokens(_MAX_PAGES, lambda why: StoreError(f"listing {what}: {why}"))


@dataclass(frozen=True)
class SinkOptions:
    endpoint: str | None = None  # an S3-compatible or GCS-compatible server instead of AWS's or Google's
    timeout: float = 30.0  # seconds, per wait for bytes
    retrying: Backoff = Backoff()  # as reads retry (`sources.http`)
    deadline: float = 300.0  # seconds for one request, all its attempts included
    connections: int = 32


class StoreError(Exception):
    """A request the store did not carry out; `str()` is one line naming the request."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(one_line(message))
        self.status = status


class Exists(StoreError):
    """A conditional write found an object under the key (412)."""


class Corrupted(StoreError):
    """The store's answer does not describe the bytes sent (a lying or broken store)."""


@dataclass(frozen=True)
class StoredObject:
    """What the store holds under a key."""

    size: int
    crc32c: int | None  # the store's own CRC-32C of the whole object, where it states one
    tag: str  # what a conditional replacement names: S3 ETag, GCS generation


@dataclass(frozen=True)
class Listed:
    """One name a listing gives: an object, with its size (and the store's CRC-32C where the listing
    states one), or, in a listing by directory, a common prefix (`directory`)."""

    path: str  # relative to the store's prefix
    size: int = 0
    crc32c: int | None = None
    directory: bool = False


@dataclass(frozen=True)
class Digest:
    """The checksums of a body, as the stores' headers carry them."""

    crc32c: int
    md5: bytes
    sha256: str

    @classmethod
    def of(cls, data: bytes | memoryview) -> "Digest":
        return cls(crc32c.crc32c(data), hashlib.md5(data).digest(), hashlib.sha256(data).hexdigest())

    @property
    def crc_b64(self) -> str:
        return base64.b64encode(self.crc32c.to_bytes(4, "big")).decode()

    @property
    def md5_b64(self) -> str:
        return base64.b64encode(self.md5).decode()


def crc_from_b64(value: str | None) -> int | None:
    """A CRC-32C as the stores state it (base64 of 4 big-endian bytes); None if it is not one."""
    if not value:
        return None
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except ValueError:
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


def key_problem(key: str) -> str | None:
    """Why `key` (prefix and path) is never requested, or None."""
    problem = path_problem(key)
    if problem is not None:
        return problem
    if len(key.encode()) > MAX_KEY:
        return f"key of {len(key.encode()):,} bytes (the stores' limit is {MAX_KEY:,})"
    return None


def parse_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, prefix) of an s3:// or gs:// URL; ConfigError for anything else."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("s3", "gs"):
        raise ConfigError(f"{url}: not an s3:// or gs:// URL")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ConfigError(f"{url}: the URL needs a bucket name")
    check_bucket(bucket, scheme)
    prefix = prefix.strip("/")
    problem = key_problem(prefix) if prefix else None
    if problem is not None:
        raise ConfigError(f"{url}: prefix {problem}")
    return scheme, bucket, prefix


@dataclass(frozen=True)
class Answer:
    status: int
    headers: httpx.Headers
    body: bytes


def _size(value: object) -> int:
    """An object size as GCS states it (a decimal string); ValueError for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"object size {value!r:.40}")
    return int(value)


def _error_code(body: bytes) -> str:
    """The store's error code (S3/GCS XML `<Code>`, GCS JSON `error.message`), if the body has one."""
    text = body[:4096]
    try:
        if text.lstrip().startswith(b"<"):
            root = ET.fromstring(body)
            code = root.findtext("Code") or root.findtext(f"{S3_NS}Code") or ""
            return code[:100]
        if text.lstrip().startswith(b"{"):
            doc = json.loads(body)
            message = doc.get("error", {}).get("message", "") if isinstance(doc, dict) else ""
            return str(message)[:100]
    except (ET.ParseError, ValueError, AttributeError):
        pass
    return ""


class ObjectStore:
    """Objects of one bucket under one prefix, written, read back, listed and removed."""

    scheme = ""

    def __init__(self, bucket: str, prefix: str, options: SinkOptions,
                 transport: httpx.BaseTransport | None = None) -> None:
        """`transport`: how requests reach the store (httpx's; None: over the network, pooled)."""
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options = options
        self.description = f"{self.scheme}://{bucket}/{self.prefix}".rstrip("/")
        self._client = httpx.Client(timeout=options.timeout, follow_redirects=False, transport=transport,
                                    limits=httpx.Limits(max_connections=options.connections,
                                                        max_keepalive_connections=options.connections))

    def close(self) -> None:
        self._client.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("an object store client is opened where it is used, never pickled")

    # -- keys -------------------------------------------------------------------

    def key(self, rel: str) -> str:
        """The full key of `rel` below the prefix; StoreError (no request sent) for one that is not safe."""
        key = f"{self.prefix}/{rel}" if self.prefix else rel
        problem = key_problem(key) if rel else "an empty path"
        if problem is not None:
            raise StoreError(f"{self.where(rel)}: {problem}: not requested")
        return key

    def where(self, rel: str) -> str:
        return f"{self.description}/{rel}" if rel else self.description

    def relative(self, key: str) -> str | None:
        """`key` relative to the prefix, None if it is not below it."""
        if not self.prefix:
            return key
        head = self.prefix + "/"
        return key[len(head):] if key.startswith(head) else None

    # -- requests -----------------------------------------------------------------

    def sign(self, method: str, url: str, headers: dict[str, str], body: bytes) -> dict[str, str]:
        """Credentials for one attempt (none: anonymous)."""
        return {}

    def request(self, method: str, url: str, what: str, headers: dict[str, str] | None = None, body: bytes = b"",
                limit: int = ERROR_BODY_LIMIT, ok_limit: int | None = None) -> Answer:
        """One request, retried on transport errors, 408/429/5xx within the deadline; the body read up
        to `ok_limit` (2xx) or `limit` bytes (a longer one is an error, never held)."""
        retries = self.options.retrying.schedule()
        deadline = time.monotonic() + self.options.deadline
        last = ""
        attempts = 0
        while True:
            if attempts:
                wait = retries.wait(time.monotonic(), deadline)
                if wait is None:
                    break
                time.sleep(wait)
            attempts += 1
            sent = {"User-Agent": "unshardfs", "Accept-Encoding": "identity", **(headers or {})}
            sent.update(self.sign(method, url, sent, body))
            try:
                with self._client.stream(method, url, headers=sent, content=body) as response:
                    cap = ok_limit if ok_limit is not None and 200 <= response.status_code < 300 else limit
                    data = bytearray()
                    for piece in response.iter_raw():
                        data += piece
                        if len(data) > cap:
                            raise StoreError(f"{method} {what}: an answer of more than {cap:,} bytes")
                    answer = Answer(response.status_code, response.headers, bytes(data))
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            if answer.status not in RETRY_STATUS:
                return answer
            last = f"HTTP {answer.status} {_error_code(answer.body)}".rstrip()
        raise StoreError(f"{method} {what}: {last} (after {attempts} attempts)")

    def fail(self, method: str, what: str, answer: Answer) -> StoreError:
        """The error an unexpected answer is: 412 `Exists`, else a StoreError naming the status."""
        code = _error_code(answer.body)
        kind = Exists if answer.status == 412 else StoreError
        return kind(f"{method} {what}: HTTP {answer.status} {code}".rstrip(), answer.status)

    # -- the sink's operations (per store below) --------------------------------------

    def put(self, rel: str, data: bytes, create: bool = True, replace: str | None = None) -> StoredObject:
        """Write `data` as one object: created only where none is (`create`), or replacing exactly
        the object tagged `replace`; `Exists` if that precondition fails."""
        raise NotImplementedError

    def head(self, rel: str) -> StoredObject | None:
        raise NotImplementedError

    def address(self, rel: str, media: bool = False) -> str:
        """The URL of the object `rel` (`media`: of its bytes, where the API tells them apart)."""
        raise NotImplementedError

    def get(self, rel: str, limit: int, tail: int | None = None) -> bytes | None:
        """The object's bytes (its last `tail` bytes), None if absent; StoreError beyond `limit` bytes."""
        what = self.where(rel)
        answer = self.request("GET", self.address(rel, media=True), what,
                              {"Range": f"bytes=-{tail}"} if tail else None, ok_limit=limit)
        if answer.status == 404:
            return None
        if answer.status == 416:
            return b""
        if answer.status not in (200, 206):
            raise self.fail("GET", what, answer)
        return answer.body

    def read(self, rel: str, size: int) -> Iterator[bytes]:
        """An object of `size` bytes, in pieces of at most PART bytes (ranged GETs)."""
        offset = 0
        while offset < size:
            piece = self.get_range(rel, offset, min(PART, size - offset))
            if not piece:
                raise StoreError(f"GET {self.where(rel)}: ended at {offset:,} of {size:,} bytes")
            offset += len(piece)
            yield piece

    def get_range(self, rel: str, offset: int, size: int) -> bytes:
        what = self.where(rel)
        answer = self.request("GET", self.address(rel, media=True), what,
                              {"Range": f"bytes={offset}-{offset + size - 1}"}, ok_limit=size)
        if answer.status == 416:
            return b""
        if answer.status == 200 and offset == 0:  # the whole object (of at most `size` bytes)
            return answer.body
        if answer.status != 206:
            raise self.fail("GET", what, answer)
        return answer.body

    def delete(self, rel: str) -> None:
        what = self.where(rel)
        answer = self.request("DELETE", self.address(rel), what)
        if answer.status not in (200, 204, 404):
            raise self.fail("DELETE", what, answer)

    def list(self, rel: str = "", delimiter: bool = False) -> Iterator[Listed]:
        """Every object whose key starts with `rel`; with `delimiter` (`rel` a directory ending in
        '/'), the objects directly in it and its sub-directories. Keys outside the prefix are left
        out; other names are as the store gives them (`key` refuses the unsafe ones)."""
        raise NotImplementedError

    def listed(self, key: str, size: int = 0, crc: int | None = None, directory: bool = False) -> Listed | None:
        """A key (or common prefix) of a listing as a `Listed`, if it lies below the prefix; StoreError
        for a size no object can have."""
        rel = self.relative(key.rstrip("/") if directory else key)
        if not rel:
            return None
        if not 0 <= size <= MAX_OBJECT_SIZE:
            raise StoreError(f"listing {self.description}: an object of {size} bytes")
        return Listed(rel, size, crc, directory)

    def upload(self, rel: str, create: bool = True) -> "Upload":
        raise NotImplementedError

    def abort_unfinished(self) -> int:
        """Abort every unfinished upload below the prefix (what a killed run left); how many."""
        return 0

    def probe(self) -> None:
        """A one-line ConfigError if the bucket does not exist or cannot be listed."""
        try:
            next(iter(self.list("", delimiter=True)), None)
        except StoreError as e:
            why = {404: f"bucket {self.bucket} does not exist", 403: "no permission to list it (check the credentials)",
                   401: "not authenticated (no credentials found?)"}.get(e.status)
            raise ConfigError(f"{self.description}: {why} ({e})" if why else f"{self.description}: {e}") from None


class Upload:
    """A big object sent in parts, assembled under its key only by `complete`."""

    def add(self, piece: bytes) -> None:
        raise NotImplementedError

    def complete(self) -> StoredObject:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


# ---- S3 --------------------------------------------------------------------------------------------


def _xml(body: bytes, what: str) -> tuple[ET.Element, str]:
    try:
        root = ET.fromstring(body)
    except ET.ParseError as e:
        raise StoreError(f"{what}: malformed answer ({e})") from None
    return root, S3_NS if root.tag.startswith(S3_NS) else ""


def _etag(headers: httpx.Headers) -> str:
    return str(headers.get("etag", "")).strip()


class S3Store(ObjectStore):
    scheme = "s3"

    def __init__(self, bucket: str, prefix: str, options: SinkOptions,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(bucket, prefix, options, transport)
        self.region = aws_region()
        self.base = s3_bucket_url(bucket, self.region, options.endpoint)
        self._origin = origin(httpx.URL(self.base))
        self._signature = aws_signature(self.region)

    def sign(self, method: str, url: str, headers: dict[str, str], body: bytes) -> dict[str, str]:
        if self._signature is None or origin(httpx.URL(url)) != self._origin:
            return {}
        signed = {k: v for k, v in headers.items() if k.lower() not in ("user-agent", "accept-encoding")}
        return self._signature(method, url, signed, body)

    def url(self, rel: str, query: dict[str, str] | None = None) -> str:
        path = quote(self.key(rel), safe="/") if rel else ""
        return f"{self.base}/{path}" + (f"?{urlencode(sorted(query.items()))}" if query else "")

    def address(self, rel: str, media: bool = False) -> str:
        return self.url(rel)

    def _checked(self, rel: str, digest: Digest, answer: Answer, what: str) -> None:
        """The store's answer to a PUT must describe our bytes: its CRC-32C echo, else an MD5 ETag."""
        echoed = answer.headers.get("x-amz-checksum-crc32c")
        if echoed is not None:
            if crc_from_b64(echoed) != digest.crc32c:
                raise Corrupted(f"{what}: the store states crc32c {echoed}, the body's is {digest.crc_b64}")
            return
        tag = _etag(answer.headers).strip('"')
        if answer.headers.get("x-amz-server-side-encryption") == "aws:kms" or "-" in tag:
            return  # an ETag that is no MD5 of the body (KMS); the store verified Content-MD5 itself
        if tag.lower() != digest.md5.hex():
            raise Corrupted(f"{what}: the store answers ETag {tag[:40]!r}, the body's MD5 is {digest.md5.hex()}")

    def put(self, rel: str, data: bytes, create: bool = True, replace: str | None = None) -> StoredObject:
        digest = Digest.of(data)
        headers = {"Content-Type": "application/octet-stream", "Content-MD5": digest.md5_b64,
                   "x-amz-checksum-crc32c": digest.crc_b64, "X-Amz-Content-SHA256": digest.sha256}
        if replace is not None:
            headers["If-Match"] = replace
        elif create:
            headers["If-None-Match"] = "*"
        what = self.where(rel)
        answer = self.request("PUT", self.url(rel), what, headers, data)
        if answer.status != 200:
            raise self.fail("PUT", what, answer)
        self._checked(rel, digest, answer, f"PUT {what}")
        return StoredObject(len(data), digest.crc32c, _etag(answer.headers))

    def head(self, rel: str) -> StoredObject | None:
        what = self.where(rel)
        answer = self.request("HEAD", self.url(rel), what, {"x-amz-checksum-mode": "ENABLED"})
        if answer.status == 404:
            return None
        if answer.status != 200:
            raise self.fail("HEAD", what, answer)
        length = answer.headers.get("content-length", "")
        if not length.isdigit() or int(length) > MAX_OBJECT_SIZE:
            raise StoreError(f"HEAD {what}: no usable Content-Length")
        # A multipart object's checksum is of its parts ("...-N"): not the object's, not used.
        crc = answer.headers.get("x-amz-checksum-crc32c")
        return StoredObject(int(length), crc_from_b64(crc) if crc and "-" not in crc else None, _etag(answer.headers))

    def _pages(self, query: dict[str, str], what: str) -> Iterator[tuple[ET.Element, str]]:
        tokens = _page_tokens(what)
        for token in tokens:
            page = dict(query, **({"continuation-token": token} if token else {}))
            answer = self.request("GET", f"{self.base}/?{urlencode(sorted(page.items()))}", what,
                                  ok_limit=LISTING_PAGE_LIMIT)
            if answer.status != 200:
                raise self.fail("GET", what, answer)
            root, ns = _xml(answer.body, f"listing {what}")
            yield root, ns
            if root.findtext(f"{ns}IsTruncated") == "true":
                tokens.follow(root.findtext(f"{ns}NextContinuationToken"))

    def list(self, rel: str = "", delimiter: bool = False) -> Iterator[Listed]:
        prefix = f"{self.prefix}/{rel}" if self.prefix else rel
        query = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
        if delimiter:
            query["delimiter"] = "/"
        for root, ns in self._pages(query, self.where(rel)):
            for element in root.iter(f"{ns}CommonPrefixes"):
                key = unquote_plus(element.findtext(f"{ns}Prefix", ""), errors="surrogateescape")
                found = self.listed(key, directory=True)
                if found is not None:
                    yield found
            for element in root.iter(f"{ns}Contents"):
                key = unquote_plus(element.findtext(f"{ns}Key", ""), errors="surrogateescape")
                size = element.findtext(f"{ns}Size", "")
                found = self.listed(key, int(size)) if size.isdigit() else None
                if found is not None:
                    yield found

    def upload(self, rel: str, create: bool = True) -> Upload:
        return _S3Upload(self, rel, create)

    def abort_unfinished(self) -> int:
        prefix = f"{self.prefix}/" if self.prefix else ""
        what = f"unfinished uploads of {self.description}"
        aborted = 0
        tokens = _page_tokens(what)
        for token in tokens:
            key_marker, _, upload_marker = (token or "").partition("\n")
            query = {"uploads": "", "prefix": prefix}
            if token:
                query.update({"key-marker": key_marker, "upload-id-marker": upload_marker})
            answer = self.request("GET", f"{self.base}/?{urlencode(sorted(query.items()))}", what,
                                  ok_limit=LISTING_PAGE_LIMIT)
            if answer.status != 200:
                raise self.fail("GET", what, answer)
            root, ns = _xml(answer.body, what)
            for element in root.iter(f"{ns}Upload"):
                key, upload = element.findtext(f"{ns}Key", ""), element.findtext(f"{ns}UploadId", "")
                rel = self.relative(key)
                if rel is None or not upload or key_problem(key):
                    continue
                done = self.request("DELETE", self.url(rel, {"uploadId": upload}), self.where(rel))
                if done.status not in (200, 204, 404):
                    raise self.fail("DELETE", self.where(rel), done)
                aborted += 1
            if root.findtext(f"{ns}IsTruncated") == "true" and root.findtext(f"{ns}NextKeyMarker"):
                # The two markers are the next page's token.
                tokens.follow(f"{root.findtext(f'{ns}NextKeyMarker')}\n{root.findtext(f'{ns}NextUploadIdMarker', '')}")
        return aborted


class _S3Upload(Upload):
    def __init__(self, store: S3Store, rel: str, create: bool) -> None:
        self.store, self.rel, self.create = store, rel, create
        self.what = store.where(rel)
        self.parts: list[tuple[int, str, bytes]] = []  # (number, ETag, MD5)
        self.upload_id: str | None = None
        self.size = 0
        self.crc = 0

    def _begin(self) -> str:
        answer = self.store.request("POST", self.store.url(self.rel, {"uploads": ""}), self.what,
                                    ok_limit=ERROR_BODY_LIMIT)
        if answer.status != 200:
            raise self.store.fail("POST", self.what, answer)
        root, ns = _xml(answer.body, f"POST {self.what}")
        upload = root.findtext(f"{ns}UploadId") or ""
        if not upload or len(upload) > 1024:
            raise StoreError(f"POST {self.what}: no usable UploadId in the answer")
        return upload

    def add(self, piece: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self._begin()
        if len(self.parts) >= MAX_PARTS:
            raise StoreError(f"{self.what}: more than {MAX_PARTS:,} parts")
        number = len(self.parts) + 1
        digest = Digest.of(piece)
        headers = {"Content-MD5": digest.md5_b64, "X-Amz-Content-SHA256": digest.sha256}
        url = self.store.url(self.rel, {"partNumber": str(number), "uploadId": self.upload_id})
        answer = self.store.request("PUT", url, self.what, headers, piece)
        if answer.status != 200:
            raise self.store.fail("PUT", f"{self.what} (part {number})", answer)
        self.store._checked(self.rel, digest, answer, f"PUT {self.what} (part {number})")
        self.parts.append((number, _etag(answer.headers), digest.md5))
        self.size += len(piece)
        self.crc = crc32c.crc32c(piece, self.crc)

    def complete(self) -> StoredObject:
        if self.upload_id is None:
            return self.store.put(self.rel, b"", self.create)
        body = "<CompleteMultipartUpload>" + "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{tag.replace('&', '&amp;').replace('<', '&lt;')}</ETag></Part>"
            for n, tag, _ in self.parts) + "</CompleteMultipartUpload>"
        data = body.encode()
        headers = {"Content-Type": "application/xml", "X-Amz-Content-SHA256": hashlib.sha256(data).hexdigest()}
        if self.create:
            headers["If-None-Match"] = "*"
        answer = self.store.request("POST", self.store.url(self.rel, {"uploadId": self.upload_id}), self.what,
                                    headers, data, ok_limit=ERROR_BODY_LIMIT)
        if answer.status != 200:
            raise self.store.fail("POST", self.what, answer)
        root, ns = _xml(answer.body, f"POST {self.what}")
        if root.tag.endswith("Error"):  # S3 may answer 200 and then fail the assembly in the body
            code = root.findtext("Code") or root.findtext(f"{ns}Code") or "?"
            raise (Exists if code == "PreconditionFailed" else StoreError)(f"POST {self.what}: {code[:100]}")
        tag = (root.findtext(f"{ns}ETag") or "").strip('"')
        expected = hashlib.md5(b"".join(md5 for _, _, md5 in self.parts)).hexdigest() + f"-{len(self.parts)}"
        if tag and "-" in tag and tag.lower() != expected:
            raise Corrupted(f"POST {self.what}: the store answers ETag {tag[:60]!r}, the parts make {expected}")
        self.upload_id = None
        return StoredObject(self.size, self.crc, f'"{tag}"')

    def abort(self) -> None:
        if self.upload_id is None:
            return
        upload, self.upload_id = self.upload_id, None
        try:
            self.store.request("DELETE", self.store.url(self.rel, {"uploadId": upload}), self.what)
        except StoreError as e:  # best effort: `--resume` aborts what is left
            log.debug("%s", e)


# ---- Google Cloud Storage --------------------------------------------------------------------------


class GcsStore(ObjectStore):
    """Through the JSON API: media uploads for small objects, resumable uploads for big ones (XML
    multipart uploads take no preconditions)."""

    scheme = "gs"

    def __init__(self, bucket: str, prefix: str, options: SinkOptions,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(bucket, prefix, options, transport)
        self.endpoint = (options.endpoint or GCS_ENDPOINT).rstrip("/")
        self._origin = origin(httpx.URL(self.endpoint))
        self._credentials = google_credentials(GCS_WRITE)

    def sign(self, method: str, url: str, headers: dict[str, str], body: bytes) -> dict[str, str]:
        # Credentials go to the endpoint only (an upload session's URL is checked to be on it).
        if self._credentials is None or origin(httpx.URL(url)) != self._origin:
            return {}
        return {"Authorization": f"Bearer {google_token(self._credentials)}"}

    def address(self, rel: str, media: bool = False) -> str:
        name = quote(self.key(rel), safe="")
        return f"{self.endpoint}/storage/v1/b/{self.bucket}/o/{name}" + ("?alt=media" if media else "")

    def upload_url(self, rel: str, kind: str, create: bool, replace: str | None) -> str:
        query = {"uploadType": kind, "name": self.key(rel)}
        if replace is not None:
            query["ifGenerationMatch"] = replace
        elif create:
            query["ifGenerationMatch"] = "0"
        return f"{self.endpoint}/upload/storage/v1/b/{self.bucket}/o?{urlencode(query)}"

    def resource(self, answer: Answer, what: str, size: int | None = None, crc: int | None = None) -> StoredObject:
        """The object an upload made, from its JSON resource; `Corrupted` if it is not our bytes."""
        try:
            doc = json.loads(answer.body)
            stored = StoredObject(int(doc["size"]), crc_from_b64(doc.get("crc32c")), str(int(doc["generation"])))
        except (ValueError, KeyError, TypeError):
            raise StoreError(f"{what}: malformed object resource in the answer") from None
        if size is not None and stored.size != size:
            raise Corrupted(f"{what}: the store holds {stored.size:,} bytes, {size:,} were sent")
        if crc is not None and stored.crc32c != crc:
            raise Corrupted(f"{what}: the store states crc32c {doc.get('crc32c')!r}, the bytes sent have "
                            f"{base64.b64encode(crc.to_bytes(4, 'big')).decode()}")
        return stored

    def put(self, rel: str, data: bytes, create: bool = True, replace: str | None = None) -> StoredObject:
        digest = Digest.of(data)
        headers = {"Content-Type": "application/octet-stream",
                   "x-goog-hash": f"crc32c={digest.crc_b64},md5={digest.md5_b64}"}
        what = self.where(rel)
        answer = self.request("POST", self.upload_url(rel, "media", create, replace), what, headers, data,
                              ok_limit=ERROR_BODY_LIMIT)
        if answer.status not in (200, 201):
            raise self.fail("POST", what, answer)
        return self.resource(answer, f"POST {what}", len(data), digest.crc32c)

    def head(self, rel: str) -> StoredObject | None:
        what = self.where(rel)
        answer = self.request("GET", self.address(rel) + "?fields=size,crc32c,generation", what,
                              ok_limit=ERROR_BODY_LIMIT)
        if answer.status == 404:
            return None
        if answer.status != 200:
            raise self.fail("GET", what, answer)
        return self.resource(answer, f"GET {what}")

    def list(self, rel: str = "", delimiter: bool = False) -> Iterator[Listed]:
        prefix = f"{self.prefix}/{rel}" if self.prefix else rel
        what = self.where(rel)
        tokens = _page_tokens(what)
        for token in tokens:
            query = {"prefix": prefix, "fields": "items(name,size,crc32c),prefixes,nextPageToken"}
            if delimiter:
                query["delimiter"] = "/"
            if token:
                query["pageToken"] = token
            answer = self.request("GET", f"{self.endpoint}/storage/v1/b/{self.bucket}/o?{urlencode(query)}",
                                  what, ok_limit=LISTING_PAGE_LIMIT)
            if answer.status != 200:
                raise self.fail("GET", what, answer)
            try:
                doc = json.loads(answer.body)
                items, prefixes, following = doc.get("items", []), doc.get("prefixes", []), doc.get("nextPageToken")
                found = [self.listed(str(name), directory=True) for name in prefixes]
                found += [self.listed(str(item["name"]), _size(item["size"]), crc_from_b64(item.get("crc32c")))
                          for item in items]
            except (ValueError, KeyError, TypeError, AttributeError):
                raise StoreError(f"listing {what}: malformed answer") from None
            yield from (entry for entry in found if entry is not None)
            if following is not None and not isinstance(following, str):
                raise StoreError(f"listing {what}: malformed answer")
            tokens.follow(following)

    def upload(self, rel: str, create: bool = True) -> Upload:
        return _GcsUpload(self, rel, create)


class _GcsUpload(Upload):
    """A resumable upload: a session, then pieces of PART bytes; the last one completes it, with the
    whole object's CRC-32C (checked by the store) and the precondition given when it began."""

    def __init__(self, store: GcsStore, rel: str, create: bool) -> None:
        self.store, self.rel, self.create = store, rel, create
        self.what = store.where(rel)
        self.session: str | None = None
        self.held: bytes | None = None  # the last piece, sent by `complete` with the total size
        self.size = 0
        self.crc = 0

    def _begin(self) -> str:
        answer = self.store.request("POST", self.store.upload_url(self.rel, "resumable", self.create, None),
                                    self.what, {"Content-Type": "application/json"}, b"{}")
        if answer.status != 200:
            raise self.store.fail("POST", self.what, answer)
        session = answer.headers.get("location", "")
        try:
            same = origin(httpx.URL(session)) == self.store._origin
        except httpx.InvalidURL:
            same = False
        if not same:  # our bytes (and credentials) go nowhere but the endpoint
            raise StoreError(f"POST {self.what}: upload session {session[:200]!r} is not on {self.store.endpoint}")
        return str(session)

    def _send(self, piece: bytes, last: bool) -> Answer:
        if self.session is None:
            self.session = self._begin()
        start = self.size
        total = str(start + len(piece)) if last else "*"
        span = f"bytes {start}-{start + len(piece) - 1}/{total}" if piece else f"bytes */{total}"
        headers = {"Content-Range": span}
        crc = crc32c.crc32c(piece, self.crc)
        if last:
            headers["x-goog-hash"] = f"crc32c={base64.b64encode(crc.to_bytes(4, 'big')).decode()}"
        answer = self.store.request("PUT", self.session, self.what, headers, piece, ok_limit=ERROR_BODY_LIMIT)
        expected = (200, 201) if last else (308,)
        if answer.status not in expected:
            raise self.store.fail("PUT", self.what, answer)
        if not last:
            have = answer.headers.get("range", "")
            if have != f"bytes=0-{start + len(piece) - 1}":
                raise Corrupted(f"PUT {self.what}: the store holds {have or 'nothing'!r} after "
                                f"{start + len(piece):,} bytes were sent")
        self.size += len(piece)
        self.crc = crc
        return answer

    def add(self, piece: bytes) -> None:
        if self.held is not None:
            if len(self.held) % (256 << 10):
                raise StoreError(f"{self.what}: a piece of {len(self.held):,} bytes before the last "
                                 "(resumable uploads take multiples of 256 KiB)")
            self._send(self.held, last=False)
        self.held = piece

    def complete(self) -> StoredObject:
        piece, self.held = self.held or b"", None
        if self.session is None and len(piece) <= PART:
            return self.store.put(self.rel, piece, self.create)
        answer = self._send(piece, last=True)
        self.session = None
        return self.store.resource(answer, f"PUT {self.what}", self.size, self.crc)

    def abort(self) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        try:
            self.store.request("DELETE", session, self.what)
        except StoreError as e:  # best effort: an unfinished session expires after a week
            log.debug("%s", e)


def open_store(url: str, options: SinkOptions, transport: httpx.BaseTransport | None = None) -> ObjectStore:
    """The store an s3:// or gs:// URL names (its bucket and prefix); ConfigError for a bad URL.
    `transport`: how requests reach it (httpx's; None: over the network)."""
    scheme, bucket, prefix = parse_url(url)
    kind = S3Store if scheme == "s3" else GcsStore
    return kind(bucket, prefix, options, transport)
