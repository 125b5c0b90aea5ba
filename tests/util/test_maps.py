"""Bounded maps (`unshardfs.util.maps`): LRU and FIFO, by entries or bytes, with a ttl, counted.

First the remote stat cache's case (FIFO, an entry per object, each for `ttl` seconds), then
every combination against a reference implementation.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unshardfs.util.maps import BoundedMap, payload_size


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_after_their_ttl_and_none_is_a_value():
    clock = Clock()
    m = BoundedMap(10, lru=False, ttl=5, clock=clock)
    m["absent"] = None  # a cached absence
    m["x"] = 1
    clock.now = 4.9
    assert m.get("absent", "miss") is None and m.get("x") == 1
    m["x"] = 2  # set again: a new lifetime
    clock.now = 5.0
    assert m.get("absent", "miss") == "miss"
    assert m.get("x") == 2 and len(m) == 1
    clock.now = 9.8
    assert m.get("x") == 2
    clock.now = 9.9
    assert m.get("x", "miss") == "miss" and len(m) == 0


def test_the_oldest_set_is_dropped_at_maxsize():
    m = BoundedMap(3, lru=False, ttl=60, clock=Clock())
    for key in "abc":
        m[key] = key
    m["a"] = "again"  # set again: now the newest
    m["d"] = "d"
    assert [m.get(k) for k in "abcd"] == ["again", None, "c", "d"] and len(m) == 3


def test_pop_removes_and_answers_the_value():
    m = BoundedMap(3, lru=False, ttl=60, clock=Clock())
    m["a"] = None
    assert m.pop("a", "miss") is None and m.pop("a", "miss") == "miss" and len(m) == 0


# -- every policy against a reference: a list of entries, oldest first ---------------------

class Reference:
    """What a bounded map must do, written the slow obvious way."""

    def __init__(self, maxsize: int, lru: bool, sized: bool, ttl: float | None) -> None:
        self.maxsize, self.lru, self.sized, self.ttl = maxsize, lru, sized, ttl
        self.entries: list[list] = []  # [key, value, deadline], the oldest first
        self.hits = self.misses = 0
        self.evicted: list[tuple[int, bytes]] = []

    def _find(self, key: int) -> int | None:
        return next((i for i, e in enumerate(self.entries) if e[0] == key), None)

    def _live(self, key: int, now: float) -> int | None:
        """Where `key`'s live entry is (an expired one is dropped), counted as a hit or a miss."""
        i = self._find(key)
        if i is not None and self.ttl is not None and self.entries[i][2] <= now:
            del self.entries[i]  # read when expired: dropped
            i = None
        if i is None:
            self.misses += 1
        else:
            self.hits += 1
        return i

    def get(self, key: int, now: float) -> object:
        i = self._live(key, now)
        if i is None:
            return "default"
        entry = self.entries[i]
        if self.lru:
            self.entries.append(self.entries.pop(i))
        return entry[1]

    def pop(self, key: int, now: float) -> object:
        i = self._live(key, now)
        return "default" if i is None else self.entries.pop(i)[1]

    def contains(self, key: int, now: float) -> bool:
        i = self._find(key)
        return i is not None and (self.ttl is None or self.entries[i][2] > now)

    def size(self) -> int:
        return sum(len(e[1]) for e in self.entries) if self.sized else len(self.entries)

    def set(self, key: int, value: bytes, now: float) -> None:
        i = self._find(key)
        if i is not None:
            del self.entries[i]
        if self.sized and len(value) > self.maxsize:
            return
        self.entries.append([key, value, now + (self.ttl or 0)])
        while self.size() > self.maxsize or len(self.entries) > self.maxsize:
            old = self.entries.pop(0)
            self.evicted.append((old[0], old[1]))


ops = st.lists(st.one_of(
    st.tuples(st.just("set"), st.integers(0, 7), st.binary(max_size=12)),
    st.tuples(st.sampled_from(["get", "pop", "in", "del"]), st.integers(0, 7)),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 3.0])),
), max_size=60)


@settings(max_examples=400, deadline=None)
@given(maxsize=st.integers(0, 24), lru=st.booleans(), sized=st.booleans(), counted=st.booleans(),
       ttl=st.one_of(st.none(), st.sampled_from([1.0, 2.5])), script=ops)
