"""Chunk files of one sharded directory: lookup, listing, reading, all format-neutral.

A `ChunkContext` holds what every chunk file of a directory shares: the
format's store and naming, the payload codec, the mount's fetcher and
caches, and the read-ahead scope. A `ChunkFile` is then just an extent, a
id and a size. Lookups locate one id; listings stream the store's tables
shard by shard (reading upcoming shards' indexes concurrently) with one
damage policy: a damaged shard or entry is logged once and skipped, the
rest is listed.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from typing import Any, AsyncIterator, Callable, Hashable, Literal, cast

import numpy as np

from unshardfs.core.blob import Blob
from unshardfs.core.caches import Caches
from unshardfs.core.codecs import Codec
from unshardfs.core.fetch import Extent
from unshardfs.core.geometry import Geometry
from unshardfs.core.nameorder import NameOrder
from unshardfs.core.naming import Naming
from unshardfs.core.policy import POLICY
from unshardfs.core.readahead import ScanScope
from unshardfs.core.scan import DeclaredScan
from unshardfs.core.store import Shard, ShardedStore
from unshardfs.core.table import ChunkTable, int_list
from unshardfs.tree.nodes import EntryBatch, FdRange, FileNode, Node, StoredRange, Verdict
from unshardfs.util.decompress import off_loop
from unshardfs.util.errors import DataError
from unshardfs.util.logonce import log_once

log = logging.getLogger(__name__)

WHOLE_READ_MAX = POLICY.whole_read_max
LIST_BATCH = POLICY.list_batch


class ChunkFile(FileNode):
    """Bytes of one stored chunk, decoded by its directory's codec."""

    __slots__ = ("ctx", "blob", "start", "length", "chunk_id", "extra")

    def __init__(self, ctx: "ChunkContext", blob: Blob, start: int, length: int, chunk_id: int, size: int,
                 child_id: int | None, extra: int = 0) -> None:
        # Slots set directly (no super().__init__ chain): listings may build
        # millions of these.
        self.mtime_ns = blob.mtime_ns
        self.child_id = child_id
        self.size = size
        self.ctx = ctx
        self.blob = blob
        self.start = start
        self.length = length
        self.chunk_id = chunk_id
        self.extra = extra

    @property
    def extent(self) -> Extent:
        return Extent(self.blob, self.start, self.length)

    @property
    def where(self) -> str:
        return f"{self.blob.label} {self.ctx.store.describe(self.chunk_id)}"

    async def read(self, offset: int, size: int) -> bytes:
        size = self.span(offset, size)
        if not size:
            return b""
        ctx = self.ctx
        if ctx.direct:
            # Local shards, stored bytes: one pread (no extent, batch or read-ahead).
            return await ctx.fetcher.read_direct(self.blob, self.start + offset, size)
        if offset == 0 and ctx.scope is not None:
            ctx.scope.note(self.chunk_id)
        if ctx.codec.transparent:
            if ctx.whole_reads and self.length <= WHOLE_READ_MAX:
                return (await ctx.payload(self))[offset:offset + size]
            return await ctx.fetcher.read(Extent(self.blob, self.start + offset, size))
        return (await ctx.decoded(self))[offset:offset + size]

    def read_now(self, offset: int, size: int) -> bytes | bytearray | None:
        if offset >= self.size or size <= 0 or not self.ctx.direct:  # (`span`, inline)
            return None
        return self.ctx.fetcher.read_now(self.blob, self.start + offset, min(size, self.size - offset))

    def cached_range(self, offset: int, size: int) -> FdRange | None:
        size = self.span(offset, size)
        if not size or not self.ctx.direct:
            return None
        return self.ctx.fetcher.cached_direct(self.blob, self.start + offset, size)

    def content_version(self) -> tuple[object, ...]:
        return (self.blob.version, self.start, self.length)

    def stored_range(self) -> StoredRange | str:
        """Where the file's bytes lie in its shard, when its codec leaves them as stored (`StoredBytes`)."""
        if self.blob.refused is not None:  # a reader elsewhere must not be sent where the mount would not go
            return f"its shard is refused: {self.blob.refused}"
        codec = self.ctx.codec
        piece = codec.stored_slice(self.length)
        if piece is None:
            return f"its chunks are stored {codec.label}-encoded: a reader would get them undecoded"
        skip, keep = piece
        if keep != self.size:
            return f"a chunk's stored slice ({keep:,} bytes) is not its file ({self.size:,} bytes)"
        offset = self.start + skip
        base = 0
        for path, size, version in self.blob.parts:
            if base <= offset and offset + keep <= base + size:
                return StoredRange(self.ctx.store.source, path, offset - base, keep, version)
            base += size
        return f"a chunk spans two stored objects ({self.blob.label})"

    def xattrs(self) -> dict[str, bytes]:
        return {
            "user.unshardfs.source": self.blob.label.encode(),
            "user.unshardfs.offset": str(self.start).encode(),
            "user.unshardfs.length": str(self.length).encode(),
            "user.unshardfs.encoding": self.ctx.codec.label.encode(),
            "user.unshardfs.chunk_id": str(self.chunk_id).encode(),
        }


