"""HTTP(S) servers and object stores as byte sources: ranged GETs over one pooled client.

Everything runs on the daemon's trio loop through `h1` (HTTP/1.1 keep-alive,
a bounded connection pool, many requests in flight at once). Each request is
retried with exponential backoff on connection errors, timeouts, 429 and
5xx; when it finally fails the format sees a `SourceError` (EIO for that
file, logged). A 404 is an absent object, which formats treat as a missing
shard. `stat` results (including absences) are cached for `stat_ttl`
seconds: a lookup would otherwise cost a HEAD round trip every time.

Object versions are the server's ETag (else Last-Modified; on Google Cloud
Storage its generation, which its listings and its media answers both
state, where their ETags differ) plus the size; reads made with a version
send `If-Match` (a strong ETag), `If-Unmodified-Since` (a date) or
`x-goog-if-generation-match`, and compare the tag the answer names (the
only check a weak ETag allows: If-Match compares strongly), so a shard
replaced on the server is noticed (412 or another tag -> StaleError) instead
of mixing an old index with new data.

Every response is untrusted, so a server can cost us at most what we asked
for: bodies are streamed raw (never decoded: `Accept-Encoding: identity`,
and any other `Content-Encoding` is refused) up to a cap chosen per status
(exactly the requested length for a 206, whose `Content-Range` must match),
each request has one deadline over all its attempts, redirects and body, and
redirects stay on the origin we were given, so neither requests nor
credentials ever go to another host or down from https to http. Paths become
URL paths segment by segment, percent-quoted, and paths a server (or a URL library)
would normalise into another path are never requested.
"""

from __future__ import annotations

import datetime
import email.utils
import logging
import re
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, cast
from urllib.parse import quote, urljoin

import httpx
import trio

from unshardfs.sources import h1
from unshardfs.sources.base import UrlLocation, ObjectStat, Version, name_problem, opaque_tag, tag_problem
from unshardfs.util.backoff import Backoff
from unshardfs.util.errors import ConfigError, SourceError, StaleError
from unshardfs.util.flight import Flights
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5
BASE_HEADERS = {"User-Agent": "unshardfs", "Accept-Encoding": "identity"}
ABSENT_STATUS = frozenset({404, 410})
# Bodies we do not use (errors, redirects) are read this far, so a short one keeps its connection
# alive; a longer one is dropped with its connection.
ERROR_BODY_LIMIT = 64 << 10
# Sizes beyond int64 cannot be a file size (the kernel's off_t).
MAX_OBJECT_SIZE = (1 << 63) - 1
# A version tag naming a Google Cloud Storage generation (`generation_tag`), not an ETag or a date.
GENERATION = "x-goog-generation:"
_GENERATION = re.compile(r"[0-9]{1,20}")


def generation_tag(value: object) -> str | None:
    """The version tag of a GCS object generation (a decimal string), or None if it is not one."""
    return GENERATION + value if isinstance(value, str) and _GENERATION.fullmatch(value) else None


@dataclass(frozen=True)
class HttpOptions:
    concurrency: int = 32  # requests in flight (and pooled connections)
    timeout: float = 30.0  # seconds, per request attempt
    retries: int = 5  # further attempts after the first
    backoff: float = 0.25  # first retry delay in seconds; doubles up to backoff_max
    backoff_max: float = 8.0
    stat_ttl: float = 300.0
    # A server that ignores Range sends whole objects; accept those up to this size.
    whole_object_limit: int = 64 << 20
    # Seconds one request may take from its first attempt to its last body byte, retries,
    # backoff and redirects included (None: 4 x timeout). `timeout` alone bounds each wait for
    # a byte, so a server dripping bytes just fast enough would otherwise hold a slot forever.
    deadline: float | None = None

    def request_deadline(self) -> float:
        return self.deadline if self.deadline is not None else 4 * self.timeout

    def retrying(self) -> Backoff:
        """How a failed request is retried (shared with DEST's writer, `dest.store`)."""
        return Backoff(self.backoff, self.backoff_max, self.retries)


WHOLE_KEPT = 4 << 20  # bytes of small objects kept from ranged stats that brought them whole


@dataclass
class HttpCounters:
    requests: int = 0
    # The longest chain of requests each sent once the one before it was answered: the round
    # trips a client waited for one after another, however many requests overlapped.
    round_trips: int = 0
    retries: int = 0
    failures: int = 0
    bytes: int = 0
    whole_object_fallbacks: int = 0
    status: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"requests": self.requests, "round_trips": self.round_trips, "retries": self.retries,
                "failures": self.failures,
                "bytes": self.bytes, "whole_object_fallbacks": self.whole_object_fallbacks,
                "status": {str(k): v for k, v in sorted(self.status.items())}}


