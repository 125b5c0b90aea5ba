"""ExpiringMap: the remote stat cache (an entry per object, each for `ttl` seconds, bounded)."""

from __future__ import annotations

from unshardfs.util.maps import ExpiringMap


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_after_their_ttl_and_none_is_a_value():
    clock = Clock()
    m = ExpiringMap(maxsize=10, ttl=5, clock=clock)
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
    m = ExpiringMap(maxsize=3, ttl=60, clock=Clock())
    for key in "abc":
        m[key] = key
    m["a"] = "again"  # set again: now the newest
    m["d"] = "d"
    assert [m.get(k) for k in "abcd"] == ["again", None, "c", "d"] and len(m) == 3


def test_pop_removes_and_answers_the_value():
    m = ExpiringMap(maxsize=3, ttl=60, clock=Clock())
    m["a"] = None
    assert m.pop("a", "miss") is None and m.pop("a", "miss") == "miss" and len(m) == 0
