"""Sharded directories shown unsharded: volume scales, multi-LOD meshes, skeletons.

Each directory answers lookups of computed names straight from the shard
indexes (no listing needed) and streams its listing minishard by minishard.
Files of the source directory that are not shard files pass through, so
nothing the dataset's owner put there disappears.
"""

from __future__ import annotations

import logging
import struct
from typing import AsyncIterator

import numpy as np

from ...concurrency import gather
from ...errors import DataError
from ...logonce import log_once
from ...overlay import NOT_VIRTUAL, OverlayDir
from ...sources.base import ByteSource, ObjectStat
from ...vtree import CHILD_ID_BITS, BytesFile, Entry
from .chunkfile import ChunkFile
from .grid import ChunkGrid
from .shardfile import MinishardIndex, Shard, ShardedStore

log = logging.getLogger(__name__)

U64_MAX = (1 << 64) - 1


class ShardedDir(OverlayDir):
    """Common behaviour: rewritten `info`, hidden shard files, passthrough of the rest."""

    __slots__ = ("store",)

    def __init__(self, source: ByteSource, key: str, st: ObjectStat, store: ShardedStore,
                 info: BytesFile | None = None) -> None:
        super().__init__(source, key, st, {} if info is None else {"info": info}, f"sharded:{key}")
        self.store = store

    def hides(self, name: str) -> bool:
        return self.store.is_shard_file(name)

    @property
    def gzipped(self) -> bool:
        """Whether payloads (volume chunks, skeletons, mesh manifests) are gzip-encoded."""
        return self.store.spec.data_encoding == "gzip"

    def ident_of(self, chunk_id: int) -> int | None:
        """The `ident` of the file holding `chunk_id`'s payload."""
        return chunk_id if chunk_id < 1 << CHILD_ID_BITS else None

    def ident_differs(self, ids: np.ndarray) -> bool:
        """Whether `ident_of` is anything but the identity on these ids (checked per batch)."""
        return bool(len(ids)) and int(ids.max()) >= 1 << CHILD_ID_BITS

    async def _chunk(self, chunk_id: int) -> ChunkFile | None:
        found = await self.store.locate(chunk_id)
        if found is None:
            return None
        shard, start, length = found
        return await ChunkFile.open(self.store, shard, start, length, self.gzipped, chunk_id,
                                    self.ident_of(chunk_id), prefetch=True)

    async def _sized(self, shard: Shard, row: tuple) -> ChunkFile | None:
        _name, cid, ident, start, size = row
        try:
            return await ChunkFile.open(self.store, shard, start, size, True, cid, ident)
        except DataError as e:
            log_once(log, f"list:{e}", "listing %s: skipping %s", self.key, e)
            return None

    def names(self, shard: Shard, mini: MinishardIndex) -> list[str | None]:
        """File names of a minishard's ids (None: not listable); segment ids by default."""
        return [str(cid) for cid in mini.ids.tolist()]

    async def _listed_chunks(self) -> AsyncIterator[list[tuple[str, ChunkFile]]]:
        """Every listable chunk, in batches of whole minishards; a chunk that
        cannot even be sized is logged and skipped."""
        store, gzipped, ident_of = self.store, self.gzipped, self.ident_of
        async for shard, mini in store.listing():
            ids = mini.ids.tolist()
            idents = [ident_of(cid) for cid in ids] if self.ident_differs(mini.ids) else ids
            rows = zip(self.names(shard, mini), ids, idents, mini.starts.tolist(), mini.sizes.tolist())
            if not gzipped:
                # Raw payloads are sized by the index itself: no I/O, no awaits.
                batch = [(name, ChunkFile(store, shard, start, size, False, size, cid, ident))
                         for name, cid, ident, start, size in rows if name is not None]
            else:
                # Sizing gzip payloads costs a small read each: remotely, many at once.
                named = [row for row in rows if row[0] is not None]
                if store.source.remote:
                    opened = await gather([lambda r=r: self._sized(shard, r) for r in named], limit=64)
                else:
                    opened = [await self._sized(shard, r) for r in named]
                batch = [(row[0], node) for row, node in zip(named, opened) if node is not None]
            if batch:
                yield batch


