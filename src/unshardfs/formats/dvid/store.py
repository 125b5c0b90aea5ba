"""One scale of a DVID export as a core `ShardedStore`, and its block codec.

Scale N's shard files `s<N>/<ox>_<oy>_<oz>.arrow` are named by voxel
origin; the volume spec's sharding tells which shard a chunk belongs to, so
a chunk file is found with one index lookup and no listing beyond the
scale directory's. Chunk ids are the compressed Morton codes of chunk cells,
as for precomputed volumes.
"""

from __future__ import annotations

import logging
import re
from typing import AsyncIterator, Callable

import numpy as np
import pyarrow as pa

from unshardfs.core.blob import Blob
from unshardfs.core.codecs import GeometrySized, PayloadRef
from unshardfs.core.runtime import Runtime
from unshardfs.core.store import ShardedStore
from unshardfs.core.table import ChunkTable
from unshardfs.formats.dvid.block import decode_block, max_block_bytes
from unshardfs.formats.dvid.shard import ArrowShardReader, ShardIndex, decode_record
from unshardfs.sources.base import join_path
from unshardfs.util.decompress import unzstd
from unshardfs.util.errors import DataError
from unshardfs.util.logonce import log_once
from unshardfs.volume.grid import Cell, ChunkGrid, VolumeGeometry
from unshardfs.volume.sharding import ShardingSpec

log = logging.getLogger(__name__)

SHARD_FILE = re.compile(r"^(\d{1,15})_(\d{1,15})_(\d{1,15})\.arrow$")


