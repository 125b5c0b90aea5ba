"""A webKnossos WKW dataset shown as unsharded Neuroglancer precomputed: one volume per WKW layer.

The mount root keeps the dataset's own files (`datasource-properties.json`,
...) and shows each WKW layer directory as a precomputed volume: an `info`
made from the properties and the mag headers, and per mag a directory of
chunk files (one per block). The source's mag directories (`header.wkw`,
`z*/y*/x*.wkw`) are hidden; anything else in a layer directory passes
through. A directory of mags without properties (a bare layer) is shown
the same way at the root, its bounding box taken from the files present.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import AsyncIterator

from unshardfs.core.chunks import ChunkContext
from unshardfs.core.dirs import ChunksDir
from unshardfs.core.inventory import ChunkInventory, InventoryPart
from unshardfs.core.jsonfile import encode_json, read_json
from unshardfs.core.runtime import Runtime
from unshardfs.formats.wkw.header import BLOCK_TYPES, HEADER_BYTES, HeaderError, WkwHeader
from unshardfs.formats.wkw.properties import PROPERTIES, Layer, Mag, finest_first, parse_mag, parse_properties
from unshardfs.formats.wkw.store import MagView, WkwBlockCodec, WkwStore, list_files, wkw_geometry
from unshardfs.sources.base import ByteSource, ObjectStat, join_path
from unshardfs.tree.nodes import BytesFile, Closable, DirNode, Node
from unshardfs.tree.overlay import OverlayDir
from unshardfs.util.errors import ConfigError, SourceError
from unshardfs.volume.grid import ChunkGrid, GridNaming

log = logging.getLogger(__name__)

# The data types of precomputed's `info` (float64 has none).
PRECOMPUTED_TYPES = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float32"}
MAX_BARE_MAGS = 64


class LayerDir(OverlayDir):
    """A layer directory: `info` and the mag views fixed, the source's mag directories hidden."""

    __slots__ = ("hidden",)

    def __init__(self, source: ByteSource, path: str, st: ObjectStat, fixed: dict[str, Node],
                 hidden: frozenset[str]) -> None:
        super().__init__(source, path, st, fixed, f"wkw:{path}")
        self.hidden = hidden

    def hides(self, name: str) -> bool:
        return name in self.hidden


@dataclass
class ShownMag:
    mag: Mag
    dir_name: str  # the mag directory inside the layer directory
    header: WkwHeader


