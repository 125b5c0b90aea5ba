"""The toy format as a plug-in: a `ShardedStore`, a `Naming`, an exact `Geometry`, and the
`FormatPlugin` registered at the foot of this module (see the package docstring for the layout)."""

from __future__ import annotations

import struct
from typing import AsyncIterator

import numpy as np

from unshardfs.core.blob import Blob
from unshardfs.core.chunks import ChunkContext
from unshardfs.core.codecs import codec
from unshardfs.core.dirs import ShardedDir
from unshardfs.core.fetch import Extent
from unshardfs.core.fields import Fields
from unshardfs.core.geometry import Geometry
from unshardfs.core.inventory import ChunkInventory, InventoryPart
from unshardfs.core.naming import Naming
from unshardfs.core.runtime import Runtime
from unshardfs.core.store import ShardedStore
from unshardfs.core.table import ChunkTable
from unshardfs.errors import ConfigError, DataError
from unshardfs.formats.jsonfile import encode_json, read_json
from unshardfs.formats.registry import Dataset, FormatPlugin, register_format
from unshardfs.sources.base import ByteSource
from unshardfs.vtree import BytesFile

MARKER = "toy.json"
SUFFIX = ".toyshard"
HEADER = 8  # the entry count
ENTRY = 24  # key, offset, length
MAX_SHARDS = 1 << 16


def parse_decimal(text: str) -> int | None:
    """A canonical base-10 uint64 (no sign, no leading zeros), or None."""
    if not (text.isascii() and text.isdigit()) or (len(text) > 1 and text[0] == "0") or len(text) > 20:
        return None
    value = int(text)
    return value if value < 1 << 64 else None


class DecimalNaming(Naming):
    def claims(self, name: str) -> bool:
        return name.isascii() and name.isdigit()

    def parse(self, name: str) -> int | None:
        return parse_decimal(name)

    def names(self, keys: np.ndarray) -> list[str | None]:
        return [str(k) for k in keys.tolist()]


class ExactGeometry(Geometry):
    """Every chunk decodes to exactly `size` bytes: sizes are known from the index alone."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size

    def exact(self, keys: np.ndarray) -> np.ndarray:
        return np.full(len(keys), self.size, dtype=np.int64)


class ToyStore(ShardedStore):
    def __init__(self, runtime: Runtime, shard_count: int) -> None:
        super().__init__(runtime, "")
        self.shard_count = shard_count

    def shard_number(self, name: str) -> int | None:
        number = parse_decimal(name[:-len(SUFFIX)]) if name.endswith(SUFFIX) else None
        return number if number is not None and number < self.shard_count else None

    def is_shard_file(self, name: str) -> bool:
        return self.shard_number(name) is not None

    async def shards(self, within: object = None) -> AsyncIterator[int]:  # type: ignore[override]
        if not self.source.listable:  # every candidate; `tables` of an absent one is []
            for number in range(self.shard_count):
                yield number
            return
        found = [self.shard_number(name) async for name, st in self.source.list("") if not st.is_dir]
        for number in sorted(n for n in found if n is not None):
            yield number

    async def table(self, shard: int) -> ChunkTable | None:
        """The shard's index (cached per object version), or None if the shard does not exist."""
        key = f"{shard}{SUFFIX}"
        st = await self.source.stat(key)
        if st is None or st.is_dir:
            return None
        blob = Blob.of(key, st)
        return await self.flights.cached(self.caches.shard_index, ("toy", blob.ident), lambda: self._index(blob))

    async def _index(self, blob: Blob) -> ChunkTable:
        if blob.size < HEADER:
            raise DataError(blob.label, f"{blob.size} bytes: shorter than the shard header")
        (count,) = struct.unpack("<Q", await self.fetcher.read(Extent(blob, 0, HEADER), index=True))
        size = ENTRY * count
        self.limits.check_index(size, blob.label)
        if HEADER + size > blob.size:
            raise DataError(blob.label, f"an index of {count:,} entries runs past the end of the file")
        raw = await self.fetcher.read(Extent(blob, HEADER, size), index=True)
        entries = np.frombuffer(raw, dtype="<u8").reshape(-1, 3).T
        return ChunkTable.build(blob, entries[0], entries[1], entries[2], HEADER + size, blob.size)

    async def tables(self, shard: int) -> list[ChunkTable]:  # type: ignore[override]
        table = await self.table(shard)
        if table is None:
            return []
        # Keys stored in the wrong shard could never be looked up: not listed either.
        return [table.where(table.keys % np.uint64(self.shard_count) == np.uint64(shard))]

    async def locate(self, key: int) -> tuple[ChunkTable, int] | None:
        table = await self.table(key % self.shard_count)
        if table is None:
            return None
        if key in table.bad:
            raise DataError(f"{table.blob.label} chunk {key}", table.bad[key])
        i = table.find(key)
        return None if i is None else (table, i)


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
        chunks = ChunkContext(ToyStore(runtime, shards), DecimalNaming(), codec(encoding), ExactGeometry(chunk_size))
        shown = BytesFile(encode_json({"chunk_size": chunk_size}), loaded[1].mtime_ns)
        part = ChunkInventory("toy chunks", "", chunks, f"key % {shards}; {encoding}", shards)

        async def inventory() -> AsyncIterator[InventoryPart]:
            yield part

        return Dataset(ShardedDir(runtime.source, "", root, chunks, {MARKER: shown}), inventory)


register_format(ToyFormat())
