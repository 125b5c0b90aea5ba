"""A precomputed dataset root: parse `info` files and decide what each directory becomes.

All metadata is read and validated when the mount starts (a handful of small
JSON files, independent of dataset size), so bad input is reported before
the mount goes live and never surfaces later as a puzzling I/O error.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import AsyncIterator, Callable

from unshardfs.core.chunks import ChunkContext
from unshardfs.core.codecs import codec
from unshardfs.core.dirs import ShardedDir
from unshardfs.core.geometry import Geometry
from unshardfs.core.inventory import ChunkInventory, InventoryPart
from unshardfs.core.jsonfile import encode_json, read_json
from unshardfs.core.naming import Naming
from unshardfs.core.runtime import Runtime
from unshardfs.formats.precomputed.annotations import ANNOTATIONS_TYPE, CellNaming, grid_of, rank_of
from unshardfs.formats.precomputed.dirs import MultiLodMeshDir, SegmentNaming
from unshardfs.formats.precomputed.shards import PrecomputedStore
from unshardfs.sources.base import ObjectStat, join_path, normalize_path
from unshardfs.tree.nodes import BytesFile, DirNode, Node, Verdict
from unshardfs.tree.passthrough import PassthroughDir
from unshardfs.util.errors import ConfigError, quote
from unshardfs.util.fields import INT_LIMIT, VOXEL_LIMIT, Fields, MetadataError, ShallowEdit, as_ints, grid_shape
from unshardfs.util.limits import METADATA_LEVELS
from unshardfs.volume.grid import ChunkGrid, GridNaming, VolumeGeometry
from unshardfs.volume.sharding import ShardingSpec, layout

log = logging.getLogger(__name__)

# Builds the node for a special directory once its stat is known.
DirFactory = Callable[[ObjectStat], DirNode]
VOXEL_BYTES = {"uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "float32": 4,
               "uint64": 8, "int64": 8, "float64": 8}
MORTON_BITS = 64  # chunk ids are uint64


class PrecomputedDataset:
    """The virtual tree of one precomputed dataset rooted at the source's root."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.source = runtime.source
        self.special: dict[str, DirFactory] = {}
        # Every directory the info files name (scales, mesh and skeleton
        # directories, and their parents): what a source that cannot list
        # (plain HTTP) shows, and what its lookups trust without a stat.
        self.known_dirs: set[str] = set()
        self.root_info: BytesFile | None = None
        self.parts: list[InventoryPart] = []

    async def build(self) -> DirNode:
        loaded = await read_json(self.source, "info", self.runtime.limits)
        if loaded is None:
            raise ConfigError(f"{self.source.description} has no info file: not a precomputed dataset")
        raw, info_st = loaded
        info = Fields(raw, "info")
        shown = ShallowEdit(info.raw)
        for i, scale in enumerate(info.objects("scales", default=[], max_length=METADATA_LEVELS)):
            if scale.has("sharding"):
                self._add_scale(info, scale)
                del shown.at("scales", i)["sharding"]
            elif isinstance(scale.get("key"), str):
                self._know_quietly(scale.get("key"))
        for member in ("mesh", "skeletons"):
            if info.has(member):
                await self._add_object_dir(info.str(member), info.at(member))
        if info.get("@type") == ANNOTATIONS_TYPE:
            self._add_annotations(info, shown)
        if isinstance(info.get("segment_properties"), str):
            self._know_quietly(info.get("segment_properties"))
        self.root_info = BytesFile(encode_json(shown.root), info_st.mtime_ns)
        root_st = await self.source.stat("")
        assert root_st is not None
        self.dir_stat = ObjectStat(0, info_st.mtime_ns, True)
        return PassthroughDir(self.source, "", root_st, self._override, self._declared)

    def _know(self, dir_path: str) -> None:
        while dir_path:
            self.known_dirs.add(dir_path)
            dir_path = dir_path.rpartition("/")[0]

    def _know_quietly(self, path: str) -> None:
        """An unsharded part is not ours to validate: it passes through, or not."""
        try:
            self._know(normalize_path(path))
        except ConfigError:
            pass

    def _declared(self, dir_path: str) -> list[str]:
        names = {path.rpartition("/")[2] for path in self.known_dirs if path.rpartition("/")[0] == dir_path}
        # `provenance` is the one standard file the info does not name.
        return sorted(names) + (["info", "provenance"] if dir_path == "" else [])

    async def _override(self, path: str, st: ObjectStat | None) -> Node | Verdict:
        if path == "info" and self.root_info is not None:
            return self.root_info
        factory = self.special.get(path)
        if factory is not None and (st is None or st.is_dir):
            return factory(st or self.dir_stat)
        if st is None and path in self.known_dirs:
            return PassthroughDir(self.source, path, self.dir_stat, self._override, self._declared)
        return Verdict.PASS

    def _dir_path(self, value: str, where: str) -> str:
        try:
            dir_path = normalize_path(value)
        except ConfigError as e:
            raise MetadataError(where, str(e)) from None
        if not dir_path:
            raise MetadataError(where, "must name a subdirectory")
        return dir_path

    def _add_scale(self, info: Fields, scale: Fields) -> None:
        where = scale.where
        dir_path = self._dir_path(scale.str("key"), scale.at("key"))
        spec = ShardingSpec.from_json(scale.get("sharding"), scale.at("sharding"))
        chunk_sizes = scale.list("chunk_sizes")
        if len(chunk_sizes) != 1:
            raise MetadataError(scale.at("chunk_sizes"), f"a sharded scale must have exactly one chunk size, got "
                                f"{len(chunk_sizes)}")
        chunk = as_ints(chunk_sizes[0], f"{scale.at('chunk_sizes')}[0]", 3, lo=1, hi=VOXEL_LIMIT)
        size = scale.ints("size", 3, lo=0, hi=VOXEL_LIMIT)
        offset = scale.ints("voxel_offset", 3, lo=-VOXEL_LIMIT, hi=VOXEL_LIMIT, default=[0, 0, 0])
        cells = grid_shape(size, chunk, where)
        grid = ChunkGrid(size, chunk, offset)
        if grid.coder.total_bits > MORTON_BITS:
            raise MetadataError(where, f"a grid of {cells} chunks needs more than 64 bits of chunk id")
        runtime = self.runtime
        store = PrecomputedStore(runtime, dir_path, spec)
        encoding = scale.get("encoding")
        data_type = info.get("data_type")
        voxel = VOXEL_BYTES.get(data_type) if isinstance(data_type, str) else None  # a list is unhashable
        channels = info.get("num_channels", 1)
        if voxel is not None and isinstance(channels, int) and not isinstance(channels, bool) \
                and 0 < channels <= 1 << 16:
            if math.prod(chunk) * voxel * channels * VolumeGeometry.SLACK + VolumeGeometry.EXTRA > INT_LIMIT:
                raise MetadataError(scale.at("chunk_sizes"), "chunks this large cannot be addressed")
            geometry: Geometry = VolumeGeometry(grid, voxel * channels, encoding == "raw",
                                                runtime.limits.payload_bytes)
        else:
            geometry = Geometry(runtime.limits.payload_bytes)
        ctx = ChunkContext(store, GridNaming(grid), codec(spec.data_encoding), geometry)
        self._know(dir_path)
        self.special[dir_path] = lambda st: ShardedDir(self.source, dir_path, st, ctx)
        self.parts.append(ChunkInventory("volume scale", dir_path, ctx, layout(spec), 1 << spec.shard_bits, {
            "encoding": encoding, "size": list(size), "chunk_size": list(chunk),
            "grid_cells": cells[0] * cells[1] * cells[2]}))

    async def _add_object_dir(self, value: str, where: str) -> None:
        dir_path = self._dir_path(value, where)
        self._know(dir_path)
        loaded = await read_json(self.source, join_path(dir_path, "info"), self.runtime.limits)
        if loaded is None:
            return  # nothing to rewrite; the directory (if any) passes through
        raw, st = loaded
        info = Fields(raw, f"{dir_path}/info")
        if not info.has("sharding"):
            return
        spec = ShardingSpec.from_json(info.get("sharding"), info.at("sharding"))
        info_file = BytesFile(encode_json({k: v for k, v in info.raw.items() if k != "sharding"}), st.mtime_ns)
        store = PrecomputedStore(self.runtime, dir_path, spec)
        payloads = codec(spec.data_encoding)
        kind = info.get("@type")
        if kind == "neuroglancer_multilod_draco":
            manifests = ChunkContext(store, SegmentNaming(".index", 1, 1), payloads)
            self.special[dir_path] = lambda dst: MultiLodMeshDir(self.source, dir_path, dst, manifests,
                                                                {"info": info_file})
            ctx = manifests
        elif kind == "neuroglancer_skeletons":
            ctx = ChunkContext(store, SegmentNaming(), payloads)
            self.special[dir_path] = lambda dst: ShardedDir(self.source, dir_path, dst, ctx, {"info": info_file})
        else:
            # e.g. sharded legacy single-resolution meshes: there is no
            # standard unsharded form to show, so the directory passes through.
            log.warning("%s: sharded %s of @type %r has no unsharded form here; shown unchanged", info.where,
                        where, kind)
            return
        self.parts.append(ChunkInventory(str(kind), dir_path, ctx, layout(spec), 1 << spec.shard_bits))

    def _add_annotations(self, info: Fields, shown: ShallowEdit) -> None:
        """Each sharded index of an annotation set (by_id, relationships, spatial levels) as a
        directory of unsharded files; `sharding` is removed from what the `info` shows."""
        rank = rank_of(info)
        indexes: list[tuple[Fields, tuple[str | int, ...], str]] = []
        if info.has("by_id"):
            indexes.append((info.obj("by_id"), ("by_id",), "annotations by_id"))
        for i, rel in enumerate(info.objects("relationships", default=[], max_length=METADATA_LEVELS)):
            indexes.append((rel, ("relationships", i), f"annotation relationship {quote(rel.get('id'))}"))
        for i, level in enumerate(info.objects("spatial", default=[], max_length=METADATA_LEVELS)):
            indexes.append((level, ("spatial", i), f"annotation spatial level {i}"))
        for index, path, kind in indexes:
            if not index.has("sharding"):
                if isinstance(index.get("key"), str):
                    self._know_quietly(index.get("key"))
                continue
            dir_path = self._dir_path(index.str("key"), index.at("key"))
            spec = ShardingSpec.from_json(index.get("sharding"), index.at("sharding"))
            naming: Naming = CellNaming(grid_of(index, rank)) if "spatial" in kind else SegmentNaming()
            ctx = ChunkContext(PrecomputedStore(self.runtime, dir_path, spec), naming, codec(spec.data_encoding))
            self._know(dir_path)
            self.special[dir_path] = functools.partial(ShardedDir, self.source, dir_path, chunks=ctx)
            self.parts.append(ChunkInventory(kind, dir_path, ctx, layout(spec), 1 << spec.shard_bits))
            del shown.at(*path)["sharding"]

    async def inventory(self) -> AsyncIterator[InventoryPart]:
        for part in self.parts:
            yield part