@dataclass(frozen=True)
class Reply:
    """A final response, its body read up to the limit its status allowed."""

    status: int
    headers: dict[str, str]  # lower-case names (see `h1.headers_of`)
    body: bytes | None  # None: longer than that limit (or a HEAD), not read


# How many body bytes a response of each status may bring (an int: the body, None beyond), or
# which of them to take (a slice: those bytes of the body, never reading or holding more).
BodyLimit = Callable[[int], "int | slice"]


def _error_bodies(status: int) -> int:
    return ERROR_BODY_LIMIT


def _encoding(headers: dict[str, str]) -> str | None:
    """The Content-Encoding of an answer, None for identity (the only one we ask for)."""
    encoding = headers.get("content-encoding", "").strip().lower()
    return encoding if encoding not in ("", "identity") else None


def _http_date(text: str) -> datetime.datetime | None:
    """`text` as an HTTP date (Last-Modified), or None when it is none."""
    try:
        return email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None


def _mtime_ns(headers: dict[str, str]) -> int:
    value = _http_date(headers.get("last-modified") or "")
    if value is not None:
        try:
            return int(value.timestamp() * 1e9)
        except (ValueError, OverflowError):
            pass
    return 0


def path_problem(path: str) -> str | None:
    """Why `path` cannot be requested as it is, or None.

    '' , '.' and '..' segments would be resolved away by a URL library or the server
    (`ds/../x` is requested as `x`: another prefix, even another bucket), and
    NUL or non-UTF-8 cannot be sent faithfully; such paths are never requested.
    """
    for segment in path.split("/"):
        problem = name_problem(segment)
        if problem is not None:
            return f"path {path!r}: {problem}"
    return None


def quote_path(path: str) -> str:
    """`path` as a URL path: each segment percent-quoted, so none of it is read as URL syntax."""
    problem = path_problem(path)
    if problem is not None:
        raise SourceError(f"{problem}: not requested")
    return "/".join(quote(segment, safe="") for segment in path.split("/"))


def origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return url.scheme, url.host, url.port


def redirect_refusal(current: str, location: str, follow: bool = True) -> str | None:
    """Why a redirect from `current` to `location` must not be followed, or None to follow it.

    Only to the same scheme, host and port: another host would receive our
    requests (and reach data outside the source), https -> http would send them
    in clear. Object stores never redirect a read we should trust (`follow`).
    """
    try:
        target = urljoin(current, location)
        # Both parsers must agree: httpx's (as configured URLs are checked) and the one whose
        # answer is where the request goes (h1's), so no URL parsed two ways slips through.
        same = (origin(httpx.URL(target)) == origin(httpx.URL(current))
                and h1.endpoint(target).key == h1.endpoint(current).key)
    except (ValueError, httpx.InvalidURL, h1.TransportError):  # urljoin's own complaints are ValueErrors
        return f"refused redirect to invalid URL {location!r}"
    if not follow or not same:
        return f"refused redirect to {target}"
    return None


# At most 20 digits a number (an int64 has 19): int() refuses over 4300 with a ValueError, and a
# number we cannot use anyway is an answer we refuse, not an exception out of a read.
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20}|\*)")
# Retry-After in seconds (an HTTP date is ignored); str.isdigit() would also accept '²', which float() refuses.
_SECONDS = re.compile(r"[0-9]{1,20}")


def ranged_body(where: str, reply: Reply, offset: int, size: int) -> bytes:
    """The body of a 206 to `Range: bytes=offset-(offset+size-1)`, checked against that request.

    A server or cache in between may answer another range, or a length its own
    Content-Range does not state; taken as they come, those would be bytes from
    elsewhere in the object. The answer may be shorter only at the object's end.
    """
    value = reply.headers.get("content-range", "")
    match = _CONTENT_RANGE.fullmatch(value.strip())
    if reply.body is None or match is None:
        got = "more bytes than" if reply.body is None else f"Content-Range {value!r} for"
        raise SourceError(f"{where}: server sent {got} the {size} bytes at {offset} asked for")
    start, last, total = int(match[1]), int(match[2]), match[3]
    end = offset + size if total == "*" else min(offset + size, int(total))
    if (start, last + 1, len(reply.body)) != (offset, end, end - offset):
        raise SourceError(f"{where}: asked for bytes {offset}-{offset + size - 1}, server sent "
                          f"{len(reply.body)} bytes as {value!r}")
    return reply.body


