"""The Fetcher over an in-memory byte source that counts its reads: planning (gaps, spans),
coalescing, joins of reads in flight, prefetch (budget, adoption, gap filling, accounting) and
the retry of a failed prefetch."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from unshardfs.core.blob import Blob
from unshardfs.core.fetch import Extent, Fetcher, FetchPolicy, plan
from unshardfs.sources.base import ObjectStat
from unshardfs.util.errors import DataError, SourceError

DATA = bytes(range(256)) * 1024  # 256 KiB


class MemorySource:
    """One object, `key`, served from memory. Reads can be held at a gate and made to fail."""

    description = "memory"
    listable = False
    remote = True
    index_cache = None

    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.gate: trio.Event | None = None  # reads wait for it while set
        self.in_nursery = False  # reads wait for the gate in a child task (as a client racing two waits does)
        self.fail = 0  # this many next reads fail

    async def read(self, path: str, offset: int, size: int, version: tuple | None = None) -> bytes:
        self.reads.append((offset, size))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None and self.in_nursery:
                async with trio.open_nursery() as nursery:  # cancelled: a group holding Cancelled
                    nursery.start_soon(self.gate.wait)
            elif self.gate is not None:
                await self.gate.wait()
            await trio.sleep(0)
            if self.fail:
                self.fail -= 1
                raise SourceError(f"{path}: injected failure")
            return DATA[offset:offset + size]
        finally:
            self.in_flight -= 1

    read_index = read


BLOB = Blob.of("key", ObjectStat(len(DATA), 0, False, ("v", len(DATA))))
OTHER = Blob.of("other", ObjectStat(len(DATA), 0, False, ("w", len(DATA))))


def ext(start: int, length: int, blob: Blob = BLOB) -> Extent:
    return Extent(blob, start, length)


def expect(e: Extent) -> bytes:
    return DATA[e.start:e.end]


def fetcher(**policy) -> tuple[Fetcher, MemorySource]:
    source = MemorySource()
    return Fetcher(source, FetchPolicy(**policy)), source  # type: ignore[arg-type]


def spans(runs) -> list[tuple[str, int, int]]:
    return [(run.blob.label, run.start, run.end) for run in runs]


# -- planning ---------------------------------------------------------------------------------

def test_plan_joins_across_small_gaps_only():
    extents = [ext(0, 10), ext(14, 6), ext(100, 5), ext(20, 10)]  # unsorted; gaps 4, 0, 70
    assert spans(plan(extents, max_gap=4, max_span=1 << 20)) == [("key", 0, 30), ("key", 100, 105)]
    assert spans(plan(extents, max_gap=3, max_span=1 << 20)) == [("key", 0, 10), ("key", 14, 30), ("key", 100, 105)]
    assert spans(plan(extents, max_gap=70, max_span=1 << 20)) == [("key", 0, 105)]


def test_plan_caps_each_span_and_keeps_blobs_apart():
    extents = [ext(i * 10, 10) for i in range(10)] + [ext(0, 10, OTHER)]
    assert spans(plan(extents, max_gap=0, max_span=35)) == [
        ("key", 0, 30), ("key", 30, 60), ("key", 60, 90), ("key", 90, 100), ("other", 0, 10)]
    # An extent longer than the cap is still one read of its own.
    assert spans(plan([ext(0, 100), ext(100, 5)], max_gap=0, max_span=50)) == [("key", 0, 100), ("key", 100, 105)]


def test_plan_overlapping_and_repeated_extents_share_a_run():
    runs = plan([ext(0, 20), ext(10, 5), ext(0, 20)], max_gap=0, max_span=1 << 20)
    assert spans(runs) == [("key", 0, 20)] and len(runs[0].extents) == 3


# -- reads ---------------------------------------------------------------------------------------

def test_read_many_coalesces_close_extents_into_one_read():
    f, source = fetcher(max_gap=4096)
    extents = [ext(5000, 100), ext(0, 1000), ext(1000 + 4096, 10), ext(200_000, 10)]
    got = trio.run(f.read_many, extents)
    assert got == [expect(e) for e in extents]
    assert sorted(source.reads) == [(0, 5106), (200_000, 10)]
    assert f.counters.reads == 2 and f.counters.extents == 4


def test_runs_of_one_batch_are_read_concurrently():
    f, source = fetcher(max_gap=0, concurrency=3)
    extents = [ext(i * 10_000, 10) for i in range(6)]

    async def main() -> list[bytes]:
        source.gate = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_release_when, source, 3)
            return await f.read_many(extents)

    assert trio.run(main) == [expect(e) for e in extents]
    assert len(source.reads) == 6 and source.max_in_flight == 3  # bounded by the policy's concurrency


async def _release_when(source: MemorySource, in_flight: int) -> None:
    while source.in_flight < in_flight:
        await trio.sleep(0.001)
    assert source.gate is not None
    source.gate.set()


def test_a_read_in_flight_is_joined_not_repeated():
    f, source = fetcher()

    async def main() -> tuple[bytes, bytes]:
        source.gate = trio.Event()
        results: dict[str, bytes] = {}
        async with trio.open_nursery() as nursery:
            async def first() -> None:
                results["first"] = await f.read(ext(0, 1000))

            async def second() -> None:
                while not source.reads:
                    await trio.sleep(0.001)
                results["second"] = await f.read(ext(100, 50))  # inside the first read

            nursery.start_soon(first)
            nursery.start_soon(second)
            while f.counters.joined == 0 and f.counters.batches < 2:
                await trio.sleep(0.001)
            await trio.sleep(0.01)
            source.gate.set()
        return results["first"], results["second"]

    assert trio.run(main) == (expect(ext(0, 1000)), expect(ext(100, 50)))
    assert source.reads == [(0, 1000)] and f.counters.joined == 1


def test_a_joined_read_whose_reader_is_cancelled_is_read_again_by_the_joiner():
    f, source = fetcher()
    source.in_nursery = True

    async def main() -> bytes:
        source.gate = trio.Event()
        first = trio.CancelScope()
        results: list[bytes] = []

        async def reader() -> None:
            with first:
                await f.read(ext(0, 1000))

        async def joiner() -> None:
            results.append(await f.read(ext(100, 50)))  # inside the first read

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(joiner)
            await trio.testing.wait_all_tasks_blocked()
            assert f.counters.joined == 0 and len(source.reads) == 1
            first.cancel()
            await trio.testing.wait_all_tasks_blocked()
            source.gate.set()
        return results[0]

    assert trio.run(main) == expect(ext(100, 50))
    assert source.reads == [(0, 1000), (100, 50)] and f.counters.joined == 1


def test_a_failed_read_fails_every_extent_of_it():
    f, source = fetcher(max_gap=4096)
    source.fail = 1
    with pytest.raises(DataError, match="injected failure"):
        trio.run(f.read_many, [ext(0, 10), ext(20, 10)])
    assert len(source.reads) == 1
    assert trio.run(f.read_many, [ext(0, 10), ext(20, 10)]) == [expect(ext(0, 10)), expect(ext(20, 10))]


# -- prefetch --------------------------------------------------------------------------------------

async def _with_background(f: Fetcher, work):
    """Run `work()` with the fetcher's background nursery attached, then wait for all prefetches."""
    async with trio.open_nursery() as nursery:
        f.attach(nursery)
        try:
            return await work()
        finally:
            while f._in_flight:  # noqa: SLF001 - wait for the prefetches to land
                await trio.sleep(0.001)
            f.attach(None)


