"""A DVID `export-shards` directory shown as an unsharded precomputed segmentation.

The export has no `info`; the user supplies the Neuroglancer volume spec
it was exported against (`--info`, or an `info` file in the export). Scale
N's shard files `s<N>/<ox>_<oy>_<oz>.arrow` are named by voxel origin; the
spec's sharding tells which shard a chunk belongs to, so a chunk file is
found with one index lookup and no listing of the export.

Each chunk file holds the decoded block as raw little-endian uint64, x
fastest, clipped at the volume edge. Its size is known from the geometry
alone, so listings and `stat` read no block data; decoded chunks are cached.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import AsyncIterator

import numpy as np
import zstandard

from ...caches import Caches
from ...errors import ConfigError, DataError
from ...logonce import log_once
from ...overlay import OverlayDir
from ...sources.base import ByteSource, ObjectStat, join_key
from ...sources.blob import Blob
from ...vtree import CHILD_ID_BITS, BytesFile, DirNode, Entry, FileNode, Node
from ..jsonfile import encode_json, read_json
from ..precomputed.dataset import vec3
from ..precomputed.grid import Cell, ChunkGrid
from ..precomputed.sharding import ShardingSpec
from .block import decode_block
from .shard import ArrowShardReader, RecordRef, ShardIndex

log = logging.getLogger(__name__)

SHARD_FILE = re.compile(r"^(\d+)_(\d+)_(\d+)\.arrow$")
MAX_BLOCK_BYTES = 64 << 20  # a 64^3 block decompresses to well under this


class DvidScale:
    """Scale N of the export: its shard files, their indexes, and decoded chunks."""

    def __init__(self, source: ByteSource, dir_key: str, grid: ChunkGrid, spec: ShardingSpec, caches: Caches,
                 supervoxels: bool) -> None:
        self.source = source
        self.dir_key = dir_key
        self.grid = grid
        self.spec = spec
        self.caches = caches
        self.supervoxels = supervoxels
        self.reader = ArrowShardReader(source, grid.chunk_size, self.owned)
        self._files: dict[int, str] | None = None

    def owned(self, cells: np.ndarray, shard: int) -> np.ndarray:
        """Which cells lie in the grid and hash to `shard` under the spec."""
        inside = ((cells >= 0) & (cells < np.array(self.grid.shape, dtype=np.int64))).all(axis=1)
        codes = np.array([self.grid.coder.encode(tuple(c)) if ok else 0
                          for c, ok in zip(cells.tolist(), inside.tolist())], dtype=np.uint64)
        shards, _ = self.spec.locations_array(codes)
        return inside & (shards == np.uint64(shard))

    def shard_of(self, cell: Cell) -> int:
        return self.spec.location(self.grid.coder.encode(cell))[0]

    async def files(self) -> dict[int, str]:
        """Shard number -> file name, from one listing of the scale directory."""
        if self._files is None:
            found: dict[int, str] = {}
            async for name, st in self.source.list(self.dir_key):
                m = None if st.is_dir else SHARD_FILE.match(name)
                if m is None:
                    continue
                origin = tuple(int(v) for v in m.groups())
                if any(o % c for o, c in zip(origin, self.grid.chunk_size)):
                    log_once(log, f"origin:{name}", "%s/%s: origin is not chunk-aligned; ignored", self.dir_key, name)
                    continue
                cell = tuple(o // c for o, c in zip(origin, self.grid.chunk_size))
                if any(g >= s for g, s in zip(cell, self.grid.shape)):
                    log_once(log, f"origin:{name}", "%s/%s: origin lies outside the volume; ignored", self.dir_key, name)
                    continue
                shard = self.shard_of(cell)  # type: ignore[arg-type]
                if shard in found:
                    log_once(log, f"dup:{name}", "%s: %s and %s are the same shard; using %s", self.dir_key,
                             found[shard], name, min(found[shard], name))
                    name = min(found[shard], name)
                found[shard] = name
            self._files = dict(sorted(found.items()))
        return self._files

    async def index(self, shard: int) -> ShardIndex | None:
        name = (await self.files()).get(shard)
        if name is None:
            return None
        key = join_key(self.dir_key, name)
        st = await self.source.stat(key)
        if st is None or st.is_dir:
            return None
        blob = Blob.of(key, st)
        cache_key = (blob.label, blob.version)
        cached = self.caches.shard_index.get(cache_key)
        if cached is None:
            cached = await self.reader.load(blob, key.removesuffix(".arrow"), shard)
            self.caches.put(self.caches.shard_index, cache_key, cached)
        return cached

    async def decoded(self, index: ShardIndex, cell: Cell, ref: RecordRef) -> bytes:
        where = f"{index.blob.label} block {cell}"
        cache_key = (index.blob.label, index.blob.version, cell, self.supervoxels)
        data = self.caches.decoded_chunk.get(cache_key)
        if data is not None:
            return data
        record = await self.reader.record(index, ref, where)
        voxels = tuple(g * c for g, c in zip(cell, self.grid.chunk_size))
        if record.coords != cell and record.coords != voxels:
            raise DataError(where, f"record holds block {record.coords}, the index places it at {cell}")
        raw = record.block
        if record.zstd or raw[:4] == b"\x28\xb5\x2f\xfd":
            try:
                raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=MAX_BLOCK_BYTES)
            except zstandard.ZstdError as e:
                raise DataError(where, f"bad zstd data: {e}") from e
        if record.uncompressed_size is not None and len(raw) != record.uncompressed_size:
            raise DataError(where, f"block is {len(raw)} bytes, the record says {record.uncompressed_size}")
        try:
            block = decode_block(raw, None if self.supervoxels else agglomeration(record.supervoxels, record.labels))
        except ValueError as e:
            raise DataError(where, f"bad DVID block: {e}") from e
        want = tuple(reversed(self.grid.chunk_size))
        if block.shape != want:
            raise DataError(where, f"block is {block.shape[::-1]} voxels (x, y, z), chunks are "
                                   f"{self.grid.chunk_size}")
        ex, ey, ez = self.grid.extent(cell)
        data = np.ascontiguousarray(block[:ez, :ey, :ex]).astype("<u8", copy=False).tobytes()
        self.caches.put(self.caches.decoded_chunk, cache_key, data)
        return data


def agglomeration(supervoxels: np.ndarray, labels: np.ndarray):
    """A function mapping block label lists from supervoxel ids to agglomerated labels."""
    order = np.argsort(supervoxels, kind="stable")
    keys, values = supervoxels[order], labels[order]

    def relabel(ids: np.ndarray) -> np.ndarray:
        if not len(keys):
            return ids
        at = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
        return np.where(keys[at] == ids, values[at], ids)
    return relabel


class DvidChunkFile(FileNode):
    __slots__ = ("scale", "index", "cell", "ref")

    def __init__(self, scale: DvidScale, index: ShardIndex, cell: Cell, ref: RecordRef, ident: int | None) -> None:
        ex, ey, ez = scale.grid.extent(cell)
        super().__init__(8 * ex * ey * ez, index.blob.mtime_ns)
        self.ident = ident
        self.scale = scale
        self.index = index
        self.cell = cell
        self.ref = ref

    async def read(self, offset: int, size: int) -> bytes:
        if not self.span(offset, size):
            return b""
        return (await self.scale.decoded(self.index, self.cell, self.ref))[offset:offset + size]

    def xattrs(self) -> dict[str, bytes]:
        return {"user.unshardfs.source": self.index.blob.label.encode(),
                "user.unshardfs.offset": str(self.ref.offset).encode(),
                "user.unshardfs.length": str(self.ref.length).encode(),
                "user.unshardfs.encoding": b"dvid-supervoxels" if self.scale.supervoxels else b"dvid-agglomerated"}


class DvidScaleDir(DirNode):
    """A scale's unsharded chunk files, computed from the shard indexes."""

    __slots__ = ("scale", "stable_key")

    def __init__(self, scale: DvidScale, mtime_ns: int) -> None:
        super().__init__(mtime_ns)
        self.scale = scale
        self.stable_key = f"dvid:{scale.dir_key}"

    def _ident(self, cell: Cell) -> int | None:
        code = self.scale.grid.coder.encode(cell)
        return code if code < 1 << CHILD_ID_BITS else None

    async def lookup(self, name: str) -> Node | None:
        cell = self.scale.grid.parse_chunk_name(name)
        if cell is None:
            return None
        index = await self.scale.index(self.scale.shard_of(cell))
        if index is None or cell not in index.records:
            return None
        return DvidChunkFile(self.scale, index, cell, index.records[cell], self._ident(cell))

    async def entries(self) -> AsyncIterator[list[Entry]]:  # type: ignore[override]
        for shard in await self.scale.files():
            try:
                index = await self.scale.index(shard)
            except DataError as e:
                log_once(log, f"list:{e}", "listing %s: skipping shard: %s", self.scale.dir_key, e)
                continue
            if index is None or not index.records:
                continue
            cells = sorted(index.records)
            names = self.scale.grid.names(np.array(cells, dtype=np.int64))
            yield [(name, DvidChunkFile(self.scale, index, cell, index.records[cell], self._ident(cell)))
                   for name, cell in zip(names, cells)]

    def child_name(self, ident: int) -> str:
        return self.scale.grid.name_of_code(ident)


