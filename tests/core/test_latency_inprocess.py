"""What the core's read path costs an object store, in requests and round trips, in process.

The datasets of tests/sources/test_latency.py sit in a `MemorySource` behind a `LatencySource`
(remote and not listable, as a plain HTTP server: each request answered LATENCY after it was
sent) and are walked over the node API under trio's MockClock, so the waits cost no real time
and the round trips are counted exactly. These are the in-process counterparts of that module's
mounts over the test HTTP server (the `mount` tier): the same datasets and, where the mechanism
is the same, the same numbers, in milliseconds, so the quick tier catches a read-path regression.

What differs from a mount: there is no kernel. A file is read by `read_file` (whole, as the
kernel reads these 4 KiB chunks), found by `lookup` after a listing of names (as a reader of
the mount opens a listed path); no page cache, no readahead or request splitting of the kernel's
own. A reader spends READ_TIME per file besides its waits for the source (a FUSE request and
the kernel's part), where a reader in process would otherwise outrun every answer.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

import pytest
import trio
import trio.testing

from tests.support.latency import (KEY, LISTED_OWN_READS, OPEN_WINDOW, SPEC, Shards, plain, scattered, sent_to,
                                   write_site)
from unshardfs.testing.inprocess import opened, read_file, resolve
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.tree.nodes import DirNode, FileNode

T = TypeVar("T")
LATENCY = 0.02  # an object store's
# What reading one file costs its reader besides waiting for the source: an odd fraction of
# LATENCY, so no reader wakes at the instant an answer lands. (Trio runs the tasks woken at one
# instant in a random order; no count here depends on that order.)
READ_TIME = 0.137 * LATENCY


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_site(tmp_path_factory.mktemp("latency"), nested=False, seg=False)


def store(root: Path) -> LatencySource:
    return LatencySource(MemorySource.from_directory(root), LATENCY)


def run(main: Callable[[], Awaitable[T]]) -> T:
    """`main` on trio's MockClock: every wait for the source costs no real time."""
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def waits(elapsed: float, reads: int) -> float:
    """Round trips a reader waited for, from the trio time it took to make `reads` reads."""
    return round((elapsed - reads * READ_TIME) / LATENCY, 6)


async def listing(directory: DirNode) -> dict[str, int]:
    """Name -> size of every entry, in listing order."""
    return {name: node.size for batch in [b async for b in directory.entries()] for name, node in batch
            if isinstance(node, FileNode)}


async def read_named(directory: DirNode, name: str) -> bytes:
    """A file of `directory` looked up by name and read whole, as a reader of the mount opens it."""
    node = await directory.lookup(name)
    assert isinstance(node, FileNode), name
    data = await read_file(node)
    await trio.sleep(READ_TIME)
    return data


def accounted(fetch: dict[str, int]) -> bool:
    """Every prefetched byte was read, wasted or is still held (the cache counts 64 B per entry)."""
    held = fetch["prefetch_cached_bytes"] - 64 * fetch["prefetch_cached_entries"]
    return fetch["prefetch_bytes"] == fetch["prefetch_hit_bytes"] + fetch["prefetch_wasted_bytes"] + held