class ChunkContext:
    """What the chunk files of one sharded directory share: a format's store, naming, codec and
    geometry, and the mount's fetcher, caches and read-ahead scope.

    Formats build one per directory and hand it to `ShardedDir`; lookups
    (`lookup`, `file`), streamed listings (`listing`) and reads are then the
    core's. Lookups return None for an absent chunk and raise DataError for
    a damaged one; listings log damage once and leave the damaged part out.
    """

    def __init__(self, store: ShardedStore[Any, Any], naming: Naming, codec: Codec, geometry: Geometry | None = None,
                 read_ahead: bool = True) -> None:
        self.store = store
        self.naming = naming
        self.codec = codec
        self.geometry = geometry or Geometry(store.limits.payload_bytes)
        self.fetcher = store.fetcher
        self.caches: Caches = store.caches
        self.whole_reads = store.source.remote
        self.scope: ScanScope | None = None
        self.lookups: ScanScope | None = None  # the scope of lookups by name, beside that of reads
        if read_ahead and self.fetcher.policy.read_ahead:
            self.scope = ScanScope(self)
            self.lookups = self.scope.of_lookups()
        # Reads of a chunk's stored bytes go straight to the source (see Fetcher.direct).
        self.direct = self.fetcher.direct and codec.transparent and self.scope is None
        self._name_order: NameOrder | None = None  # built when read-ahead first asks
        self._name_order_built = False
        self._declared: _Declared | None = None  # the last `will_read_all`

    # -- what read-ahead sees (readahead.ScanTarget) --------------------------------------

    @property
    def dense(self) -> bool:
        return self.naming.dense

    @property
    def name_order(self) -> NameOrder | None:
        """The string order of the names (None: not known without a listing)."""
        if not self._name_order_built:
            self._name_order, self._name_order_built = self.naming.order(), True
        return self._name_order

    async def locate(self, chunk_id: int) -> tuple[ChunkTable, int] | None:
        if not self._in_scope(chunk_id):
            return None  # a planned task's read-ahead stays within its own shards
        return await self.store.locate(chunk_id)

    def table_of(self, chunk_id: int) -> Hashable | None:
        if not self._in_scope(chunk_id):
            return None
        return self.store.table_of(chunk_id)

    def _in_scope(self, chunk_id: int) -> bool:
        """Whether the chunk's shard is one this source may read ahead in: any, except in a planned
        task, which reads its own shards only (another task reads the others)."""
        scope = self.store.runtime.shard_scope
        return scope is None or scope.planning or scope.holds(self.store.label, self.store.shard_of(chunk_id))

    def has_payload(self, ext: Extent) -> bool:
        return ext.key in self.caches.encoded_chunk

    def with_naming(self, naming: Naming) -> "ChunkContext":
        """The same chunks under other names (one level of nested chunk directories);
        read-ahead sees them as one directory."""
        other = copy.copy(self)
        other.naming = naming
        return other

    # -- files -------------------------------------------------------------------------

    async def lookup(self, name: str) -> Node | None | Literal[Verdict.PASS]:
        """The chunk file called `name`: Verdict.PASS if the name is not of the computed form."""
        chunk_id = self.naming.parse(name)  # a name it parses is one it claims (`Naming.parse`)
        if chunk_id is None:
            return None if self.naming.claims(name) else Verdict.PASS
        return await self.file(chunk_id)

    def make(self, table: ChunkTable, i: int, size: int, child_id: int | None) -> ChunkFile:
        # `item`: Python ints straight from the arrays (no numpy scalar per field).
        extra = 0 if table.extra is None else table.extra.item(i)
        return ChunkFile(self, table.blob, table.starts.item(i), table.lengths.item(i), table.ids.item(i), size,
                         child_id, extra)

    async def file(self, chunk_id: int, prefetch: bool = True) -> ChunkFile | None:
        """The file of chunk `chunk_id`, or None if the chunk is absent (DataError if damaged).

        With `prefetch` (a lookup by name, likely followed by a read), a
        small payload whose size needs its trailer is fetched whole, so the
        read that follows costs no further request.
        """
        if prefetch and self.lookups is not None:
            self.lookups.note(chunk_id)  # before its table is read: a scan's next tables come along
        found = await self.store.locate(chunk_id)
        if found is None:
            return None
        table, i = found
        length = table.lengths.item(i)
        exact, cap = self.geometry.sizes_one(chunk_id)
        try:
            # The chunk is named only when it fails (a call and a format per lookup otherwise).
            size = self.codec.size(length, exact, cap, "")
        except DataError as e:
            raise DataError(self._where(table, i), e.reason) from None
        if size is None:
            where = self._where(table, i)
            ext = Extent(table.blob, int(table.starts[i]), length)
            if prefetch and self.whole_reads and length <= WHOLE_READ_MAX:
                payload = await self.payload_of(ext)
                trailer = payload[-self.codec.trailer:]
            else:
                trailer = await self.fetcher.read(Extent(table.blob, ext.end - self.codec.trailer, self.codec.trailer))
            size = self.codec.size_from_trailer(trailer, cap, where)
        extra = 0 if table.extra is None else table.extra.item(i)  # (`make`, inline: every lookup)
        return ChunkFile(self, table.blob, table.starts.item(i), length, chunk_id, size, self.naming.child_id(chunk_id),
                         extra)

    async def payload_of(self, ext: Extent) -> bytes:
        """A payload fetched whole (once, however many ask) and kept in the encoded-chunk cache."""
        # A scan's next chunk is waiting in the prefetch cache: taken without the flight and
        # batch machinery (a fifth of its cost), on the hot path of every prefetched read.
        hit = self.fetcher.take_prefetched(ext)
        if hit is not None:
            self.caches.encoded_chunk[ext.key] = hit
            return hit
        return await self.fetcher.flights.cached(self.caches.encoded_chunk, ext.key, lambda: self.fetcher.read(ext))

    async def payload(self, f: ChunkFile) -> bytes:
        return await self.payload_of(f.extent)

    async def warm(self, files: list[ChunkFile]) -> None:
        """Fetch the payloads of many small files in one batch (coalesced, concurrent), for a
        listing that must read them all; failures are left for each file's own read to report."""
        extents = [f.extent for f in files if f.extent.key not in self.caches.encoded_chunk]
        try:
            payloads = await self.fetcher.read_many(extents)
        except DataError:
            return
        for ext, payload in zip(extents, payloads):
            self.caches.encoded_chunk[ext.key] = payload

    async def content(self, f: ChunkFile) -> bytes:
        """The file's whole content (small files: manifests, metadata records)."""
        return await self.payload(f) if self.codec.transparent else await self.decoded(f)

    async def decoded(self, f: ChunkFile) -> bytes:
        """The file's whole content, decoded once and kept in the decoded-chunk cache."""
        ext = f.extent

        async def decode() -> bytes:
            prepared = await self.codec.prepare(f)
            payload = self.caches.encoded_chunk.pop(ext.key, None)
            if payload is None:
                payload = await self.fetcher.read(ext)
            return await off_loop(lambda: self.codec.decode(payload, f, prepared), len(payload))

        # Several chunks may share one stored extent (rows of one Arrow record
        # batch): the id and row are part of what identifies the bytes.
        return await self.fetcher.flights.cached(
            self.caches.decoded_chunk, (ext.key, f.chunk_id, f.extra, self.codec.label, f.size), decode)

    # -- declared scans ----------------------------------------------------------------

    def will_read_all(self, within: object = None, select: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """The caller will read every chunk file of the directory (those `within`/`select` pick
        out, as `listing`), whole: declare them, shard by shard in listing order, to a
        `DeclaredScan` (each shard's index, then its chunks in large reads, at most half the
        prefetch budget ahead of the reader). A background task declares the shards ahead of the
        listing; the listing declares each shard it reaches first itself, before it yields its
        files, so the reader's first read joins the scan's. Nothing on local shards."""
        if not self.fetcher.can_prefetch or (self._declared is not None and self._declared.whole):
            return
        scope = self.store.runtime.shard_scope
        if scope is not None and scope.planning:
            return  # planning a split run: nothing is read
        encoded = self.caches.encoded_chunk
        declared = self._declared = _Declared(DeclaredScan(self.fetcher, skip=lambda ext: ext.key in encoded),
                                              within, select)
        self.fetcher.spawn(self._declare_ahead, declared)

    async def _declare_ahead(self, declared: "_Declared") -> None:
        async for shard, tables in self.shard_tables(declared.within):
            if self._declared is not declared:
                return  # another declaration took over
            await declared.scan.room()
            declared.add(self.store.token(shard), tables)

    # -- listings ----------------------------------------------------------------------
    # -- listings ----------------------------------------------------------------------

    async def shard_tables(self, within: object = None) -> AsyncIterator[tuple[Shard, list[ChunkTable]]]:
        """Every readable shard's tables in order; damaged shards logged and skipped.

        On a remote source the indexes of the next shards are read in the
        background while this one is listed, so a directory of N shards
        costs a few round trips, not N (bounded by the fetcher's
        concurrency). This is not read-ahead of chunks: the listing needs
        every one of these indexes, so `--no-read-ahead` keeps it.
        """
        store = self.store
        ahead: deque[Shard] = deque()
        window = max(1, self.fetcher.policy.concurrency) if self.fetcher.background and store.source.remote else 0
        scope = store.runtime.shard_scope
        if scope is not None and scope.planning:
            async for shard, size in store.sized_shards(within):
                scope.record(store.label, store.token(shard), shard, size)
            return
        shards = (store.shards(within) if scope is None else _given(store, scope.given(store.label), within)).__aiter__()
        exhausted = False
        while True:
            while not exhausted and len(ahead) <= window:
                try:
                    shard = await shards.__anext__()
                except StopAsyncIteration:
                    exhausted = True
                    break
                ahead.append(shard)
                if window and len(ahead) > 1:
                    self.fetcher.spawn(self._warm, shard)
            if not ahead:
                return
            shard = ahead.popleft()
            try:
                tables = await self._tables(shard)
            except DataError as e:
                log_once(log, f"list:{e}", "listing %s: skipping shard: %s", store.label, e)
                continue
            yield shard, tables

    async def _warm(self, shard: Shard) -> None:
        try:
            await self._tables(shard)
        except DataError:
            pass  # reported when the listing reaches it

    async def _tables(self, shard: Shard) -> list[ChunkTable]:
        """The shard's tables, read once when the listing reaches a shard its look-ahead is
        still reading (else both would send the shard's HEAD and index reads)."""
        return await self.fetcher.flights.run(("tables", id(self.store), shard), lambda: self.store.tables(shard))

    async def listing(self, select: Callable[[np.ndarray], np.ndarray] | None = None,
                      within: object = None) -> AsyncIterator[EntryBatch]:
        """The directory's chunk files in batches of about LIST_BATCH, shard by shard.

        `select(ids) -> mask` keeps a subset of the shards `within` gives
        (nested Zarr chunk directories).
        """
        pending: list[ChunkTable] = []
        count = 0
        async for shard, tables in self.shard_tables(within):
            if self._declared is not None:
                self._declared.add(self.store.token(shard), tables)
            for table in tables:
                if select is not None and len(table):
                    table = table.where(select(table.ids))
                if not len(table):
                    continue
                pending.append(table)
                count += len(table)
                if count >= LIST_BATCH:
                    batch = await self._batch(pending)
                    pending, count = [], 0
                    if batch is not None:
                        yield batch
            if pending:
                batch = await self._batch(pending)
                pending, count = [], 0
                if batch is not None:
                    yield batch

    async def _batch(self, tables: list[ChunkTable]) -> EntryBatch | None:
        try:
            return await self._build_batch(tables)
        except DataError as e:  # e.g. payload trailers of a shard that is cut short
            log_once(log, f"list:{e}", "listing %s: skipping %d chunks: %s", self.store.label,
                     sum(map(len, tables)), e)
            return None

    async def _build_batch(self, tables: list[ChunkTable]) -> EntryBatch | None:
        if self.scope is not None:
            self.scope.tables_read(tables)
        table = tables[0] if len(tables) == 1 else _concat(tables)
        where = f"listing {self.store.label}"
        names = self.naming.names(table.ids)
        keep = (np.ones(len(names), dtype=bool) if None not in names
                else np.array([n is not None for n in names], dtype=bool))
        sizes, ok = await self._sizes(table, where)
        keep &= ok
        if not keep.all():
            table = table.where(keep)
            if sizes is not None:
                sizes = sizes[keep]
            names = [n for n, k in zip(names, keep.tolist()) if k]
        if not len(table):
            return None
        if self.scope is not None:
            self.scope.listed(table, tables)
        # Entries without a name were dropped above.
        return ChunkBatch(self, table, cast(list[str], names), int_list(sizes), self.naming.child_ids(table.ids))

    async def _sizes(self, table: ChunkTable, where: str) -> tuple[np.ndarray, np.ndarray]:
        """File sizes of a table's entries and which entries can be listed at all."""
        codec = self.codec
        exact, cap = self.geometry.exact(table.ids), self.geometry.cap(table.ids)
        sizes, ok = codec.sizes(table.lengths, exact, cap)
        if not ok.all():
            for i in np.nonzero(~ok)[0][:20].tolist():
                try:
                    codec.size(int(table.lengths[i]), None if exact is None else int(exact[i]), int(cap[i]),
                               self._where(table, i))
                except DataError as e:
                    log_once(log, f"list:{e}", "%s: skipping %s", where, e)
        if sizes is not None:
            return sizes, ok
        # The codec needs each payload's trailer: read them as one batch
        # (coalesced where payloads are small, concurrent otherwise).
        sizes = np.zeros(len(table), dtype=np.int64)
        need = np.nonzero(ok)[0].tolist()
        t = codec.trailer
        ends = (table.starts + table.lengths).tolist()
        trailers = await self.fetcher.read_many([Extent(table.blob, ends[i] - t, t) for i in need])
        for i, trailer in zip(need, trailers):
            try:
                sizes[i] = codec.size_from_trailer(trailer, int(cap[i]), self._where(table, i))
            except DataError as e:
                log_once(log, f"list:{e}", "%s: skipping %s", where, e)
                ok[i] = False
        return sizes, ok

    def _where(self, table: ChunkTable, i: int) -> str:
        return f"{table.blob.label} {self.store.describe(int(table.ids[i]))}"


class _Declared:
    """A `will_read_all` under way: its scan, what picks its chunks, and the shards queued."""

    def __init__(self, scan: DeclaredScan, within: object, select: Callable[[np.ndarray], np.ndarray] | None) -> None:
        self.scan = scan
        self.within = within
        self.select = select
        self.whole = within is None and select is None
        # The reader of a declared scan reads each chunk whole, however large (a walk reads files up
        # to its piece size in one read), so large chunks are declared too, up to a quarter of what
        # the scan keeps ahead: several stay in flight at once. Larger ones are read on demand.
        self.largest = scan.ahead // 4
        self._queued: set[str] = set()

    def add(self, token: str, tables: list[ChunkTable]) -> None:
        """Queue the chunks of one shard (once), in their order in the shard."""
        if token in self._queued:
            return
        self._queued.add(token)
        extents: list[Extent] = []
        for table in tables:
            if self.select is not None and len(table):
                table = table.where(self.select(table.ids))
            blob = table.blob
            extents += [Extent(blob, start, length) for start, length in
                        zip(table.starts.tolist(), table.lengths.tolist()) if length <= self.largest]
        extents.sort(key=lambda ext: ext.start)
        self.scan.queue(extents)


async def _given(store: ShardedStore[Any, Any], shards: tuple[Shard, ...], within: object) -> AsyncIterator[Shard]:
    """The shards a task was given, those `within` only: no listing of the directory. A name that
    cannot be one of the store's shards (a task list garbled in DEST) is logged and skipped."""
    for shard in shards:
        if not store.accepts(shard):
            log_once(log, f"given:{store.label}:{shard!r:.100}", "listing %s: the task names shard %.100r, which "
                     "this store cannot have; skipped", store.label, shard)
        elif store.holds(shard, within):
            yield shard


class ChunkBatch(EntryBatch):
    """A listing batch of chunk files; nodes are built only when someone asks for one."""

    __slots__ = ("ctx", "table")

    def __init__(self, ctx: ChunkContext, table: ChunkTable, names: list[str], sizes: list[int],
                 child_ids: list[int | None]) -> None:
        super().__init__(names, sizes, child_ids, table.blob.mtime_ns)
        self.ctx = ctx
        self.table = table

    def node(self, i: int) -> ChunkFile:
        return self.ctx.make(self.table, i, self.sizes[i], self.child_ids[i])


def _concat(tables: list[ChunkTable]) -> ChunkTable:
    """Tables of one shard as one (listing order kept; not for lookups)."""
    extra = None if tables[0].extra is None else np.concatenate([t.extra for t in tables if t.extra is not None])
    return ChunkTable(tables[0].blob, np.concatenate([t.ids for t in tables]),
                      np.concatenate([t.starts for t in tables]), np.concatenate([t.lengths for t in tables]),
                      {}, extra)
