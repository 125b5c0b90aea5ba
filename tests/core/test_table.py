"""ChunkTable validation, in-process: which entries are kept, which are bad and with what reason."""

from __future__ import annotations

import numpy as np

from unshardfs.core.blob import Blob
from unshardfs.core.table import MAX_BAD_REASONS, ChunkTable
from unshardfs.sources.base import ObjectStat

BLOB = Blob.of("s.shard", ObjectStat(1000, 0, False, ("v",)))
U64_MAX = (1 << 64) - 1


def build(ids, starts, lengths, lo=100, hi=1000, **kw) -> ChunkTable:
    return ChunkTable.build(BLOB, np.array(ids, dtype=np.uint64), np.array(starts, dtype=np.uint64),
                            np.array(lengths, dtype=np.uint64), lo, hi, **kw)


def test_entries_inside_the_data_area_are_kept_in_order():
    t = build([1, 5, 9], [100, 200, 990], [100, 50, 10])
    assert t.ids.tolist() == [1, 5, 9] and not t.bad
    assert [t.row(i) for i in range(3)] == [(1, 100, 100), (5, 200, 50), (9, 990, 10)]
    assert t.find(5) == 1 and t.find(4) is None


def test_each_bad_range_is_kept_out_with_its_reason():
    t = build([1, 2, 3, 4], [99, 995, 500, U64_MAX - 5], [1, 10, 10, 10])
    assert t.ids.tolist() == [3]
    assert t.bad == {
        1: "byte range [99, +1) lies outside the data area [100, 1000) of s.shard",
        2: "byte range [995, +10) lies outside the data area [100, 1000) of s.shard",
        # start + length wraps around 2**64: outside by construction, never "inside"
        4: f"byte range [{U64_MAX - 5}, +10) lies outside the data area [100, 1000) of s.shard",
    }


def test_unsorted_keys_are_sorted_and_the_first_of_duplicates_wins():
    t = build([9, 3, 9, 1], [100, 200, 300, 400], [1, 2, 3, 4])
    assert t.ids.tolist() == [1, 3, 9] and t.row(2) == (9, 100, 1)


def test_a_bad_first_duplicate_is_bad_even_if_a_later_one_is_fine():
    t = build([7, 3, 7], [5000, 200, 300], [1, 2, 3])
    assert t.ids.tolist() == [3] and set(t.bad) == {7}


def test_reasons_given_by_the_format_are_kept_and_bounded():
    t = build([1], [100], [1], reasons={8: "record 8 does not exist"})
    assert t.bad == {8: "record 8 does not exist"} and t.find(8) is None
    many = build(list(range(5000)), [0] * 5000, [1] * 5000)
    assert len(many) == 0 and len(many.bad) == MAX_BAD_REASONS


def test_find_refuses_keys_no_uint64_can_be():
    t = build([0, U64_MAX], [100, 200], [1, 1])
    assert t.find(0) == 0 and t.find(U64_MAX) == 1
    assert t.find(-1) is None and t.find(1 << 64) is None
    assert ChunkTable.empty(BLOB).find(0) is None


def test_where_and_part_and_extra_follow_the_selection():
    t = build([1, 2, 3], [100, 200, 300], [1, 1, 1], extra=np.array([7, 8, 9]), part=5)
    picked = t.where(np.array([True, False, True]))
    assert picked.ids.tolist() == [1, 3] and picked.extra.tolist() == [7, 9] and picked.part == 5
    assert not picked.bad and picked.blob is BLOB