# -- scans ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["igneous", "ts"])
def test_scan_in_listing_order(site: Path, layout: str) -> None:
    """Reading every file in listing order costs what it costs through a mount, per shard: 1
    stat with its shard index (one request), its minishard indexes (one read where they are
    contiguous; one per minishard in TensorStore's layout, all in one round trip) and one payload
    read; the shard the scan starts in also pays its first read and the prefetch of the next
    entries that read starts. Round trips: the listing's 2 (stats with shard indexes, minishard
    indexes), the first
    read's (the open window's prefetch, which the second read finds, goes out with it), then the
    prefetches of 3 later windows, each sent once the one before had landed and each landing
    before the reader gets there: the reader waits for the listing and its first read only."""
    source, shards = store(site / layout), Shards(site / layout / KEY)

    async def main() -> tuple[dict[str, int], float]:
        async with opened(source) as session:
            directory = await resolve(session.tree, KEY)
            assert isinstance(directory, DirNode)
            source.reset_log()
            start = trio.current_time()
            names = list(await listing(directory))
            for name in names:
                assert await read_named(directory, name) == (plain(site) / name).read_bytes(), name
            assert len(names) == 256
            return session.stats()["fetch"], trio.current_time() - start

    fetch, elapsed = run(main)
    costs = shards.costs(sent_to(source))
    first = next(s for s in costs if costs[s]["payload"] > 1)
    minishards = 1 if layout == "igneous" else 1 << SPEC["minishard_bits"]
    assert costs == {s: Counter(index=1, minishard=minishards,
                                payload=1 + (LISTED_OWN_READS + 1) * (s == first)) for s in costs}
    assert source.counts() == Counter(head=4, read=4 * minishards + 4 + LISTED_OWN_READS + 1)
    assert source.round_trips() == 6
    assert waits(elapsed, 256) == 2 + LISTED_OWN_READS
    wasted = shards.check_payloads(sent_to(source), reread=LISTED_OWN_READS + OPEN_WINDOW)
    assert fetch["prefetch_wasted_bytes"] == wasted
    assert fetch["prefetch_cached_entries"] == 0  # every prefetched chunk was read
    assert fetch["prefetch_hits"] == 256 - LISTED_OWN_READS and accounted(fetch)


def test_zarr_scan_in_listing_order(site: Path) -> None:
    """A sharded Zarr v3 array read in listing order: per shard its index with its stat (one
    request: a suffix range), no stat of its own, and one payload read (the shard the scan
    starts in also pays its first read and the prefetch of the next entries that read starts).
    Round trips: the 8 indexes' one, the first read's, then 3 later windows' prefetches, which
    the reader never waits for."""
    source = store(site / "zarr" / "sharded" / "arr")
    reference = site / "zarr" / "plain" / "arr"

    async def main() -> tuple[dict[str, int], float]:
        async with opened(source, named="zarr") as session:
            source.reset_log()
            start = trio.current_time()
            names = [n for n in await listing(session.tree) if n.startswith("c.")]
            assert len(names) == 128
            for name in names:
                assert await read_named(session.tree, name) == (reference / name).read_bytes(), name
            return session.stats()["fetch"], trio.current_time() - start

    fetch, elapsed = run(main)
    costs: dict[str, Counter[str]] = {}
    for r in source.log:
        costs.setdefault(r.path, Counter())[r.kind] += 1
    assert len(costs) == 8
    first = next(s for s in costs if costs[s]["read"] > 1)
    assert costs == {s: Counter(tail=1, read=1 + (LISTED_OWN_READS + 1) * (s == first)) for s in costs}
    assert fetch["seeded"] == fetch["seeded_hits"] == 8
    assert fetch["prefetch_hits"] == 128 - LISTED_OWN_READS and accounted(fetch)
    assert source.round_trips() == 5
    assert waits(elapsed, 128) == 1 + LISTED_OWN_READS


# -- scattered reads: a viewer -----------------------------------------------------------------

