"""Byte-bounded caches shared by every sharded directory of a mount.

One budget per kind of decoded data (each index level a format declares,
decoded chunks) rather than one per directory, so the daemon's memory is
bounded by configuration, not by the number of scales or shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from unshardfs.core.blob import RecentBlobs
from unshardfs.util.maps import BoundedMap, MiB, payload_size


@dataclass(frozen=True)
class IndexLevel:
    """One level of a format's index structures, declared by the format: the caches are made from these.

    Each level gets one byte-bounded cache shared by every directory of the
    mount, its budget set by the option `option` (MiB; `default` bytes when
    not given). Two formats declaring a level of the same `name` share it
    (precomputed, Zarr, DVID and the toy format all use `SHARD_INDEX`).
    """

    name: str  # the cache's name in `stats` ("shard_index")
    option: str  # the command-line option of its budget ("--shard-index-cache")
    default: int  # budget in bytes
    help: str  # what the option's help says it caches

    @property
    def dest(self) -> str:
        """The argparse destination of `option`."""
        return self.option.lstrip("-").replace("-", "_")


def byte_cache(budget: int) -> BoundedMap[Any, Any]:
    """An LRU cache of decoded data within `budget` bytes (each value's `payload_size`)."""
    return BoundedMap(budget, getsizeof=payload_size)


SHARD_INDEX = IndexLevel("shard_index", "--shard-index-cache", 32 * MiB, "shard index cache")


@dataclass(frozen=True)
class CacheSizes:
    """Defaults keep a fully warm daemon under ~250 MB RSS (the memory bound docs/mount.md states)."""

    # Budget in bytes of each index level by name; a level not named here gets its declared default.
    index_bytes: dict[str, int] = field(default_factory=dict)
    decoded_chunk_bytes: int = 64 * MiB
    # Compressed payloads fetched at lookup, waiting for the read that follows.
    encoded_chunk_bytes: int = 8 * MiB
    # Metadata files (info, zarr.json) as built from each version, and the errors of damaged ones.
    metadata_bytes: int = 16 * MiB


@dataclass
class Caches:
    """The mount's caches: one per declared index level (in declaration order), decoded chunks,
    encoded payloads waiting for their read, and the shards' recent `Blob`s."""

    sizes: CacheSizes = field(default_factory=CacheSizes)
    levels: Sequence[IndexLevel] = ()

    def __post_init__(self) -> None:
        self._index: dict[str, BoundedMap[Any, Any]] = {}
        for level in self.levels:
            self.index(level)
        self.decoded_chunk: BoundedMap[Any, Any] = byte_cache(self.sizes.decoded_chunk_bytes)
        self.encoded_chunk: BoundedMap[Any, Any] = byte_cache(self.sizes.encoded_chunk_bytes)
        self.metadata: BoundedMap[Any, Any] = byte_cache(self.sizes.metadata_bytes)
        self.blobs = RecentBlobs()

    def index(self, level: IndexLevel) -> BoundedMap[Any, Any]:
        """The cache of one index level (made on first use, from its declaration)."""
        cache = self._index.get(level.name)
        if cache is None:
            cache = self._index[level.name] = byte_cache(self.sizes.index_bytes.get(level.name, level.default))
        return cache

    def usage(self) -> dict[str, dict[str, int]]:
        named = [*self._index.items(), ("decoded_chunk", self.decoded_chunk), ("encoded_chunk", self.encoded_chunk),
                 ("metadata", self.metadata)]
        return {name: {"bytes": int(cache.currsize), "limit": int(cache.maxsize), "entries": len(cache),
                       "hits": cache.hits, "misses": cache.misses}
                for name, cache in named}
