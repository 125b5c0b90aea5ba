"""One mag of a WKW layer as a core `ShardedStore`, and the codec that turns a block into a chunk file.

Shards are the `.wkw` files `z<k>/y<j>/x<i>.wkw` of the mag directory; each
holds a cube of `F^3` blocks in Morton order (x the lowest bit). Chunk ids
are the compressed Morton codes of the *view's* grid cells (the precomputed
grid, whose voxel offset is block-aligned), so a chunk file is one block:
its file and position follow from the id alone, and a lookup reads that
file's header and jump table once (cached) and then the block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import AsyncIterator

import lz4.block
import numpy as np

from unshardfs.core.blob import Blob
from unshardfs.core.caches import SHARD_INDEX
from unshardfs.core.codecs import GeometrySized, PayloadRef
from unshardfs.core.fetch import Extent
from unshardfs.core.runtime import Runtime
from unshardfs.core.store import ShardedStore
from unshardfs.core.table import ChunkTable
from unshardfs.formats.wkw.header import BLOCK_TYPES, HEADER_BYTES, RAW, HeaderError, WkwHeader
from unshardfs.sources.base import ByteSource, join_path
from unshardfs.util.errors import DataError
from unshardfs.volume.grid import ChunkGrid, VolumeGeometry
from unshardfs.volume.morton import MortonCoder

FileCell = tuple[int, int, int]  # a shard: the (x, y, z) index of one .wkw file
_DIR = {"z": re.compile(r"^z(0|[1-9]\d{0,8})$"), "y": re.compile(r"^y(0|[1-9]\d{0,8})$")}
_FILE = re.compile(r"^x(0|[1-9]\d{0,8})\.wkw$")


def encode_cells(coder: MortonCoder, cells: np.ndarray) -> np.ndarray:
    """Compressed Morton codes of an (n, 3) array of in-grid cells (vectorised `coder.encode`)."""
    codes = np.zeros(len(cells), dtype=np.uint64)
    for j, (dim, i) in enumerate(coder.plan):
        codes |= ((cells[:, dim].astype(np.uint64) >> np.uint64(i)) & np.uint64(1)) << np.uint64(j)
    return codes


@dataclass(frozen=True)
class MagView:
    """One mag as the view shows it: the mag header and the precomputed grid over its blocks."""

    dir_path: str  # the mag directory in the source (`color/1`)
    header: WkwHeader  # from the mag's header.wkw: what every file must agree on
    grid: ChunkGrid  # chunk = block; voxel offset a multiple of the block edge

    @property
    def first_block(self) -> np.ndarray:
        """Absolute block index of grid cell (0, 0, 0)."""
        return np.array(self.grid.voxel_offset, dtype=np.int64) // self.header.block_edge

    def file_range(self) -> tuple[np.ndarray, np.ndarray]:
        """Inclusive range of file indexes the volume touches."""
        first = self.first_block
        last = first + np.array(self.grid.shape, dtype=np.int64) - 1
        return first // self.header.file_edge, last // self.header.file_edge

    def file_path(self, f: FileCell) -> str:
        return f"{self.dir_path}/z{f[2]}/y{f[1]}/x{f[0]}.wkw"


class WkwStore(ShardedStore[FileCell, ChunkTable]):
    def __init__(self, runtime: Runtime, view: MagView) -> None:
        super().__init__(runtime, view.dir_path)
        self.view = view
        self._local: np.ndarray | None = None

    @property
    def local(self) -> np.ndarray:
        """Block n of any file sits at `local[n]` (in blocks) inside its file. Built on first use,
        after the file's size was checked against the limits (a header may declare 2^24 blocks)."""
        if self._local is None:
            n = self.view.header.blocks
            self._local = MortonCoder((self.view.header.file_edge,) * 3).decode_array(np.arange(n, dtype=np.uint64))[0]
        return self._local

    def describe(self, chunk_id: int) -> str:
        cells, valid = self.view.grid.coder.decode_array(np.array([chunk_id], dtype=np.uint64))
        if not valid[0]:
            return f"chunk {chunk_id}"
        block = cells[0] + self.view.first_block
        return f"block {tuple(int(b) % self.view.header.file_edge for b in block)}"

    # -- the ShardedStore contract ----------------------------------------------------------

    def shard_of(self, chunk_id: int) -> FileCell | None:
        cells, valid = self.view.grid.coder.decode_array(np.array([chunk_id], dtype=np.uint64))
        if not valid[0]:
            return None
        x, y, z = ((cells[0] + self.view.first_block) // self.view.header.file_edge).tolist()
        return x, y, z

    def accepts(self, shard: object) -> bool:
        return isinstance(shard, tuple) and len(shard) == 3 and \
            all(isinstance(i, int) and not isinstance(i, bool) for i in shard)

    def shards(self, within: object = None) -> AsyncIterator[FileCell]:
        return self._listed() if self.source.listable else self._candidates()

    async def _candidates(self) -> AsyncIterator[FileCell]:
        lo, hi = self.view.file_range()
        for z in range(int(lo[2]), int(hi[2]) + 1):
            for y in range(int(lo[1]), int(hi[1]) + 1):
                for x in range(int(lo[0]), int(hi[0]) + 1):
                    yield x, y, z

    def _listed(self) -> AsyncIterator[FileCell]:
        lo, hi = self.view.file_range()
        return list_files(self.source, self.view.dir_path, lo.tolist(), hi.tolist())

    async def open_shard(self, shard: FileCell) -> Blob | None:
        path = self.view.file_path(shard)
        st = await self.source.stat(path)
        return None if st is None or st.is_dir else self.blob(path, st)

    async def read_index(self, shard: FileCell, blob: Blob) -> ChunkTable:
        """The blocks of the file inside the volume, from its header and (LZ4) jump table."""
        mag = self.view.header
        where = blob.label
        # The decoded table holds 32 bytes per block (id, start, length, block type).
        self.check_index(32 * mag.blocks, where, SHARD_INDEX)
        # Header and (if the mag is compressed) jump table in one read.
        raw = await self.fetcher.read(Extent(blob, 0, min(blob.size, HEADER_BYTES + mag.jump_table_bytes)),
                                      index=True)
        try:
            header = WkwHeader.parse(raw)
        except HeaderError as e:
            raise DataError(where, str(e)) from None
        if header.layout() != mag.layout():
            raise DataError(where, f"file header ({header.describe()}) disagrees with the mag's header.wkw "
                                   f"({mag.describe()})")
        n = header.blocks
        if header.compressed:
            table_end = HEADER_BYTES + 8 * n
            if len(raw) < table_end:
                if blob.size < table_end:
                    raise DataError(where, f"the jump table ends at byte {table_end:,}, past the end of the "
                                           f"file ({blob.size:,} bytes)")
                raw = await self.fetcher.read(Extent(blob, 0, table_end), index=True)
            if header.data_offset < table_end:
                raise DataError(where, f"data offset {header.data_offset} lies inside the header or jump table")
            ends = np.frombuffer(raw, dtype="<u8", count=n, offset=HEADER_BYTES).astype(np.uint64)
            starts = np.empty(n, dtype=np.uint64)
            starts[0] = header.data_offset
            starts[1:] = ends[:-1]
            lengths = ends - starts  # wraps for decreasing offsets: the range is then rejected as outside
        else:
            if header.data_offset < HEADER_BYTES:
                raise DataError(where, f"data offset {header.data_offset} lies inside the header")
            starts = (header.data_offset + np.arange(n, dtype=np.uint64) * np.uint64(header.block_bytes))
            lengths = np.full(n, header.block_bytes, dtype=np.uint64)
        # Blocks of this file that are cells of the view (the others can never be looked up).
        cells = np.array(shard, dtype=np.int64) * header.file_edge + self.local - self.view.first_block
        inside = ((cells >= 0) & (cells < np.array(self.view.grid.shape, dtype=np.int64))).all(axis=1)
        ids = encode_cells(self.view.grid.coder, cells[inside])
        kinds = np.full(int(inside.sum()), header.block_type, dtype=np.int64)
        return ChunkTable.build(blob, ids, starts[inside], lengths[inside], header.data_offset, blob.size, kinds)

    def placed(self, shard: FileCell, table: ChunkTable) -> np.ndarray:
        # Ids are computed from the file's own blocks: every one is placed here.
        return np.ones(len(table), dtype=bool)


async def _numbers(source: ByteSource, path: str, pattern: re.Pattern[str], want_dir: bool, lo: int, hi: int
                   ) -> list[int]:
    found = []
    async for name, st in source.list(path):
        m = pattern.match(name)
        if m is not None and st.is_dir == want_dir and lo <= int(m.group(1)) <= hi:
            found.append(int(m.group(1)))
    return sorted(found)


async def list_files(source: ByteSource, dir_path: str, lo: list[int], hi: list[int]) -> AsyncIterator[FileCell]:
    """The `.wkw` files of a mag directory within the inclusive file range [lo, hi], from
    listings of its z and y directories (x fastest)."""
    for z in await _numbers(source, dir_path, _DIR["z"], True, lo[2], hi[2]):
        zkey = join_path(dir_path, f"z{z}")
        for y in await _numbers(source, zkey, _DIR["y"], True, lo[1], hi[1]):
            for x in await _numbers(source, join_path(zkey, f"y{y}"), _FILE, False, lo[0], hi[0]):
                yield x, y, z


def wkw_geometry(view: MagView, limit: int) -> VolumeGeometry:
    """A chunk file holds every voxel of its block inside the volume, all channels: exact sizes."""
    return VolumeGeometry(view.grid, view.header.voxel_size, True, limit)


def lz4_bound(size: int) -> int:
    """The largest LZ4 block that `size` bytes compress to (LZ4_COMPRESSBOUND)."""
    return size + size // 255 + 16


class WkwBlockCodec(GeometrySized):
    """A stored block (raw or LZ4, as the table's `extra` column says) -> the chunk file's bytes.

    WKW stores a block x fastest with the channels of each voxel together;
    precomputed's raw encoding is x fastest with channel the slowest axis,
    clipped at the volume edge.
    """

    name = "wkw-block"

    def __init__(self, view: MagView) -> None:
        self.view = view
        header = view.header
        self.block_bytes = header.block_bytes
        self.shape = (header.block_edge,) * 3 + (header.channels,)  # z, y, x, channel
        self.dtype = header.dtype

    async def prepare(self, f: PayloadRef) -> object:
        # Before the payload is fetched: no LZ4 block of this block size is that long.
        if f.extra != RAW and f.length > lz4_bound(self.block_bytes):
            raise DataError(f.where, f"{BLOCK_TYPES.get(f.extra, '?')} block of {f.length:,} bytes is longer than "
                                     f"any encoding of a {self.block_bytes:,}-byte block")
        return None

    def decode(self, payload: bytes, f: PayloadRef, prepared: object = None) -> bytes:
        if f.extra == RAW:
            block = payload
        else:
            try:
                # The raw LZ4 block API with the output bounded by the block size: a block
                # that would decode to more is an error, never a larger allocation.
                block = lz4.block.decompress(payload, uncompressed_size=self.block_bytes)
            except lz4.block.LZ4BlockError as e:
                raise DataError(f.where, f"bad LZ4 block: {e}") from None
        if len(block) != self.block_bytes:
            raise DataError(f.where, f"block decodes to {len(block):,} bytes, expected {self.block_bytes:,}")
        channels = self.shape[3]
        if f.size == self.block_bytes:
            # A whole block (the geometry's size says so): one channel is already the chunk file;
            # several are moved apart in one pass.
            data = block if channels == 1 else np.frombuffer(block, dtype=self.dtype).reshape(-1, channels).T.tobytes()
        else:
            grid = self.view.grid
            cells, _ = grid.coder.decode_array(np.array([f.chunk_id], dtype=np.uint64))
            x, y, z = cells[0].tolist()
            ex, ey, ez = grid.extent((x, y, z))
            voxels = np.frombuffer(block, dtype=self.dtype).reshape(self.shape)[:ez, :ey, :ex]
            data = np.ascontiguousarray(voxels.transpose(3, 0, 1, 2)).tobytes()
        if len(data) != f.size:
            raise DataError(f.where, f"block gives {len(data):,} bytes, the chunk file has {f.size:,}")
        return data
