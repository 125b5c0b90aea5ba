"""A Zarr v3 hierarchy under one of the two views, resolved lazily.

Only the root's `zarr.json` is read at mount time (and must be valid);
every other directory becomes an array or group node the first time it is
looked up, from its own `zarr.json`. That keeps mounting a store with
thousands of arrays instant, and needs no listing of the store.

A child array whose metadata cannot be shown in the chosen view is logged
once with the reason: the v3 view then shows it unchanged (still a valid,
sharded array), the v2 view leaves it out.
"""

from __future__ import annotations

import logging
import math
from typing import Any, AsyncIterator, cast

from unshardfs.core.chunks import ChunkContext
from unshardfs.core.codecs import Crc32cSuffix, Stored
from unshardfs.core.inventory import ChunkInventory, InventoryPart, NotShown
from unshardfs.core.jsonfile import encode_json, read_built
from unshardfs.core.runtime import Runtime
from unshardfs.formats.zarr.keys import KeyLayout
from unshardfs.formats.zarr.metadata import ArrayMeta, node_type
from unshardfs.formats.zarr.sharding import Unsharded, Unsupported, unshard
from unshardfs.formats.zarr.store import ZarrStore
from unshardfs.formats.zarr.tree import ArrayDir, ChunkGeometry, ChunkView, FlatNaming, GroupDir
from unshardfs.formats.zarr.v2 import DTYPES, array_v2, attrs_v2, ome_attributes
from unshardfs.sources.base import ObjectStat, join_path, name_problem
from unshardfs.tree.nodes import BytesFile, DirNode, Node, Verdict
from unshardfs.tree.passthrough import PassthroughDir
from unshardfs.util.errors import ConfigError
from unshardfs.util.logonce import log_once

log = logging.getLogger(__name__)

VIEWS = ("zarr3", "zarr2")


def _children(entries: dict[str, Any] | None) -> tuple[str, ...]:
    """Direct children named by consolidated metadata (paths are relative to the group);
    names that cannot be a path segment (`..`, NUL, ...) are logged and left out."""
    names = set()
    for path in entries or {}:
        name = path.split("/")[0] if isinstance(path, str) else ""
        problem = name_problem(name)
        if problem is None:
            names.add(name)
        else:
            log_once(log, f"consolidated:{problem}", "consolidated metadata: skipping %s", problem)
    return tuple(sorted(names))


def parent_path(path: str) -> str:
    return path.rpartition("/")[0]


def _is_ome(node: object) -> bool:
    attrs = node.get("attributes") if isinstance(node, dict) else None
    return isinstance(attrs, dict) and ome_attributes(attrs) is not None


def _json_file(obj: object, mtime_ns: int) -> BytesFile:
    return BytesFile(encode_json(obj, indent=2), mtime_ns)


