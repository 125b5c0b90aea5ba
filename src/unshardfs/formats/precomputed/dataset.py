"""A precomputed dataset root: parse `info` files and decide what each directory becomes.

All metadata is read and validated when the mount starts (a handful of small
JSON files, independent of dataset size), so bad input is reported before
the mount goes live and never surfaces later as a puzzling I/O error.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Callable

from ...caches import Caches
from ...errors import ConfigError
from ...passthrough import PassthroughDir
from ...sources.base import ByteSource, ObjectStat, join_key, normalize_key
from ...vtree import BytesFile, DirNode, Node
from ..jsonfile import encode_json, read_json
from .dirs import MultiLodMeshDir, SkeletonDir, VolumeScaleDir
from .shardfile import ShardedStore
from .sharding import ShardingSpec

log = logging.getLogger(__name__)

# Builds the node for a special directory once its stat is known.
DirFactory = Callable[[ObjectStat], DirNode]


@dataclass
class ShardedPart:
    """A sharded directory of the dataset, as `inspect` describes it."""

    kind: str
    key: str
    store: ShardedStore
    details: dict


def vec3(obj: dict, name: str, where: str, default: list | None = None, positive: bool = False) -> tuple[int, int, int]:
    value = obj.get(name, default)
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or (positive and not all(v > 0 for v in value))
            or (not positive and name == "size" and not all(v >= 0 for v in value))):
        kind = "positive integers" if positive else "integers"
        raise ConfigError(f"{where}: {name} must be a list of 3 {kind}, got {value!r}")
    return (value[0], value[1], value[2])


class PrecomputedDataset:
    """The virtual tree of one precomputed dataset rooted at the source's root."""

    def __init__(self, source: ByteSource, caches: Caches) -> None:
        self.source = source
        self.caches = caches
        self.special: dict[str, DirFactory] = {}
        # Every directory the info files name (scales, mesh and skeleton
        # directories, and their parents): what a source that cannot list
        # (plain HTTP) shows, and what its lookups trust without a stat.
        self.known_dirs: set[str] = set()
        self.root_info: BytesFile | None = None
        # What `unshardfs inspect` reports: one entry per sharded directory.
        self.sharded: list[ShardedPart] = []

    async def build(self) -> DirNode:
        loaded = await read_json(self.source, "info")
        if loaded is None:
            raise ConfigError(f"{self.source.description} has no info file: not a precomputed dataset")
        info, info_st = loaded
        if not isinstance(info, dict):
            raise ConfigError("info must be a JSON object")
        shown = copy.deepcopy(info)
        scales = info.get("scales")
        if scales is not None:
            if not isinstance(scales, list):
                raise ConfigError("info: scales must be a list")
            for i, scale in enumerate(scales):
                if not isinstance(scale, dict):
                    raise ConfigError(f"info: scales[{i}] must be an object")
                if "sharding" in scale:
                    self._add_scale(scale, f"info: scales[{i}]")
                    del shown["scales"][i]["sharding"]
                elif isinstance(scale.get("key"), str):
                    try:
                        self._know(normalize_key(scale["key"]))
                    except ConfigError:
                        pass  # an unsharded scale is not ours to validate; it passes through or not
        for member, kind in (("mesh", "mesh"), ("skeletons", "skeletons")):
            if member in info:
                await self._add_object_dir(info[member], kind)
        if isinstance(info.get("segment_properties"), str):
            try:
                self._know(normalize_key(info["segment_properties"]))
            except ConfigError:
                pass
        self.root_info = BytesFile(encode_json(shown), info_st.mtime_ns)
        root_st = await self.source.stat("")
        assert root_st is not None
        self.dir_stat = ObjectStat(0, info_st.mtime_ns, True)
        return PassthroughDir(self.source, "", root_st, self._override, self._declared)

    def _know(self, dir_key: str) -> None:
        while dir_key:
            self.known_dirs.add(dir_key)
            dir_key = dir_key.rpartition("/")[0]

    def _declared(self, dir_key: str) -> list[str]:
        names = {key.rpartition("/")[2] for key in self.known_dirs if key.rpartition("/")[0] == dir_key}
        # `provenance` is the one standard file the info does not name.
        return sorted(names) + (["info", "provenance"] if dir_key == "" else [])

    async def _override(self, key: str, st: ObjectStat | None) -> Node | None:
        if key == "info" and self.root_info is not None:
            return self.root_info
        factory = self.special.get(key)
        if factory is not None and (st is None or st.is_dir):
            return factory(st or self.dir_stat)
        if st is None and key in self.known_dirs:
            return PassthroughDir(self.source, key, self.dir_stat, self._override, self._declared)
        return None

    def _add_scale(self, scale: dict, where: str) -> None:
        key = scale.get("key")
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where}: key must be a non-empty string")
        where = f"{where} ({key})"
        spec = ShardingSpec.from_json(scale["sharding"])
        chunk_sizes = scale.get("chunk_sizes")
        if not isinstance(chunk_sizes, list) or len(chunk_sizes) != 1:
            raise ConfigError(f"{where}: a sharded scale must have exactly one chunk size, got {chunk_sizes!r}")
        chunk_size = vec3({"chunk_sizes": chunk_sizes[0]}, "chunk_sizes", where, positive=True)
        size = vec3(scale, "size", where)
        voxel_offset = vec3(scale, "voxel_offset", where, default=[0, 0, 0])
        dir_key = normalize_key(key)
        if not dir_key:
            raise ConfigError(f"{where}: a scale key must name a subdirectory")
        store = ShardedStore(self.source, dir_key, spec, self.caches)
        self._know(dir_key)
        self.special[dir_key] = lambda st: VolumeScaleDir(
            self.source, dir_key, st, store, size, chunk_size, voxel_offset)
        grid = [-(-s // c) for s, c in zip(size, chunk_size)]
        self.sharded.append(ShardedPart("volume scale", dir_key, store, {
            "encoding": scale.get("encoding"), "size": list(size), "chunk_size": list(chunk_size),
            "grid_cells": grid[0] * grid[1] * grid[2]}))

    async def _add_object_dir(self, value: object, kind: str) -> None:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"info: {kind} must be a non-empty string, got {value!r}")
        dir_key = normalize_key(value)
        if not dir_key:
            raise ConfigError(f"info: {kind} must name a subdirectory")
        self._know(dir_key)
        loaded = await read_json(self.source, join_key(dir_key, "info"))
        if loaded is None:
            return  # nothing to rewrite; the directory (if any) passes through
        info, st = loaded
        where = f"{dir_key}/info"
        if not isinstance(info, dict):
            raise ConfigError(f"{where} must be a JSON object")
        if "sharding" not in info:
            return
        spec = ShardingSpec.from_json(info["sharding"])
        shown = {k: v for k, v in info.items() if k != "sharding"}
        info_file = BytesFile(encode_json(shown), st.mtime_ns)
        store = ShardedStore(self.source, dir_key, spec, self.caches)
        type_ = info.get("@type")
        if type_ == "neuroglancer_multilod_draco":
            cls = MultiLodMeshDir
        elif type_ == "neuroglancer_skeletons":
            cls = SkeletonDir
        else:
            # e.g. sharded legacy single-resolution meshes: there is no
            # standard unsharded form to show, so the directory passes through.
            log.warning("%s: sharded %s of @type %r has no unsharded form here; shown unchanged", where, kind, type_)
            return
        self.special[dir_key] = lambda dst: cls(self.source, dir_key, dst, store, info_file)
        self.sharded.append(ShardedPart(type_, dir_key, store, {}))


async def build_tree(source: ByteSource, caches: Caches) -> DirNode:
    return await PrecomputedDataset(source, caches).build()


async def open_dataset(source: ByteSource, caches: Caches) -> tuple[PrecomputedDataset, DirNode]:
    dataset = PrecomputedDataset(source, caches)
    return dataset, await dataset.build()
