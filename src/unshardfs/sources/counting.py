"""Counts what the formats ask of a byte source.

Backing reads are the cost that matters on every backend (a syscall locally,
a request remotely), so tests pin their number and `unshardfs stats` shows
them live.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator, Coroutine

from unshardfs.sources.base import ByteSource, FdRange, ObjectStat, SourceLayer, Version, end_listing


@dataclass
class SourceCounters:
    reads: int = 0
    read_bytes: int = 0
    stats: int = 0
    lists: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class CountingSource(SourceLayer):
    def __init__(self, inner: ByteSource) -> None:
        super().__init__(inner)
        self.counters = SourceCounters()

    def stat(self, path: str) -> Coroutine[Any, Any, ObjectStat | None]:
        self.counters.stats += 1
        return self.inner.stat(path)  # awaited by the caller: every lookup stats its shard

    async def read(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        data = await self.inner.read(path, offset, size, version)
        self.counters.reads += 1
        self.counters.read_bytes += len(data)
        return data

    async def read_index(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        data = await self.inner.read_index(path, offset, size, version)
        self.counters.reads += 1
        self.counters.read_bytes += len(data)
        return data

    async def read_versioned(self, path: str, offset: int, size: int) -> tuple[bytes, Version | None]:
        found = await super().read_versioned(path, offset, size)
        self.counters.reads += 1
        self.counters.read_bytes += len(found[0])
        return found

    def read_now(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes | bytearray | None:
        below = self._read_now_below  # (decided once: every small page-cached READ asks)
        data = below(path, offset, size, version) if below is not None else None
        if data is not None:  # counted as the read it replaces
            self.counters.reads += 1
            self.counters.read_bytes += size
        return data

    def cached_range(self, path: str, offset: int, size: int, version: Version | None = None) -> FdRange | None:
        found = super().cached_range(path, offset, size, version)
        if found is not None:  # counted as the read it replaces
            self.counters.reads += 1
            self.counters.read_bytes += size
        return found

    async def stat_tail(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        return self._stat_with_bytes(await super().stat_tail(path, size))

    async def stat_head(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        return self._stat_with_bytes(await super().stat_head(path, size))

    def _stat_with_bytes(self, found: tuple[ObjectStat | None, bytes | None]) -> tuple[ObjectStat | None, bytes | None]:
        self.counters.stats += 1
        if found[1] is not None:  # counted as the read it replaces
            self.counters.reads += 1
            self.counters.read_bytes += len(found[1])
        return found

    async def stat_dir(self, path: str) -> ObjectStat | None:
        self.counters.stats += 1
        return await self.inner.stat_dir(path)

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        self.counters.lists += 1
        listing = self.inner.list(path)
        try:
            async for item in listing:
                yield item
        finally:
            await end_listing(listing)

    def own_stats(self) -> dict[str, object]:
        return {"source": self.counters.as_dict()}
