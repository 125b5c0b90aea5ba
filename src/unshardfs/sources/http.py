"""HTTP(S) servers and object stores as byte sources: ranged GETs over one pooled client.

Everything runs on the daemon's trio loop through httpx (HTTP/1.1 keep-alive,
a bounded connection pool, many requests in flight at once). Each request is
retried with exponential backoff on connection errors, timeouts, 429 and
5xx; when it finally fails the format sees a `SourceError` (EIO for that
file, logged). A 404 is an absent object, which formats treat as a missing
shard. `stat` results (including absences) are cached for `stat_ttl`
seconds: a lookup would otherwise cost a HEAD round trip every time.

Object versions are the server's ETag (else Last-Modified) plus the size;
reads made with a version send `If-Match`, so a shard replaced on the server
is noticed (412 -> StaleError) instead of mixing an old index with new data.
"""

from __future__ import annotations

import email.utils
import logging
import random
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable
from urllib.parse import quote, urljoin

import httpx
import trio
from cachetools import TTLCache

from ..errors import SourceError, StaleError
from ..logonce import log_once
from .base import ObjectStat

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5
BASE_HEADERS = {"User-Agent": "unshardfs", "Accept-Encoding": "identity"}
ABSENT_STATUS = frozenset({404, 410})


@dataclass
class HttpOptions:
    concurrency: int = 32  # requests in flight (and pooled connections)
    timeout: float = 30.0  # seconds, per request attempt
    retries: int = 5  # further attempts after the first
    backoff: float = 0.25  # first retry delay in seconds; doubles up to backoff_max
    backoff_max: float = 8.0
    stat_ttl: float = 300.0
    # A server that ignores Range sends whole objects; accept those up to this size.
    whole_object_limit: int = 64 << 20


@dataclass
class HttpCounters:
    requests: int = 0
    retries: int = 0
    failures: int = 0
    bytes: int = 0
    whole_object_fallbacks: int = 0
    status: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "retries": self.retries, "failures": self.failures,
                "bytes": self.bytes, "whole_object_fallbacks": self.whole_object_fallbacks,
                "status": {str(k): v for k, v in sorted(self.status.items())}}


def _mtime_ns(headers: httpx.Headers) -> int:
    value = headers.get("last-modified")
    if value:
        try:
            return int(email.utils.parsedate_to_datetime(value).timestamp() * 1e9)
        except (TypeError, ValueError):
            pass
    return 0


# Signs or otherwise authorises a request in place (S3 SigV4, GCS bearer tokens).
Authorizer = Callable[[httpx.Request], "None"]


