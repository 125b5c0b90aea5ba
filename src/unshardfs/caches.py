"""Byte-bounded caches shared by every sharded directory of a mount.

One budget per kind of decoded data (shard indexes, minishard indexes,
decoded chunks) rather than one per directory, so the daemon's memory is
bounded by configuration, not by the number of scales or shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from cachetools import LRUCache

MiB = 1 << 20


def _nbytes(value: object) -> int:
    size = getattr(value, "nbytes", None)
    if size is None:
        size = len(value)  # type: ignore[arg-type]
    return max(int(size), 1) + 64


class CountedLRU(LRUCache):
    """An LRU cache bounded by bytes that counts its hits and misses for `stats`."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize=maxsize, getsizeof=_nbytes)
        self.hits = 0
        self.misses = 0

    def _counted(self, value: object, default: object) -> object:
        if value is _MISSING:
            self.misses += 1
            return default
        self.hits += 1
        return value

    def get(self, key, default=None):  # type: ignore[override]
        # Every lookup asks several caches: one dict probe on a hit (not
        # cachetools' `in` followed by `[]`).
        try:
            value = self[key]
        except KeyError:
            self.misses += 1
            return default
        self.hits += 1
        return value

    def pop(self, key, default=None):  # type: ignore[override]
        return self._counted(super().pop(key, _MISSING), default)

    def put(self, key: object, value: object) -> None:
        """Insert unless the value alone exceeds the whole budget (then just skip it)."""
        try:
            self[key] = value
        except ValueError:
            pass


_MISSING = object()


@dataclass
class CacheSizes:
    """Defaults keep a fully warm daemon under ~250 MB RSS (issue #8's bound)."""

    shard_index_bytes: int = 32 * MiB
    minishard_index_bytes: int = 64 * MiB
    decoded_chunk_bytes: int = 64 * MiB
    # Compressed payloads fetched at lookup, waiting for the read that follows.
    encoded_chunk_bytes: int = 8 * MiB


@dataclass
class Caches:
    sizes: CacheSizes = field(default_factory=CacheSizes)

    def __post_init__(self) -> None:
        self.shard_index = CountedLRU(self.sizes.shard_index_bytes)
        self.minishard_index = CountedLRU(self.sizes.minishard_index_bytes)
        self.decoded_chunk = CountedLRU(self.sizes.decoded_chunk_bytes)
        self.encoded_chunk = CountedLRU(self.sizes.encoded_chunk_bytes)

    def usage(self) -> dict[str, dict[str, int]]:
        return {name: {"bytes": int(cache.currsize), "limit": int(cache.maxsize), "entries": len(cache),
                       "hits": cache.hits, "misses": cache.misses}
                for name, cache in (("shard_index", self.shard_index), ("minishard_index", self.minishard_index),
                                    ("decoded_chunk", self.decoded_chunk), ("encoded_chunk", self.encoded_chunk))}
