"""Read-ahead decisions, in-process, over a directory stand-in (`ScanTarget`) whose fetcher records
what it is asked to prefetch: which reads make a scan, how far ahead it reads, what it skips."""

from __future__ import annotations

import numpy as np
import trio

from unshardfs.core.blob import Blob
from unshardfs.core.fetch import Extent
from unshardfs.core.nameorder import NameOrder
from unshardfs.core.policy import POLICY
from unshardfs.core.readahead import ScanOrder, ScanScope
from unshardfs.core.table import ChunkTable
from unshardfs.sources.base import ObjectStat
from unshardfs.util.errors import DataError

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

    def spawn(self, work, *args) -> bool:
        return False  # no background: read-ahead reads the index tables it needs itself

    def watch(self, ext, watcher) -> bool:
        return False  # what was read is not told: every read here is observed by the test

    def holds(self, ext) -> bool:
        return False


class Target:
    def __init__(self, tables: list[ChunkTable], dense: bool = True, damaged: frozenset[int] = frozenset(),
                 name_order: NameOrder | None = None) -> None:
        self.fetcher = Fetcher()
        self.dense = dense
        self.name_order = name_order
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

    def table_of(self, chunk_id: int):
        return next((t.blob.label for t in self.tables if t.find(chunk_id) is not None), None)


def observe(scope: ScanScope, ids: list[int]) -> None:
    async def main() -> None:
        for chunk_id in ids:
            await scope.observe(chunk_id)

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


def listed(n: int) -> tuple[Target, ScanScope]:
    """A directory of ids 0..n-1 in one shard, its listing read."""
    table = shard("a", list(range(n)))
    target = Target([table])
    scope = ScanScope(target)
    scope.listed(table)
    return target, scope


def test_a_listed_directory_read_from_its_first_entry_is_confirmed_by_one_follow():
    """`cp -r`, `tar` or `find -exec` list a directory, then read its files from the first: that
    read prefetches the next few at once (the second read finds them on their way, a round trip
    sooner) and the second confirms the scan; read from elsewhere, a scan needs three reads."""
    target, scope = listed(40)
    observe(scope, [0])
    assert prefetched(target) == [("a", k) for k in range(1, 1 + POLICY.open_window)]
    observe(scope, [1])
    assert prefetched(target) == [("a", k) for k in range(1, 40)]
    elsewhere, scope = listed(40)
    observe(scope, [5, 6])
    assert prefetched(elsewhere) == []


def test_joint_readers_starting_at_a_listing_s_first_entry_miss_nothing():
    """Several readers start at a listing's first entry together: the open window covers the
    next 8, and the stream their jumbled reads confirm also prefetches what lies between that
    window and the furthest read that none of them has read yet (10 here)."""
    target, scope = listed(400)
    observe(scope, [0, 12, 9, 14, 11, 13])
    got = {k for _, k in prefetched(target)}
    assert set(range(1, 9)) | {10} <= got and not got & {0, 9, 11, 12, 13, 14}


def test_the_first_read_of_a_listing_prefetches_only_the_open_window():
    """The guess made at a listing's first entry is not a scan yet: its prefetch is OPEN_WINDOW
    chunks, not stretched to the end of the shard's run (a tool that lists and reads one file)."""
    target, scope = listed(400)
    observe(scope, [0])
    assert prefetched(target) == [("a", k) for k in range(1, 1 + POLICY.open_window)]
    observe(scope, [300])  # not a follow: nothing more
    assert len(prefetched(target)) == POLICY.open_window


def test_the_id_stream_carries_on_once_the_listing_streams_window_reaches_its_directorys_end():
    """Nested chunk directories (`cp -r` of Zarr's c/i/j/k): the listing of one directory ends
    with it; the id stream beside it prefetches the next directories' chunks at once, not only
    after the reader has read the listed ones (a round trip's stall)."""
    listed = shard("a", list(range(8)))  # the directory being copied
    target = Target([listed, shard("b", list(range(8, 80)))])  # b: the next directories' chunks
    scope = ScanScope(target)
    scope.listed(listed)
    observe(scope, [0, 1])
    assert sorted({k for s, k in prefetched(target) if s == "a"}) == list(range(1, 8))
    assert [k for s, k in prefetched(target) if s == "b"] == list(range(72))  # its whole run, at once


def test_scattered_reads_start_no_prefetch():
    target = Target([shard("a", list(range(40)))])
    observe(ScanScope(target), [5, 17, 3, 30, 11, 25])
    assert prefetched(target) == []


