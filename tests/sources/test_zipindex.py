"""The compact zip index on parsed entries alone: path order (against Python's sort of the mapped
names), the ambiguity rules (against a plain model of them), lookups and listings, and what it keeps
per entry."""

from __future__ import annotations

import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from unshardfs.sources.zipformat import COLUMNS, Entries
from unshardfs.sources.zipindex import KEY, build_index, path_order


def _entries(names: list[bytes], headers: list[int] | None = None) -> Entries:
    starts = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in names], out=starts[1:])
    n = len(names)
    columns = {k: np.zeros(n, dtype=np.uint64) for k in COLUMNS}
    columns["header"] = np.asarray(headers if headers is not None else [100 * i for i in range(n)], dtype=np.uint64)
    columns["usize"] = np.arange(n, dtype=np.uint64)  # which entry it was
    return Entries(np.frombuffer(b"".join(names), dtype=np.uint8).copy(), starts, columns)


def _model(names: list[bytes], headers: list[int]) -> tuple[list[bytes], dict[bytes, str]]:
    """The rules stated plainly: (names kept, in path order; why each refused file is)."""
    files = [x for x in names if not x.endswith(b"/")]
    dirs = {x[:i] for x in names for i in range(1, len(x)) if x[i:i + 1] == b"/"}
    why: dict[bytes, str] = {}
    for i, name in enumerate(names):
        if name.endswith(b"/"):
            continue
        if files.count(name) > 1:
            why[name] = "the name occurs more than once"
        elif name in dirs:
            why[name] = "the name is also a directory"
        elif sum(headers[j] == headers[i] for j, x in enumerate(names) if not x.endswith(b"/")) > 1:
            why[name] = "its local header is shared with another entry (overlapping members)"
    kept = sorted({x for x in names if x not in why}, key=lambda x: x.translate(KEY))
    return kept, why


segment = st.sampled_from([b"a", b"b", b"a-b", b"a.b", b"A", b"0", b"\xc3\xa9", b"ab", b"a!", b"zz"])
name = st.lists(segment, min_size=1, max_size=4).map(b"/".join)
entry = st.tuples(name, st.booleans()).map(lambda t: t[0] + b"/" if t[1] else t[0])


@settings(max_examples=300, deadline=None)
@given(names=st.lists(entry, max_size=25), shared=st.lists(st.integers(0, 30), max_size=3))
def test_rules_and_order_against_a_model(names, shared):
    headers = [100 * i for i in range(len(names))]
    for i in shared:  # some files pointed at another's local header
        if i + 1 < len(names):
            headers[i + 1] = headers[i]
    skipped: list[tuple[object, str]] = []
    index = build_index(_entries(names, headers), 10**9, lambda n, why: skipped.append((n, why)))
    kept, why = _model(names, headers)
    assert [index.name(i) for i in range(len(index))] == kept
    assert {n.encode(): w for n, w in skipped} == why  # type: ignore[union-attr]
    for i, n in enumerate(kept):
        assert index.find(n) == i
        assert int(index.usize[i]) == names.index(n)  # the columns follow their names (the first of a repeat)
        assert bool(index.isdir[i]) == n.endswith(b"/")


@settings(max_examples=200, deadline=None)
@given(strings=st.lists(st.binary(min_size=1, max_size=40).filter(lambda b: 0 not in b), max_size=60))
def test_path_order_is_a_stable_sort(strings):
    keys = [s.translate(KEY) for s in strings]
    starts = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum([len(k) for k in keys], out=starts[1:])
    blob = np.frombuffer(b"".join(keys), dtype=np.uint8)
    order, same = path_order(blob, starts[:-1], np.diff(starts))
    assert list(order) == sorted(range(len(keys)), key=keys.__getitem__)
    assert list(same) == [i > 0 and keys[order[i]] == keys[order[i - 1]] for i in range(len(keys))]


def test_listing_is_in_name_order_and_skips_subtrees():
    names = [b"a-b", b"a/x", b"a/", b"a/y/z", b"a.c", b"b", b"a/y/w"]
    index = build_index(_entries(names), 10**9, lambda n, why: None)
    assert list(index.children(b"")) == [(b"a", None), (b"a-b", index.find(b"a-b")), (b"a.c", index.find(b"a.c")),
                                         (b"b", index.find(b"b"))]
    assert [c for c, _ in index.children(b"a/")] == [b"x", b"y"]
    assert [c for c, _ in index.children(b"a/y/")] == [b"w", b"z"]
    assert index.is_dir(b"a/y/") and not index.is_dir(b"a/q/") and index.find(b"a/") >= 0


def test_memory_per_entry():
    """57 bytes per entry beside its name once built, and no Python object per entry while building."""
    n = 200_000
    names = [f"s/{i % 100}-{i % 100 + 1}_{i // 100 % 100}-{i // 100 % 100 + 1}_{i // 10000}".encode()
             for i in range(n)]
    entries = _entries(names)
    name_bytes = sum(map(len, names))
    del names
    tracemalloc.start()
    try:
        index = build_index(entries, 10**12, lambda n, why: None)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(index) == n
    assert (kept - name_bytes) / n <= 64, kept / n
    assert (peak - 2 * name_bytes) / n <= 160, peak / n
