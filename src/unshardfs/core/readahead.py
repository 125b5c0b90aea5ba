"""Read-ahead: recognise scans of a sharded directory and fetch what comes next.

Tools that copy or walk a directory read its chunk files one after another,
each read a round trip to an object store. A `ScanScope` watches the order
in which a directory's chunk files are first read and recognises two kinds
of scan:

- id order: ascending chunk ids, which is inode order (`cp -r` sorts a
  directory by inode number before copying, and our computed inodes are the
  ids) and, for grids, a walk over neighbouring cells;
- listing order: the order of the directory's listing (`tar`, `find`,
  `ls -f | xargs`), which is the order of the index tables, shard by shard;
  before any listing, consecutive entries of one index table.

A guess becomes a stream after two reads that match it, so a viewer reading
scattered chunks starts no prefetch. A confirmed stream keeps a window of
upcoming chunks prefetched (doubling up to MAX_WINDOW), coalesced by the
fetcher; a window that ends inside a shard's run of upcoming chunks is
stretched to the end of that run, so each run of adjacent chunks costs one
request rather than one per window. Several streams per directory are
tracked at once (parallel readers each scanning their part).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import numpy as np

from ..errors import DataError
from .blob import Blob, Ident
from .fetch import Extent, Fetcher
from .policy import POLICY
from .table import ChunkTable, int_list

MAX_STREAMS = POLICY.max_streams
FIRST_WINDOW = POLICY.first_window
MAX_WINDOW = POLICY.max_window
SLACK = POLICY.slack
CONFIRM = POLICY.confirm
LISTED_IDS_MAX = POLICY.listed_ids_max
WHOLE_READ_MAX = POLICY.whole_read_max

Picked = tuple[int, Extent, ChunkTable]  # a stream position, its chunk's extent, and the chunk's table


class ScanTarget(Protocol):
    """What read-ahead needs of a directory of chunk files (a `ChunkContext` is one)."""

    @property
    def fetcher(self) -> Fetcher: ...

    @property
    def dense(self) -> bool:
        """Whether ids fill a range (the id after k is k+1)."""

    async def locate(self, chunk_id: int) -> tuple[ChunkTable, int] | None:
        """The table holding chunk `chunk_id` and its position (None: absent; DataError: damaged)."""

    def has_payload(self, ext: Extent) -> bool:
        """Whether the payload at `ext` is already kept for its reader."""


@dataclass(eq=False)
class _Stream:
    order: str  # "id" or "listing"
    upcoming: list[int]  # predicted ids, in order
    cursor: int = 0  # index in `upcoming` of the next expected id
    frontier: int = 0  # ids before this index have been prefetched
    hits: int = 0
    window: int = FIRST_WINDOW

    def match(self, chunk_id: int) -> bool:
        # A guess must be followed exactly: scattered reads (a viewer) would
        # otherwise land within the slack of some guess often enough to look
        # like a scan on a small directory. A confirmed stream tolerates skips.
        reach = SLACK if self.hits >= CONFIRM else 1
        try:
            i = self.upcoming.index(chunk_id, self.cursor, self.cursor + reach)
        except ValueError:
            return False
        self.cursor = i + 1
        self.hits += 1
        return True


class Listings:
    """What a directory's listing batches said: ids in listing order, to continue a scan where
    the listing goes next (the next table, the next shard), and each blob's chunk extents, to
    name the chunks a prefetch reads in its gaps. Bounded by LISTED_KEYS_MAX entries; a
    listing read again adds nothing."""

    def __init__(self) -> None:
        self.batches: list[np.ndarray] = []
        self.count = 0
        self._seen: set[tuple[Ident, int, int]] = set()
        self._orders: dict[int, np.ndarray] = {}  # batch -> argsort of its ids (on demand)
        self._last = 0  # the batch the last question was answered from (scans move forward)
        self._sorted: np.ndarray | None = None
        self._tables: dict[Ident, list[ChunkTable]] = {}  # blob ident -> its listed tables
        # ... as (starts, lengths, ids) sorted by start
        self._spans: dict[Ident, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def add(self, table: ChunkTable) -> None:
        mark = (table.blob.ident, int(table.ids[0]), len(table))
        if mark in self._seen or self.count >= LISTED_IDS_MAX:
            return
        self._seen.add(mark)
        self.batches.append(table.ids)
        self.count += len(table.ids)
        self._sorted = None
        self._tables.setdefault(table.blob.ident, []).append(table)
        self._spans.pop(table.blob.ident, None)

    def within(self, blob: Blob, start: int, end: int, after: int | None = None) -> list[Extent]:
        """Listed chunk extents of `blob` lying inside [start, end) (of ids above `after`, if given)."""
        spans = self._spans.get(blob.ident)
        if spans is None:
            tables = self._tables.get(blob.ident)
            if not tables:
                return []
            starts = np.concatenate([t.starts for t in tables])
            order = np.argsort(starts, kind="stable")
            spans = self._spans[blob.ident] = (starts[order], np.concatenate([t.lengths for t in tables])[order],
                                               np.concatenate([t.ids for t in tables])[order])
        starts, lengths, ids = spans
        lo, hi = np.searchsorted(starts, [np.uint64(start), np.uint64(end)])
        if after is not None:
            ahead = ids[lo:hi] > np.uint64(after)
            pairs = zip(starts[lo:hi][ahead].tolist(), lengths[lo:hi][ahead].tolist())
        else:
            pairs = zip(starts[lo:hi].tolist(), lengths[lo:hi].tolist())
        return [Extent(blob, s, n) for s, n in pairs if s + n <= end]

    def after(self, chunk_id: int, n: int) -> list[int] | None:
        """Up to `n` ids listed after `chunk_id`; None if `chunk_id` was not listed."""
        count = len(self.batches)
        for b in [self._last, *range(self._last + 1, count), *range(self._last)] if count else []:
            i = self._position(b, chunk_id)
            if i is not None:
                self._last = b
                out = int_list(self.batches[b][i + 1:i + 1 + n])
                for later in self.batches[b + 1:]:
                    if len(out) >= n:
                        break
                    out += int_list(later[:n - len(out)])
                return out
        return None

    def _position(self, b: int, chunk_id: int) -> int | None:
        ids = self.batches[b]
        order = self._orders.get(b)
        if order is None:
            order = self._orders[b] = np.argsort(ids, kind="stable")
        j = int(np.searchsorted(ids, np.uint64(chunk_id), sorter=order))
        return int(order[j]) if j < len(ids) and int(ids[order[j]]) == chunk_id else None

    def sorted_ids(self) -> np.ndarray | None:
        if not self.batches:
            return None
        if self._sorted is None:
            self._sorted = np.unique(np.concatenate(self.batches))
        return self._sorted


@dataclass(eq=False)
class ScanScope:
    ctx: ScanTarget
    streams: list[_Stream] = field(default_factory=list)
    pending: deque[int] = field(default_factory=lambda: deque(maxlen=4096))
    working: bool = False
    listings: Listings = field(default_factory=Listings)

    # -- fed by the chunk files and listings --------------------------------------------

    def note(self, chunk_id: int) -> None:
        """Chunk `chunk_id`'s file is being read from its start (cheap: the work happens in the background)."""
        fetcher = self.ctx.fetcher
        if not fetcher.can_prefetch:
            return
        self.pending.append(chunk_id)
        if not self.working:
            self.working = fetcher.spawn(self._work)

    def listed(self, table: ChunkTable) -> None:
        """Ids of a listing batch, in listing order."""
        if len(table):
            self.listings.add(table)

    # -- the background worker -------------------------------------------------------------

    async def _work(self) -> None:
        try:
            while self.pending:
                await self._observe(self.pending.popleft())
        finally:
            self.working = False

    async def _observe(self, chunk_id: int) -> None:
        # Every stream that predicted the id moves on, not only the first; the first
        # confirmed one reads ahead, or the next where it has nothing more ahead: a
        # listing stream ends with its directory, and the id stream beside it then
        # carries the scan into the next one (`cp -r` of nested Zarr chunk directories).
        matched = [stream for stream in self.streams if stream.match(chunk_id)]
        if matched:
            self.streams = matched + [stream for stream in self.streams if stream not in matched]
            for stream in matched:
                if stream.hits >= CONFIRM and await self._extend(stream):
                    break
            return
        for order in ("id", "listing"):
            upcoming = await self._successors(order, chunk_id, FIRST_WINDOW + SLACK)
            if upcoming:
                self.streams.insert(0, _Stream(order, upcoming))
        del self.streams[MAX_STREAMS:]

    async def _extend(self, stream: _Stream) -> bool:
        """Keep `window` chunks prefetched ahead of the stream's reader; whether any are."""
        if stream.frontier - stream.cursor >= stream.window // 2:
            return True
        if stream.cursor > MAX_WINDOW:  # forget what the reader has passed
            del stream.upcoming[:stream.cursor]
            stream.frontier -= stream.cursor
            stream.cursor = 0
        start = max(stream.frontier, stream.cursor)
        picked, stop = await self._window(stream, start, stream.cursor + stream.window)
        tables: dict[Ident, dict[int, ChunkTable]] = {}  # blob -> the tables the window's chunks are in
        for _, _, table in picked:
            tables.setdefault(table.blob.ident, {})[id(table)] = table

        # A scan in id order over hashed shards wants chunks scattered over each shard: the
        # chunks between them come later in the same scan (those above the id just read), so a
        # request may span them (fewer, larger requests) and keep them rather than read them again.
        after = stream.upcoming[stream.cursor - 1] if stream.order == "id" and stream.cursor else None

        def fill(blob: Blob, start: int, end: int) -> list[Extent]:
            return self._fill(blob, start, end, tables.get(blob.ident, {}).values(), after)

        taken = self.ctx.fetcher.prefetch([ext for _, ext, _ in picked], fill, wide=after is not None)
        # The frontier passes only what the fetcher took (its budget may stop it
        # early): the rest is asked for again at the next extension.
        stream.frontier = picked[taken][0] if taken < len(picked) else stop
        stream.window = min(stream.window * 2, MAX_WINDOW)
        return stream.frontier > stream.cursor

    async def _window(self, stream: _Stream, start: int, want: int) -> tuple[list[Picked], int]:
        """(position, extent, table) of the stream's upcoming ids from `start` on, and where they stop:
        up to `want`, then on while they stay in the last one's blob (a window never splits
        a shard's run of upcoming chunks into two requests), with at most MAX_WINDOW more
        ids and a quarter of the prefetch budget in bytes."""
        picked: list[Picked] = []
        limit = want + MAX_WINDOW
        budget = self.ctx.fetcher.policy.prefetch_bytes // 4
        i = start
        while i < limit and budget > 0:
            if i >= len(stream.upcoming):
                more = await self._successors(stream.order, stream.upcoming[-1], max(want - i, FIRST_WINDOW) +
                                              SLACK) if stream.upcoming else []
                if not more:
                    break
                stream.upcoming.extend(more)
            found = await self._extent(stream.upcoming[i])
            if i >= want and (found is None or not picked or found[0].blob.ident != picked[-1][1].blob.ident):
                break
            if found is not None:
                picked.append((i, *found))
                budget -= found[0].length
            i += 1
        return picked, i

    async def _extent(self, chunk_id: int) -> tuple[Extent, ChunkTable] | None:
        """The chunk's extent and the table it is in, if it is worth prefetching."""
        try:
            found = await self.ctx.locate(chunk_id)
        except DataError:
            return None
        if found is None:
            return None
        table, i = found
        ext = Extent(table.blob, int(table.starts[i]), int(table.lengths[i]))
        return (ext, table) if self._wanted(ext) else None

    def _wanted(self, ext: Extent) -> bool:
        """Whether prefetching the chunk's payload could save its reader a request."""
        return ext.length <= WHOLE_READ_MAX and not self.ctx.has_payload(ext)

    def _fill(self, blob: Blob, start: int, end: int, tables: Iterable[ChunkTable],
              after: int | None = None) -> list[Extent]:
        """The chunks a prefetch of [start, end) of `blob` reads anyway, known from the listing
        and from `tables` (a scan in id order wants them later: keep them rather than read them
        again); with `after`, only those of ids above it (the scan has read the others)."""
        found = {ext.key: ext for ext in self.listings.within(blob, start, end, after)}
        for table in tables:
            ends = table.starts + table.lengths
            inside = (table.starts >= np.uint64(start)) & (ends <= np.uint64(end))
            if after is not None:
                inside &= table.ids > np.uint64(after)
            for i in np.nonzero(inside)[0].tolist():
                ext = Extent(blob, int(table.starts[i]), int(table.lengths[i]))
                found.setdefault(ext.key, ext)
        return [ext for ext in found.values() if self._wanted(ext)]

    async def _successors(self, order: str, chunk_id: int, n: int) -> list[int]:
        """Up to `n` ids expected after `chunk_id` in a scan of the given order."""
        if order == "id":
            if self.ctx.dense:
                return list(range(chunk_id + 1, chunk_id + 1 + n))
            listed = self.listings.sorted_ids()
            if listed is None:
                return []
            i = int(np.searchsorted(listed, np.uint64(chunk_id), side="right"))
            return int_list(listed[i:i + n])
        listed_after = self.listings.after(chunk_id, n)
        if listed_after is not None:
            return listed_after
        try:  # not listed: the entries after it in its index table
            found = await self.ctx.locate(chunk_id)
        except DataError:
            return []
        if found is None:
            return []
        table, i = found
        return int_list(table.ids[i + 1:i + 1 + n])