def test_a_confirmed_stream_takes_skips_within_what_it_declared_and_the_slack():
    """A reader skipping files goes on with its scan as long as it reads what the scan declared,
    or within SLACK past it; further on it starts a guess of its own beside the stream."""
    target = Target([shard("a", list(range(4000)))])  # (one shard: windows stretched to its end)
    scope = ScanScope(target)
    observe(scope, [0, 1, 2])
    [stream] = scope.streams
    declared_to, hits = stream.frontier, stream.hits
    observe(scope, [2 + POLICY.slack, declared_to - 1])  # skips within the declared window
    assert scope.streams == [stream] and stream.hits == hits + 2 and not scope.guesses
    observe(scope, [stream.frontier + POLICY.slack])  # beyond what it declared and the slack: a guess
    assert scope.streams == [stream] and stream.hits == hits + 2 and len(scope.guesses) == 1


def test_large_cached_and_damaged_chunks_are_not_prefetched():
    big = POLICY.whole_read_max + 1
    table = shard("a", list(range(12)), [CHUNK] * 4 + [big] + [CHUNK] * 7)
    target = Target([table], damaged=frozenset({6}))
    target.kept.add(Extent(table.blob, int(table.starts[5]), CHUNK).key)  # id 5's payload is waiting already
    observe(ScanScope(target), [0, 1, 2])
    assert [int(np.searchsorted(table.starts, np.uint64(e.start))) for e in target.fetcher.prefetched] == \
        [3, 7, 8, 9, 10, 11]