class VolumeScaleDir(ShardedDir):
    """A sharded scale: one file per existing chunk, named by its voxel bounds."""

    __slots__ = ("grid",)

    def __init__(self, source: ByteSource, key: str, st: ObjectStat, store: ShardedStore,
                 size: tuple[int, int, int], chunk_size: tuple[int, int, int],
                 voxel_offset: tuple[int, int, int]) -> None:
        super().__init__(source, key, st, store)
        self.grid = ChunkGrid(size, chunk_size, voxel_offset)

    def claims(self, name: str) -> bool:
        return ChunkGrid.claims(name)

    def child_name(self, ident: int) -> str:
        return self.grid.name_of_code(ident)

    async def virtual_lookup(self, name: str) -> object:
        if not self.claims(name):
            return NOT_VIRTUAL
        cell = self.grid.parse_chunk_name(name)
        if cell is None:
            return None
        return await self._chunk(self.grid.coder.encode(cell))

    def names(self, shard: Shard, mini: MinishardIndex) -> list[str | None]:
        cells, valid = self.grid.coder.decode_array(mini.ids)
        if valid.all():
            return self.grid.names(cells)  # type: ignore[return-value]
        log_once(log, f"grid:{shard.label}", "%s: %d chunk ids lie outside the volume grid; not listed",
                 shard.label, int((~valid).sum()))
        names = iter(self.grid.names(cells[valid]))
        return [next(names) if ok else None for ok in valid.tolist()]

    def virtual_entries(self) -> AsyncIterator[list[Entry]]:
        return self._listed_chunks()  # type: ignore[return-value]


def parse_segment_id(text: str) -> int | None:
    """A canonical base-10 uint64, as unsharded mesh/skeleton writers name files."""
    if not text.isdigit() or not text.isascii() or (len(text) > 1 and text[0] == "0"):
        return None
    value = int(text)
    return value if value <= U64_MAX else None


class SkeletonDir(ShardedDir):
    """Sharded skeletons: `<segid>` holds the encoded skeleton."""

    def child_name(self, ident: int) -> str:
        return str(ident)

    def claims(self, name: str) -> bool:
        return parse_segment_id(name) is not None

    async def virtual_lookup(self, name: str) -> object:
        seg = parse_segment_id(name)
        if seg is None:
            return NOT_VIRTUAL
        return await self._chunk(seg)

    def virtual_entries(self) -> AsyncIterator[list[Entry]]:
        return self._listed_chunks()  # type: ignore[return-value]


def manifest_fragment_bytes(manifest: bytes, where: str) -> int:
    """Total size of the fragment data a multi-LOD mesh manifest describes.

    The manifest is parsed in full and must be consumed exactly: a damaged
    manifest would otherwise place the fragment file at a wrong offset.
    """
    try:
        num_lods = struct.unpack_from("<I", manifest, 24)[0]
        pos = 28 + 4 * num_lods + 12 * num_lods
        counts = struct.unpack_from(f"<{num_lods}I", manifest, pos)
        pos += 4 * num_lods
        total = 0
        for count in counts:
            pos += 12 * count
            total += sum(struct.unpack_from(f"<{count}I", manifest, pos))
            pos += 4 * count
    except struct.error as e:
        raise DataError(where, f"mesh manifest is truncated ({len(manifest)} bytes)") from e
    if pos != len(manifest):
        raise DataError(where, f"mesh manifest has {len(manifest) - pos} trailing bytes")
    return total


class MultiLodMeshDir(ShardedDir):
    """Sharded multi-resolution meshes: `<segid>.index` manifest, `<segid>` fragments.

    In the shard, a segment's fragment data sits immediately before its
    manifest, and only the manifest is indexed (and possibly gzip-encoded).
    """

    def claims(self, name: str) -> bool:
        return parse_segment_id(name.removesuffix(".index")) is not None

    # Two files per segment: ident 2*segid is the fragment data, 2*segid+1 the manifest.
    def ident_of(self, chunk_id: int) -> int | None:
        return 2 * chunk_id + 1 if 2 * chunk_id + 1 < 1 << CHILD_ID_BITS else None

    def ident_differs(self, ids: np.ndarray) -> bool:
        return True

    def child_name(self, ident: int) -> str:
        return f"{ident >> 1}.index" if ident & 1 else str(ident >> 1)

    async def fragments(self, manifest: ChunkFile) -> ChunkFile:
        total = manifest_fragment_bytes(await manifest.decoded(), manifest.where)
        start = manifest.start - total
        if start < self.store.spec.shard_index_size:
            raise DataError(manifest.where, f"fragment data of {total} bytes would start before the shard data")
        return ChunkFile(self.store, manifest.shard, start, total, False, total, manifest.chunk_id,
                         None if manifest.ident is None else manifest.ident - 1)

    async def virtual_lookup(self, name: str) -> object:
        stem = name.removesuffix(".index")
        seg = parse_segment_id(stem)
        if seg is None:
            return NOT_VIRTUAL
        manifest = await self._chunk(seg)
        if manifest is None or stem != name:
            return manifest
        return await self.fragments(manifest)

    async def virtual_entries(self) -> AsyncIterator[list[Entry]]:  # type: ignore[override]
        async for manifests in self._listed_chunks():
            batch: list[Entry] = []
            for name, manifest in manifests:
                try:
                    fragments = await self.fragments(manifest)
                except DataError as e:
                    log_once(log, f"list:{e}", "listing %s: skipping %s", self.key, e)
                    continue
                batch.append((name, fragments))
                batch.append((f"{name}.index", manifest))
            if batch:
                yield batch