def _content_range_total(value: str) -> int | None:
    # "bytes 0-0/12345"
    match = _CONTENT_RANGE.fullmatch(value.strip())
    return int(match[3]) if match and match[3] != "*" and int(match[3]) <= MAX_OBJECT_SIZE else None


class HttpSource:
    """Objects under a base URL: `<base>/<path>`."""

    listable = False
    remote = True
    index_cache = None
    # Whether redirects (to the same origin only) are followed; object stores never need them.
    follow_redirects = True

    def __init__(self, base_url: str, options: HttpOptions | None = None, description: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.options = options or HttpOptions()
        self.description = description or self.base_url
        self.counters = HttpCounters()
        try:
            url = httpx.URL(self.base_url)
        except httpx.InvalidURL as e:
            raise ConfigError(f"invalid URL {base_url!r}: {e}") from None
        if url.scheme not in ("http", "https") or not url.host or url.query or url.fragment:
            # Paths are appended to the path: a query or fragment would swallow them.
            raise ConfigError(f"invalid URL {base_url!r}: need http(s)://host/path, without '?' or '#'")
        # Credentials (`authorize`) go to this origin only: the endpoint the user configured.
        self.credential_origin = origin(url)
        try:
            self._credential_key = h1.endpoint(self.base_url).key  # where requests actually go
        except h1.TransportError as e:
            raise ConfigError(f"invalid URL {base_url!r}: {e}") from None
        self._pool: h1.Pool | None = None
        self._limiter: trio.CapacityLimiter | None = None
        self._stats: BoundedMap[str, ObjectStat | None] = BoundedMap(200_000, lru=False, ttl=self.options.stat_ttl)
        self._no_suffix = False  # the server ignores Range: `stat_tail` is a HEAD
        self._stat_flights = Flights()  # HEADs in flight, joined by stats of the same path
        # Small objects a ranged stat brought whole (a metadata file probed for detection), with their
        # version: a later `stat_head`/`stat_tail` of the same version takes them instead of a read.
        self._whole: BoundedMap[str, tuple[object, bytes]] = BoundedMap(
            WHOLE_KEPT, getsizeof=lambda kept: len(kept[1]), ttl=self.options.stat_ttl)

    # -- plumbing ---------------------------------------------------------------

    def object_url(self, path: str) -> str:
        return f"{self.base_url}/{quote_path(path)}" if path else self.base_url + "/"

    async def authorize(self, request: h1.ClientRequest) -> None:
        """Add credentials to a request (none for plain HTTP)."""

    def pool(self) -> h1.Pool:
        # Our own HTTP/1.1 client (h1.py): httpx's transport spent more CPU receiving a body than
        # the rest of a chunk read, and its client layer (cookies, auth flows, header merging)
        # more per request (both measured); a byte source needs none of it. Redirects: `_send`.
        if self._pool is None:
            self._pool = h1.Pool(max_idle=self.options.concurrency)
            self._limiter = trio.CapacityLimiter(self.options.concurrency)
        return self._pool

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None

    async def _send(self, method: str, url: str, headers: dict[str, str] | None) -> h1.Response:
        """One attempt: the request, then the redirects `redirect_refusal` allows."""
        for _hop in range(MAX_REDIRECTS + 1):
            request = h1.ClientRequest(method, url, {**BASE_HEADERS, **(headers or {})})
            if h1.endpoint(url).key == self._credential_key:
                await self.authorize(request)
            counters = self.counters
            counters.requests += 1
            depth = counters.round_trips + 1  # a chain one longer than the longest answered so far
            response = await self.pool().send(request, self.options.timeout)
            counters.round_trips = max(counters.round_trips, depth)
            location = response.headers.get("location")
            if response.status not in REDIRECT_STATUS or not location:
                return response
            await response.aclose()
            refusal = redirect_refusal(url, location, self.follow_redirects)
            if refusal is not None:
                raise SourceError(f"{method} {url}: {refusal}")
            url = urljoin(url, location)
        raise SourceError(f"{method} {url}: more than {MAX_REDIRECTS} redirects")

    async def _attempt(self, method: str, url: str, headers: dict[str, str] | None, limit: BodyLimit) -> Reply:
        response = await self._send(method, url, headers)
        try:
            status = response.status
            self.counters.status[status] = self.counters.status.get(status, 0) + 1
            body = None
            if method != "HEAD" and status not in RETRY_STATUS:
                encoding = _encoding(response.headers)
                if 200 <= status < 300 and encoding is not None:
                    # Data we would have to decode (`gzip, gzip` of zeros is a bomb): we asked for identity.
                    raise SourceError(f"{method} {url}: refusing Content-Encoding {encoding!r}")
                cap = limit(status)
                body = (await response.read_part(cap.start, cap.stop - cap.start) if isinstance(cap, slice)
                        else await response.read(cap))
        finally:
            await response.aclose()
        self.counters.bytes += len(body or b"")
        return Reply(status, response.headers, body)

    async def request(self, method: str, url: str, headers: dict[str, str] | None = None,
                      limit: BodyLimit = _error_bodies) -> Reply:
        """Send with retries until a status other than 408/429/5xx, within one deadline counted from
        the first attempt (waiting for a free slot does not count). The body is read up to
        `limit(status)` bytes (None beyond)."""
        self.pool()
        assert self._limiter is not None
        retries = self.options.retrying().schedule()
        deadline: float | None = None
        attempts = 0
        last = ""
        try:
            while True:
                if deadline is not None:  # a retry: the first attempt set the deadline
                    wait = retries.wait(trio.current_time(), deadline)
                    if wait is None:
                        break  # no retry left, or no time for one
                    self.counters.retries += 1
                    await trio.sleep(wait)
                attempts += 1
                try:
                    async with self._limiter:
                        if deadline is None:
                            deadline = trio.current_time() + self.options.request_deadline()
                        with trio.fail_at(deadline):
                            reply = await self._attempt(method, url, headers, limit)
                except h1.TransportError as e:  # connection errors, timeouts, broken bodies
                    last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                    continue
                if reply.status not in RETRY_STATUS:
                    return reply
                last = f"HTTP {reply.status}"
                retry_after = reply.headers.get("retry-after", "").strip()
                if _SECONDS.fullmatch(retry_after):
                    retries.at_least(float(retry_after))
        except trio.TooSlowError:
            last = f"no complete answer within the {self.options.request_deadline():g} s deadline"
        except SourceError:
            self.counters.failures += 1
            raise
        self.counters.failures += 1
        raise SourceError(f"{method} {url}: {last} (after {attempts} attempts)")

    # -- the ByteSource contract ------------------------------------------------

    def _stat_from(self, reply: Reply, size: int) -> ObjectStat:
        tag = (generation_tag(reply.headers.get("x-goog-generation")) or reply.headers.get("etag")
               or reply.headers.get("last-modified") or "")
        return ObjectStat(size=size, mtime_ns=_mtime_ns(reply.headers), is_dir=False, version=(tag, size))

    async def stat(self, path: str) -> ObjectStat | None:
        # Probed first: only paths that passed the check below are ever cached, and a shard's
        # stat is asked for at every lookup of one of its chunks.
        cached = self._stats.get(path, _MISSING)
        if cached is not _MISSING:
            return cast("ObjectStat | None", cached)
        if not path:
            return ObjectStat(0, 0, True)
        problem = path_problem(path)
        if problem is not None:
            # Absent: a name no request can reach exactly has no object behind it for us.
            log_once(log, f"key:{self.description}:{problem}", "%s: %s: treated as absent", self.description,
                     problem)
            return None
        # Readers looking up chunks of one cold shard at once stat it together: one HEAD.
        return await self._stat_flights.run(path, lambda: self._head_kept(path))

    async def _head_kept(self, path: str) -> ObjectStat | None:
        result = self._stats[path] = await self._head(path)
        return result

    async def _head(self, path: str) -> ObjectStat | None:
        url = self.object_url(path)
        reply = await self.request("HEAD", url)
        if self.is_absent(reply.status):
            return None
        if reply.status >= 400:
            raise SourceError(f"HEAD {url}: HTTP {reply.status}")
        length = reply.headers.get("content-length", "")
        if length.isdigit() and int(length) <= MAX_OBJECT_SIZE and _encoding(reply.headers) is None:
            return self._stat_from(reply, int(length))
        # No usable length from HEAD: ask for one byte and read the total from Content-Range.
        reply = await self.request("GET", url, {"Range": "bytes=0-0"}, limit=lambda status: 1)
        total = _content_range_total(reply.headers.get("content-range", ""))
        if reply.status != 206 or total is None:
            raise SourceError(f"GET {url}: cannot tell the object's size")
        return self._stat_from(reply, total)

    async def stat_tail(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        """`stat`, and the object's last `size` bytes with it, in one request (`Range: bytes=-size`,
        whose Content-Range states the object's size: `base.stat_and_tail`). See `_stat_ranged`."""
        return await self._stat_ranged(path, size, f"bytes=-{size}", lambda total: max(total - size, 0))

    async def stat_head(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        """`stat`, and the object's first `size` bytes with it, in one request (`Range: bytes=0-`
        up to `size`, whose Content-Range states the object's size: `base.stat_and_head`). See
        `_stat_ranged`."""
        return await self._stat_ranged(path, size, f"bytes=0-{size - 1}", lambda total: 0)

    async def _stat_ranged(self, path: str, size: int, range_value: str,
                           start_of: Callable[[int], int]) -> tuple[ObjectStat | None, bytes | None]:
        """`stat`, and `size` bytes from `start_of(total)` (fewer where the object ends first) with
        it, in one ranged GET. A stat already known comes from the cache, without bytes. A server
        that ignores Range (200: remembered, it is never asked so again), an empty object (416) or
        an answer without a total: statted as usual, a HEAD more. Another error status is the
        error a HEAD would have met."""
        known = self._stats.get(path, _MISSING)
        if isinstance(known, ObjectStat):
            kept = self._whole.get(path)
            if kept is not None and kept[0] == known.version:  # the object as that stat saw it, whole
                start = start_of(known.size)
                return known, kept[1][start:start + size]
        if (size <= 0 or not path or self._no_suffix or known is not _MISSING
                or path_problem(path) is not None):
            return await self.stat(path), None
        url = self.object_url(path)
        # Only a 206's body is read (exactly `size` bytes at most); a 200 is dropped with its connection.
        reply = await self.request("GET", url, {"Range": range_value},
                                   lambda status: size if status == 206 else 0 if status < 300 else ERROR_BODY_LIMIT)
        if self.is_absent(reply.status):
            self._stats[path] = None
            return None, None
        if reply.status >= 400 and reply.status != 416:
            raise SourceError(f"GET {url}: HTTP {reply.status}")
        total = _content_range_total(reply.headers.get("content-range", ""))
        if reply.status == 200:
            self._no_suffix = True
            log_once(log, f"nosuffix:{self.base_url}", "%s ignores Range requests: statting objects with HEAD",
                     self.base_url)
        if reply.status != 206 or total is None:
            return await self.stat(path), None
        # The bytes Content-Range must name for this request, or a SourceError.
        body = ranged_body(f"GET {url}", reply, start_of(total), size)
        stat = self._stats[path] = self._stat_from(reply, total)
        if len(body) == total:
            self._whole[path] = (stat.version, body)
        return stat, body

    def is_absent(self, status: int) -> bool:
        return status in ABSENT_STATUS

    async def stored_at(self, path: str, version: Version | None) -> UrlLocation | None:
        """The object's URL, as requests for it name it (`StoredAt`)."""
        return UrlLocation(self.base_url, path, self.object_url(path), 0, version or ())

    async def read(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return (await self._read(path, offset, size, version, False))[0]

    async def read_versioned(self, path: str, offset: int, size: int) -> tuple[bytes, Version | None]:
        """`read`, and the version the answer names (`VersionedRead`): its validator and, from its
        Content-Range, the object's size, as a stat would give them; None for an answer without them."""
        data, st = await self._read(path, offset, size, None, True)
        return data, st.version if st is not None else None

    async def _read(self, path: str, offset: int, size: int, version: Version | None, told: bool
                    ) -> tuple[bytes, ObjectStat | None]:
        """`read`, and (`told`) the object's stat as the answer (a 206) states it, where it does."""
        if size <= 0:
            return b"", None
        url = self.object_url(path)
        headers = {"Range": f"bytes={offset}-{offset + size - 1}"}
        tag = version[0] if version else None  # (`_stat_from`'s version: (ETag or Last-Modified, size))
        tagged = isinstance(tag, str) and tag.startswith(('"', 'W/"'))
        generation = tag[len(GENERATION):] if isinstance(tag, str) and tag.startswith(GENERATION) else None
        # A Last-Modified date (a listing's own tags are none).
        dated = isinstance(tag, str) and not tagged and generation is None and _http_date(tag) is not None
        if generation is not None:
            headers["x-goog-if-generation-match"] = generation
        elif tagged and not cast(str, tag).startswith("W/"):
            # If-Match compares strongly: a weak tag would be refused (412) on every read, so it
            # is only compared with the tag the answer names (below).
            headers["If-Match"] = cast(str, tag)
        elif dated:
            headers["If-Unmodified-Since"] = cast(str, tag)
        # A 200 is the whole object (the server ignored Range): only the bytes asked for are kept,
        # the ones before them dropped as they arrive, the connection dropped after them.
        whole = slice(offset, offset + size) if offset + size <= self.options.whole_object_limit else 0
        limits: dict[int, int | slice] = {206: size, 200: whole}
        reply = await self.request("GET", url, headers, lambda status: limits.get(status, ERROR_BODY_LIMIT))
        status = reply.status
        if tagged and status in (200, 206):
            # A server that ignores If-Match still names the object it answers from.
            answered = reply.headers.get("etag")
            if answered and opaque_tag(answered) != opaque_tag(cast(str, tag)):
                self._stats.pop(path, None)
                raise StaleError(path, f"object changed on the server (ETag {answered[:100]}, not {tag})")
        if generation is not None and status in (200, 206):
            answered = reply.headers.get("x-goog-generation")
            if answered and answered.strip() != generation:
                self._stats.pop(path, None)
                raise StaleError(path, f"object changed on the server (generation {answered[:40]}, not {generation})")
        if dated and status in (200, 206):
            answered = reply.headers.get("last-modified")
            if answered and answered.strip() != cast(str, tag).strip():
                self._stats.pop(path, None)
                raise StaleError(path, f"object changed on the server (Last-Modified {answered[:100]}, not {tag})")
        if status == 206:
            body = ranged_body(f"GET {url}", reply, offset, size)
            total = _content_range_total(reply.headers.get("content-range", "")) if told else None
            return body, self._stat_from(reply, total) if total is not None else None
        if status == 200:
            # The server ignores Range and sent the whole object.
            self.counters.whole_object_fallbacks += 1
            if reply.body is None:
                raise SourceError(f"GET {url}: the server ignores Range requests, and bytes {offset}-"
                                  f"{offset + size - 1} lie beyond the first {self.options.whole_object_limit >> 20}"
                                  " MiB of an object read that way; serve the data with Range support")
            log_once(log, f"norange:{self.base_url}", "%s ignores Range requests: reading objects from their "
                     "start (up to %d MiB into each); a server with Range support is far faster", self.base_url,
                     self.options.whole_object_limit >> 20)
            return reply.body, None
        if status == 416:
            return b"", None  # the range starts at or past the end
        if status == 412 or (version and self.is_absent(status)):
            self._stats.pop(path, None)
            raise StaleError(path, f"object changed on the server (HTTP {status})")
        raise SourceError(f"GET {url}: HTTP {status}")

    async def read_index(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return await self.read(path, offset, size, version)

    async def read_if_tagged(self, path: str, offset: int, size: int, etag: str,
                             version: Version | None = None) -> bytes | None:
        """`read` with `If-Match` on the recorded tag (the request itself is the check: no HEAD first; a
        strong tag names the content, so `version` adds nothing). A weak tag never matches there (If-Match
        compares strongly), so it is compared with the tag the object's stat names instead (the stat is
        kept as long as any other), and the read is made with `version`, else that stat's."""
        problem = tag_problem(etag)
        if problem is not None:
            raise SourceError(f"{self.object_url(path)}: {problem}")
        opaque = opaque_tag(etag)
        if etag.strip()[:2] not in ("W/", "w/"):
            return await self.read(path, offset, size, (f'"{opaque}"', None))
        st = await self.stat(path)
        current = st.version[0] if st is not None and not st.is_dir and st.version else None
        if not isinstance(current, str) or opaque_tag(current) != opaque:
            raise StaleError(path, f"object changed on the server (ETag {str(current)[:100]}, not {etag[:100]})")
        assert st is not None
        return await self.read(path, offset, size, version or st.version)

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        return
        yield

    async def stat_dir(self, path: str) -> ObjectStat | None:
        return ObjectStat(0, 0, True) if not path else None

    def stats(self) -> dict[str, object]:
        """The counters, and the connections opened so far (how well keep-alive holds)."""
        opened = self._pool.connections if self._pool is not None else 0
        return {"http": {**self.counters.as_dict(), "connections": opened}}


_MISSING = object()

