"""An inner chunk shown as a file: its stored bytes, unchanged.

In the v2 view a chunk whose codec chain ends in crc32c is served without
those 4 bytes (v2 has no such codec); the checksum is verified first, so a
damaged chunk is an I/O error rather than silently different bytes.
"""

from __future__ import annotations

import crc32c

from ...caches import Caches
from ...errors import DataError
from ...sources.base import ByteSource
from ...vtree import FileNode
from .chunks import ChunkRef


class ZarrChunkFile(FileNode):
    __slots__ = ("source", "ref", "checksum", "caches", "where")

    def __init__(self, source: ByteSource, ref: ChunkRef, checksum: bool, caches: Caches, where: str,
                 ident: int | None = None) -> None:
        if checksum and ref.length < 4:
            raise DataError(where, f"{ref.length}-byte chunk is too short to end in a crc32c checksum")
        super().__init__(ref.length - 4 if checksum else ref.length, ref.blob.mtime_ns)
        self.ident = ident
        self.source = source
        self.ref = ref
        self.checksum = checksum
        self.caches = caches
        self.where = where

    async def _verified(self) -> bytes:
        ref = self.ref
        key = (ref.blob.label, ref.blob.version, ref.start, "crc32c")
        data = self.caches.decoded_chunk.get(key)
        if data is None:
            stored = await ref.blob.read(self.source, ref.start, ref.length)
            data = stored[:-4]
            if crc32c.crc32c(data) != int.from_bytes(stored[-4:], "little"):
                raise DataError(self.where, "chunk crc32c checksum mismatch")
            self.caches.put(self.caches.decoded_chunk, key, data)
        return data

    async def read(self, offset: int, size: int) -> bytes:
        size = self.span(offset, size)
        if not size:
            return b""
        if self.checksum:
            return (await self._verified())[offset:offset + size]
        ref = self.ref
        return await ref.blob.read_payload(self.source, ref.start, ref.length, offset, size, self.caches.encoded_chunk)

    def xattrs(self) -> dict[str, bytes]:
        return {
            "user.unshardfs.source": self.ref.blob.label.encode(),
            "user.unshardfs.offset": str(self.ref.start).encode(),
            "user.unshardfs.length": str(self.ref.length).encode(),
            "user.unshardfs.encoding": b"crc32c-verified" if self.checksum else b"raw",
        }
