"""Bounded maps: the one place that decides how a map of ours stays within its bound."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence, Sized, cast

from cachetools import LRUCache

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

    def figures(self, name: str) -> dict[str, int]:
        """This cache's counters for `stats`, each named `NAME_cache_...`."""
        return {f"{name}_cache_bytes": int(self.currsize), f"{name}_cache_entries": len(self),
                f"{name}_cache_hits": self.hits, f"{name}_cache_misses": self.misses}

    def put(self, key: object, value: object) -> None:
        """Insert unless the value alone exceeds the whole budget (then just skip it)."""
        try:
            self[key] = value
        except ValueError:
            pass


_MISSING = object()


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
