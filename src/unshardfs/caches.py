"""Byte-bounded caches shared by every sharded directory of a mount.

One budget per kind of decoded data (each index level a format declares,
decoded chunks) rather than one per directory, so the daemon's memory is
bounded by configuration, not by the number of scales or shards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence, Sized, cast

from cachetools import LRUCache

from .core.blob import RecentBlobs

MiB = 1 << 20


def _nbytes(value: object) -> int:
    size = getattr(value, "nbytes", None)
    if size is None:
        size = len(cast(Sized, value))  # bytes, or anything else with a length
    return max(int(size), 1) + 64


def _internals_known() -> bool:
    probe: LRUCache[str, int] = LRUCache(maxsize=2)
    probe["a"], probe["b"] = 1, 2
    return (getattr(probe, "_Cache__data", None) == {"a": 1, "b": 2}
            and list(getattr(probe, "_LRUCache__order", ())) == ["a", "b"])


# cachetools' `get` is four Python calls (`in`, then `[]`, which updates the order in turn); every
# lookup and read asks several caches, so `QuickLRU.get` reaches into its two dictionaries
# directly when they are where cachetools (5.x-8.x) keeps them.
_QUICK = _internals_known()


class QuickLRU(LRUCache):
    """cachetools' LRUCache whose `get` costs one dict probe and one `move_to_end` on a hit."""

    if _QUICK:
        def get(self, key: Hashable, default: Any = None) -> Any:
            try:
                value = self._Cache__data[key]  # type: ignore[attr-defined]
            except KeyError:
                return default
            self._LRUCache__order.move_to_end(key)  # type: ignore[attr-defined]
            return value


class CountedLRU(QuickLRU):
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

    # cachetools has no type information: values come back as Any, callers say what they hold.
    def get(self, key: Hashable, default: Any = None) -> Any:
        if _QUICK:  # QuickLRU.get, not called: every lookup asks twice
            try:
                value = self._Cache__data[key]  # type: ignore[attr-defined]
            except KeyError:
                self.misses += 1
                return default
            self._LRUCache__order.move_to_end(key)  # type: ignore[attr-defined]
        else:
            value = super().get(key, _MISSING)
            if value is _MISSING:
                self.misses += 1
                return default
        self.hits += 1
        return value

    def pop(self, key: Hashable, default: Any = None) -> Any:
        return self._counted(super().pop(key, _MISSING), default)

    def put(self, key: object, value: object) -> None:
        """Insert unless the value alone exceeds the whole budget (then just skip it)."""
        try:
            self[key] = value
        except ValueError:
            pass


_MISSING = object()


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


SHARD_INDEX = IndexLevel("shard_index", "--shard-index-cache", 32 * MiB, "shard index cache")


@dataclass
class CacheSizes:
    """Defaults keep a fully warm daemon under ~250 MB RSS (issue #8's bound)."""

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
        self._index: dict[str, CountedLRU] = {}
        for level in self.levels:
            self.index(level)
        self.decoded_chunk = CountedLRU(self.sizes.decoded_chunk_bytes)
        self.encoded_chunk = CountedLRU(self.sizes.encoded_chunk_bytes)
        self.metadata = CountedLRU(self.sizes.metadata_bytes)
        self.blobs = RecentBlobs()

    def index(self, level: IndexLevel) -> CountedLRU:
        """The cache of one index level (made on first use, from its declaration)."""
        cache = self._index.get(level.name)
        if cache is None:
            cache = self._index[level.name] = CountedLRU(self.sizes.index_bytes.get(level.name, level.default))
        return cache

    def usage(self) -> dict[str, dict[str, int]]:
        named = [*self._index.items(), ("decoded_chunk", self.decoded_chunk), ("encoded_chunk", self.encoded_chunk),
                 ("metadata", self.metadata)]
        return {name: {"bytes": int(cache.currsize), "limit": int(cache.maxsize), "entries": len(cache),
                       "hits": cache.hits, "misses": cache.misses}
                for name, cache in named}


class ExpiringMap:
    """Values kept for `ttl` seconds each, `maxsize` at most (the oldest set dropped first).

    cachetools' `TTLCache` costs about ten Python calls per probe (its timer context, the
    expiry links, the LRU order); a remote source's stat cache is probed for every lookup
    and every chunk read ahead, where this costs one dictionary probe and one clock read.
    """

    def __init__(self, maxsize: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.maxsize = maxsize
        self.ttl = ttl
        self._clock = clock
        self._data: dict[Hashable, tuple[float, Any]] = {}

    def get(self, key: Hashable, default: Any = None) -> Any:
        entry = self._data.get(key)
        if entry is None:
            return default
        if entry[0] <= self._clock():
            del self._data[key]
            return default
        return entry[1]

    def __setitem__(self, key: Hashable, value: Any) -> None:
        data = self._data
        if data.pop(key, None) is None and len(data) >= self.maxsize:
            del data[next(iter(data))]  # the oldest set (dicts keep insertion order)
        data[key] = (self._clock() + self.ttl, value)

    def pop(self, key: Hashable, default: Any = None) -> Any:
        entry = self._data.pop(key, None)
        return default if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._data)