def accounted(f: Fetcher) -> bool:
    """Every prefetched byte was read by someone, wasted, or is still held."""
    c = f.counters
    held = sum(len(v) for v in f.prefetched.values())
    return c.prefetch_bytes == c.prefetch_hit_bytes + c.prefetch_wasted_bytes + held


def test_nothing_is_prefetched_without_background_or_read_ahead():
    f, source = fetcher()
    assert f.prefetch([ext(0, 10)]) == 0
    f, source = fetcher(read_ahead=False)

    async def work():
        return f.prefetch([ext(0, 10)])

    assert trio.run(_with_background, f, work) == 0 and source.reads == []


def test_prefetched_extents_are_read_once_and_then_served():
    f, source = fetcher(prefetch_gap=1000)
    wanted = [ext(0, 100), ext(600, 100), ext(50_000, 100)]

    async def work():
        assert f.prefetch(wanted) == 3
        await trio.sleep(0.01)
        return await f.read_many(wanted)

    assert trio.run(_with_background, f, work) == [expect(e) for e in wanted]
    assert sorted(source.reads) == [(0, 700), (50_000, 100)]  # joined across a 500-byte gap
    c = f.counters
    assert (c.prefetch_reads, c.reads, c.prefetch_hits, c.prefetch_hit_bytes) == (2, 0, 3, 300)
    assert c.prefetch_wasted_bytes == 500 and accounted(f)  # the gap


