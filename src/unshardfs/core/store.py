"""What a format supplies to the core for one sharded directory, and what the core keeps: `ShardedStore`.

The store's `locate` and `tables` are the core's and final: they turn a bad
index entry into a DataError, drop entries that belong to another shard
(a listing never shows a name a lookup cannot find), and read each shard's
index once per version of its object, however many ask at once, within the
index limit and the budget of the cache that keeps it.

A format implements only what is its own: which shard an id lives in
(`shard_of`), which shards exist (`shards`), how to open a shard
(`open_shard`), how to read and decode its index (`read_index`, into
`ChunkTable`s), and, for multi-level indexes, which table holds an id
(`table_for`, `index_tables`). Index levels are declared (`index_levels`),
and each level's cache is made from its declaration; further levels are read
through `cached` (one entry) or `cached_batch` (entries read together in one
request, undecodable ones remembered), so no format keeps a cache by hand.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, AsyncIterator, Awaitable, Callable, Generic, Hashable, Sequence, TypeVar, cast, final

import numpy as np

from unshardfs.core.blob import Blob
from unshardfs.core.caches import SHARD_INDEX, IndexLevel
from unshardfs.core.fetch import SEED_MAX, Extent
from unshardfs.core.runtime import Runtime
from unshardfs.core.table import ChunkTable
from unshardfs.sources.base import ObjectStat, stat_and_head, stat_and_tail
from unshardfs.util.errors import DataError
from unshardfs.util.flight import Flights
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap

ShardT = TypeVar("ShardT", bound=Hashable)  # a store's own handle for one shard (a number, a grid index)
IndexT = TypeVar("IndexT")  # what one shard's first index level decodes to (usually a ChunkTable)
T = TypeVar("T")
# Several index entries decoded at once: [(key, raw bytes, where)] -> each value or DataError.
DecodeMany = Callable[[list[tuple[Hashable, bytes, str]]], Awaitable[list[T | DataError]]]

# Index entries of a batch level that failed to decode, remembered per store: a damaged or hostile
# entry (a gzip bomb) is decoded once, not again by every lookup of a chunk it would hold.
FAILED_MAX = 1024
INDEXED_MAX = 1 << 14  # shard objects remembered as opened with their index (`stat_shard`)

Shard = Hashable  # a shard handle, for code that does not know the store's type

log = logging.getLogger(__name__)


def shard_token(shard: object) -> str:
    """A shard handle as text that is the same in every process (a number, a name, a tuple of them)."""
    if isinstance(shard, bool) or not isinstance(shard, (int, str, tuple)):
        raise TypeError(f"no stable token for a shard handle of type {type(shard).__name__}; "
                        "override ShardedStore.token")
    if isinstance(shard, tuple):
        return "(" + ",".join(shard_token(part) for part in shard) + ")"
    return str(shard) if isinstance(shard, int) else repr(shard)


class ShardedStore(ABC, Generic[ShardT, IndexT]):
    """The index structures of one sharded directory.

    Subclass with the shard handle type and the type the first index level
    decodes to (`ShardedStore[int, ChunkTable]`). Read through
    `self.fetcher` with `Extent`s (batches are coalesced and shared with
    read-ahead), index bytes through `read_index_bytes` (limit-checked).

    Errors: anything wrong with stored bytes is a `DataError(where, reason)`
    (EIO for the files it touches, logged once); absence is None or [].
    """

    # The index levels this store reads, first level first; the first one's
    # cache keeps what `read_index` returns. Empty: the object is the chunk
    # (no index; nothing is cached).
    index_levels: tuple[IndexLevel, ...] = (SHARD_INDEX,)

    def __init__(self, runtime: Runtime, label: str) -> None:
        self.runtime = runtime
        self.source = runtime.source
        self.fetcher = runtime.fetcher
        self.caches = runtime.caches
        self.limits = runtime.limits
        self.label = label or "."  # for messages: the directory's path
        self.flights = runtime.fetcher.flights
        self._failed: BoundedMap[tuple[str, Hashable], tuple[str, str]] = BoundedMap(FAILED_MAX)
        self._kind = type(self).__qualname__  # the first part of every cache key (`_full`)
        self._caches: dict[str, BoundedMap[Any, Any]] = {}  # `cache(level)` by level name: every lookup asks twice
        # Shard objects whose index came with a stat (`stat_shard`): only the first open asks for it.
        self._indexed: BoundedMap[str, bool] = BoundedMap(INDEXED_MAX, lru=False, counted=False)
        # ... and the opens asked for while that request is on its way wait for it (readers starting
        # together otherwise send a stat beside it, and a reader holding that stat's blob may ask
        # for the index before its bytes are there: a round trip of its own).
        self._indexing = Flights()

    # -- the format's own ----------------------------------------------------------------

    @abstractmethod
    def shard_of(self, chunk_id: int) -> ShardT | None:
        """The shard chunk `chunk_id` lives in; None if no chunk can have this id (outside the grid).

        Pure computation (no I/O): a lookup by name must not list anything.
        """

    def table_of(self, chunk_id: int) -> Hashable | None:
        """What names the index table that holds the chunk (what a lookup reads the index of),
        without I/O: read-ahead opens the tables a scan reaches next before it gets there.
        Default: the chunk's shard (formats with a second index level name its part too)."""
        return self.shard_of(chunk_id)

    @abstractmethod
    def shards(self, within: object = None) -> AsyncIterator[ShardT]:
        """Existing shards in listing order (on sources that cannot list: every candidate).

        `within` narrows them to a part of the directory in the format's own
        terms (a slab of a Zarr shard grid, for its nested chunk directories).
        """

    async def sized_shards(self, within: object = None) -> AsyncIterator[tuple[ShardT, int | None]]:
        """`shards(within)`, each with its stored size in bytes where finding it told it (a listing's
        sizes, a probe's stat), None where it did not: a planned check or export deals shards into
        tasks by their bytes. Default: no sizes."""
        async for shard in self.shards(within):
            yield shard, None

    @abstractmethod
    async def open_shard(self, shard: ShardT) -> Blob | None:
        """The shard's stored object(s) as they are now; None if the shard does not exist.

        DataError when the shard exists but cannot be read as one (half of a
        file pair missing).
        """

    @abstractmethod
    async def read_index(self, shard: ShardT, blob: Blob) -> IndexT:
        """Read and decode the shard's first index level (called once per version of `blob`).

        The result is cached by the core in the first level's cache, so it
        must have a truthful `nbytes`. Validate every range (`ChunkTable.build`):
        a bad entry goes into the table's `bad`, never silently absent; a
        damaged index as a whole is a DataError.
        """

    async def table_for(self, shard: ShardT, blob: Blob, index: IndexT, chunk_id: int) -> ChunkTable | None:
        """The table of the shard's index that would hold `chunk_id` (reading further levels as needed);
        None when the index says the id's table is empty. Default: the index is the table."""
        return cast(ChunkTable, index)

    async def index_tables(self, shard: ShardT, blob: Blob, index: IndexT) -> list[ChunkTable]:
        """Every table of the shard, in listing order. Damaged parts of a multi-level index are
        logged and left out. Default: the index is the one table."""
        return [cast(ChunkTable, index)]

    def placed(self, shard: ShardT, table: ChunkTable) -> np.ndarray:
        """Mask of the table's ids a lookup would find in this very table (the rest belong to
        another shard, or another table of it). Default: `shard_of` of each id."""
        return np.fromiter((self.shard_of(k) == shard for k in table.ids.tolist()), dtype=bool,
                           count=len(table))

    def placed_all(self, shard: ShardT, tables: list[ChunkTable]) -> list[np.ndarray] | None:
        """`placed` of each of a shard's tables; None when every entry of every table is placed
        (the usual case). Stores may answer for all tables at once (one call per shard)."""
        masks = [self.placed(shard, table) for table in tables]
        return None if all(mask.all() for mask in masks) else masks

    def accepts(self, shard: object) -> bool:
        """Whether `shard` is a handle of this store's kind (a task's list of shards, read back from
        DEST, may name anything). Default: any (stores whose handles are not plain numbers say)."""
        return True

    def holds(self, shard: ShardT, within: object) -> bool:
        """Whether `shards(within)` would include `shard` (were it listed): a task given its shards
        by name narrows them as the listing would. Default: `within` narrows nothing."""
        return True

    def token(self, shard: ShardT) -> str:
        """Text naming the shard that is the same in every process (split check/export hash it)."""
        return shard_token(shard)

    def is_shard_file(self, name: str) -> bool:
        """Whether `name` in the directory is one of the store's shard files (hidden from the view)."""
        return False

    def describe(self, chunk_id: int) -> str:
        """How log lines name a chunk."""
        return f"chunk {chunk_id}"

    # -- the core's: final (the type checker refuses an override) -------------------------

    @final
    async def index(self, shard: ShardT) -> tuple[Blob, IndexT] | None:
        """The shard's object and its decoded first index level (cached per object version, one
        read however many ask at once); None if the shard does not exist."""
        blob = await self.open_shard(shard)
        if blob is None:
            return None
        if not self.index_levels:
            return blob, await self.read_index(shard, blob)
        if blob.refused is not None:  # no index of it is read: why, not what its size would mean
            raise DataError(blob.label, f"refused: {blob.refused}")
        index = await self.cached(self.index_levels[0], blob.identity, lambda: self.read_index(shard, blob))
        return blob, index

    @final
    async def locate(self, chunk_id: int) -> tuple[ChunkTable, int] | None:
        """The table holding chunk `chunk_id` and its position there; None if the chunk is absent.

        DataError when the chunk's shard or index is damaged, or the chunk's
        own index entry is (a `bad` entry of its table).
        """
        shard = self.shard_of(chunk_id)
        if shard is None:
            return None
        opened = await self.index(shard)
        if opened is None:
            return None
        table = await self.table_for(shard, opened[0], opened[1], chunk_id)
        if table is None:
            return None
        reason = table.bad.get(chunk_id)
        if reason is not None:
            raise DataError(f"{table.blob.label} {self.describe(chunk_id)}", reason)
        i = table.find(chunk_id)
        return None if i is None else (table, i)

    @final
    async def tables(self, shard: ShardT) -> list[ChunkTable]:
        """The listable entries of one shard, in listing order; [] if the shard is absent.

        Entries a lookup could not find there (ids of another shard or
        table) are left out and logged. DataError if the shard is damaged.
        """
        opened = await self.index(shard)
        if opened is None:
            return []
        out = []
        tables = [table for table in await self.index_tables(shard, *opened) if len(table)]
        masks = self.placed_all(shard, tables)
        if masks is None:
            return tables
        for table, keep in zip(tables, masks):
            if not keep.all():
                log_once(log, f"misplaced:{table.blob.label}:{table.part}", "%s: %d entries belong to another "
                         "shard or index table; not listed", table.blob.label, int((~keep).sum()))
                table = table.where(keep)
                if not len(table):
                    continue
            out.append(table)
        return out

    # -- index reads: cached, de-duplicated, bounded --------------------------------------

    @final
    async def stat_shard(self, path: str, index_size: int, at_end: bool) -> ObjectStat | None:
        """The stat of the one-object shard at `path`. A remote shard's first stat also asks for its
        first index level, `index_size` bytes at its end (`at_end`) or start, in the same request
        where the source can (`StatTail`, `StatHead`: the answer's Content-Range states the size),
        and seeds the fetcher with them for the index read that follows: one round trip instead
        of two. Only the first open asks: a later one (its stat expired) has the index cached, and
        its bytes again would be a download for nothing. Never with a disk cache of indexes (a
        remount finds them there), nor for an index too large to be asked for before the limits
        see it (over SEED_MAX), nor for `index_size` 0."""
        if (not 0 < index_size <= SEED_MAX or not self.source.remote or self.source.index_cache is not None
                or (path in self._indexed and path not in self._indexing)):
            return await self.source.stat(path)
        return await self._indexing.run(path, lambda: self._stat_indexed(path, index_size, at_end))

    async def _stat_indexed(self, path: str, index_size: int, at_end: bool) -> ObjectStat | None:
        if path in self._indexed:
            return await self.source.stat(path)
        self._indexed[path] = True
        st, got = await (stat_and_tail if at_end else stat_and_head)(self.source, path, index_size)
        if st is not None and not st.is_dir and got is not None and len(got) == index_size:
            # The index's bytes (not those of an object shorter than its index): its first read takes them.
            self.fetcher.seed(Extent(self.blob(path, st), st.size - index_size if at_end else 0, index_size), got)
        return st

    def blob(self, path: str, st: ObjectStat) -> Blob:
        """The `Blob` of the object at `path` as `st` describes it, the same one again while the
        source answers with the same ObjectStat (this session's `RecentBlobs`): what `open_shard`
        returns for a one-object shard, revalidated on every lookup."""
        return self.caches.blobs.of(path, st)

    def cache(self, level: IndexLevel) -> BoundedMap[Any, Any]:
        cache = self._caches.get(level.name)
        if cache is None:
            cache = self._caches[level.name] = self.caches.index(level)
        return cache

    @final
    async def cached(self, level: IndexLevel, key: Hashable, load: Callable[[], Awaitable[T]]) -> T:
        """`load()`'s value kept in `level`'s cache under `key` (this store's kind of index), computed
        once however many ask at once."""
        cache = self._caches.get(level.name)
        if cache is None:
            cache = self.cache(level)
        full = (self._kind, key)
        value: T | None = cache.get(full)  # the hot path: a hit takes no flight (nor a call to `cast`)
        if value is not None:
            return value  # what `load` returned for this key
        return await self.flights.fill(cache, full, load)

    def _full(self, key: Hashable) -> tuple[str, Hashable]:
        return self._kind, key  # one cache per level is shared by every store of the mount

    @final
    def held(self, level: IndexLevel, key: Hashable) -> bool:
        """Whether entry `key` of `level` needs no read: cached, or remembered as undecodable."""
        full = self._full(key)
        return full in self.cache(level) or full in self._failed

    @final
    def recall(self, level: IndexLevel, key: Hashable) -> object | None:
        """Entry `key` of `level` from its cache; None when it must be read. DataError (the same one
        again) when it was read and could not be decoded."""
        full = (self._kind, key)
        cache = self._caches.get(level.name)
        if cache is None:
            cache = self.cache(level)
        value: object = cache.get(full)
        if value is not None:
            return value
        failed = self._failed.get(full)
        if failed is not None:
            raise DataError(*failed)
        return None

    @final
    async def cached_batch(self, level: IndexLevel, blob: Blob, batch: Sequence[tuple[Hashable, int, int, str]],
                           decode: Callable[[Hashable, bytes, str], Awaitable[T]],
                           gap: int | None = None,
                           decode_many: DecodeMany[T] | None = None) -> list[T | DataError]:
        """Entries of `level`, those not held read together: `batch` is (key, offset, length, where)
        of each, the first the one wanted, the others best effort. Each entry to read is checked
        against the index limit and the level's budget, all are read from `blob` in one coalesced
        batch (extents closer than `gap` in one request; default: the fetcher's coalescing gap),
        and each is decoded by `decode(key, raw, where)` and kept in the level's cache, or
        remembered as undecodable. One batch runs however many ask for the same first entry at
        once; entries already held are neither read nor decoded again (nor counted as cache hits:
        ask `recall` first for that).

        Returns each entry's value or DataError, in `batch` order; the first entry's DataError
        (limit or decode, now or remembered) is raised instead.

        `decode_many` (optional) decodes several entries at once, each to its value or DataError,
        as `decode` would: a listing reads a shard's many small tables together, and decoding
        them in one go spreads the per-call costs over all of them."""
        cache = self.cache(level)

        def held_now() -> list[T | DataError | None]:
            out: list[T | DataError | None] = []
            for i, (key, _, _, _) in enumerate(batch):
                full = self._full(key)
                failed = self._failed.get(full)
                if failed is not None and i == 0:
                    raise DataError(*failed)
                out.append(cache[full] if full in cache else None if failed is None else DataError(*failed))
            return out

        async def load() -> list[T | DataError]:
            out = held_now()
            for i, (_, _, length, where) in enumerate(batch):
                if out[i] is not None:
                    continue
                try:
                    self.check_index(length, where, level)
                except DataError as e:
                    if i == 0:
                        raise
                    out[i] = e  # the others are best effort: this one is reported when wanted itself
            readable = [i for i, got in enumerate(out) if got is None]
            raws = await self.fetcher.read_many([Extent(blob, batch[i][1], batch[i][2]) for i in readable],
                                                index=True, max_gap=gap) if readable else []
            decoded: list[T | DataError] | None = None
            if decode_many is not None and len(readable) > 1:
                decoded = await decode_many([(batch[i][0], raw, batch[i][3]) for i, raw in zip(readable, raws)])
            for n, (i, raw) in enumerate(zip(readable, raws)):
                key, _, _, where = batch[i]
                try:
                    if decoded is None:
                        value = await decode(key, raw, where)
                    elif isinstance(decoded[n], DataError):
                        raise cast(DataError, decoded[n])
                    else:
                        value = cast(T, decoded[n])
                except DataError as e:
                    self._failed[self._full(key)] = (e.where, e.reason)
                    if i == 0:
                        raise
                    out[i] = e
                    continue
                cache[self._full(key)] = value
                out[i] = value
            return cast("list[T | DataError]", out)

        return await self.flights.run(("batch", level.name, self._full(batch[0][0])), load)

    def check_index(self, size: int, where: str, level: IndexLevel | None = None) -> None:
        """DataError for an index of `size` bytes beyond the limit or, with `level`, beyond the budget
        of the level's cache (one larger would be read again on every use)."""
        self.limits.check_index(size, where, cache=None if level is None else int(self.cache(level).maxsize))

    @final
    async def read_index_bytes(self, blob: Blob, offset: int, size: int, where: str | None = None,
                               level: IndexLevel | None = None) -> bytes:
        """`size` bytes of index at `offset` of `blob`, checked by `check_index` before they are read."""
        self.check_index(size, where or blob.label, level)
        return await self.fetcher.read(Extent(blob, offset, size), index=True)