class ExportRoot(OverlayDir):
    """The export directory: `info`, one directory per scale key, the `s<N>` dirs hidden."""

    __slots__ = ("hidden",)

    def __init__(self, source: ByteSource, st: ObjectStat, fixed: dict[str, Node], hidden: frozenset[str]) -> None:
        super().__init__(source, "", st, fixed, "dvid-root")
        self.hidden = hidden

    def hides(self, name: str) -> bool:
        return name in self.hidden


class DvidExport:
    def __init__(self, source: ByteSource, caches: Caches, info_path: str | None = None,
                 supervoxels: bool = False) -> None:
        self.source = source
        self.caches = caches
        self.info_path = info_path
        self.supervoxels = supervoxels
        self.scales: list[DvidScale] = []

    async def _info(self) -> tuple[dict, int]:
        if self.info_path is not None:
            import json
            import os

            try:
                with open(self.info_path, "rb") as f:
                    info = json.load(f)
                return info, os.stat(self.info_path).st_mtime_ns
            except OSError as e:
                raise ConfigError(f"cannot read --info {self.info_path}: {e.strerror}") from e
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConfigError(f"--info {self.info_path} is not valid JSON: {e}") from e
        loaded = await read_json(self.source, "info")
        if loaded is None:
            raise ConfigError(f"{self.source.description} has no info file; give the volume spec the export was "
                              "made against with --info SPEC.json")
        return loaded[0], loaded[1].mtime_ns  # type: ignore[return-value]

    async def build(self) -> DirNode:
        if not self.source.listable:
            raise ConfigError(f"{self.source.description}: DVID exports name shard files by origin, so they need a "
                              "source that can list (a local directory, gs:// or s3://)")
        info, mtime_ns = await self._info()
        if not isinstance(info, dict) or not isinstance(info.get("scales"), list) or not info["scales"]:
            raise ConfigError("the DVID volume spec must be a precomputed info object with a non-empty scales list")
        shown = copy.deepcopy(info)
        shown.update({"data_type": "uint64", "type": info.get("type", "segmentation")})
        root_st = await self.source.stat("")
        assert root_st is not None
        fixed: dict[str, Node] = {}
        hidden = set()
        for i, scale in enumerate(info["scales"]):
            where = f"info: scales[{i}]"
            if not isinstance(scale, dict) or not isinstance(scale.get("key"), str) or not scale["key"] \
                    or "/" in scale["key"] or scale["key"] in (".", "..", "info"):
                raise ConfigError(f"{where}: key must be a plain directory name")
            if "sharding" not in scale:
                raise ConfigError(f"{where}: no sharding spec; it is needed to find DVID's shard files")
            spec = ShardingSpec.from_json(scale["sharding"])
            chunks = scale.get("chunk_sizes")
            if not isinstance(chunks, list) or len(chunks) != 1:
                raise ConfigError(f"{where}: needs exactly one chunk size, got {chunks!r}")
            grid = ChunkGrid(vec3(scale, "size", where), vec3({"c": chunks[0]}, "c", where, positive=True),
                             vec3(scale, "voxel_offset", where, default=[0, 0, 0]))
            dvid_scale = DvidScale(self.source, f"s{i}", grid, spec, self.caches, self.supervoxels)
            self.scales.append(dvid_scale)
            fixed[scale["key"]] = DvidScaleDir(dvid_scale, root_st.mtime_ns)
            hidden.add(f"s{i}")
            view = shown["scales"][i]
            view.pop("sharding", None)
            view.pop("compressed_segmentation_block_size", None)
            view["encoding"] = "raw"
        fixed["info"] = BytesFile(encode_json(shown), mtime_ns)
        return ExportRoot(self.source, root_st, fixed, frozenset(hidden))


async def looks_like_export(source: ByteSource) -> bool:
    """An `s0` directory holding `.arrow` files (DVID writes no other marker)."""
    st = await source.stat("s0")
    if st is None or not st.is_dir:
        return False
    async for name, _ in source.list("s0"):
        if SHARD_FILE.match(name):
            return True
    return False
