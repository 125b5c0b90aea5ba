"""The toy format as a plug-in: its `ShardedStore` (shard placement, shard files, index decoding)
and the `FormatPlugin` registered at the foot of this module (see the package docstring for the
layout); names, geometry, codecs, caching and damage policy are the core's."""

from __future__ import annotations

import struct
from typing import AsyncIterator

import numpy as np

from unshardfs.abc import (
    Blob,
    BytesFile,
    ByteSource,
    ChunkContext,
    ChunkInventory,
    ChunkTable,
    ConfigError,
    DataError,
    Dataset,
    DecimalNaming,
    Fields,
    FixedSize,
    FormatPlugin,
    InventoryPart,
    Runtime,
    ShardedDir,
    ShardedStore,
    codec,
    parse_decimal,
)
from unshardfs.core.jsonfile import encode_json, read_json

MARKER = "toy.json"
SUFFIX = ".toyshard"
HEADER = 8  # the entry count
ENTRY = 24  # id, offset, length
MAX_SHARDS = 1 << 16


class ToyStore(ShardedStore[int, ChunkTable]):
    """Chunk k lives in shard k % S; a shard's index is one table."""

    def __init__(self, runtime: Runtime, shard_count: int) -> None:
        super().__init__(runtime, "")
        self.shard_count = shard_count

    def shard_of(self, chunk_id: int) -> int:
        return chunk_id % self.shard_count

    def shard_number(self, name: str) -> int | None:
        number = parse_decimal(name[:-len(SUFFIX)]) if name.endswith(SUFFIX) else None
        return number if number is not None and number < self.shard_count else None

    def is_shard_file(self, name: str) -> bool:
        return self.shard_number(name) is not None

    async def shards(self, within: object = None) -> AsyncIterator[int]:
        if not self.source.listable:  # every candidate; an absent one lists nothing
            for number in range(self.shard_count):
                yield number
            return
        found = [self.shard_number(name) async for name, st in self.source.list("") if not st.is_dir]
        for number in sorted(n for n in found if n is not None):
            yield number

    async def open_shard(self, shard: int) -> Blob | None:
        st = await self.source.stat(f"{shard}{SUFFIX}")
        return None if st is None or st.is_dir else self.blob(f"{shard}{SUFFIX}", st)

    async def read_index(self, shard: int, blob: Blob) -> ChunkTable:
        if blob.size < HEADER:
            raise DataError(blob.label, f"{blob.size} bytes: shorter than the shard header")
        (count,) = struct.unpack("<Q", await self.read_index_bytes(blob, 0, HEADER))
        size = ENTRY * count
        if HEADER + size > blob.size:
            raise DataError(blob.label, f"an index of {count:,} entries runs past the end of the file")
        entries = np.frombuffer(await self.read_index_bytes(blob, HEADER, size), dtype="<u8").reshape(-1, 3).T
        return ChunkTable.build(blob, entries[0], entries[1], entries[2], HEADER + size, blob.size)


class ToyFormat(FormatPlugin):
    name = "toy"
    description = "toy test format"
    marker = "a toy.json file"
    prefixes = ("toy://",)

    async def detect(self, source: ByteSource, options: dict) -> bool:
        st = await source.stat(MARKER)
        return st is not None and not st.is_dir

    async def open(self, runtime: Runtime, options: dict) -> Dataset:
        loaded = await read_json(runtime.source, MARKER)
        root = await runtime.source.stat("")
        if loaded is None or root is None:
            raise ConfigError(f"{runtime.source.description} has no {MARKER}")
        meta = Fields(loaded[0], MARKER)
        chunk_size = meta.int("chunk_size", lo=1, hi=runtime.limits.payload_bytes)
        shards = meta.int("shards", lo=1, hi=MAX_SHARDS)
        encoding = meta.str("encoding", ("raw", "gzip"), default="raw")
        chunks = ChunkContext(ToyStore(runtime, shards), DecimalNaming(), codec(encoding), FixedSize(chunk_size))
        shown = BytesFile(encode_json({"chunk_size": chunk_size}), loaded[1].mtime_ns)
        part = ChunkInventory("toy chunks", "", chunks, f"id % {shards}; {encoding}", shards)

        async def inventory() -> AsyncIterator[InventoryPart]:
            yield part

        return Dataset(ShardedDir(runtime.source, "", root, chunks, {MARKER: shown}), inventory)