def test_a_prefetched_payload_is_taken_without_a_flight_or_batch(monkeypatch):
    """A scan's reads find their chunk waiting in the prefetch cache: `ChunkContext.payload_of`
    takes it there (a hit, kept in the encoded-chunk cache) without the flight and batch
    machinery a miss goes through (a fifth of the per-read cost)."""
    from types import SimpleNamespace

    from unshardfs.core.chunks import ChunkContext
    from unshardfs.util import flight
    from unshardfs.core.caches import byte_cache

    f, source = fetcher()
    wanted = [ext(0, 100), ext(4096, 100)]

    async def work():
        f.prefetch(wanted)
        await trio.sleep(0.01)

    trio.run(_with_background, f, work)
    calls = []
    monkeypatch.setattr(flight.Flights, "run", lambda *args: calls.append(args))
    monkeypatch.setattr(Fetcher, "read_many", lambda *args, **kw: calls.append(args))
    ctx = SimpleNamespace(fetcher=f, caches=SimpleNamespace(encoded_chunk=byte_cache(1 << 20)))
    for e in wanted:
        assert trio.run(ChunkContext.payload_of, ctx, e) == expect(e)
        assert ctx.caches.encoded_chunk.get(e.key) == expect(e)
    assert calls == []
    c = f.counters
    assert (c.prefetch_hits, c.batches, c.extents, c.reads) == (2, 2, 2, 0) and accounted(f)
    assert f.take_prefetched(wanted[0]) is None and c.batches == 2  # taken once; a miss counts nothing


def test_a_reader_joins_a_prefetch_in_flight():
    f, source = fetcher()

    async def work():
        source.gate = trio.Event()
        f.prefetch([ext(0, 100)])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_release_when, source, 1)
            got = await f.read(ext(0, 100))
        return got

    assert trio.run(_with_background, f, work) == expect(ext(0, 100))
    assert len(source.reads) == 1 and f.counters.joined == 1
    assert f.counters.prefetch_hits == 1 and len(f.prefetched) == 0 and accounted(f)  # used, not left to waste


def test_a_failed_prefetch_is_retried_by_its_reader():
    f, source = fetcher()

    async def work():
        source.gate = trio.Event()
        source.fail = 1
        f.prefetch([ext(0, 100)])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_release_when, source, 1)
            got = await f.read(ext(0, 100))  # joins the prefetch, which fails
        return got

    assert trio.run(_with_background, f, work) == expect(ext(0, 100))
    assert source.reads == [(0, 100), (0, 100)] and f.counters.joined == 1
    assert f.counters.prefetch_wasted_bytes == 100 and accounted(f)


