"""Read-ahead: recognise scans of a sharded directory and fetch what comes next.

Tools that copy or walk a directory read its chunk files one after another,
each read a round trip to an object store. A `ScanScope` watches the order
in which a directory's chunk files are first read and recognises two kinds
of scan:

- key order: ascending chunk keys, which is inode order (`cp -r` sorts a
  directory by inode number before copying, and our computed inodes are the
  keys) and, for grids, a walk over neighbouring cells;
- table order: consecutive entries of one index table (a minishard, a Zarr
  shard), which is listing order (`tar`, `find`, `ls -f | xargs`).

A guess becomes a stream after two reads that match it, so a viewer reading
scattered chunks starts no prefetch. A confirmed stream keeps a window of
upcoming chunks prefetched (doubling up to MAX_WINDOW), coalesced by the
fetcher. Several streams per directory are tracked at once (parallel
readers each scanning their part).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import DataError
from .fetch import Extent

if TYPE_CHECKING:
    from .chunks import ChunkContext, ChunkFile

MAX_STREAMS = 16
FIRST_WINDOW = 8
MAX_WINDOW = 256  # chunks prefetched ahead of a stream at most (the byte budget is the fetcher's)
SLACK = 8  # a read may skip this many predicted chunks and still continue the stream
CONFIRM = 2  # matches before a guess starts prefetching
LISTED_KEYS_MAX = 4 << 20  # keys remembered from listings, for key order over sparse keys


@dataclass(eq=False)
class _Stream:
    order: str  # "key" or "table"
    upcoming: list[int]  # predicted keys, in order
    cursor: int = 0  # index in `upcoming` of the next expected key
    frontier: int = 0  # keys before this index have been prefetched
    hits: int = 0
    window: int = FIRST_WINDOW

    def match(self, key: int) -> bool:
        try:
            i = self.upcoming.index(key, self.cursor, self.cursor + SLACK)
        except ValueError:
            return False
        self.cursor = i + 1
        self.hits += 1
        return True


@dataclass(eq=False)
class ScanScope:
    ctx: "ChunkContext"
    streams: list[_Stream] = field(default_factory=list)
    pending: deque = field(default_factory=lambda: deque(maxlen=4096))
    working: bool = False
    _listed: list[np.ndarray] = field(default_factory=list)
    _listed_count: int = 0
    _sorted: np.ndarray | None = None

    # -- fed by the chunk files and listings --------------------------------------------

    def note(self, f: "ChunkFile") -> None:
        """A chunk file is being read from its start (cheap: the work happens in the background)."""
        fetcher = self.ctx.fetcher
        if not fetcher.can_prefetch:
            return
        self.pending.append(f.key)
        if not self.working:
            self.working = fetcher.spawn(self._work)

    def listed(self, table) -> None:
        """Keys of a listing batch; they give key order where keys are sparse (segment ids)."""
        if self.ctx.naming.dense or self._listed_count >= LISTED_KEYS_MAX:
            return
        self._listed.append(table.keys)
        self._listed_count += len(table.keys)
        self._sorted = None

    # -- the background worker -------------------------------------------------------------

    async def _work(self) -> None:
        try:
            while self.pending:
                await self._observe(self.pending.popleft())
        finally:
            self.working = False

    async def _observe(self, key: int) -> None:
        for i, stream in enumerate(self.streams):
            if stream.match(key):
                if i:
                    self.streams.insert(0, self.streams.pop(i))
                if stream.hits >= CONFIRM:
                    await self._extend(stream)
                return
        for order in ("key", "table"):
            upcoming = await self._successors(order, key, FIRST_WINDOW + SLACK)
            if upcoming:
                self.streams.insert(0, _Stream(order, upcoming))
        del self.streams[MAX_STREAMS:]

    async def _extend(self, stream: _Stream) -> None:
        """Keep `window` chunks prefetched ahead of the stream's reader."""
        if stream.frontier - stream.cursor >= stream.window // 2:
            return
        if stream.cursor > MAX_WINDOW:  # forget what the reader has passed
            del stream.upcoming[:stream.cursor]
            stream.frontier -= stream.cursor
            stream.cursor = 0
        want = stream.cursor + stream.window
        if len(stream.upcoming) < want + SLACK:
            more = await self._successors(stream.order, stream.upcoming[-1],
                                          want + SLACK - len(stream.upcoming))
            stream.upcoming.extend(more)
        start = max(stream.frontier, stream.cursor)
        keys = stream.upcoming[start:want]
        stream.frontier = max(stream.frontier, start + len(keys))
        stream.window = min(stream.window * 2, MAX_WINDOW)
        extents = [ext for ext in [await self._extent(k) for k in keys] if ext is not None]
        if extents:
            self.ctx.fetcher.prefetch(extents)

    async def _extent(self, key: int) -> Extent | None:
        from .chunks import WHOLE_READ_MAX

        try:
            found = await self.ctx.store.locate(key)
        except DataError:
            return None
        if found is None:
            return None
        table, i = found
        ext = Extent(table.blob, int(table.starts[i]), int(table.lengths[i]))
        if ext.length > WHOLE_READ_MAX or ext.key in self.ctx.caches.encoded_chunk:
            return None
        return ext

    async def _successors(self, order: str, key: int, n: int) -> list[int]:
        """Up to `n` keys expected after `key` in a scan of the given order."""
        if order == "key":
            if self.ctx.naming.dense:
                return list(range(key + 1, key + 1 + n))
            listed = self._sorted_keys()
            if listed is None:
                return []
            i = int(np.searchsorted(listed, np.uint64(key), side="right"))
            return listed[i:i + n].tolist()
        try:
            found = await self.ctx.store.locate(key)
        except DataError:
            return []
        if found is None:
            return []
        table, i = found
        return table.keys[i + 1:i + 1 + n].tolist()

    def _sorted_keys(self) -> np.ndarray | None:
        if not self._listed:
            return None
        if self._sorted is None:
            self._sorted = np.unique(np.concatenate(self._listed))
        return self._sorted
