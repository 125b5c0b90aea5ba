"""Inner chunks of one Zarr v3 array, as a core `ShardedStore`.

Chunk ids are linear (C-order) indexes in the grid of inner chunks. A shard is
the object the array's key encoding names for an outer grid index; its
(possibly nested) shard indexes are flattened into one `ChunkTable` of the
shard's non-empty, in-bounds inner chunks. An unsharded array is the
degenerate case with no levels (each chunk is its whole object), which the
v2 view of plain arrays uses.

Every index entry is checked against the range it points into before it is
used; a bad entry fails that chunk (kept in the table's `bad`), a bad
checksum or a size beyond the limits fails the whole shard.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import AsyncIterator, Iterable, cast

import numpy as np

from unshardfs.core.blob import Blob
from unshardfs.core.caches import SHARD_INDEX
from unshardfs.core.fetch import Extent
from unshardfs.core.runtime import Runtime
from unshardfs.core.store import ShardedStore
from unshardfs.core.table import ChunkTable
from unshardfs.formats.zarr.keys import KeyLayout, parse_index
from unshardfs.formats.zarr.metadata import ArrayMeta
from unshardfs.formats.zarr.sharding import EMPTY, Unsharded
from unshardfs.sources.base import ObjectStat, join_path
from unshardfs.util.errors import DataError
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap

log = logging.getLogger(__name__)

U64 = np.uint64
# On a source that cannot list, every shard position of a slab is probed;
# beyond this many candidates a listing is refused (lookups still work).
PROBE_MAX = 1 << 16
SHARD_PATHS_MAX = 1 << 14  # shard keys remembered (the one set longest ago formatted again past this)


class ZarrStore(ShardedStore[tuple[int, ...], ChunkTable]):
    """A shard is an outer grid index; its (nested) shard indexes are flattened into one table."""

    def __init__(self, runtime: Runtime, path: str, meta: ArrayMeta, flat: Unsharded) -> None:
        super().__init__(runtime, path)
        self.path = path
        self.meta = meta
        self.levels = flat.levels
        if not self.levels:
            self.index_levels = ()  # unsharded: the object is the chunk, nothing to cache
        self.chunk_shape = flat.chunk_shape
        self.grid = tuple(-(-s // c) for s, c in zip(meta.shape, flat.chunk_shape))
        self.shard_grid = meta.grid
        self.source_keys = KeyLayout("c" if meta.key_encoding.name == "default" else None,
                                     meta.key_encoding.separator, meta.ndim)
        # How many inner chunks make one shard along each array dimension.
        self.per_shard = tuple(s // c for s, c in zip(meta.chunk_shape, flat.chunk_shape))
        self._strides = np.array([math.prod(self.grid[d + 1:]) for d in range(len(self.grid))], dtype=np.int64)
        # The same strides as ints: `id_of`/`index_of` run for every chunk a reader or read-ahead
        # touches, and numpy's ravel/unravel cost more per scalar call than the arithmetic.
        self._id_strides = tuple(int(x) for x in self._strides)
        self._count = math.prod(self.grid)
        self._shard_axes = tuple(zip(self._id_strides, self.grid, self.per_shard))
        self._shard_paths: BoundedMap[tuple[int, ...], str] = BoundedMap(SHARD_PATHS_MAX, lru=False, counted=False)
        # A shard's index at its end comes with its first stat (`stat_shard`).
        outer = self.levels[0] if self.levels else None
        self._tail = outer.index_size if outer is not None and not outer.at_start else 0

    # -- ids ----------------------------------------------------------------------------

    def id_of(self, index: tuple[int, ...]) -> int:
        """The linear (C-order) id of a grid index; ValueError outside the grid."""
        if not index:
            return 0
        if not self.in_bounds(index):
            raise ValueError(f"chunk index {index} outside the grid {self.grid}")
        return int(sum(i * s for i, s in zip(index, self._id_strides)))

    def index_of(self, chunk_id: int) -> tuple[int, ...]:
        """The grid index of a linear id; ValueError outside the grid."""
        if not self.grid:
            return ()
        if not 0 <= chunk_id < self._count:
            raise ValueError(f"chunk id {chunk_id} outside the grid {self.grid}")
        return tuple(chunk_id // s % g for s, g in zip(self._id_strides, self.grid))

    def indices(self, ids: np.ndarray) -> np.ndarray:
        """(n, ndim) grid indexes of linear chunk ids."""
        ids = ids.astype(np.int64)
        return (ids[:, None] // self._strides) % np.array(self.grid, dtype=np.int64) if self.grid \
            else np.zeros((len(ids), 0), dtype=np.int64)

    def in_bounds(self, index: tuple[int, ...]) -> bool:
        return len(index) == len(self.grid) and all(0 <= i < g for i, g in zip(index, self.grid))

    def describe(self, chunk_id: int) -> str:
        return f"chunk {self.source_keys.key(self.index_of(chunk_id))}"

    # -- shards ---------------------------------------------------------------------------

    def shard_of(self, chunk_id: int) -> tuple[int, ...] | None:
        if not 0 <= chunk_id < self._count:
            return None  # outside the grid: no such chunk (read-ahead may guess past the end)
        # `index_of` then a division, in one pass: read-ahead asks this several times per chunk.
        return tuple(chunk_id // s % g // p for s, g, p in self._shard_axes)

    async def open_shard(self, outer: tuple[int, ...]) -> Blob | None:
        # Every lookup and every chunk read ahead opens its shard: its key is formatted once.
        path = self._shard_paths.get(outer)
        if path is None:
            path = self._shard_paths[outer] = join_path(self.path, self.source_keys.key(outer))
        return self._shard_blob(path, await self.stat_shard(path, self._tail, at_end=True))

    def _shard_blob(self, path: str, st: ObjectStat | None) -> Blob | None:
        return None if st is None or st.is_dir else self.blob(path, st)

    def is_shard_file(self, name: str) -> bool:
        return self.source_keys.claims(name)

    async def shards(self, within: object = None) -> AsyncIterator[tuple[int, ...]]:
        """Outer indexes of the shard objects that exist (those starting with `within` only), in order."""
        async for outer, _ in self.sized_shards(within):
            yield outer

    async def sized_shards(self, within: object = None) -> AsyncIterator[tuple[tuple[int, ...], int | None]]:
        """`shards` with each shard object's bytes where the listing told them (not on a source that
        cannot list: every candidate, unsized)."""
        layout, ndim = self.source_keys, len(self.shard_grid)
        # `within`: the leading outer indexes of a slab (nested chunk directories), or None.
        lead: tuple[int, ...] = tuple(cast(Iterable[int], within or ()))
        if not self.source.listable:
            # Nothing to list: every shard position of the slab is a candidate
            # (a missing one reads as absent when its shard is looked up).
            ranges = [range(f, f + 1) for f in lead] + [range(g) for g in self.shard_grid[len(lead):]]
            if math.prod(len(r) for r in ranges) > PROBE_MAX:
                log_once(log, f"probe:{self.path}", "listing %s: too many possible shards on a source that cannot "
                         "list; not listed (lookups by name work)", self.label)
                return
            for outer in itertools.product(*ranges):
                yield outer, None
            return
        if not layout.nested:
            found: list[tuple[tuple[int, ...], int]] = []
            async for name, st in self.source.list(self.path):
                parsed = None if st.is_dir else layout.parse_flat(name)
                if parsed is not None and parsed[:len(lead)] == lead and self._outer_ok(parsed):
                    found.append((parsed, st.size))
            for outer, size in sorted(found):
                yield outer, size
            return

        async def walk(prefix: tuple[int, ...], dir_path: str) -> AsyncIterator[tuple[tuple[int, ...], int | None]]:
            depth = len(prefix)
            last = depth == ndim - 1
            names: list[tuple[str, int, int | None]]
            if depth < len(lead):
                names = [(str(lead[depth]), lead[depth], None)]
            else:
                names = []
                async for name, st in self.source.list(dir_path):
                    i = parse_index(name)
                    if i is not None and i < self.shard_grid[depth] and st.is_dir != last:
                        names.append((name, i, st.size))
                names.sort(key=lambda item: item[1])
            for name, i, size in names:
                if last:
                    yield prefix + (i,), size
                else:
                    async for found_shard in walk(prefix + (i,), join_path(dir_path, name)):
                        yield found_shard

        root = join_path(self.path, layout.lead) if layout.lead else self.path
        async for found_shard in walk((), root):
            yield found_shard

    def accepts(self, shard: object) -> bool:
        return isinstance(shard, tuple) and len(shard) == len(self.shard_grid) and \
            all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < g for i, g in zip(shard, self.shard_grid))

    def holds(self, shard: tuple[int, ...], within: object) -> bool:
        lead: tuple[int, ...] = tuple(cast(Iterable[int], within or ()))
        return shard[:len(lead)] == lead

    def _outer_ok(self, outer: tuple[int, ...]) -> bool:
        return all(o < g for o, g in zip(outer, self.shard_grid))

    # -- indexes ------------------------------------------------------------------------------

    async def _level(self, blob: Blob, depth: int, base: int, length: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One (nested) shard index: each entry's absolute range, and its state (OK/ABSENT/BAD)."""
        level = self.levels[depth]
        where = blob.label if depth == 0 else f"{blob.label} nested shard at {base}"
        # The flattened table is kept in the shard index cache: an index beyond it is refused
        # (a 256 MiB index of empty cells costs several times that to flatten).
        self.check_index(level.index_size, where, SHARD_INDEX)
        if length < level.index_size:
            raise DataError(where, f"{length:,} bytes cannot hold the {level.index_size:,}-byte shard index")
        at = base if level.at_start else base + length - level.index_size
        raw = level.decode_index(await self.fetcher.read(Extent(blob, at, level.index_size), index=True), where)
        offsets, nbytes = raw[:, 0], raw[:, 1]
        empty = (offsets == U64(EMPTY)) & (nbytes == U64(EMPTY))
        data_lo = level.index_size if level.at_start else 0
        data_hi = length if level.at_start else length - level.index_size
        ends = offsets + nbytes  # wraps on overflow; caught by ends >= offsets
        ok = ~empty & (ends >= offsets) & (offsets >= U64(data_lo)) & (ends <= U64(max(data_hi, 0)))
        state = np.where(empty, ABSENT, np.where(ok, OK, BAD)).astype(np.uint8)
        return np.where(ok, offsets + U64(base), U64(0)), np.where(ok, nbytes, U64(0)), state

    async def _flatten(self, outer: tuple[int, ...], blob: Blob) -> ChunkTable:
        """Every inner chunk of one shard as a table (nested levels walked)."""
        ndim = len(self.grid)
        # Element offsets (array order) of each entry within the shard, and its range.
        offsets = np.zeros((1, ndim), dtype=np.int64)
        starts = np.zeros(1, dtype=U64)
        lengths = np.array([blob.size], dtype=U64)
        bad_offsets: list[np.ndarray] = []
        for depth, level in enumerate(self.levels):
            next_offsets, next_starts, next_lengths = [], [], []
            for off, base, length in zip(offsets, starts.tolist(), lengths.tolist()):
                s, n, state = await self._level(blob, depth, int(base), int(length))
                # Only entries that exist cost anything from here on (never
                # one allocation per declared cell).
                for wanted, out in ((OK, None), (BAD, bad_offsets)):
                    picked = np.nonzero(state == wanted)[0]
                    if not len(picked):
                        continue
                    cells = np.stack(np.unravel_index(picked, level.counts), axis=1) if level.counts else \
                        np.zeros((len(picked), 0), dtype=np.int64)
                    rel = np.zeros((len(picked), ndim), dtype=np.int64)
                    for i, (p, c) in enumerate(zip(level.perm, level.chunk_shape)):
                        rel[:, p] = cells[:, i] * c
                    if out is None:
                        next_offsets.append(off + rel)
                        next_starts.append(s[picked])
                        next_lengths.append(n[picked])
                    else:
                        out.append(off + rel)
            if not next_offsets:
                offsets = np.zeros((0, ndim), dtype=np.int64)
                starts = lengths = np.zeros(0, dtype=U64)
                break
            offsets = np.concatenate(next_offsets)
            starts = np.concatenate(next_starts)
            lengths = np.concatenate(next_lengths)
        origin = np.array([o * p * c for o, p, c in zip(outer, self.per_shard, self.chunk_shape)], dtype=np.int64)
        chunk = np.array(self.chunk_shape, dtype=np.int64)
        grid = np.array(self.grid, dtype=np.int64)
        indices = (origin + offsets) // chunk
        inside = (indices < grid).all(axis=1)
        ids = (indices[inside] * self._strides).sum(axis=1).astype(U64) if ndim else np.zeros(int(inside.sum()), U64)
        reasons: dict[int, str] = {}
        for rel in bad_offsets:
            cells = (origin + rel) // chunk
            for cell in cells[(cells < grid).all(axis=1)][:1000].tolist():
                reasons[self.id_of(tuple(cell))] = "shard index entry points outside the shard"
        if reasons:
            log_once(log, f"bad:{blob.label}", "%s: %d shard index entries point outside the shard; those chunks "
                     "fail with EIO", blob.label, len(reasons))
        # Ranges are validated per level above; `build` sorts by id.
        return ChunkTable.build(blob, ids, starts[inside], lengths[inside], 0, blob.size, reasons=reasons)

    async def read_index(self, outer: tuple[int, ...], blob: Blob) -> ChunkTable:
        if not self.levels:  # unsharded: the object is the chunk
            chunk_id = self.id_of(outer)
            return ChunkTable(blob, np.array([chunk_id], dtype=U64), np.zeros(1, dtype=U64), np.array([blob.size], U64))
        return await self._flatten(outer, blob)

    def placed(self, shard: tuple[int, ...], table: ChunkTable) -> np.ndarray:
        outer = self.indices(table.ids) // np.array(self.per_shard, dtype=np.int64)
        mask: np.ndarray = (outer == np.array(shard, dtype=np.int64)).all(axis=1)
        return mask


OK, ABSENT, BAD = 0, 1, 2
