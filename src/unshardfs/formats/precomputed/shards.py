"""The chunks of one `neuroglancer_uint64_sharded_v1` directory: shards, indexes, locations.

A shard is `<name>.shard` (or the obsolete `<name>.index` + `<name>.data`
pair, read as their concatenation); its fixed-size shard index gives the
byte range of each minishard index; a minishard index lists chunk ids with
their byte ranges. Every range is validated before use (see
`ChunkTable.build`), and sizes declared by the spec are bounded before
anything is read.
"""

from __future__ import annotations

import functools
import logging
from typing import AsyncIterator, Hashable, cast

import numpy as np

from unshardfs.core.blob import Blob, Identity
from unshardfs.core.caches import SHARD_INDEX
from unshardfs.core.runtime import Runtime
from unshardfs.core.store import ShardedStore
from unshardfs.core.table import ChunkTable
from unshardfs.sources.base import join_path
from unshardfs.util.concurrency import gather
from unshardfs.util.decompress import gunzip, gunzip_cost, off_loop
from unshardfs.util.errors import DataError
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap
from unshardfs.volume.sharding import MINISHARD_INDEX, ShardingSpec

log = logging.getLogger(__name__)

U64 = np.uint64
PROBE_BATCH = 256  # shard existence probes in flight at once, on sources that cannot list
# On a source that cannot list, shards are found by probing every number;
# beyond this many candidates a listing is refused (lookups still work).
PROBE_MAX = 1 << 16
# A lookup that must read a minishard index also reads the indexes of
# neighbouring minishards when they lie within this span (one request
# instead of one per later lookup in the same shard).
INDEX_READ_AHEAD = 256 << 10
SHARD_PATHS = 1 << 12  # shard paths remembered (the one set longest ago forgotten past this)
# On a local source, the second lookup that reads a minishard index of a shard reads the rest
# of the shard's minishard indexes too, at most this many stored bytes of them (`_scan_rest`).
SCAN_INDEX_BYTES = 64 << 10
SCANNED_SHARDS = 1 << 12  # shards whose minishard reads by lookups are counted (oldest forgotten past this)


def decode_minishard(raw: bytes, blob: Blob, base: int, where: str, part: int = 0) -> ChunkTable:
    """The [3, n] delta-encoded uint64 array of a minishard index as a validated table."""
    if len(raw) % 24:
        raise DataError(where, f"minishard index length {len(raw)} is not a multiple of 24")
    n = len(raw) // 24
    if n == 0:
        return ChunkTable.empty(blob, part)
    arr = np.frombuffer(raw, dtype="<u8").reshape(3, n).astype(U64)
    # The format's arithmetic is modulo 2**64 (numpy's uint64 cumsum wraps
    # silently); `build` rejects whatever lands outside the shard data.
    ids = np.cumsum(arr[0], dtype=U64)
    sizes = arr[2].copy()  # a copy: a view would keep the whole array alive behind the cache's accounting
    ends = U64(base) + np.cumsum(arr[1] + sizes, dtype=U64)
    table = ChunkTable.build(blob, ids, ends - sizes, sizes, base, blob.size, part=part)
    if len(table) + len(table.bad) < n:
        log_once(log, f"dup:{where}", "%s: minishard index lists %d duplicate chunk ids; using the first of each",
                 where, n - len(table) - len(table.bad))
    return table


