"""A chunk's payload inside a shard, shown as a file of its decoded bytes."""

from __future__ import annotations

import struct

from ...errors import DataError
from ...sources.blob import WHOLE_READ_MAX
from ...vtree import FileNode
from .shardfile import Shard, ShardedStore, gunzip

GZIP_MIN = 18  # 10-byte header + empty deflate stream (2) + CRC32 + ISIZE
# A lookup by name fetches gzip payloads up to this size whole: the read that
# usually follows then needs no second trip to the shard.
PREFETCH_MAX = 1 << 20


class ChunkFile(FileNode):
    """Bytes [start, start+length) of a shard, gzip-decoded when `gzipped`.

    The decoded size of a gzip payload is taken from its ISIZE trailer so
    `stat` is exact before anything is decompressed; the full decode later
    verifies it (CRC32 and length), so a lying trailer yields EIO, never
    wrong or short bytes.
    """

    __slots__ = ("store", "shard", "start", "length", "gzipped", "chunk_id")

    def __init__(self, store: ShardedStore, shard: Shard, start: int, length: int,
                 gzipped: bool, size: int, chunk_id: int, ident: int | None = None) -> None:
        # Slots are set directly (no super().__init__ chain): listings build
        # one of these per chunk, millions of times.
        self.mtime_ns = shard.mtime_ns
        self.ident = ident
        self.size = size
        self.store = store
        self.shard = shard
        self.start = start
        self.length = length
        self.gzipped = gzipped
        self.chunk_id = chunk_id

    @classmethod
    async def open(cls, store: ShardedStore, shard: Shard, start: int, length: int,
                   gzipped: bool, chunk_id: int, ident: int | None = None, prefetch: bool = False) -> "ChunkFile":
        """Size the payload: free for raw data, one small read for gzip.

        With `prefetch` (a lookup by name, likely followed by a read) a small
        gzip payload is read whole instead of just its trailer.
        """
        size = length
        if prefetch and not gzipped and store.source.remote and length <= WHOLE_READ_MAX:
            # Over the network one request for the whole payload beats the
            # kernel's 128 KiB pieces, each a round trip.
            payload = await shard.read(store.source, start, length)
            store.caches.put(store.caches.encoded_chunk, cls._key(shard, start, length), payload)
        if gzipped:
            if length < GZIP_MIN:
                raise DataError(cls._where(shard, chunk_id), f"gzip payload of {length} bytes is too short")
            if prefetch and length <= PREFETCH_MAX:
                payload = await shard.read(store.source, start, length)
                store.caches.put(store.caches.encoded_chunk, cls._key(shard, start, length), payload)
                trailer = payload[-4:]
            else:
                trailer = await shard.read(store.source, start + length - 4, 4)
            (size,) = struct.unpack("<I", trailer)
        return cls(store, shard, start, length, gzipped, size, chunk_id, ident)

    @staticmethod
    def _key(shard: Shard, start: int, length: int) -> tuple:
        return shard.payload_key(start, length)

    @staticmethod
    def _where(shard: Shard, chunk_id: int) -> str:
        return f"{shard.label} chunk {chunk_id}"

    @property
    def where(self) -> str:
        return self._where(self.shard, self.chunk_id)

    async def decoded(self) -> bytes:
        """The whole decoded payload (cached for gzip, since readers take it in pieces)."""
        if not self.gzipped:
            return await self.shard.read(self.store.source, self.start, self.length)
        caches = self.store.caches
        cache = caches.decoded_chunk
        key = self._key(self.shard, self.start, self.length)
        data = cache.get(key)
        if data is None:
            payload = caches.encoded_chunk.pop(key, None)
            if payload is None:
                payload = await self.shard.read(self.store.source, self.start, self.length)
            data = gunzip(payload, self.where)
            if len(data) != self.size:
                raise DataError(self.where, f"gzip payload decodes to {len(data)} bytes, trailer said {self.size}")
            self.store.caches.put(cache, key, data)
        return data

    async def read(self, offset: int, size: int) -> bytes:
        size = self.span(offset, size)
        if not size:
            return b""
        if self.gzipped:
            return (await self.decoded())[offset:offset + size]
        return await self.shard.read_payload(self.store.source, self.start, self.length, offset, size,
                                             self.store.caches.encoded_chunk)

    def xattrs(self) -> dict[str, bytes]:
        return {
            "user.unshardfs.source": self.shard.label.encode(),
            "user.unshardfs.offset": str(self.start).encode(),
            "user.unshardfs.length": str(self.length).encode(),
            "user.unshardfs.encoding": b"gzip" if self.gzipped else b"raw",
            "user.unshardfs.chunk_id": str(self.chunk_id).encode(),
        }