class HttpSource:
    """Objects under a base URL: `<base>/<key>`."""

    listable = False
    remote = True
    index_cache = None

    def __init__(self, base_url: str, options: HttpOptions | None = None, description: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.options = options or HttpOptions()
        self.description = description or self.base_url
        self.counters = HttpCounters()
        self._transport: httpx.AsyncHTTPTransport | None = None
        self._limiter: trio.CapacityLimiter | None = None
        self._stats: TTLCache = TTLCache(maxsize=200_000, ttl=self.options.stat_ttl)

    # -- plumbing ---------------------------------------------------------------

    def object_url(self, key: str) -> str:
        return f"{self.base_url}/{quote(key)}" if key else self.base_url + "/"

    async def authorize(self, request: httpx.Request) -> None:
        """Add credentials to a request (none for plain HTTP)."""

    def transport(self) -> httpx.AsyncHTTPTransport:
        # The transport (httpx's connection pool) is used without the client
        # layer on top: cookie jars, auth flows and header merging cost more
        # CPU per request than the rest of a chunk read (measured), and a
        # byte source needs none of them. Redirects are followed in `_send`.
        if self._transport is None:
            limits = httpx.Limits(max_connections=self.options.concurrency,
                                  max_keepalive_connections=self.options.concurrency)
            self._transport = httpx.AsyncHTTPTransport(limits=limits)
            self._limiter = trio.CapacityLimiter(self.options.concurrency)
        return self._transport

    async def aclose(self) -> None:
        if self._transport is not None:
            await self._transport.aclose()
            self._transport = None

    async def _send(self, method: str, url: str, headers: dict[str, str] | None) -> httpx.Response:
        timeout = self.options.timeout
        extensions = {"timeout": {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}}
        for _hop in range(MAX_REDIRECTS + 1):
            request = httpx.Request(method, url, headers={**BASE_HEADERS, **(headers or {})}, extensions=extensions)
            await self.authorize(request)
            self.counters.requests += 1
            response = await self.transport().handle_async_request(request)
            location = response.headers.get("location")
            if response.status_code not in REDIRECT_STATUS or not location:
                return response
            await response.aclose()
            url = urljoin(url, location)
        raise SourceError(f"{method} {url}: more than {MAX_REDIRECTS} redirects")

    async def request(self, method: str, url: str, headers: dict[str, str] | None = None,
                      accept: Callable[[int], bool] = lambda status: status < 400,
                      max_body: int | None = None) -> httpx.Response:
        """Send with retries; returns the response (body read) once its status is accepted
        or is a final error status (4xx other than 408/429)."""
        self.transport()
        assert self._limiter is not None
        delay = self.options.backoff
        last = ""
        for attempt in range(self.options.retries + 1):
            if attempt:
                self.counters.retries += 1
                await trio.sleep(min(delay, self.options.backoff_max) * (0.5 + random.random()))
                delay *= 2
            try:
                async with self._limiter:
                    response = await self._send(method, url, headers)
                    try:
                        status = response.status_code
                        self.counters.status[status] = self.counters.status.get(status, 0) + 1
                        if status in RETRY_STATUS:
                            last = f"HTTP {status}"
                            retry_after = response.headers.get("retry-after", "")
                            if retry_after.isdigit():
                                delay = max(delay, float(retry_after))
                            continue
                        length = response.headers.get("content-length")
                        if max_body is not None and accept(status) and length and int(length) > max_body:
                            return response  # the caller decides, without downloading it
                        await response.aread()
                    finally:
                        await response.aclose()
                self.counters.bytes += len(response.content)
                return response
            except httpx.HTTPError as e:  # connection errors, timeouts, broken bodies
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        self.counters.failures += 1
        raise SourceError(f"{method} {url}: {last} (after {self.options.retries + 1} attempts)")

    # -- the ByteSource contract ------------------------------------------------

    def _stat_from(self, response: httpx.Response, size: int) -> ObjectStat:
        tag = response.headers.get("etag") or response.headers.get("last-modified") or ""
        return ObjectStat(size=size, mtime_ns=_mtime_ns(response.headers), is_dir=False, version=(tag, size))

    async def stat(self, key: str) -> ObjectStat | None:
        if not key:
            return ObjectStat(0, 0, True)
        cached = self._stats.get(key, _MISSING)
        if cached is not _MISSING:
            return cached
        result = await self._head(key)
        self._stats[key] = result
        return result

    async def _head(self, key: str) -> ObjectStat | None:
        url = self.object_url(key)
        response = await self.request("HEAD", url, {"Accept-Encoding": "identity"})
        if self.is_absent(response.status_code):
            return None
        if response.status_code >= 400:
            raise SourceError(f"HEAD {url}: HTTP {response.status_code}")
        length = response.headers.get("content-length")
        if length is not None and "gzip" not in response.headers.get("content-encoding", ""):
            return self._stat_from(response, int(length))
        # No usable length from HEAD: ask for one byte and read the total from Content-Range.
        response = await self.request("GET", url, {"Range": "bytes=0-0", "Accept-Encoding": "identity"},
                                      max_body=1 << 20)
        total = _content_range_total(response.headers.get("content-range", ""))
        if total is None:
            raise SourceError(f"GET {url}: cannot tell the object's size")
        return self._stat_from(response, total)

    def is_absent(self, status: int) -> bool:
        return status in ABSENT_STATUS

    async def read(self, key: str, offset: int, size: int, version: tuple | None = None) -> bytes:
        if size <= 0:
            return b""
        url = self.object_url(key)
        headers = {"Range": f"bytes={offset}-{offset + size - 1}", "Accept-Encoding": "identity"}
        if version and version[0] and version[0].startswith(('"', 'W/"')):
            headers["If-Match"] = version[0]
        response = await self.request("GET", url, headers, max_body=self.options.whole_object_limit)
        status = response.status_code
        if status == 206:
            data = response.content
            if len(data) > size:
                raise SourceError(f"GET {url}: server sent {len(data)} bytes for a {size}-byte range")
            return data
        if status == 200:
            # The server ignores Range and sent the whole object.
            self.counters.whole_object_fallbacks += 1
            length = int(response.headers.get("content-length") or len(response.content))
            if length > self.options.whole_object_limit:
                raise SourceError(f"GET {url}: the server ignores Range requests and the object has {length} "
                                  f"bytes (more than the {self.options.whole_object_limit >> 20} MiB accepted "
                                  "whole); serve the data with Range support")
            log_once(log, f"norange:{self.base_url}", "%s ignores Range requests: fetching whole objects "
                     "(up to %d MiB each); a server with Range support is far faster", self.base_url,
                     self.options.whole_object_limit >> 20)
            return response.content[offset:offset + size]
        if status == 416:
            return b""  # the range starts at or past the end
        if status == 412 or (version and self.is_absent(status)):
            self._stats.pop(key, None)
            raise StaleError(key, f"object changed on the server (HTTP {status})")
        raise SourceError(f"GET {url}: HTTP {status}")

    async def read_index(self, key: str, offset: int, size: int, version: tuple | None = None) -> bytes:
        return await self.read(key, offset, size, version)

    async def list(self, key: str) -> AsyncIterator[tuple[str, ObjectStat]]:  # type: ignore[override]
        return
        yield

    async def stat_dir(self, key: str) -> ObjectStat | None:
        return ObjectStat(0, 0, True) if not key else None

    def stats(self) -> dict[str, object]:
        return {"http": self.counters.as_dict()}


_MISSING = object()


def _content_range_total(value: str) -> int | None:
    # "bytes 0-0/12345"
    _, _, total = value.rpartition("/")
    return int(total) if total.isdigit() else None