def decode_minishards(raws: list[bytes], blob: Blob, base: int, wheres: list[str],
                      parts: list[int]) -> list[ChunkTable | DataError]:
    """`decode_minishard` of many minishard indexes of one shard at once, with the same tables
    as one by one: the delta decoding and validation of all their entries run as one set of
    array operations (a listing decodes every minishard, often of a few dozen entries each,
    where numpy's per-call costs were most of the work). Those that are empty, malformed or
    not clean (a range outside the data, ids out of order) are decoded one by one, which
    reports them."""
    out: list[ChunkTable | DataError | None] = [None] * len(raws)
    clean = [i for i, raw in enumerate(raws) if raw and len(raw) % 24 == 0]
    if clean:
        counts = np.array([len(raws[i]) // 24 for i in clean], dtype=np.int64)
        words = np.frombuffer(b"".join([raws[i] for i in clean]), dtype="<u8").astype(U64)
        first = np.cumsum(counts) - counts  # each minishard's first entry
        # Entry e of minishard j: its id delta at word 3*first[j] + (e - first[j]), its offset
        # delta counts[j] words later, its size 2*counts[j] words later.
        per_entry = np.repeat(counts, counts)
        id_at = np.arange(int(counts.sum())) + np.repeat(2 * first, counts)
        sizes = words[id_at + 2 * per_entry]
        ids = _segment_cumsum(words[id_at], first, counts)
        ends = U64(base) + _segment_cumsum(words[id_at + per_entry] + sizes, first, counts)
        starts = ends - sizes
        inside = (ends >= starts) & (starts >= U64(max(base, 0))) & (ends <= U64(max(blob.size, 0)))
        fine = inside.copy()
        fine[1:] &= ids[1:] > ids[:-1]
        fine[first] = inside[first]  # a minishard's first id follows no other
        all_fine = np.logical_and.reduceat(fine, first).tolist()
        for j, i in enumerate(clean):
            if all_fine[j]:
                a, b = int(first[j]), int(first[j] + counts[j])
                # Copies: views would keep the whole batch alive behind the cache's accounting.
                out[i] = ChunkTable(blob, ids[a:b].copy(), starts[a:b].copy(), sizes[a:b].copy(), {}, None, parts[i])
    for i, table in enumerate(out):
        if table is None:
            try:
                out[i] = decode_minishard(raws[i], blob, base, wheres[i], parts[i])
            except DataError as e:
                out[i] = e
    return cast("list[ChunkTable | DataError]", out)


def _segment_cumsum(values: np.ndarray, first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Running sums restarting at each segment (modulo 2**64, as the format's arithmetic is)."""
    sums = np.cumsum(values, dtype=U64)
    before = np.zeros(len(first), dtype=U64)
    before[1:] = sums[first[1:] - 1]
    return sums - np.repeat(before, counts)


class PrecomputedStore(ShardedStore[int, np.ndarray]):
    """A shard number's shard index (an array of minishard index ranges), then its minishards."""

    index_levels = (SHARD_INDEX, MINISHARD_INDEX)

    def __init__(self, runtime: Runtime, dir_path: str, spec: ShardingSpec) -> None:
        super().__init__(runtime, dir_path)
        self.dir_path = dir_path
        self.spec = spec
        self.index_size = spec.shard_index_size
        self._last_location: tuple[int, tuple[int, int]] = (-1, (0, 0))
        # shard number -> its `.shard` path (every lookup asks)
        self._shard_paths: BoundedMap[int, str] = BoundedMap(SHARD_PATHS, lru=False, counted=False)
        # minishard reads by lookups per shard version (`_scan_rest`)
        self._index_loads: BoundedMap[Identity, int] = BoundedMap(SCANNED_SHARDS, lru=False, counted=False)

    # -- shard files -------------------------------------------------------------------

    async def open_shard(self, number: int) -> Blob | None:
        """The shard's current backing files, or None if the shard does not exist."""
        path = self._shard_paths.get(number)
        if path is None:
            path = self._shard_paths[number] = join_path(self.dir_path, self.spec.shard_name(number)) + ".shard"
        st = await self.stat_shard(path, self.index_size, at_end=False)  # its index is its first bytes
        if st is not None and not st.is_dir:
            return self.blob(path, st)
        stem = path[:-len(".shard")]
        index_st = await self.source.stat(stem + ".index")
        if index_st is None or index_st.is_dir:
            return None
        if index_st.refused is not None:
            raise DataError(stem + ".index", f"refused: {index_st.refused}")
        if index_st.size != self.index_size:
            raise DataError(stem + ".index", f"obsolete-layout shard index has {index_st.size:,} bytes; the spec "
                                             f"says {self.index_size:,}")
        data_st = await self.source.stat(stem + ".data")
        if data_st is None or data_st.is_dir:
            raise DataError(stem + ".index", "obsolete-layout shard has no .data file")
        return Blob(((stem + ".index", index_st.size, index_st.version), (stem + ".data", data_st.size,
                     data_st.version)), index_st.size + data_st.size, max(index_st.mtime_ns, data_st.mtime_ns),
                    data_st.refused)

    def shard_file(self, name: str) -> tuple[int, str] | None:
        """(shard number, extension) if `name` is a shard file of this spec, else None."""
        stem, dot, ext = name.rpartition(".")
        if not dot or ext not in ("shard", "index", "data"):
            return None
        number = self.spec.parse_shard_name(stem)
        return None if number is None else (number, ext)

    def is_shard_file(self, name: str) -> bool:
        return self.shard_file(name) is not None

    def accepts(self, shard: object) -> bool:
        return isinstance(shard, int) and not isinstance(shard, bool) and 0 <= shard < 1 << self.spec.shard_bits

    async def shards(self, within: object = None) -> AsyncIterator[int]:
        """Existing shards in ascending order, found by listing the directory
        (or, on a source that cannot list, by probing every shard number)."""
        async for number, _ in self.sized_shards(within):
            yield number

    async def sized_shards(self, within: object = None) -> AsyncIterator[tuple[int, int | None]]:
        """`shards` with the bytes of each (its `.shard`, or `.index` and `.data` together): from the
        listing, or from each probe's stat."""
        if not self.source.listable:
            total = 1 << self.spec.shard_bits
            if total > PROBE_MAX:
                log_once(log, f"probe:{self.dir_path}", "listing %s: %d possible shards on a source that cannot "
                         "list; not listed (lookups by name work)", self.label, total)
                return
            for at in range(0, total, PROBE_BATCH):
                numbers = range(at, min(at + PROBE_BATCH, total))
                found = await gather([functools.partial(self._exists, n) for n in numbers], limit=PROBE_BATCH)
                for n, there in zip(numbers, found):
                    if there is not False:
                        yield n, there
            return
        listed: dict[int, int] = {}
        paired: set[int] = set()
        async for name, st in self.source.list(self.dir_path):
            parsed = None if st.is_dir else self.shard_file(name)
            if parsed is None:
                continue
            number, ext = parsed
            listed[number] = listed.get(number, 0) + st.size
            if ext != "data":  # a .data alone is not a shard
                paired.add(number)
        for number in sorted(paired):
            yield number, listed[number]

    async def _exists(self, number: int) -> int | None | bool:
        """The shard's bytes if it exists (None: there, but damaged, and listing will report it);
        False if it does not."""
        try:
            blob = await self.open_shard(number)
        except DataError:
            return None
        return False if blob is None else blob.size

    # -- indexes ------------------------------------------------------------------------

    async def read_index(self, shard: int, blob: Blob) -> np.ndarray:
        """The (2**minishard_bits, 2) array of minishard index ranges (relative to the data area)."""
        size = self.index_size
        if blob.size < size:
            raise DataError(blob.label, f"file has {blob.size:,} bytes, shorter than its {size:,}-byte "
                                        "shard index")
        raw = await self.read_index_bytes(blob, 0, size, level=SHARD_INDEX)
        return np.frombuffer(raw, dtype="<u8").reshape(-1, 2).astype(U64)

    def _range(self, index: np.ndarray, blob: Blob, m: int) -> tuple[int, int]:
        """Absolute byte range of minishard `m`'s index, validated."""
        start, end = int(index[m, 0]), int(index[m, 1])
        if start > end or self.index_size + end > blob.size:
            raise DataError(f"{blob.label} minishard {m}", f"minishard index range [{start}, {end}) lies outside "
                            f"the file ({blob.size:,} bytes)")
        return self.index_size + start, end - start

    async def minishard(self, blob: Blob, index: np.ndarray, m: int) -> ChunkTable:
        cached = cast("ChunkTable | None", self.recall(MINISHARD_INDEX, (blob.identity, m)))
        if cached is not None:
            return cached
        if not self.source.remote:
            # Local: one read per index (they lie apart, each after its minishard's chunks); a
            # shard being scanned has the rest of its small ones read and decoded together.
            return cast(ChunkTable, (await self._load(blob, index, [m, *self._scan_rest(blob, index, m)]))[0])
        wanted = [m]
        # Index read-ahead: neighbours whose indexes lie close by come
        # along in the same request (later lookups in this shard are free).
        start, length = self._range(index, blob, m)
        for other in np.nonzero(index[:, 0] != index[:, 1])[0].tolist():
            if other == m or self.held(MINISHARD_INDEX, (blob.identity, other)):
                continue
            try:
                o_start, o_len = self._range(index, blob, other)
            except DataError:
                continue
            if abs(o_start - start) <= INDEX_READ_AHEAD and o_len <= INDEX_READ_AHEAD:
                wanted.append(other)
        # The neighbours were chosen to lie within INDEX_READ_AHEAD: one ranged
        # read covers them all (the payload bytes between them are the price of
        # saving a round trip per later lookup).
        return cast(ChunkTable, (await self._load(blob, index, wanted, gap=INDEX_READ_AHEAD))[0])

    def _scan_rest(self, blob: Blob, index: np.ndarray, m: int) -> list[int]:
        """The shard's other minishards to read with `m` on a local source: none for the first
        lookup that reads one of the shard's minishard indexes (a lookup here and there costs
        one index read each); from the second on, the shard is being scanned, and the rest of
        its non-empty minishard indexes not held yet come along, as many as fit within
        SCAN_INDEX_BYTES. Each index read and decoded alone costs ~100 us of Python (reads,
        gunzip, a dozen numpy calls), about as much as the chunks of a small minishard cost
        to serve; together, their entries are decoded at once (`decode_minishards`)."""
        loads = self._index_loads
        seen = loads.get(blob.identity, 0)
        if not seen:
            loads[blob.identity] = 1
            return []
        if seen > 1:
            return []  # scanned already: what is still missing did not fit, or failed
        loads[blob.identity] = 2
        lengths = index[:, 1] - index[:, 0]
        numbers = np.nonzero((index[:, 0] < index[:, 1]) & (lengths <= U64(SCAN_INDEX_BYTES)))[0].tolist()
        rest: list[int] = []
        total = 0
        identity = blob.identity
        for other in numbers:
            if other == m or self.held(MINISHARD_INDEX, (identity, other)):
                continue
            total += int(lengths[other])
            if total > SCAN_INDEX_BYTES:
                break
            rest.append(other)
        return rest

    async def _load(self, blob: Blob, index: np.ndarray, numbers: list[int],
                    gap: int | None = None) -> list[ChunkTable | DataError]:
        """Minishard tables `numbers` through the core's batch of the MINISHARD_INDEX level (the
        first must succeed; the others are best effort; those whose range is damaged are left out)."""
        batch = [((blob.identity, m), *self._range(index, blob, m), f"{blob.label} minishard {m}") for m in numbers[:1]]
        for m in numbers[1:]:
            try:
                batch.append(((blob.identity, m), *self._range(index, blob, m), f"{blob.label} minishard {m}"))
            except DataError:
                pass
        return await self.cached_batch(MINISHARD_INDEX, blob, batch, functools.partial(self._decode_off_loop, blob),
                                       gap, functools.partial(self._decode_many, blob))

    async def _decode_many(self, blob: Blob, items: list[tuple[Hashable, bytes, str]]) -> list[ChunkTable | DataError]:
        """Minishard indexes of one batch (a listing's, a scanned shard's), decoded together
        (`decode_minishards`); gzip ones are inflated one by one first, each within the cap
        `_decode` gives it."""
        cost = sum(len(raw) for _, raw, _ in items)
        if self.spec.minishard_index_encoding == "gzip":
            # Inline if each would be decoded inline alone (`_decode_off_loop`): a scanned shard's
            # many small indexes, which only a bomb in each could inflate to much, cost no
            # thread hop, as they did not one by one.
            cost = max(cost, max(gunzip_cost(len(raw), self._inflated_max()) for _, raw, _ in items))
        return await off_loop(functools.partial(self._decode_all, blob, items), cost)

    def _decode_all(self, blob: Blob, items: list[tuple[Hashable, bytes, str]]) -> list[ChunkTable | DataError]:
        out: list[ChunkTable | DataError | None] = [None] * len(items)
        raws: list[bytes] = []
        at: list[int] = []
        for i, (_, raw, where) in enumerate(items):
            if self.spec.minishard_index_encoding == "gzip":
                try:
                    raw = gunzip(raw, self._inflated_max(), where)
                except DataError as e:
                    out[i] = e
                    continue
            raws.append(raw)
            at.append(i)
        tables = decode_minishards(raws, blob, self.index_size, [items[i][2] for i in at],
                                   [cast("tuple[Identity, int]", items[i][0])[1] for i in at])
        for i, table in zip(at, tables):
            if isinstance(table, ChunkTable):
                self._report_bad(blob, table)
            out[i] = table
        return cast("list[ChunkTable | DataError]", out)

    def _inflated_max(self) -> int:
        """The most a gzip minishard index may inflate to: a decoded index is kept in the minishard
        cache, and one that cannot fit there is not worth decoding (nor, raw, reading: see `_load`)."""
        return min(self.limits.index_bytes, int(self.cache(MINISHARD_INDEX).maxsize))

    async def _decode_off_loop(self, blob: Blob, key: Hashable, raw: bytes, where: str) -> ChunkTable:
        # A gzip index may inflate up to the budget, but no more than deflate's
        # ratio allows: a small one is decoded inline, a large one in a thread.
        budget = int(self.cache(MINISHARD_INDEX).maxsize)
        gzipped = self.spec.minishard_index_encoding == "gzip"
        cost = max(len(raw), gunzip_cost(len(raw), budget)) if gzipped else len(raw)
        m = cast("tuple[Identity, int]", key)[1]
        return await off_loop(functools.partial(self._decode, raw, blob, where, m), cost)

    def _decode(self, raw: bytes, blob: Blob, where: str, m: int) -> ChunkTable:
        if self.spec.minishard_index_encoding == "gzip":
            raw = gunzip(raw, self._inflated_max(), where)
        table = decode_minishard(raw, blob, self.index_size, where, m)
        self._report_bad(blob, table)
        return table

    @staticmethod
    def _report_bad(blob: Blob, table: ChunkTable) -> None:
        for cid, reason in list(table.bad.items())[:20]:
            log_once(log, f"bad:{blob.label}:{cid}", "%s chunk %d: %s", blob.label, cid, reason)

    # -- the ShardedStore contract -----------------------------------------------------------

    def _location(self, chunk_id: int) -> tuple[int, int]:
        """`spec.location`, remembered for the last id: a lookup asks twice (its shard, then its
        minishard), and each is a hash."""
        last_id, last = self._last_location
        if last_id == chunk_id:
            return last
        location = self.spec.location(chunk_id)
        self._last_location = (chunk_id, location)
        return location

    def shard_of(self, chunk_id: int) -> int:
        return self._location(chunk_id)[0]

    def table_of(self, chunk_id: int) -> tuple[int, int]:
        return self._location(chunk_id)  # (shard, minishard): each minishard index is a read

    async def table_for(self, shard: int, blob: Blob, index: np.ndarray, chunk_id: int) -> ChunkTable | None:
        m = self._location(chunk_id)[1]
        # A cached minishard first: only non-empty ones are ever read (here and by listings).
        cached = self.recall(MINISHARD_INDEX, (blob.identity, m))
        if isinstance(cached, ChunkTable):
            return cached
        if index[m, 0] == index[m, 1]:
            return None
        return await self.minishard(blob, index, m)

    async def index_tables(self, shard: int, blob: Blob, index: np.ndarray) -> list[ChunkTable]:
        """Every non-empty minishard of the shard, its indexes read in one batch (they are
        normally contiguous); damaged minishards are logged and skipped."""
        numbers = np.nonzero(index[:, 0] != index[:, 1])[0].tolist()
        missing = [m for m in numbers if not self.held(MINISHARD_INDEX, (blob.identity, m))]
        if missing:
            await self._load_listed(blob, index, missing)
        out = []
        for m in numbers:
            try:
                out.append(await self.minishard(blob, index, m))
            except DataError as e:
                log_once(log, f"list:{e}", "listing %s: skipping minishard: %s", self.label, e)
        return out

    def placed(self, shard: int, table: ChunkTable) -> np.ndarray:
        """Ids that hash to another shard or minishard can never be looked up."""
        shards, minis = self.spec.locations_array(table.ids)
        mask: np.ndarray = (shards == U64(shard)) & (minis == U64(table.part))
        return mask

    def placed_all(self, shard: int, tables: list[ChunkTable]) -> list[np.ndarray] | None:
        """`placed` of every table of the shard hashed in one go (a listing's minishards are
        many and small)."""
        if len(tables) < 2:
            return super().placed_all(shard, tables)
        counts = [len(table) for table in tables]
        shards, minis = self.spec.locations_array(np.concatenate([table.ids for table in tables]))
        parts = np.repeat(np.array([table.part for table in tables], dtype=U64), counts)
        mask = (shards == U64(shard)) & (minis == parts)
        if mask.all():
            return None
        return np.split(mask, np.cumsum(counts)[:-1])

    async def _load_listed(self, blob: Blob, index: np.ndarray, numbers: list[int]) -> None:
        """Load minishards for a listing: one batch per cache-sized group; failures are left for
        the per-minishard pass to report."""
        budget = max(1, self.cache(MINISHARD_INDEX).maxsize // 4)
        group: list[int] = []
        size = 0
        for m in numbers + [-1]:
            length = 0
            if m >= 0:
                try:
                    length = self._range(index, blob, m)[1]
                except DataError:
                    continue
            if group and (m < 0 or size + length > budget):
                try:
                    await self._load(blob, index, group)
                except DataError:
                    pass
                group, size = [], 0
            if m >= 0:
                group.append(m)
                size += length
