"""A byte source with an object store's latency on trio's clock, which logs every request it answers.

`LatencySource` wraps another source (usually a `MemorySource`) and makes
each request wait `latency` seconds with `trio.sleep` before it is
answered. Under `trio.testing.MockClock(autojump_threshold=0)` those waits
cost no real time, and the clock's times are exact, so a test can pin what
a workload costs in requests *and* round trips in milliseconds, in process,
as TensorStore's tests pin a kvstore's requests against a mock:

    source = LatencySource(MemorySource.from_directory(root), latency=0.1)
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert (len(source.log), source.round_trips()) == (8, 1)

By default it claims to be `remote` and not `listable`, as a plain HTTP
server is, so the core takes the read path it takes over the network
(batched, coalesced, concurrent reads; read-ahead; shard indexes listed
ahead), and it caches stats for `stat_ttl` seconds and gives an object's
tail with its stat in one request (`stat_tail`), as `HttpSource` does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, cast

import trio

from unshardfs.sources.base import ByteSource, IndexCache, ObjectStat
from unshardfs.util.errors import StaleError
from unshardfs.util.flight import Flights
from unshardfs.util.maps import BoundedMap

_MISSING = object()


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    """One request the source answered (or failed), with its times on trio's clock.

    `kind` is "stat", "tail" (a stat with the object's last bytes: `offset` is
    then -size, as in an HTTP suffix range), "head" (a stat with its first
    bytes), "read", "stat_dir" or "list" (a page of a listing); `offset` and
    `size` are a read's byte range."""

    kind: str
    path: str
    offset: int
    size: int
    sent: float
    answered: float

    @property
    def range(self) -> range:
        """The bytes a read or tail asked for (a tail's from the object's end: negative)."""
        return range(self.offset, self.offset + self.size)


def round_trips(spans: Iterable[tuple[float, float]]) -> int:
    """The longest chain of requests, given as (sent, answered) times, each sent once the one
    before it was answered: the round trips a client waited for one after another, however many
    requests overlapped."""
    chains: list[tuple[float, int]] = []  # (answered at, longest chain ending there)
    for sent, answered in sorted(spans):
        chains.append((answered, 1 + max((n for end, n in chains if end <= sent), default=0)))
    return max((n for _, n in chains), default=0)


