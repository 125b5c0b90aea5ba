"""Sharded precomputed directories shown unsharded: volume scales, skeletons, multi-LOD meshes.

Volume scales and skeletons are plain core `ShardedDir`s with their own
naming (voxel-bound chunk names, segment ids). Multi-LOD meshes show two
files per segment: `<segid>.index`, the (decoded) manifest, which is what
the shard indexes, and `<segid>`, the fragment data stored immediately
before the manifest, whose length only the manifest tells.
"""

from __future__ import annotations

import logging
import struct
from typing import AsyncIterator, Literal, cast


from unshardfs.core.chunks import ChunkContext, ChunkFile
from unshardfs.core.codecs import Stored
from unshardfs.core.dirs import ShardedDir
from unshardfs.core.naming import DecimalNaming, parse_decimal
from unshardfs.formats.precomputed.shards import PrecomputedStore
from unshardfs.sources.base import ByteSource, ObjectStat
from unshardfs.tree.nodes import Batch, Entry, Node, Verdict
from unshardfs.util.errors import DataError
from unshardfs.util.logonce import log_once

log = logging.getLogger(__name__)

parse_segment_id = parse_decimal  # segment ids name unsharded mesh/skeleton files


class SegmentNaming(DecimalNaming):
    """Files named by segment id (skeletons; mesh manifests with `suffix` '.index'); a mesh
    directory computes both spellings, whichever context asks."""

    def __init__(self, suffix: str = "", child_id_bits: int = 0, child_id_add: int = 0) -> None:
        super().__init__(suffix, child_id_bits, child_id_add, also=("", ".index"))


def manifest_fragment_bytes(manifest: bytes, where: str) -> int:
    """Total size of the fragment data a multi-LOD mesh manifest describes.

    The manifest is parsed in full and must be consumed exactly: a damaged
    manifest would otherwise place the fragment file at a wrong offset.
    """
    try:
        num_lods = struct.unpack_from("<I", manifest, 24)[0]
        if 28 + 16 * num_lods > len(manifest):
            raise struct.error("lod tables")
        pos = 28 + 4 * num_lods + 12 * num_lods
        counts = struct.unpack_from(f"<{num_lods}I", manifest, pos)
        pos += 4 * num_lods
        total = 0
        for count in counts:
            if pos + 16 * count > len(manifest):
                raise struct.error("fragments")
            pos += 12 * count
            total += sum(struct.unpack_from(f"<{count}I", manifest, pos))
            pos += 4 * count
    except struct.error as e:
        raise DataError(where, f"mesh manifest is truncated ({len(manifest)} bytes)") from e
    if pos != len(manifest):
        raise DataError(where, f"mesh manifest has {len(manifest) - pos} trailing bytes")
    return total


class MultiLodMeshDir(ShardedDir):
    __slots__ = ("fragments_ctx",)

    def __init__(self, source: ByteSource, path: str, st: ObjectStat, manifests: ChunkContext,
                 fixed: dict[str, Node]) -> None:
        super().__init__(source, path, st, manifests, fixed)
        store = manifests.store
        self.fragments_ctx = ChunkContext(store, SegmentNaming("", 1, 0), Stored(), read_ahead=False)

    async def fragments(self, manifest: ChunkFile) -> ChunkFile:
        total = manifest_fragment_bytes(await self.chunks.content(manifest), manifest.where)
        start = manifest.start - total
        store = self.chunks.store
        assert isinstance(store, PrecomputedStore)
        if start < store.index_size:
            raise DataError(manifest.where, f"fragment data of {total:,} bytes would start before the shard data")
        chunk_id = manifest.chunk_id
        return ChunkFile(self.fragments_ctx, manifest.blob, start, total, chunk_id, total,
                         self.fragments_ctx.naming.child_id(chunk_id))

    async def virtual_lookup(self, name: str) -> Node | None | Literal[Verdict.PASS]:
        stem = name.removesuffix(".index")
        seg = parse_segment_id(stem)
        if seg is None:
            return Verdict.PASS
        manifest = await self.chunks.file(seg)
        if manifest is None:
            return None
        fragments = await self.fragments(manifest)
        if stem != name:
            # A viewer reads a segment's fragments right after its manifest.
            self.chunks.fetcher.prefetch([fragments.extent])
            return manifest
        return fragments

    async def virtual_entries(self) -> AsyncIterator[Batch]:
        async for listed in self.chunks.listing():
            manifests = list(listed)
            await self.chunks.warm([cast(ChunkFile, m) for _, m in manifests])  # a chunk listing's nodes
            batch: list[Entry] = []
            for name, manifest in manifests:
                try:
                    fragments = await self.fragments(cast(ChunkFile, manifest))
                except DataError as e:
                    log_once(log, f"list:{e}", "listing %s: skipping %s", self.path, e)
                    continue
                batch.append((name.removesuffix(".index"), fragments))
                batch.append((name, manifest))
            if batch:
                yield batch

    def child_name(self, child_id: int) -> str:
        return f"{child_id >> 1}.index" if child_id & 1 else str(child_id >> 1)