def test_prefetch_stays_within_its_budget():
    f, source = fetcher(prefetch_bytes=10_000, prefetch_gap=0)
    wanted = [ext(i * 1000, 1000) for i in range(30)]

    async def work():
        source.gate = trio.Event()
        taken = f.prefetch(wanted)
        assert f._prefetch_in_flight <= 5000  # noqa: SLF001 - in flight: half the budget
        source.gate.set()
        await trio.sleep(0.01)
        return taken

    assert trio.run(_with_background, f, work) == 5
    assert f.counters.prefetch_skipped == 25
    for i in range(5, 30, 5):  # asked again for the rest: the cache keeps at most its budget
        trio.run(_with_background, f, lambda i=i: _prefetch(f, wanted[i:]))
        assert f.prefetched.currsize <= f.prefetched.maxsize == 10_000
    assert f.counters.prefetch_wasted_bytes > 0 and accounted(f)  # the oldest were evicted unread


@pytest.mark.parametrize("wide", [False, True])
def test_racing_prefetches_keep_their_reads_within_the_budget(wide):
    """Streams racing for the prefetch budget with extents whose reads join gaps: the bytes in
    flight, gaps included, never exceed half the budget; each stream gets the rest by asking again."""
    f, source = fetcher(prefetch_bytes=20_000, prefetch_gap=1000)
    # Four streams over their own stretch of the blob: 1000-byte extents with 500-byte gaps
    # between them (a read joins them, reading the gaps too).
    streams = [[ext(base + 1500 * i, 1000) for i in range(12)] for base in range(0, 80_000, 20_000)]

    def fill(blob, start, end):  # the gaps hold chunks wanted later, so a wide run may span them
        return [ext(s, 500) for s in range(start + 1000, end, 1500)]

    peak = 0
    asked = 0

    async def scan(wanted: list[Extent]) -> None:
        nonlocal peak, asked
        while wanted:
            taken = f.prefetch(wanted, fill if wide else None, wide=wide)
            peak = max(peak, f.stats()["prefetch_in_flight_bytes"])
            wanted = wanted[taken:]
            asked += 1
            await trio.sleep(0.001 if not taken else 0)  # the others race for what is left

    async def work():
        source.gate = trio.Event()  # nothing lands until every stream has asked once
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for wanted in streams:
                    nursery.start_soon(scan, wanted)
                while asked < len(streams):
                    await trio.sleep(0.001)
                source.gate.set()

    trio.run(_with_background, f, work)
    assert 0 < peak <= 10_000  # half the budget
    for e in (e for wanted in streams for e in wanted):
        assert any(off <= e.start and e.end <= off + size for off, size in source.reads), e
    assert f.counters.prefetch_skipped > 0 and accounted(f)


async def _prefetch(f: Fetcher, extents) -> int:
    return f.prefetch(extents)


def test_an_extent_inside_a_read_in_flight_is_adopted_not_read_again():
    f, source = fetcher()

    async def work():
        source.gate = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(f.read, ext(0, 1000))
            while not source.reads:
                await trio.sleep(0.001)
            assert f.prefetch([ext(200, 100), ext(5000, 100)]) == 2
            source.gate.set()
        return await f.read(ext(200, 100))

    assert trio.run(_with_background, f, work) == expect(ext(200, 100))
    assert sorted(source.reads) == [(0, 1000), (5000, 100)]
    assert f.counters.prefetch_hits == 1 and f.counters.reads == 1


def test_a_prefetch_keeps_the_extents_it_reads_in_its_gaps():
    f, source = fetcher(prefetch_gap=10_000)
    gap_chunks = [ext(100, 100), ext(200, 300)]

    def fill(blob, start, end):
        assert (blob, start, end) == (BLOB, 0, 1000)
        return [ext(0, 100), *gap_chunks, ext(900, 200)]  # the wanted one and one reaching out are left out

    async def work():
        f.prefetch([ext(0, 100), ext(900, 100)], fill)
        await trio.sleep(0.01)
        return await f.read_many(gap_chunks)

    assert trio.run(_with_background, f, work) == [expect(e) for e in gap_chunks]
    assert source.reads == [(0, 1000)] and f.counters.prefetch_hits == 2
    assert f.counters.prefetch_wasted_bytes == 400 and accounted(f)  # [500, 900) was no one's