class DvidStore(ShardedStore[int, ShardIndex]):
    """A shard number (from the sharding spec) is one Arrow file, whose chunk index is one table."""

    def __init__(self, runtime: Runtime, dir_path: str, grid: ChunkGrid, spec: ShardingSpec) -> None:
        super().__init__(runtime, dir_path)
        self.dir_path = dir_path
        self.grid = grid
        self.spec = spec
        self.reader = ArrowShardReader(self.source, self.read_index_bytes, grid.chunk_size, self.owned, self.chunk_ids,
                                      runtime.limits)
        self._files: dict[int, str] | None = None

    def chunk_ids(self, cells: np.ndarray) -> np.ndarray:
        return np.array([self.grid.coder.encode(tuple(c)) for c in cells.tolist()], dtype=np.uint64)

    def owned(self, cells: np.ndarray, shard: int) -> np.ndarray:
        """Which cells lie in the grid and hash to `shard` under the spec."""
        inside = np.asarray(((cells >= 0) & (cells < np.array(self.grid.shape, dtype=np.int64))).all(axis=1))
        codes = np.array([self.grid.coder.encode(tuple(c)) if ok else 0
                          for c, ok in zip(cells.tolist(), inside.tolist())], dtype=np.uint64)
        shards, _ = self.spec.locations_array(codes)
        mask: np.ndarray = inside & (shards == np.uint64(shard))
        return mask

    def describe(self, chunk_id: int) -> str:
        cells, valid = self.grid.coder.decode_array(np.array([chunk_id], dtype=np.uint64))
        return f"block {tuple(cells[0].tolist())}" if valid[0] else f"chunk {chunk_id}"

    async def files(self) -> dict[int, str]:
        """Shard number -> file name, from one listing of the scale directory."""
        if self._files is None:
            found: dict[int, str] = {}
            async for name, st in self.source.list(self.dir_path):
                m = None if st.is_dir else SHARD_FILE.match(name)
                if m is None:
                    continue
                origin = tuple(int(v) for v in m.groups())
                if any(o % c for o, c in zip(origin, self.grid.chunk_size)):
                    log_once(log, f"origin:{name}", "%s/%s: origin is not chunk-aligned; ignored", self.dir_path, name)
                    continue
                cell = tuple(o // c for o, c in zip(origin, self.grid.chunk_size))
                if any(g >= s for g, s in zip(cell, self.grid.shape)):
                    log_once(log, f"origin:{name}", "%s/%s: origin lies outside the volume; ignored", self.dir_path, name)
                    continue
                shard = self.spec.location(self.grid.coder.encode(cell))[0]
                if shard in found:
                    log_once(log, f"dup:{name}", "%s: %s and %s are the same shard; using %s", self.dir_path,
                             found[shard], name, min(found[shard], name))
                    name = min(found[shard], name)
                found[shard] = name
            self._files = dict(sorted(found.items()))
        return self._files

    def accepts(self, shard: object) -> bool:
        return isinstance(shard, int) and not isinstance(shard, bool)

    async def open_shard(self, shard: int) -> Blob | None:
        name = (await self.files()).get(shard)
        if name is None:
            return None
        path = join_path(self.dir_path, name)
        st = await self.source.stat(path)
        return None if st is None or st.is_dir else self.blob(path, st)

    async def read_index(self, shard: int, blob: Blob) -> ShardIndex:
        return await self.reader.load(blob, blob.label.removesuffix(".arrow"), shard)

    async def schema_of(self, f: PayloadRef) -> pa.Schema:
        """The Arrow schema of the shard file holding `f` (its index is cached)."""
        opened = await self.index(self.spec.location(f.chunk_id)[0])
        if opened is None or opened[0].identity != f.blob.identity:
            raise DataError(f.blob.label, "shard file changed while mounted")
        return opened[1].schema

    # -- the ShardedStore contract ----------------------------------------------------------

    def shard_of(self, chunk_id: int) -> int | None:
        _, valid = self.grid.coder.decode_array(np.array([chunk_id], dtype=np.uint64))
        return self.spec.location(chunk_id)[0] if valid[0] else None

    def shards(self, within: object = None) -> AsyncIterator[int]:
        async def numbers() -> AsyncIterator[int]:
            for shard in await self.files():
                yield shard
        return numbers()

    async def table_for(self, shard: int, blob: Blob, index: ShardIndex, chunk_id: int) -> ChunkTable:
        return index.table

    async def index_tables(self, shard: int, blob: Blob, index: ShardIndex) -> list[ChunkTable]:
        return [index.table]

    def placed(self, shard: int, table: ChunkTable) -> np.ndarray:
        mask: np.ndarray = self.spec.locations_array(table.ids)[0] == np.uint64(shard)
        return mask


def dvid_geometry(grid: ChunkGrid, limit: int) -> VolumeGeometry:
    """A chunk file holds the block's labels as uint64, clipped at the volume edge (raw, exact)."""
    return VolumeGeometry(grid, 8, True, limit)


class DvidBlockCodec(GeometrySized):
    """An Arrow record holding a DVID compressed label block -> the chunk's uint64 labels."""

    name = "dvid-block"

    def __init__(self, store: DvidStore, supervoxels: bool) -> None:
        self.store = store
        self.supervoxels = supervoxels
        self.chunk_size = store.grid.chunk_size
        self.block_cap = max_block_bytes(self.chunk_size)

    @property
    def label(self) -> str:
        return "dvid-supervoxels" if self.supervoxels else "dvid-agglomerated"

    async def prepare(self, f: PayloadRef) -> object:
        return await self.store.schema_of(f)

    def decode(self, payload: bytes, f: PayloadRef, prepared: object = None) -> bytes:
        where = f.where
        grid = self.store.grid
        cells, _ = grid.coder.decode_array(np.array([f.chunk_id], dtype=np.uint64))
        cell: Cell = tuple(cells[0].tolist())
        record = decode_record(payload, prepared, f.extra, where)
        voxels = tuple(g * c for g, c in zip(cell, self.chunk_size))
        if record.coords != cell and record.coords != voxels:
            raise DataError(where, f"record holds block {record.coords}, the index places it at {cell}")
        raw = record.block
        if record.zstd or raw[:4] == b"\x28\xb5\x2f\xfd":
            raw = unzstd(raw, self.block_cap, where)
        if record.uncompressed_size is not None and len(raw) != record.uncompressed_size:
            raise DataError(where, f"block is {len(raw)} bytes, the record says {record.uncompressed_size}")
        x, y, z = self.chunk_size
        want = (z, y, x)
        try:
            block = decode_block(raw, want, None if self.supervoxels else agglomeration(record.supervoxels,
                                                                                          record.labels))
        except ValueError as e:
            raise DataError(where, f"bad DVID block: {e}") from None
        ex, ey, ez = grid.extent(cell)
        data = np.ascontiguousarray(block[:ez, :ey, :ex]).astype("<u8", copy=False).tobytes()
        if len(data) != f.size:
            raise DataError(where, f"block decodes to {len(data)} bytes, the chunk has {f.size}")
        return data


def agglomeration(supervoxels: np.ndarray, labels: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A function mapping block label lists from supervoxel ids to agglomerated labels."""
    order = np.argsort(supervoxels, kind="stable")
    keys, values = supervoxels[order], labels[order]

    def relabel(ids: np.ndarray) -> np.ndarray:
        if not len(keys):
            return ids
        at = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
        return np.where(keys[at] == ids, values[at], ids)
    return relabel