class LatencySource:
    """`inner` with `latency` seconds (trio's clock) before every answer, and a log of requests.

    `remote`, `listable` (default: not when `remote`, like a plain HTTP
    server; else as the inner source) and `tails` (stat and tail, or stat
    and head, in one ranged request) say which source this stands in for.
    `page_size` entries come per listing request (None: one request lists
    all). Stats, absences included, are kept `stat_ttl` seconds of trio's
    clock (0: never), and stats of one object asked for together are one
    request, so each object is statted once as over HTTP."""

    def __init__(self, inner: ByteSource, latency: float = 0.1, *, remote: bool = True,
                 listable: bool | None = None, tails: bool = True, stat_ttl: float = 300.0,
                 page_size: int | None = None) -> None:
        if latency < 0 or (page_size is not None and page_size < 1):
            raise ValueError("latency must be >= 0 and page_size >= 1")
        self.inner = inner
        self.latency = latency
        self.description = inner.description
        self.remote = remote
        self.listable = inner.listable and (not remote if listable is None else listable)
        self.tails = tails
        self.page_size = page_size
        self.log: list[LoggedRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._stats: BoundedMap[str, ObjectStat | None] | None = (
            BoundedMap(1 << 20, lru=False, ttl=stat_ttl, clock=trio.current_time) if stat_ttl > 0 else None)
        self._stat_flights = Flights()

    @property
    def index_cache(self) -> IndexCache | None:
        return self.inner.index_cache

    # -- what was asked ------------------------------------------------------------------

    def reset_log(self) -> None:
        self.log.clear()
        self.max_in_flight = self.in_flight

    def counts(self) -> Counter[str]:
        """Requests logged, by kind."""
        return Counter(r.kind for r in self.log)

    def round_trips(self) -> int:
        """Of the logged requests (see `round_trips`)."""
        return round_trips((r.sent, r.answered) for r in self.log)

    async def _request(self) -> float:
        """Wait one latency as a request in flight; returns when it was sent (the caller logs it
        with `_answered` once the inner source has answered, or failed)."""
        sent = trio.current_time()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await trio.sleep(self.latency)
        finally:
            self.in_flight -= 1
        return sent

    def _answered(self, kind: str, path: str, sent: float, offset: int = 0, size: int = 0) -> None:
        self.log.append(LoggedRequest(kind, path, offset, size, sent, trio.current_time()))

    # -- the ByteSource contract -------------------------------------------------------

    async def stat(self, path: str) -> ObjectStat | None:
        cached = self._stats.get(path, _MISSING) if self._stats is not None else _MISSING
        if cached is not _MISSING:
            return cast("ObjectStat | None", cached)
        return await self._stat_flights.run(path, lambda: self._stat(path))

    async def _stat(self, path: str) -> ObjectStat | None:
        sent = await self._request()
        try:
            found = await self.inner.stat(path)
        finally:
            self._answered("stat", path, sent)
        if self._stats is not None:
            self._stats[path] = found
        return found

    async def stat_tail(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        """`stat`, and the object's last `size` bytes with it, in one request, as an HTTP suffix
        range gives them (a stat already known: from the cache, without bytes)."""
        return await self._stat_ranged(path, size, tail=True)

    async def stat_head(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        """`stat`, and the object's first `size` bytes with it, in one request, as an HTTP range
        from 0 gives them (a stat already known: from the cache, without bytes)."""
        return await self._stat_ranged(path, size, tail=False)

    async def _stat_ranged(self, path: str, size: int, tail: bool) -> tuple[ObjectStat | None, bytes | None]:
        known = self._stats is not None and self._stats.get(path, _MISSING) is not _MISSING
        if not self.tails or size <= 0 or known:
            return await self.stat(path), None
        sent = await self._request()
        try:
            st = await self.inner.stat(path)
            got = None
            if st is not None and not st.is_dir:
                start = max(st.size - size, 0) if tail else 0
                got = await self.inner.read(path, start, min(size, st.size - start), st.version)
        finally:
            if tail:
                self._answered("tail", path, sent, -size, size)
            else:
                self._answered("head", path, sent, 0, size)
        if self._stats is not None:
            self._stats[path] = st
        return st, got

    async def read(self, path: str, offset: int, size: int, version: tuple[object, ...] | None = None) -> bytes:
        return await self._read(False, path, offset, size, version)

    async def read_index(self, path: str, offset: int, size: int, version: tuple[object, ...] | None = None) -> bytes:
        return await self._read(True, path, offset, size, version)

    async def read_versioned(self, path: str, offset: int, size: int) -> tuple[bytes, tuple[object, ...] | None]:
        """`read`, and the version of the object the bytes came from, in one request, as an HTTP answer
        names its ETag (`VersionedRead`)."""
        sent = await self._request()
        try:
            st = await self.inner.stat(path)
            if st is None or st.is_dir:
                return await self.inner.read(path, offset, size), None  # (the inner source says what is wrong)
            return await self.inner.read(path, offset, size, st.version), st.version
        finally:
            self._answered("read", path, sent, offset, size)

    async def _read(self, index: bool, path: str, offset: int, size: int, version: tuple[object, ...] | None) -> bytes:
        sent = await self._request()
        try:
            return await (self.inner.read_index if index else self.inner.read)(path, offset, size, version)
        except StaleError:
            if self._stats is not None:
                self._stats.pop(path, None)
            raise
        finally:
            self._answered("read", path, sent, offset, size)

    async def stat_dir(self, path: str) -> ObjectStat | None:
        if not self.listable:
            return ObjectStat(0, 0, True) if not path else None
        sent = await self._request()
        try:
            return await self.inner.stat_dir(path)
        finally:
            self._answered("stat_dir", path, sent)

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        if not self.listable:
            return
        entries = [entry async for entry in self.inner.list(path)]
        page = self.page_size or max(1, len(entries))
        for start in range(0, max(1, len(entries)), page):  # an empty listing is a request too
            sent = await self._request()
            self._answered("list", path, sent)
            for entry in entries[start:start + page]:
                yield entry

    async def aclose(self) -> None:
        await self.inner.aclose()

    def stats(self) -> dict[str, object]:
        return {**self.inner.stats(), "latency": {"requests": len(self.log), "round_trips": self.round_trips()}}