def test_a_wide_prefetch_spans_gaps_its_fill_names_and_only_those():
    f, source = fetcher(prefetch_gap=100)
    later = [ext(1000 + 100 * i, 100) for i in range(1, 40)]  # chunks a key-order scan reads later

    def fill(blob, start, end):
        return [e for e in later if start <= e.start and e.end <= end]

    async def work():
        # 5000 bytes apart, but every byte between is a chunk wanted later: one read.
        f.prefetch([ext(1000, 100), ext(5000, 100)], fill, wide=True)
        await trio.sleep(0.01)
        return await f.read_many(later)

    assert trio.run(_with_background, f, work) == [expect(e) for e in later]
    assert source.reads == [(1000, 4100)] and f.counters.prefetch_wasted_bytes == 0 and accounted(f)

    # Without what lies between (read already, say): a read per extent, with the chunks wanted
    # later that adjoin it (those after 1000), and never the gap.
    f, source = fetcher(prefetch_gap=100)

    async def narrow():
        f.prefetch([ext(1000, 100), ext(5000, 100)], lambda blob, start, end: later[:3], wide=True)
        await trio.sleep(0.01)

    trio.run(_with_background, f, narrow)
    assert sorted(source.reads) == [(1000, 400), (5000, 100)]


def test_a_wide_run_that_would_waste_too_much_leaves_the_others_wide():
    """A scan's window over many shards: in one shard what lies between its chunks is wanted
    later (one read), in another it was read already (a read per chunk there, and only there)."""
    f, source = fetcher(prefetch_gap=100)
    later = [ext(1000 + 100 * i, 100) for i in range(1, 40)]

    def fill(blob, start, end):
        return [e for e in later if blob is BLOB and start <= e.start and e.end <= end]

    async def work():
        f.prefetch([ext(1000, 100), ext(5000, 100), ext(20000, 100, OTHER), ext(30000, 100, OTHER)],
                   fill, wide=True)
        await trio.sleep(0.01)
        return await f.read_many(later)

    assert trio.run(_with_background, f, work) == [expect(e) for e in later]
    assert sorted(source.reads) == [(1000, 4100), (20000, 100), (30000, 100)]
    assert f.counters.prefetch_wasted_bytes == 0

    # One run split where its gap was read already, and only there: what lies between 1000 and
    # 2000 is wanted later, what lies between 2000 and 9000 is not.
    f, source = fetcher(prefetch_gap=100)
    between = [ext(1000 + 100 * i, 100) for i in range(1, 10)]

    async def split():
        f.prefetch([ext(1000, 100), ext(2000, 100), ext(9000, 100)],
                   lambda blob, start, end: [e for e in between if start <= e.start and e.end <= end], wide=True)
        await trio.sleep(0.01)
        return await f.read_many(between)

    assert trio.run(_with_background, f, split) == [expect(e) for e in between]
    assert sorted(source.reads) == [(1000, 1100), (9000, 100)] and f.counters.prefetch_wasted_bytes == 0


def test_cancelling_the_background_cancels_prefetches():
    f, source = fetcher()

    async def main():
        source.gate = trio.Event()  # never set: the server never answers
        with trio.move_on_after(0.2):
            async with trio.open_nursery() as nursery:
                f.attach(nursery)
                f.prefetch([ext(0, 100)])
                await trio.sleep_forever()
        f.attach(None)
        return f._in_flight  # noqa: SLF001

    # On trio's MockClock: the 0.2 s the server never answers in cost no real time.
    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == {} and source.in_flight == 0