def test_scattered_reads_pay_nothing_for_read_ahead(site: Path) -> None:
    """A viewer reading scattered chunks by name (no listing) sends exactly the requests it
    sends with --no-read-ahead; 8 readers sharing them send the same requests again (a shard's
    stat and indexes once, however many readers need them at once), none prefetched."""
    names = scattered(site, 48, seed=5)
    sent: dict[tuple[str, ...], list[tuple[str, str, int, int]]] = {}
    trips: dict[tuple[str, ...], int] = {}

    def viewer(options: tuple[str, ...], readers: int) -> dict[str, int]:
        source = store(site / "igneous")

        async def main() -> dict[str, int]:
            async with opened(source, *options) as session:
                source.reset_log()

                async def reader(part: list[str]) -> None:
                    for name in part:
                        directory = await resolve(session.tree, KEY)
                        assert isinstance(directory, DirNode)
                        assert await read_named(directory, name) == (plain(site) / name).read_bytes(), name

                async with trio.open_nursery() as nursery:
                    for i in range(readers):
                        nursery.start_soon(reader, names[i::readers])
                return session.stats()["fetch"]

        fetch = run(main)
        sent[options + (str(readers),)] = sorted((r.kind, r.path, r.offset, r.size) for r in source.log)
        trips[options + (str(readers),)] = source.round_trips()
        return fetch

    for options in ((), ("--no-read-ahead",)):
        assert viewer(options, 1)["prefetch_bytes"] == 0
    assert sent[("1",)] == sent[("--no-read-ahead", "1")]
    # A stat with the shard index (one request) and every minishard index of each of the 4
    # shards, and a payload read per chunk; one after another the first time each is needed.
    assert Counter(kind for kind, *_ in sent[("1",)]) == Counter(head=4, read=4 + 48)
    assert trips[("1",)] == trips[("--no-read-ahead", "1")] == 4 * 2 + 48
    assert viewer((), 8)["prefetch_bytes"] == 0
    assert sent[("8",)] == sent[("1",)]
    # The readers' first reads wait for every shard's stat with its shard index, and minishard
    # index (2 round trips, each shard's asked for once), then each of their 6 reads is one.
    assert trips[("8",)] == 2 + 48 // 8


# -- listings --------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, options", [("igneous", ()), ("igneous", ("--no-read-ahead",)), ("ts", ())])
def test_a_listing_costs_two_round_trips(site: Path, layout: str, options: tuple[str, ...]) -> None:
    """A chunk directory listed with its sizes (`ls -l`): stats of every shard with their shard
    indexes, then their minishard indexes, each step all shards at once (not read-ahead:
    --no-read-ahead keeps it). The mount pins the same for `ls -lR`, whose lookups and
    getattrs the listing has answered already."""
    source, shards = store(site / layout), Shards(site / layout / KEY)

    async def main() -> tuple[dict[str, int], float]:
        async with opened(source, *options) as session:
            directory = await resolve(session.tree, KEY)
            assert isinstance(directory, DirNode)
            source.reset_log()
            start = trio.current_time()
            return await listing(directory), trio.current_time() - start

    sizes, elapsed = run(main)
    assert sizes == {p.name: p.stat().st_size for p in plain(site).iterdir()}
    minishards = 1 if layout == "igneous" else 1 << SPEC["minishard_bits"]
    costs = shards.costs(sent_to(source))
    assert costs == {s: Counter(index=1, minishard=minishards) for s in shards.chunks}
    assert source.round_trips() == 2 and elapsed == pytest.approx(2 * LATENCY)


# -- the stand-in itself -----------------------------------------------------------------------

def test_the_stand_in_counts_round_trips_on_the_mock_clock() -> None:
    """Requests sent together are one round trip and one sent after their answers a second; stats
    of one object are one request, kept afterwards; a listing costs a request per page."""
    source = LatencySource(MemorySource({f"d/{i}": bytes([i]) * 10 for i in range(5)}), LATENCY,
                           listable=True, page_size=2)

    async def main() -> float:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(source.read, f"d/{i}", 0, 4)
                nursery.start_soon(source.stat, "d/0")
        assert (len(source.log), source.round_trips()) == (4, 1)
        assert await source.read("d/4", 2, 4) == bytes([4]) * 4 and source.round_trips() == 2
        assert await source.stat("d/0") is not None and len(source.log) == 5  # kept
        source.reset_log()
        assert [name async for name, _ in source.list("d")] == ["0", "1", "2", "3", "4"]
        assert source.counts() == {"list": 3} and source.round_trips() == 3
        return trio.current_time() - start

    assert run(main) == pytest.approx(5 * LATENCY)
