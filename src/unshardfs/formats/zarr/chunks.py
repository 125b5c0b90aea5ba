"""Finding inner chunks: by grid index (lookups) and all of them (listings).

A chunk's bytes are located by walking the shard levels: the outer shard is
an object named by the array's key encoding, and each level's index gives
the byte range of the next level inside it. An unsharded array is the
degenerate case with no levels, each chunk being its whole object, so the
v2 view of plain arrays uses the same code.

Every index entry is checked against the range it points into before it is
used; a bad entry fails that chunk, a bad checksum fails its whole shard,
each with a logged reason.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np

from ...caches import Caches
from ...errors import DataError
from ...logonce import log_once
from ...sources.base import ByteSource, join_key
from ...sources.blob import Blob
from .keys import KeyLayout, parse_index
from .metadata import ArrayMeta
from .sharding import EMPTY, ShardLevel, Unsharded

log = logging.getLogger(__name__)

U64 = np.uint64
OK, ABSENT, BAD = 0, 1, 2


@dataclass(frozen=True, slots=True)
class ChunkRef:
    blob: Blob
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class IndexTable:
    """A decoded shard index: ranges relative to the whole blob, and each entry's state."""

    starts: np.ndarray
    lengths: np.ndarray
    state: np.ndarray  # OK, ABSENT or BAD per entry

    @property
    def nbytes(self) -> int:
        return self.starts.nbytes + self.lengths.nbytes + self.state.nbytes


def validate(raw: np.ndarray, base: int, length: int, level: ShardLevel) -> IndexTable:
    """Absolute ranges of a level's entries; anything outside the data area is BAD."""
    offsets, nbytes = raw[:, 0], raw[:, 1]
    empty = (offsets == U64(EMPTY)) & (nbytes == U64(EMPTY))
    data_lo = level.index_size if level.at_start else 0
    data_hi = length if level.at_start else length - level.index_size
    ends = offsets + nbytes  # wraps on overflow; caught by ends >= offsets
    ok = (ends >= offsets) & (offsets >= U64(data_lo)) & (ends <= U64(max(data_hi, 0)))
    state = np.where(empty, ABSENT, np.where(ok, OK, BAD)).astype(np.uint8)
    starts = np.where(ok, offsets + U64(base), U64(0))
    return IndexTable(starts, np.where(ok, nbytes, U64(0)), state)