def test_a_bounded_map_does_what_the_reference_does(maxsize, lru, sized, counted, ttl, script):
    clock = Clock()
    evicted: list[tuple[int, bytes]] = []
    m: BoundedMap[int, bytes] = BoundedMap(
        maxsize, lru=lru, getsizeof=len if sized else None, ttl=ttl, clock=clock,
        on_evict=lambda k, v: evicted.append((k, v)), counted=counted)
    ref = Reference(maxsize, lru, sized, ttl)
    for op, *args in script:
        now = clock.now
        if op == "set":
            m[args[0]] = args[1]
            ref.set(args[0], args[1], now)
        elif op == "get":
            assert m.get(args[0], "default") == ref.get(args[0], now)
        elif op == "pop":
            assert m.pop(args[0], "default") == ref.pop(args[0], now)
        elif op == "in":
            assert (args[0] in m) == ref.contains(args[0], now)
        elif op == "del":
            present = ref._find(args[0])
            if present is None:
                with pytest.raises(KeyError):
                    del m[args[0]]
            else:
                del m[args[0]]
                del ref.entries[present]
        else:
            clock.now += args[0]
        assert list(m.items()) == [(e[0], e[1]) for e in ref.entries]
        assert m.currsize == ref.size() <= max(maxsize, 0)
        assert len(m) == len(ref.entries) <= maxsize
        assert evicted == ref.evicted
        if counted or lru or ttl is not None:  # an uncounted FIFO map's `get` is the dict's own
            gets_and_pops = sum(op in ("get", "pop") for op, *_ in script)
            assert m.hits + m.misses <= gets_and_pops
        if counted:
            assert (m.hits, m.misses) == (ref.hits, ref.misses)


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(0, 4096), values=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 5000)), max_size=200))
def test_a_byte_budget_is_never_exceeded(budget, values):
    m: BoundedMap[int, bytes] = BoundedMap(budget, getsizeof=payload_size)
    for key, size in values:
        value = b"x" * size
        m[key] = value
        assert m.currsize == sum(payload_size(v) for v in m.values()) <= budget
        # Kept if it fits the whole budget alone (and then it is the newest), else not at all.
        assert (key in m) == (payload_size(value) <= budget)


def test_the_byte_budget_counts_nbytes_when_a_value_has_it():
    import numpy as np

    m: BoundedMap[str, object] = BoundedMap(10_000, getsizeof=payload_size)
    m["a"] = np.zeros(1000, dtype=np.uint64)  # 8,000 bytes, not its length of 1,000
    assert m.currsize == 8064
    m["b"] = np.zeros(500, dtype=np.uint64)
    assert list(m) == ["b"] and m.currsize == 4064


def test_lru_keeps_what_is_read_and_fifo_what_was_set_last():
    lru: BoundedMap[str, int] = BoundedMap(2)
    fifo: BoundedMap[str, int] = BoundedMap(2, lru=False)
    for m in (lru, fifo):
        m["a"], m["b"] = 1, 2
        assert m.get("a") == 1
        m["c"] = 3
    assert list(lru) == ["a", "c"] and list(fifo) == ["b", "c"]
    assert (lru.hits, lru.misses, lru.get("b"), lru.misses) == (1, 0, None, 1)


def test_eviction_is_told_and_explicit_removal_is_not():
    told: list[tuple[str, int]] = []
    m: BoundedMap[str, int] = BoundedMap(2, on_evict=lambda k, v: told.append((k, v)))
    m["a"], m["b"] = 1, 2
    assert m.pop("a", None) == 1
    del m["b"]
    m["c"], m["d"], m["e"] = 3, 4, 5
    m.clear()
    assert told == [("c", 3)] and len(m) == 0 and m.currsize == 0


def test_a_ttl_map_answers_contains_by_the_clock_and_counts_expiry_as_a_miss():
    clock = Clock()
    m: BoundedMap[str, int] = BoundedMap(4, ttl=10, clock=clock)
    m["a"] = 1
    clock.now = 9.99
    assert "a" in m and m.get("a") == 1 and (m.hits, m.misses) == (1, 0)
    clock.now = 10.0
    assert "a" not in m and len(m) == 1  # a peek drops nothing
    assert m.get("a") is None and (m.hits, m.misses) == (1, 1) and len(m) == 0


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError):
        BoundedMap(-1)