class WkwDataset:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.source = runtime.source
        self.parts: list[InventoryPart] = []

    async def build(self) -> DirNode:
        root_st = await self.source.stat("")
        assert root_st is not None
        loaded = await read_json(self.source, PROPERTIES, self.runtime.limits)
        if loaded is None:
            layer = await bare_layer(self.source)
            fixed, hidden = await self.layer_view("", layer, (1.0, 1.0, 1.0), root_st.mtime_ns)
            return LayerDir(self.source, "", root_st, fixed, hidden)
        voxel_size, layers = parse_properties(loaded[0])
        mtime_ns = loaded[1].mtime_ns
        shown: dict[str, Node] = {}
        for layer in layers:
            st = await self.source.stat_dir(layer.name) if self.source.listable else None
            if self.source.listable and (st is None or not st.is_dir):
                log.warning("%s: layer %r has no directory; not shown", PROPERTIES, layer.name)
                continue
            fixed, hidden = await self.layer_view(layer.name, layer, voxel_size, mtime_ns)
            if fixed:
                shown[layer.name] = LayerDir(self.source, layer.name, st or root_st, fixed, hidden)
        if not shown:
            raise ConfigError(f"{self.source.description}: {PROPERTIES} lists no WKW layer that can be shown")
        # Where the source cannot list (plain HTTP), the properties are still listed.
        return OverlayDir(self.source, "", root_st, shown, "wkw-root", lambda path: [PROPERTIES] if path == "" else [])

    async def mags(self, path: str, layer: Layer) -> list[ShownMag]:
        """The layer's mags whose header.wkw can be read (the others are logged and left out)."""
        found = []
        for mag in layer.mags:
            names = [mag.path.rpartition("/")[2]] if mag.path and mag.path.rpartition("/")[0] == path else []
            names += [mag.name, mag.long_name]
            for name in dict.fromkeys(names):
                header = await read_header(self.source, join_path(join_path(path, name), "header.wkw"))
                if header is not None:
                    found.append(ShownMag(mag, name, header))
                    break
            else:
                log.warning("%s: mag %s has no readable header.wkw; not shown", path or ".", mag.long_name)
        return found

    async def layer_view(self, path: str, layer: Layer, voxel_size: tuple[float, float, float],
                         mtime_ns: int) -> tuple[dict[str, Node], frozenset[str]]:
        """`info` and one chunk directory per mag; the source mag directories to hide."""
        fixed: dict[str, Node] = {}
        scales = []
        kinds: set[tuple[str, int]] = set()
        mags = await self.mags(path, layer)
        for shown in mags:
            header, mag = shown.header, shown.mag
            dtype = header.dtype.name
            if dtype not in PRECOMPUTED_TYPES:
                log.warning("%s mag %s: %s voxels cannot be shown as precomputed; not shown", path or ".",
                            mag.long_name, dtype)
                continue
            if header.block_bytes > self.runtime.limits.payload_bytes:
                log.warning("%s mag %s: blocks of %s bytes exceed the payload limit; not shown", path or ".",
                            mag.long_name, f"{header.block_bytes:,}")
                continue
            kind = (dtype, header.channels)
            if kinds and kind not in kinds:
                log.warning("%s mag %s: %s x %s differs from the other mags; not shown", path or ".",
                            mag.long_name, header.channels, dtype)
                continue
            kinds.add(kind)
            assert layer.top_left is not None and layer.extent is not None
            edge = header.block_edge
            lo = [t // m for t, m in zip(layer.top_left, mag.factors)]
            hi = [-(-(t + e) // m) for t, e, m in zip(layer.top_left, layer.extent, mag.factors)]
            # The view's grid starts on a block boundary, so that every chunk is one block.
            offset = tuple(v - v % edge for v in lo)
            size = tuple(h - o for h, o in zip(hi, offset))
            if min(size) <= 0 or any(h <= v for h, v in zip(hi, lo)):
                log.warning("%s mag %s: empty bounding box; not shown", path or ".", mag.long_name)
                continue
            grid = ChunkGrid(size, (edge,) * 3, offset)
            view = MagView(join_path(path, shown.dir_name), header, grid)
            store = WkwStore(self.runtime, view)
            ctx = ChunkContext(store, GridNaming(grid), WkwBlockCodec(view),
                               wkw_geometry(view, self.runtime.limits.payload_bytes))
            scale_key = mag.name
            fixed[scale_key] = ChunksDir(ctx, mtime_ns, f"wkw:{view.dir_path}")
            lo_f, hi_f = view.file_range()
            self.parts.append(ChunkInventory(
                "wkw mag", join_path(path, scale_key), ctx,
                f"WKW files {view.dir_path}/z*/y*/x*.wkw, {header.file_edge}^3 blocks of {edge}^3 voxels each",
                int(math.prod((hi_f - lo_f + 1).tolist())),
                {"compression": BLOCK_TYPES[header.block_type], "data_type": dtype, "channels": header.channels,
                 "size": list(size), "chunk_size": [edge] * 3, "grid_cells": math.prod(grid.shape)}))
            scales.append({"key": scale_key, "size": list(size), "voxel_offset": list(offset),
                           "resolution": [v * m for v, m in zip(voxel_size, mag.factors)],
                           "chunk_sizes": [[edge] * 3], "encoding": "raw"})
        if not scales:
            return {}, frozenset()
        (dtype, channels), = kinds
        info: dict[str, object] = {"@type": "neuroglancer_multiscale_volume",
                      "type": "segmentation" if layer.category == "segmentation" else "image",
                      "data_type": dtype, "num_channels": channels, "scales": scales}
        if layer.largest_segment_id is not None:
            info["largest_segment_id"] = layer.largest_segment_id
        fixed = {"info": BytesFile(encode_json(info), mtime_ns), **fixed}
        hidden = frozenset(shown.dir_name for shown in mags)
        return fixed, hidden

    async def inventory(self) -> AsyncIterator[InventoryPart]:
        for part in self.parts:
            yield part


async def read_header(source: ByteSource, path: str) -> WkwHeader | None:
    """A mag's header.wkw; None if absent; ConfigError if it is not a WKW header."""
    st = await source.stat(path)
    if st is None or st.is_dir:
        return None
    try:
        raw = await source.read(path, 0, min(st.size, HEADER_BYTES))
        return WkwHeader.parse(raw)
    except SourceError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    except HeaderError as e:
        raise ConfigError(f"{path}: {e}") from None


def _mag_name(name: str) -> tuple[int, int, int] | None:
    try:
        return parse_mag(name, name)
    except ConfigError:
        return None


async def mag_dirs(source: ByteSource, most: int | None = None) -> list[tuple[str, Mag]]:
    """The mag directories (`1`, `2-2-1`, ...) holding a header.wkw at the source's root; among its
    first `most` entries only, if given (detection: a directory of 10^5 prefixes is not listed whole
    to learn that none of them is a mag)."""
    found = []
    if source.listable:
        listing = source.list("").__aiter__()
        try:
            seen = 0
            async for name, st in listing:
                seen += 1
                factors = _mag_name(name) if st.is_dir else None
                if factors is not None and await source.stat(join_path(name, "header.wkw")) is not None:
                    found.append((name, Mag(factors)))
                    if len(found) > MAX_BARE_MAGS:
                        raise ConfigError(f"{source.description}: more than {MAX_BARE_MAGS} mag directories")
                if most is not None and seen >= most:
                    break  # (before the listing asks for more)
        finally:
            if isinstance(listing, Closable):
                await listing.aclose()
    else:
        header = await source.stat("1/header.wkw")
        if header is not None and not header.is_dir:
            found.append(("1", Mag((1, 1, 1))))
    return found


async def bare_layer(source: ByteSource) -> Layer:
    """A layer directory without properties: its bounding box spans the files of its mags."""
    mags = await mag_dirs(source)
    if not mags:
        raise ConfigError(f"{source.description} has neither {PROPERTIES} nor mag directories with header.wkw")
    if not source.listable:
        raise ConfigError(f"{source.description}: without {PROPERTIES} the bounding box comes from the files "
                          "present, which needs a source that can list (a local directory, gs:// or s3://)")
    lo: list[int] | None = None
    hi: list[int] | None = None
    for name, mag in mags:
        header = await read_header(source, join_path(name, "header.wkw"))
        assert header is not None
        span = header.file_edge * header.block_edge
        async for f in list_files(source, name, [0, 0, 0], [1 << 30] * 3):
            a = [c * span * m for c, m in zip(f, mag.factors)]
            b = [(c + 1) * span * m for c, m in zip(f, mag.factors)]
            lo = a if lo is None else [min(x, y) for x, y in zip(lo, a)]
            hi = b if hi is None else [max(x, y) for x, y in zip(hi, b)]
    if lo is None or hi is None:
        raise ConfigError(f"{source.description}: the mag directories hold no .wkw files")
    return Layer(".", "color", (lo[0], lo[1], lo[2]), (hi[0] - lo[0], hi[1] - lo[1], hi[2] - lo[2]),
                 finest_first(mag for _, mag in mags))
