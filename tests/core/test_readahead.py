"""Read-ahead decisions, in-process, over a directory stand-in (`ScanTarget`) whose fetcher records
what it is asked to prefetch: which reads make a scan, how far ahead it reads, what it skips."""

from __future__ import annotations

import numpy as np
import trio

from unshardfs.core.blob import Blob
from unshardfs.core.fetch import Extent
from unshardfs.core.policy import POLICY
from unshardfs.core.readahead import ScanScope
from unshardfs.core.table import ChunkTable
from unshardfs.errors import DataError
from unshardfs.sources.base import ObjectStat

CHUNK = 1000


def shard(name: str, ids: list[int], lengths: list[int] | None = None) -> ChunkTable:
    lengths = lengths or [CHUNK] * len(ids)
    starts = np.cumsum([0] + lengths[:-1]).astype(np.uint64)
    blob = Blob.of(name, ObjectStat(int(sum(lengths)), 0, False, ("v",)))
    return ChunkTable.build(blob, np.array(ids, np.uint64), starts, np.array(lengths, np.uint64), 0, blob.size)


class Policy:
    prefetch_bytes = 64 << 20


class Fetcher:
    """Takes every prefetch it is offered and remembers the extents."""

    can_prefetch = True
    policy = Policy()

    def __init__(self) -> None:
        self.prefetched: list[Extent] = []

    def prefetch(self, extents, fill, wide=False) -> int:
        self.prefetched += extents
        return len(extents)


class Target:
    def __init__(self, tables: list[ChunkTable], dense: bool = True, damaged: frozenset[int] = frozenset()) -> None:
        self.fetcher = Fetcher()
        self.dense = dense
        self.tables = tables
        self.damaged = damaged
        self.kept: set[tuple] = set()

    async def locate(self, chunk_id: int):
        if chunk_id in self.damaged:
            raise DataError("s", "bad entry")
        for t in self.tables:
            i = t.find(chunk_id)
            if i is not None:
                return t, i
        return None

    def has_payload(self, ext: Extent) -> bool:
        return ext.key in self.kept


def observe(scope: ScanScope, ids: list[int]) -> None:
    async def main() -> None:
        for chunk_id in ids:
            await scope._observe(chunk_id)

    trio.run(main)


def prefetched(target: Target) -> list[tuple[str, int]]:
    """(shard, first byte / CHUNK) of each prefetched extent."""
    return [(e.blob.label, e.start // CHUNK) for e in target.fetcher.prefetched]


def test_a_guess_is_confirmed_by_two_reads_then_the_window_covers_the_shards_run():
    target = Target([shard("a", list(range(40))), shard("b", list(range(40, 80)))])
    scope = ScanScope(target)
    observe(scope, [0, 1])
    assert prefetched(target) == []  # one match: still a guess
    observe(scope, [2])
    # Ids 3..10 are the first window; it ends inside shard a's run, so it is stretched to its end
    # (one request for the run) and stops at the shard boundary.
    assert prefetched(target) == [("a", k) for k in range(3, 40)]


def test_scattered_reads_start_no_prefetch():
    target = Target([shard("a", list(range(40)))])
    observe(ScanScope(target), [5, 17, 3, 30, 11, 25])
    assert prefetched(target) == []


def test_a_confirmed_stream_tolerates_skips_within_the_slack_only():
    target = Target([shard("a", list(range(400)))])
    scope = ScanScope(target)
    observe(scope, [0, 1, 2, 2 + POLICY.slack])  # the last skips slack - 1 predicted ids
    assert [s.hits for s in scope.streams if s.order == "id"] == [3]
    observe(scope, [3 + 2 * POLICY.slack])  # beyond the slack: a new guess beside the stream
    assert [s.hits for s in scope.streams if s.order == "id"] == [0, 3]


def test_large_cached_and_damaged_chunks_are_not_prefetched():
    big = POLICY.whole_read_max + 1
    table = shard("a", list(range(12)), [CHUNK] * 4 + [big] + [CHUNK] * 7)
    target = Target([table], damaged=frozenset({6}))
    target.kept.add(Extent(table.blob, int(table.starts[5]), CHUNK).key)  # id 5's payload is waiting already
    observe(ScanScope(target), [0, 1, 2])
    assert [int(np.searchsorted(table.starts, np.uint64(e.start))) for e in target.fetcher.prefetched] == \
        [3, 7, 8, 9, 10, 11]


def test_sparse_keys_follow_the_listing_order():
    ids = [7, 3, 11, 5, 42, 19, 23, 8]  # listing order of a sparse directory
    table = ChunkTable(shard("a", sorted(ids)).blob, np.array(ids, np.uint64),
                       np.arange(len(ids), dtype=np.uint64) * CHUNK, np.full(len(ids), CHUNK, np.uint64))
    target = Target([shard("a", sorted(ids))], dense=False)
    scope = ScanScope(target)
    scope.listed(table)
    observe(scope, [7, 3, 11])
    # the rest of the listing, in its order
    wanted = {k: int(target.tables[0].starts[target.tables[0].find(k)]) // CHUNK for k in ids}
    assert prefetched(target) == [("a", wanted[k]) for k in [5, 42, 19, 23, 8]]