def test_sparse_keys_follow_the_listing_order():
    rng = np.random.default_rng(5)
    ids = [int(k) for k in rng.choice(10_000, 60, replace=False)]  # listing order of a sparse directory
    table = ChunkTable(shard("a", sorted(ids)).blob, np.array(ids, np.uint64),
                       np.arange(len(ids), dtype=np.uint64) * CHUNK, np.full(len(ids), CHUNK, np.uint64))
    target = Target([shard("a", sorted(ids))], dense=False)
    scope = ScanScope(target)
    scope.listed(table)
    wanted = {k: int(target.tables[0].starts[target.tables[0].find(k)]) // CHUNK for k in ids}
    observe(scope, [ids[0]])  # the listing's first entry: its open window, in listing order
    opened = prefetched(target)
    assert opened == [("a", wanted[k]) for k in ids[1:1 + POLICY.open_window]]
    observe(scope, [ids[1]])  # the one after it (on its way): the rest of the listing, in its order
    assert [s.order for s in scope.streams] == [ScanOrder.LISTING]
    assert [e for e in prefetched(target)[len(opened):] if e not in opened] == \
        [("a", wanted[k]) for k in ids[2:] if ("a", wanted[k]) not in opened]


# -- name order: readers that split the sorted names between them -----------------------------

def test_name_order_is_the_string_order_of_the_names():
    """Successors counted on the axes' ranks are the names sorted as strings: precomputed names
    (clipped ends, a negative offset: '-8-8' sorts before '-24-8'... as strings do) and Zarr keys,
    nested ('c/1/...' before 'c/10/...') and flat."""
    from unshardfs.core.naming import Naming
    from unshardfs.formats.zarr.keys import KeyLayout
    from unshardfs.volume.grid import ChunkGrid, GridNaming

    def check(naming_order: NameOrder, name_of, keys: list[int]) -> None:
        by_name = sorted(keys, key=name_of)
        assert naming_order.after(by_name[0], len(keys)) == by_name[1:]
        assert naming_order.after(by_name[37], 5) == by_name[38:43]
        assert naming_order.after(by_name[-1], 5) == []

    grid = ChunkGrid((200, 70, 40), (16, 16, 16), (-24, 0, 3))
    naming: Naming = GridNaming(grid)
    order = naming.order()
    assert order is not None
    cells = np.stack(np.meshgrid(*[np.arange(n) for n in grid.shape], indexing="ij"), -1).reshape(-1, 3)
    check(order, naming.name, [grid.coder.encode(tuple(c)) for c in cells.tolist()])
    shape = (12, 3, 11)
    for separator in ("/", "."):
        layout = KeyLayout("c", separator, 3)
        cells = list(np.ndindex(*shape))
        zorder = NameOrder([[str(i) for i in range(n)] for n in shape],
                           lambda k: tuple(int(i) for i in np.unravel_index(k, shape)) if 0 <= k < len(cells) else None,
                           lambda cell: int(np.ravel_multi_index(cell, shape)))
        check(zorder, lambda k: layout.key(cells[k]), list(range(len(cells))))


def grid_target(n: int = 512) -> tuple[Target, list[int]]:
    """A dense directory of `n` chunks in 4 shards (keys spread over them as a hash would), whose
    names are decimals unrelated to the keys; and its keys in name order."""
    keys = list(range(n))
    shards = [shard(s, [k for k in keys if k // 3 % 4 == i]) for i, s in enumerate("abcd")]
    texts = [str(k * 7919 % n) for k in keys]
    order = NameOrder([texts], lambda k: (k,) if 0 <= k < n else None, lambda cell: cell[0])
    return Target(shards, name_order=order), sorted(keys, key=texts.__getitem__)


def joint(names: list[int], readers: int, seed: int) -> list[int]:
    """The order in which `readers` readers, each taking every readers-th name, reach the daemon:
    each round one file per reader, in a random order (and one reader now and then a round late)."""
    rng = np.random.default_rng(seed)
    parts = [names[i::readers] for i in range(readers)]
    arrived: list[int] = []
    late: list[int] = []
    for round_ in range(max(len(p) for p in parts)):
        now = [p[round_] for p in parts if round_ < len(p)]
        rng.shuffle(now)
        arrived += late
        late = [now.pop()] if rng.random() < 0.3 and len(now) > 1 else []
        arrived += now
    return arrived + late


def read_in_turn(target: Target, scope: ScanScope, keys: list[int]) -> list[int]:
    """Each key observed, then its payload kept (as a read leaves it in the chunk cache); the
    keys whose reads found no prefetch of theirs."""
    where = {int(k): Extent(t.blob, int(t.starts[i]), int(t.lengths[i])).key
             for t in target.tables for i, k in enumerate(t.ids)}
    missed = []

    async def main() -> None:
        for key in keys:
            await scope.observe(key)
            if where[key] not in {e.key for e in target.fetcher.prefetched}:
                missed.append(key)
            target.kept.add(where[key])

    trio.run(main)
    return missed


def test_readers_splitting_sorted_names_are_one_stream():
    """8 readers taking every 8th of the sorted names, arriving out of order: one name-order
    stream is recognised within the first round of reads, however they arrived (a read coming
    after reads of the names just after it takes their guesses); from then on every read finds
    its chunk prefetched, each chunk is prefetched once, and nothing the readers do not read."""
    target, names = grid_target()
    scope = ScanScope(target)
    arrived = joint(names, 8, seed=3)
    assert sorted(map(names.index, arrived[:8])) == list(range(8))  # the first round, jumbled
    missed = read_in_turn(target, scope, arrived[:8])
    assert [s.order for s in scope.streams] == [ScanOrder.NAME]
    missed += read_in_turn(target, scope, arrived[8:])
    assert set(missed) <= set(arrived[:8])  # the first round's reads, and no other
    keys = [e.key for e in target.fetcher.prefetched]
    assert len(keys) == len(set(keys)) == len(names) - len(missed)


def test_scattered_reads_start_no_prefetch_with_a_name_order():
    """A viewer's scattered reads, by 8 readers at once, over a directory whose name order is
    known: no guess is confirmed, nothing is prefetched."""
    target, names = grid_target()
    rng = np.random.default_rng(11)
    for _ in range(5):
        chosen = [int(k) for k in rng.choice(len(names), 200, replace=False)]
        observe(ScanScope(target), chosen)
    assert prefetched(target) == []


class BackgroundFetcher(Fetcher):
    """Also runs work in the background, as the real fetcher does in the mount's nursery, and
    takes an extent it holds already no second time (two streams of one scan offer it twice)."""

    def __init__(self, nursery) -> None:
        super().__init__()
        self.nursery = nursery

    def prefetch(self, extents, fill, wide=False) -> int:
        held = {e.key for e in self.prefetched}
        self.prefetched += [e for e in extents if e.key not in held]
        return len(extents)

    def spawn(self, work, *args) -> bool:
        self.nursery.start_soon(work, *args)
        return True


def test_the_tables_a_scan_reaches_are_read_ahead_of_it_once_each():
    """A scan's windows reach chunks whose index tables nobody has read yet: those tables, with
    those of the window after, are read in the background (once each, all at once), their chunks
    are prefetched as soon as they are, and the readers' lookups find them read."""
    import trio.testing

    tables = [shard(s, list(range(i * 10, i * 10 + 10))) for i, s in enumerate("abcd")]
    target = Target(tables)
    located: list[str] = []
    opened: set[str] = set()
    plain_locate = target.locate

    async def locate(key: int):
        found = await plain_locate(key)
        if found is not None and found[0].blob.label not in opened:
            opened.add(found[0].blob.label)
            located.append(found[0].blob.label)
            await trio.sleep(0)  # a read of the index
        return found

    target.locate = locate
    scope = ScanScope(target)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            target.fetcher = BackgroundFetcher(nursery)
            for key in range(40):
                await scope.observe(key)
                await trio.testing.wait_all_tasks_blocked()

    trio.run(main)
    assert sorted(located) == ["a", "b", "c", "d"]  # each read once (c and d together)
    assert set(scope.tables.ready) == {"a", "b", "c", "d"} and not scope.tables.opening
    keys = [int(t.ids[t.starts.tolist().index(e.start)]) for e in target.fetcher.prefetched
            for t in tables if t.blob.label == e.blob.label]
    assert keys == list(range(3, 40))  # after the two reads that confirm the scan: every chunk, once


def test_a_bug_in_read_ahead_never_fails_the_read(caplog):
    """A read the scans did not foresee is followed in the background: a format whose `table_of`
    raises costs the scan its prefetch and one log line, not the read nor the reads after it."""
    import trio.testing

    class Broken(Target):
        def table_of(self, chunk_id: int):
            raise ValueError("a bug in a format")

    scope = ScanScope(Broken([shard("s", list(range(64)))]))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            scope.ctx.fetcher = BackgroundFetcher(nursery)
            for chunk_id in range(8):
                scope.note(chunk_id)  # must not raise
            await trio.testing.wait_all_tasks_blocked()

    trio.run(main)
    assert scope.ctx.fetcher.prefetched == [] and not scope.pending and not scope.working
    assert sum("read-ahead failed: ValueError" in r.getMessage() for r in caplog.records) == 1


def gated(tables: list[ChunkTable], slow: str) -> tuple[Target, list[str], list[trio.Event]]:
    """A target whose index tables each take a read (a checkpoint), table `slow` until the event
    in the list is set; and the labels of the tables read, in order."""
    target = Target(tables)
    located: list[str] = []
    gate: list[trio.Event] = []
    plain_locate = target.locate

    async def locate(key: int):
        found = await plain_locate(key)
        label = found[0].blob.label if found is not None else None
        if label is not None and label not in located:
            located.append(label)
            await trio.sleep(0)
        if label == slow:
            await gate[0].wait()
        return found

    target.locate = locate
    return target, located, gate


def test_a_window_goes_on_past_a_table_still_being_read():
    """A window that reaches a chunk whose index table is still being read goes on past it: the
    chunks of the tables read meanwhile are prefetched at once, those of the slow table as soon as
    it is read, each once (a window stopping there left the rest until it was read)."""
    import trio.testing

    tables = [shard(s, list(range(i * 10, i * 10 + 10))) for i, s in enumerate("abcd")]
    target, located, gate = gated(tables, "b")
    scope = ScanScope(target)

    def ids() -> list[int]:
        return sorted(int(t.ids[t.starts.tolist().index(e.start)]) for e in target.fetcher.prefetched
                      for t in tables if t.blob.label == e.blob.label)

    async def main() -> None:
        gate.append(trio.Event())
        async with trio.open_nursery() as nursery:
            target.fetcher = BackgroundFetcher(nursery)
            for key in range(3):
                await scope.observe(key)
            await trio.testing.wait_all_tasks_blocked()
            # The first window (ids 3-34, after the two reads that confirm the scan), but b's.
            assert ids() == [*range(3, 10), *range(20, 35)]
            gate[0].set()
            await trio.testing.wait_all_tasks_blocked()

    trio.run(main)
    assert ids() == list(range(3, 35)) and sorted(located) == ["a", "b", "c", "d"]


def test_lookups_in_order_read_the_next_tables_ahead_and_no_payload():
    """Lookups by name come before the reads they serve, each a chain of index reads: once they
    follow an order, the scope of lookups reads the tables of the chunks looked up next (those of
    its window and the next), never a payload; scattered lookups read nothing ahead."""
    import trio.testing

    tables = [shard(s, list(range(i * 16, i * 16 + 16))) for i, s in enumerate("abcdefgh")]

    def looked_up(keys: list[int]) -> tuple[Target, list[str]]:
        target, located, gate = gated(tables, "")
        scope = ScanScope(target).of_lookups()

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                target.fetcher = BackgroundFetcher(nursery)
                for key in keys:
                    await scope.observe(key)
                    await trio.testing.wait_all_tasks_blocked()

        trio.run(main)
        return target, located

    target, located = looked_up([0, 1, 2])
    # Ids 3-34 (the first window) and up to 98 (the next): every table but h's, nothing prefetched.
    assert sorted(located) == list("abcdefg") and target.fetcher.prefetched == []
    target, located = looked_up([5, 70, 33, 101, 12, 90])
    assert located == [] and target.fetcher.prefetched == []
