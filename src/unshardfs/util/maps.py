"""Bounded maps: the one place that decides how a map of ours stays within its bound.

Every cache, memo and "recently seen" table of the daemon is a `BoundedMap`: at most
`maxsize` entries, or `maxsize` bytes when given a `getsizeof`, the oldest entry dropped
first to make room. Two policies say which entry is the oldest:

- LRU (`lru=True`, the default): the least recently read or set; a hit moves its entry last.
- FIFO (`lru=False`): the one set longest ago; a hit moves nothing, which suits a table
  every lookup asks and every listing fills.

With a `ttl`, an entry also expires that many seconds (of `clock`) after it was set: it reads
as absent, and is dropped when next read. Hits and misses of `get` and `pop` are counted for
`stats` unless `counted=False`; a FIFO map without a ttl that is not counted answers `get` with
the dict's own probe (no Python call: the tables every lookup asks). An `on_evict(key, value)` is told of every entry the bound drops (not of those
popped, deleted, expired or cleared): a cache of open descriptors closes them there.

Eviction is O(1) (`OrderedDict.popitem(last=False)`): a plain dict's first key found by
`next(iter(d))` costs a scan of every slot deleted before it, quadratic over a long life.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import (Callable, Generic, Hashable, ItemsView, Iterator, KeysView, Protocol, Sized, TypeVar, ValuesView,
                    cast, overload)

MiB = 1 << 20

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)
V_co = TypeVar("V_co", covariant=True)


class _Get(Protocol[K_contra, V_co]):
    """`BoundedMap.get`: the value of `key`, or `default` (None unless given)."""

    @overload
    def __call__(self, key: K_contra, /) -> V_co | None: ...

    @overload
    def __call__(self, key: K_contra, default: D, /) -> V_co | D: ...


def payload_size(value: object) -> int:
    """What a cached value costs a byte budget: its `nbytes` (numpy arrays and our own decoded
    structures say it) or its length (bytes), and 64 bytes for its entry."""
    if type(value) is bytes:  # the common case, without a failed attribute lookup (an exception)
        return max(len(value), 1) + 64
    size = getattr(value, "nbytes", None)
    if size is None:
        size = len(cast(Sized, value))
    return max(int(size), 1) + 64


class _Missing:
    """The marker of an absent entry (None is a value: a cached absence)."""


_MISSING = _Missing()


class BoundedMap(Generic[K, V]):
    """A map that stays within `maxsize` entries (or bytes, with `getsizeof`); see the module.

    A value whose size alone exceeds the budget is not kept (and the key's previous value is
    dropped): a cache skips what it cannot hold instead of failing the read that produced it.
    """

    __slots__ = ("get", "maxsize", "hits", "misses", "_data", "_lru", "_getsizeof", "_sizes", "_bytes",
                 "_ttl", "_deadlines", "_clock", "_on_evict")

    get: _Get[K, V]
    """The value of `key` (a hit: LRU moves it last), or `default` (a miss)."""

    def __init__(self, maxsize: int, *, lru: bool = True, getsizeof: Callable[[V], int] | None = None,
                 ttl: float | None = None, clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[K, V], None] | None = None, counted: bool = True) -> None:
        if maxsize < 0:
            raise ValueError(f"a bounded map's maxsize must not be negative, not {maxsize}")
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lru = lru
        self._getsizeof = getsizeof
        self._sizes: dict[K, int] | None = {} if getsizeof is not None else None
        self._bytes = 0
        self._ttl = 0.0 if ttl is None else float(ttl)
        self._deadlines: dict[K, float] | None = {} if ttl is not None else None
        self._clock = clock
        self._on_evict = on_evict
        # `get` is chosen once here, not decided per call: `_lru_get` is `_counted_get` without the
        # checks a counted LRU map without a ttl never needs (the caches of indexes, chunks and
        # metadata, asked several times per read). Each answers what `_Get` says (the dict's
        # overloads and the `object` returns are spelled differently, hence the ignores).
        if lru and ttl is None and counted:
            self.get = self._lru_get  # type: ignore[assignment]
        elif lru or ttl is not None or counted:
            self.get = self._counted_get if counted else self._uncounted_get  # type: ignore[assignment]
        else:
            self.get = self._data.get  # type: ignore[assignment]

    def figures(self, name: str) -> dict[str, int]:
        """This map's counters for `stats`, each named `NAME_cache_...`."""
        return {f"{name}_cache_bytes": self.currsize, f"{name}_cache_entries": len(self),
                f"{name}_cache_hits": self.hits, f"{name}_cache_misses": self.misses}

    # -- reads -------------------------------------------------------------------------

    def _lru_get(self, key: K, default: object = None) -> object:
        data = self._data
        value = data.get(key, _MISSING)
        if value is _MISSING:
            self.misses += 1
            return default
        data.move_to_end(key)
        self.hits += 1
        return value

    def _counted_get(self, key: K, default: object = None) -> object:
        value = self._data.get(key, _MISSING)
        if value is _MISSING or (self._deadlines is not None and self._expired(key)):
            self.misses += 1
            return default
        if self._lru:
            self._data.move_to_end(key)
        self.hits += 1
        return value

    def _uncounted_get(self, key: K, default: object = None) -> object:
        value = self._data.get(key, _MISSING)
        if value is _MISSING or (self._deadlines is not None and self._expired(key)):
            return default
        if self._lru:
            self._data.move_to_end(key)
        return value

    def __getitem__(self, key: K) -> V:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return cast(V, value)

    def __contains__(self, key: object) -> bool:
        """Whether `key` has a live value (neither counted nor moved: a peek)."""
        deadlines = self._deadlines
        if deadlines is None:
            return key in self._data
        return key in self._data and deadlines[cast(K, key)] > self._clock()

    def _expired(self, key: K) -> bool:
        """Whether `key`'s entry (present) outlived its ttl; dropped if so."""
        assert self._deadlines is not None
        if self._deadlines[key] > self._clock():
            return False
        self._discard(key)
        return True

    def __len__(self) -> int:
        """Entries held (expired ones included until read or evicted)."""
        return len(self._data)

    @property
    def currsize(self) -> int:
        """What counts against `maxsize`: bytes with a `getsizeof`, entries without."""
        return self._bytes if self._sizes is not None else len(self._data)

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def keys(self) -> KeysView[K]:
        return self._data.keys()

    def values(self) -> ValuesView[V]:
        return self._data.values()

    def items(self) -> ItemsView[K, V]:
        return self._data.items()

    # -- writes ------------------------------------------------------------------------

    def __setitem__(self, key: K, value: V) -> None:
        """Set `key` (now the newest entry), dropping the oldest while over the bound."""
        data = self._data
        sizes, getsizeof = self._sizes, self._getsizeof
        if sizes is None or getsizeof is None:  # (both or neither)
            if key in data:
                data.move_to_end(key)
            data[key] = value
        else:
            size = getsizeof(value)
            old = sizes.pop(key, None)
            if old is not None:
                del data[key]
                self._bytes -= old
            if size > self.maxsize:
                if self._deadlines is not None:
                    self._deadlines.pop(key, None)
                return
            while self._bytes + size > self.maxsize:
                self._evict()
            data[key] = value
            sizes[key] = size
            self._bytes += size
        if self._deadlines is not None:
            self._deadlines[key] = self._clock() + self._ttl
        while len(data) > self.maxsize:
            self._evict()

    def pop(self, key: K, default: D) -> V | D:
        """Remove `key`: its value (a hit) or `default` (a miss, or expired)."""
        value = self._data.get(key, _MISSING)
        if value is _MISSING or (self._deadlines is not None and self._expired(key)):
            self.misses += 1
            return default
        self._discard(key)
        self.hits += 1
        return cast(V, value)

    def __delitem__(self, key: K) -> None:
        if key not in self._data:
            raise KeyError(key)
        self._discard(key)

    def clear(self) -> None:
        """Drop every entry (the counts of hits and misses stay)."""
        self._data.clear()
        if self._sizes is not None:
            self._sizes.clear()
            self._bytes = 0
        if self._deadlines is not None:
            self._deadlines.clear()

    def _discard(self, key: K) -> None:
        """Drop `key`'s entry (present) and what is kept beside it."""
        del self._data[key]
        if self._sizes is not None:
            self._bytes -= self._sizes.pop(key)
        if self._deadlines is not None:
            del self._deadlines[key]

    def _evict(self) -> None:
        """Drop the oldest entry for the bound, and tell `on_evict`."""
        key, value = self._data.popitem(last=False)
        if self._sizes is not None:
            self._bytes -= self._sizes.pop(key)
        if self._deadlines is not None:
            del self._deadlines[key]
        if self._on_evict is not None:
            self._on_evict(key, value)