class ArrayChunks:
    """The inner chunks of one array, sharded (any depth) or not."""

    def __init__(self, source: ByteSource, key: str, meta: ArrayMeta, flat: Unsharded, caches: Caches) -> None:
        self.source = source
        self.key = key
        self.meta = meta
        self.levels = flat.levels
        self.chunk_shape = flat.chunk_shape
        self.grid = tuple(-(-s // c) for s, c in zip(meta.shape, flat.chunk_shape))
        self.shard_grid = meta.grid
        self.source_keys = KeyLayout("c" if meta.key_encoding.name == "default" else None,
                                     meta.key_encoding.separator, meta.ndim)
        self.caches = caches
        # How many inner chunks make one shard along each array dimension.
        self.per_shard = tuple(s // c for s, c in zip(meta.chunk_shape, flat.chunk_shape))

    # -- shards ---------------------------------------------------------------

    async def shard(self, outer: tuple[int, ...]) -> Blob | None:
        key = join_key(self.key, self.source_keys.key(outer))
        st = await self.source.stat(key)
        if st is None or st.is_dir:
            return None
        return Blob.of(key, st)

    async def table(self, blob: Blob, depth: int, base: int, length: int) -> IndexTable:
        level = self.levels[depth]
        cache_key = (blob.label, blob.version, depth, base, length)
        cached = self.caches.shard_index.get(cache_key)
        if cached is not None:
            return cached
        where = blob.label if depth == 0 else f"{blob.label} nested shard at {base}"
        if length < level.index_size:
            raise DataError(where, f"{length} bytes cannot hold the {level.index_size}-byte shard index")
        at = base if level.at_start else base + length - level.index_size
        raw = level.decode_index(await blob.read(self.source, at, level.index_size, index=True), where)
        table = validate(raw, base, length, level)
        bad = int((table.state == BAD).sum())
        if bad:
            log_once(log, f"bad:{where}", "%s: %d shard index entries point outside the shard; "
                     "those chunks fail with EIO", where, bad)
        self.caches.put(self.caches.shard_index, cache_key, table)
        return table

    # -- one chunk ------------------------------------------------------------

    def in_bounds(self, index: tuple[int, ...]) -> bool:
        return len(index) == len(self.grid) and all(0 <= i < g for i, g in zip(index, self.grid))

    async def locate(self, index: tuple[int, ...]) -> ChunkRef | None:
        """Where the inner chunk at `index` (in bounds) is stored, or None if it is empty."""
        outer = tuple(i // p for i, p in zip(index, self.per_shard))
        blob = await self.shard(outer)
        if blob is None:
            return None
        # Element offset of the chunk inside the current (nested) shard, in array order.
        offset = [(i % p) * c for i, p, c in zip(index, self.per_shard, self.chunk_shape)]
        base, length = 0, blob.size
        for depth, level in enumerate(self.levels):
            pos = [offset[p] // c for p, c in zip(level.perm, level.chunk_shape)]
            for p, c, q in zip(level.perm, level.chunk_shape, pos):
                offset[p] -= q * c
            entry = int(np.ravel_multi_index(pos, level.counts)) if pos else 0
            table = await self.table(blob, depth, base, length)
            state = table.state[entry]
            if state == ABSENT:
                return None
            if state == BAD:
                raise DataError(f"{blob.label} chunk {self.source_keys.key(index)}",
                                "shard index entry points outside the shard")
            base, length = int(table.starts[entry]), int(table.lengths[entry])
        return ChunkRef(blob, base, length)

    # -- all chunks -----------------------------------------------------------

    async def existing_shards(self, fixed: tuple[int, ...]) -> AsyncIterator[tuple[int, ...]]:
        """Grid indices of the shard objects that exist, those starting with `fixed` only, in order."""
        layout, ndim = self.source_keys, len(self.shard_grid)
        if not self.source.listable:
            # Nothing to list: every shard position of the slab is a candidate
            # (a missing one reads as absent when its shard is looked up).
            ranges = [range(f, f + 1) for f in fixed] + [range(g) for g in self.shard_grid[len(fixed):]]
            for outer in itertools.product(*ranges):
                yield outer
            return
        if not layout.nested:
            found = []
            async for name, st in self.source.list(self.key):
                outer = None if st.is_dir else layout.parse_flat(name)
                if outer is not None and outer[:len(fixed)] == fixed and self._outer_ok(outer):
                    found.append(outer)
            for outer in sorted(found):
                yield outer
            return

        async def walk(prefix: tuple[int, ...], dir_key: str) -> AsyncIterator[tuple[int, ...]]:
            depth = len(prefix)
            last = depth == ndim - 1
            if depth < len(fixed):
                names = [(str(fixed[depth]), fixed[depth])]
            else:
                names = []
                async for name, st in self.source.list(dir_key):
                    i = parse_index(name)
                    if i is not None and i < self.shard_grid[depth] and st.is_dir != last:
                        names.append((name, i))
                names.sort(key=lambda item: item[1])
            for name, i in names:
                if last:
                    yield prefix + (i,)
                else:
                    async for outer in walk(prefix + (i,), join_key(dir_key, name)):
                        yield outer

        root = join_key(self.key, layout.lead) if layout.lead else self.key
        async for outer in walk((), root):
            yield outer

    def _outer_ok(self, outer: tuple[int, ...]) -> bool:
        return all(o < g for o, g in zip(outer, self.shard_grid))

    async def shard_chunks(self, outer: tuple[int, ...]) -> tuple[np.ndarray, list[ChunkRef]] | None:
        """Every non-empty, in-bounds inner chunk of one shard: (indices as an (n, ndim) array, refs)."""
        blob = await self.shard(outer)
        if blob is None:
            return None
        ndim = len(self.grid)
        origin = np.array([o * p * c for o, p, c in zip(outer, self.per_shard, self.chunk_shape)], dtype=np.int64)
        offsets = np.zeros((1, ndim), dtype=np.int64)  # element offsets within the shard, array order
        ranges = [(0, blob.size)]
        for depth, level in enumerate(self.levels):
            next_offsets, next_ranges = [], []
            cells = np.indices(level.counts, dtype=np.int64).reshape(ndim, -1).T  # C order, as the index
            step = np.zeros((len(cells), ndim), dtype=np.int64)
            for i, (p, c) in enumerate(zip(level.perm, level.chunk_shape)):
                step[:, p] = cells[:, i] * c
            for off, (base, length) in zip(offsets, ranges):
                table = await self.table(blob, depth, base, length)
                keep = table.state == OK
                next_offsets.append(off + step[keep])
                next_ranges.extend(zip(table.starts[keep].tolist(), table.lengths[keep].tolist()))
            offsets = np.concatenate(next_offsets) if next_offsets else np.zeros((0, ndim), dtype=np.int64)
            ranges = next_ranges
        indices = (origin + offsets) // np.array(self.chunk_shape, dtype=np.int64)
        inside = (indices < np.array(self.grid, dtype=np.int64)).all(axis=1)
        refs = [ChunkRef(blob, s, n) for (s, n), ok in zip(ranges, inside.tolist()) if ok]
        return indices[inside], refs

    async def chunks(self, fixed: tuple[int, ...] = ()) -> AsyncIterator[tuple[np.ndarray, list[ChunkRef]]]:
        """Every listable inner chunk whose index starts with `fixed`, one batch per shard.

        Damaged shards are logged and skipped, so a listing still shows
        everything else (their chunks then fail with EIO when looked up).
        """
        outer_fixed = tuple(i // p for i, p in zip(fixed, self.per_shard))
        async for outer in self.existing_shards(outer_fixed):
            try:
                found = await self.shard_chunks(outer)
            except DataError as e:
                log_once(log, f"list:{e}", "listing %s: skipping shard: %s", self.key or ".", e)
                continue
            if found is None:
                continue
            indices, refs = found
            if fixed:
                match = (indices[:, :len(fixed)] == np.array(fixed, dtype=np.int64)).all(axis=1)
                indices = indices[match]
                refs = [r for r, m in zip(refs, match.tolist()) if m]
            if refs:
                yield indices, refs