class ZarrHierarchy:
    def __init__(self, runtime: Runtime, view: str = "zarr3") -> None:
        if view not in VIEWS:
            raise ConfigError(f"unknown view {view!r} (choose from {', '.join(VIEWS)})")
        self.runtime = runtime
        self.source = runtime.source
        self.view = view
        # What `inspect` reports: the sharded arrays resolved so far, by path (a
        # dict: directories are resolved again whenever the kernel forgets them).
        self.sharded: dict[str, InventoryPart] = {}
        # ... and the arrays and groups the view leaves out or shows as stored, with why.
        self.not_shown: dict[str, NotShown] = {}
        self.root: DirNode | None = None
        # Groups seen with OME-Zarr 0.5 metadata: their arrays use nested chunk keys in the
        # zarr2 view, as OME-Zarr 0.4 requires and its readers assume.
        self.ome_groups: set[str] = set()

    async def build(self) -> DirNode:
        root_st = await self.source.stat("")
        assert root_st is not None
        node = await self.resolve("", root_st, strict=True)
        self.root = node if isinstance(node, DirNode) else PassthroughDir(self.source, "", root_st)
        return self.root

    async def resolve(self, path: str, st: ObjectStat | None, strict: bool = False) -> Node | Verdict:
        """The node for directory `path`: a zarr node, Verdict.PASS (plain directory, or nothing), or
        Verdict.HIDE.

        `st` is None when the source cannot tell directories exist (plain
        HTTP): the directory is then shown if it holds a zarr.json.
        """
        meta_path = join_path(path, "zarr.json")

        def build(raw: object, meta_st: ObjectStat) -> Node | Verdict:
            # Off the event loop for a large zarr.json (see read_built): touches no trio state.
            dir_st = st or ObjectStat(0, meta_st.mtime_ns, True)
            kind = node_type(raw, meta_path)
            meta = cast(dict[str, Any], raw)  # node_type made sure it is a JSON object
            if kind == "group":
                return self._group(path, dir_st, meta, meta_st)
            return self._array(path, dir_st, meta, meta_st)

        try:
            node = await read_built(self.source, meta_path, self.runtime.limits, build, self.runtime.caches.metadata)
            if node is None:
                if strict:
                    raise ConfigError(f"{self.source.description} has no zarr.json: not a Zarr v3 store")
                return Verdict.PASS
            return node
        except ConfigError as e:
            if strict:
                raise
            shown = "shown unchanged" if self.view == "zarr3" else "left out of the zarr2 view"
            log_once(log, f"zarr:{meta_path}", "%s: %s", shown, e)
            self.not_shown[path] = NotShown(shown, path, str(e))
            return Verdict.PASS if self.view == "zarr3" else Verdict.HIDE

    # -- arrays ---------------------------------------------------------------

    def _array(self, path: str, st: ObjectStat, raw: dict[str, Any], meta_st: ObjectStat) -> Node | Verdict:
        where = join_path(path, "zarr.json")
        meta = ArrayMeta.from_json(raw, where)
        try:
            flat = unshard(meta, where)
        except Unsupported as e:
            if self.view == "zarr2":
                raise
            log_once(log, f"zarr:{where}", "shown unchanged: %s", e)
            self.not_shown[path] = NotShown("shown unchanged", path, str(e))
            return Verdict.PASS
        store = ZarrStore(self.runtime, path, meta, flat)
        dtype = DTYPES.get(meta.data_type) if isinstance(meta.data_type, str) else None
        geometry = ChunkGeometry(store, None if dtype is None else int(dtype[1:]), self.runtime.limits.payload_bytes)
        if self.view == "zarr3":
            if not flat.levels:
                return Verdict.PASS  # an unsharded array is already what we would show
            layout = store.source_keys
            chunks = ChunkContext(store, FlatNaming(store, layout), Stored(), geometry)
            self._inventory(path, store, chunks)
            view = ChunkView(chunks, layout, f"zarr3:{path}", st.mtime_ns)
            fixed: dict[str, Node] = {"zarr.json": _json_file(meta.rewritten(flat.chunk_shape, flat.codecs),
                                                              meta_st.mtime_ns)}
            return ArrayDir(self.source, path, st, fixed, view)
        separator = "/" if parent_path(path) in self.ome_groups else meta.key_encoding.separator
        zarray, zattrs, checksum = array_v2(meta, flat, separator, where)
        layout = KeyLayout(None, separator, meta.ndim)
        chunks = ChunkContext(store, FlatNaming(store, layout), Crc32cSuffix() if checksum else Stored(), geometry)
        self._inventory(path, store, chunks)
        view = ChunkView(chunks, layout, f"zarr2:{path}", st.mtime_ns)
        fixed = {".zarray": _json_file(zarray, meta_st.mtime_ns)}
        if zattrs:
            fixed[".zattrs"] = _json_file(zattrs, meta_st.mtime_ns)
        return ArrayDir(self.source, path, st, fixed, view, frozenset({"zarr.json", ".zattrs", ".zarray"}))

    def _inventory(self, path: str, store: ZarrStore, chunks: ChunkContext) -> None:
        if not store.levels:
            return
        levels = " > ".join(f"{'x'.join(map(str, lvl.counts))} per shard (index at "
                            f"{'start' if lvl.at_start else 'end'}{', crc32c' if lvl.checksum else ''})"
                            for lvl in store.levels)
        self.sharded[path] = ChunkInventory(
            "zarr array", path, chunks, f"inner chunks {list(store.chunk_shape)}, {levels}",
            math.prod(store.shard_grid), {"grid_cells": math.prod(store.grid), "data_type": store.meta.data_type,
                                          "shape": list(store.meta.shape)})

    async def inventory(self) -> AsyncIterator[InventoryPart]:
        """Every sharded array, found by resolving every group (chunk directories are not entered); then
        what the view leaves out or shows unchanged."""

        async def visit(node: DirNode) -> None:
            async for batch in node.entries():
                for _name, child in batch:
                    if isinstance(child, GroupDir):
                        await visit(child)

        if isinstance(self.root, GroupDir):
            await visit(self.root)
        for path in sorted(self.sharded):
            yield self.sharded[path]
        for path in sorted(self.not_shown):
            yield self.not_shown[path]

    # -- groups ---------------------------------------------------------------

    def _group(self, group_path: str, st: ObjectStat, raw: dict[str, Any], meta_st: ObjectStat) -> Node:
        consolidated = raw.get("consolidated_metadata")
        if not isinstance(consolidated, dict):
            consolidated = {}
        entries = consolidated.get("metadata")
        if not isinstance(entries, dict):
            entries = None
        fixed: dict[str, Node] = {}
        if self.view == "zarr3":
            if entries is not None:
                rewritten = {path: self._consolidated_v3(join_path(group_path, path), node) for path, node in entries.items()}
                shown = {**raw, "consolidated_metadata": {**consolidated, "metadata": rewritten}}
                fixed["zarr.json"] = _json_file(shown, meta_st.mtime_ns)
            return GroupDir(self.source, group_path, st, fixed, self.resolve, children=_children(entries))
        if _is_ome(raw):
            self.ome_groups.add(group_path)
        fixed[".zgroup"] = _json_file({"zarr_format": 2}, meta_st.mtime_ns)
        attrs = attrs_v2(raw)
        if attrs:
            fixed[".zattrs"] = _json_file(attrs, meta_st.mtime_ns)
        if entries is not None:
            fixed[".zmetadata"] = _json_file(self._zmetadata(group_path, raw, entries), meta_st.mtime_ns)
        return GroupDir(self.source, group_path, st, fixed, self.resolve,
                        frozenset({"zarr.json", ".zgroup", ".zattrs", ".zmetadata"}), _children(entries))

    def _consolidated_v3(self, path: str, node: object) -> object:
        """A consolidated entry, rewritten like the array's own zarr.json would be."""
        if not isinstance(node, dict) or node.get("node_type") != "array":
            return node
        try:
            meta = ArrayMeta.from_json(node, f"consolidated metadata of {path}")
            flat: Unsharded = unshard(meta, f"consolidated metadata of {path}")
        except ConfigError:
            return node  # logged when the array itself is looked up
        return meta.rewritten(flat.chunk_shape, flat.codecs) if flat.levels else node

    def _zmetadata(self, group_path: str, raw: dict[str, Any], entries: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, object] = {".zgroup": {"zarr_format": 2}}
        attrs = attrs_v2(raw)
        if attrs:
            out[".zattrs"] = attrs
        for path, node in sorted(entries.items()):
            if not isinstance(node, dict):
                continue
            attrs = attrs_v2(node)
            if node.get("node_type") == "group":
                out[f"{path}/.zgroup"] = {"zarr_format": 2}
            else:
                where = f"consolidated metadata of {join_path(group_path, path)}"
                parent = entries.get(parent_path(path)) if parent_path(path) else raw
                try:
                    meta = ArrayMeta.from_json(node, where)
                    separator = "/" if _is_ome(parent) else meta.key_encoding.separator
                    zarray, attrs, _ = array_v2(meta, unshard(meta, where), separator, where)
                except ConfigError as e:
                    log_once(log, f"zmeta:{where}", "left out of .zmetadata: %s", e)
                    continue
                out[f"{path}/.zarray"] = zarray
            if attrs:
                out[f"{path}/.zattrs"] = attrs
        return {"zarr_consolidated_format": 1, "metadata": out}
