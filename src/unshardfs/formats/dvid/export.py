"""A DVID `export-shards` directory shown as an unsharded precomputed segmentation.

The export has no `info`; the user supplies the Neuroglancer volume spec
it was exported against (`--info`, or an `info` file in the export). Each
scale's chunk files hold the decoded block as raw little-endian uint64, x
fastest, clipped at the volume edge: a chunk's size is known from the
geometry alone, so listings and `stat` read no block data.
"""

from __future__ import annotations

import os
from typing import AsyncIterator

from unshardfs.core.chunks import ChunkContext
from unshardfs.core.dirs import ChunksDir
from unshardfs.core.inventory import ChunkInventory, InventoryPart
from unshardfs.core.jsonfile import encode_json, read_json
from unshardfs.core.runtime import Runtime
from unshardfs.formats.dvid.store import SHARD_FILE, DvidBlockCodec, DvidStore, dvid_geometry
from unshardfs.sources.base import ByteSource, ObjectStat
from unshardfs.tree.nodes import BytesFile, DirNode, Node
from unshardfs.tree.overlay import OverlayDir
from unshardfs.util.errors import ConfigError
from unshardfs.util.fdpath import open_argument
from unshardfs.util.fields import VOXEL_LIMIT, Fields, ShallowEdit, as_ints, grid_shape, load_json
from unshardfs.util.limits import METADATA_LEVELS
from unshardfs.volume.grid import ChunkGrid, GridNaming
from unshardfs.volume.sharding import ShardingSpec, layout


class ExportRoot(OverlayDir):
    """The export directory: `info`, one directory per scale key, the `s<N>` dirs hidden."""

    __slots__ = ("hidden",)

    def __init__(self, source: ByteSource, st: ObjectStat, fixed: dict[str, Node], hidden: frozenset[str]) -> None:
        super().__init__(source, "", st, fixed, "dvid-root")
        self.hidden = hidden

    def hides(self, name: str) -> bool:
        return name in self.hidden


class DvidExport:
    def __init__(self, runtime: Runtime, info_path: str | None = None, supervoxels: bool = False) -> None:
        self.runtime = runtime
        self.source = runtime.source
        self.info_path = info_path
        self.supervoxels = supervoxels
        self.parts: list[InventoryPart] = []

    async def _info(self) -> tuple[object, int]:
        if self.info_path is not None:
            fd = open_argument(self.info_path, "--info")  # a regular file, opened without blocking
            try:
                with os.fdopen(fd, "rb") as f:
                    raw = f.read(self.runtime.limits.metadata_bytes + 1)  # one byte more: too large is an error
                    mtime_ns = os.fstat(f.fileno()).st_mtime_ns
            except OSError as e:
                raise ConfigError(f"cannot read --info {self.info_path}: {e.strerror}") from e
            return load_json(raw, f"--info {self.info_path}", self.runtime.limits), mtime_ns
        loaded = await read_json(self.source, "info", self.runtime.limits)
        if loaded is None:
            raise ConfigError(f"{self.source.description} has no info file; give the volume spec the export was "
                              "made against with --info SPEC.json")
        return loaded[0], loaded[1].mtime_ns

    async def build(self) -> DirNode:
        if not self.source.listable:
            raise ConfigError(f"{self.source.description}: DVID exports name shard files by origin, so they need a "
                              "source that can list (a local directory, gs:// or s3://)")
        raw, mtime_ns = await self._info()
        info = Fields(raw, "the DVID volume spec")
        scales = list(info.objects("scales", max_length=METADATA_LEVELS))
        if not scales:
            raise ConfigError("the DVID volume spec must be a precomputed info object with a non-empty scales list")
        shown = ShallowEdit(info.raw)
        shown.root.update({"data_type": "uint64", "type": info.get("type", "segmentation")})
        root_st = await self.source.stat("")
        assert root_st is not None
        fixed: dict[str, Node] = {}
        hidden = set()
        for i, scale in enumerate(scales):
            key = scale.str("key")
            if not key or "/" in key or key in (".", "..", "info"):
                raise ConfigError(f"{scale.at('key')}: must be a plain directory name")
            if not scale.has("sharding"):
                raise ConfigError(f"{scale.where}: no sharding spec; it is needed to find DVID's shard files")
            spec = ShardingSpec.from_json(scale.get("sharding"), scale.at("sharding"))
            chunks = scale.list("chunk_sizes")
            if len(chunks) != 1:
                raise ConfigError(f"{scale.at('chunk_sizes')}: needs exactly one chunk size, got {len(chunks)}")
            chunk = as_ints(chunks[0], f"{scale.at('chunk_sizes')}[0]", 3, lo=1, hi=1 << 12)
            size = scale.ints("size", 3, lo=0, hi=VOXEL_LIMIT)
            cells = grid_shape(size, chunk, scale.where)
            offset = scale.ints("voxel_offset", 3, lo=-VOXEL_LIMIT, hi=VOXEL_LIMIT, default=[0, 0, 0])
            grid = ChunkGrid(size, chunk, offset)
            store = DvidStore(self.runtime, f"s{i}", grid, spec)
            ctx = ChunkContext(store, GridNaming(grid), DvidBlockCodec(store, self.supervoxels),
                               dvid_geometry(grid, self.runtime.limits.payload_bytes))
            fixed[key] = ChunksDir(ctx, root_st.mtime_ns, f"dvid:s{i}")
            hidden.add(f"s{i}")
            self.parts.append(ChunkInventory("dvid scale", key, ctx, f"Arrow shard files s{i}/; {layout(spec)}",
                                             1 << spec.shard_bits, {"encoding": ctx.codec.label, "size": list(size),
                                                                    "chunk_size": list(chunk),
                                                                    "grid_cells": cells[0] * cells[1] * cells[2]}))
            view = shown.at("scales", i)
            view.pop("sharding", None)
            view.pop("compressed_segmentation_block_size", None)
            view["encoding"] = "raw"
        fixed["info"] = BytesFile(encode_json(shown.root), mtime_ns)
        return ExportRoot(self.source, root_st, fixed, frozenset(hidden))

    async def inventory(self) -> AsyncIterator[InventoryPart]:
        for part in self.parts:
            yield part


async def looks_like_export(source: ByteSource) -> bool:
    """An `s0` directory holding `.arrow` files (DVID writes no other marker)."""
    st = await source.stat("s0")
    if st is None or not st.is_dir:
        return False
    async for name, _ in source.list("s0"):
        if SHARD_FILE.match(name):
            return True
    return False
