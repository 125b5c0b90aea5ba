"""A declared scan, in process: a reader that says it will read a whole directory (an export's or
a check's walk: `DirNode.will_read_all`) waits one round trip for each level of the index and one
for the data, whatever the number of files, as TensorStore's batched reads do; and the scan's
bytes stay within its budget.

The datasets are those of the latency tests (tests/support/latency.py): a precomputed scale of
256 chunks of 4 KiB in 4 shards x 4 minishards in two layouts, and a Zarr v3 array of 128 chunks
in 8 shards, in a `MemorySource` behind a `LatencySource` under trio's MockClock.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

import pytest
import trio
import trio.testing

from tests.support.latency import KEY, Shards, plain, sent_to, write_site
from unshardfs.core.fetch import Extent, FetchPolicy, Fetcher
from unshardfs.core.scan import DeclaredScan
from unshardfs.testing.inprocess import READ_SIZE, opened, read_file, resolve
from unshardfs.testing.latency import LatencySource
from unshardfs.tools.walk import PIECE
from unshardfs.testing.memory import MemorySource
from unshardfs.tree.nodes import DirNode, FileNode

T = TypeVar("T")
LATENCY = 0.02
READ_TIME = 0.137 * LATENCY  # a reader's own time per file, an odd fraction of the latency


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_site(tmp_path_factory.mktemp("declared"), nested=True, seg=False)


def run(main: Callable[[], Awaitable[T]]) -> T:
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def read_all(directory: DirNode, prefix: str = "", piece: int = READ_SIZE) -> dict[str, bytes]:
    """Every file below `directory`, read whole in listing order after declaring it, as a walk
    that exports or checks it does, in `piece`-sized reads."""
    directory.will_read_all()
    out: dict[str, bytes] = {}
    async for batch in directory.entries():
        for name, node in batch:
            if isinstance(node, DirNode):
                out.update(await read_all(node, f"{prefix}{name}/", piece))
            elif isinstance(node, FileNode):
                out[prefix + name] = await read_file(node, piece)
                await trio.sleep(READ_TIME)
    return out


def walked(source: LatencySource, rel: str, *options: str, piece: int = READ_SIZE) -> tuple[dict[str, bytes], float, int]:
    """(files read, round trips the reader waited for, files) of a declared walk of `rel`."""

    async def main() -> tuple[dict[str, bytes], float]:
        async with opened(source, *options) as session:
            directory = await resolve(session.tree, rel)
            assert isinstance(directory, DirNode)
            source.reset_log()
            start = trio.current_time()
            files = await read_all(directory, piece=piece)
            return files, trio.current_time() - start

    files, elapsed = run(main)
    return files, round((elapsed - len(files) * READ_TIME) / LATENCY, 6), len(files)


@pytest.mark.parametrize("layout", ["igneous", "ts"])
def test_a_declared_precomputed_directory_waits_for_its_index_levels_and_one_data_read(site: Path,
                                                                                      layout: str) -> None:
    """Shard indexes (with their stats), minishard indexes, then every shard's chunks in one
    request each, all shards at once: the reader waits 3 round trips for 256 files."""
    source = LatencySource(MemorySource.from_directory(site / layout), LATENCY)
    files, waited, n = walked(source, KEY)
    assert n == 256 and all(data == (plain(site) / name).read_bytes() for name, data in files.items())
    assert waited == 3 and source.round_trips() == 3
    costs = Shards(site / layout / KEY).costs(sent_to(source))
    assert all(c["payload"] == 1 for c in costs.values()), costs  # one data request per shard


@pytest.mark.parametrize("array", ["zarr", "nested"])
def test_a_declared_zarr_array_waits_for_its_shard_indexes_and_one_data_read(site: Path, array: str) -> None:
    """Each shard's index comes with its stat (one request), then its chunks in one more: 2 round
    trips for the array, flat chunk keys or nested directories alike."""
    source = LatencySource(MemorySource.from_directory(site / array / "sharded" / "arr"), LATENCY)
    files, waited, n = walked(source, "")
    assert n == 128 + 1  # the chunks and zarr.json
    assert waited <= 2 and source.round_trips() == 2
    reads = Counter(r.path for r in source.log if r.kind == "read")
    assert source.counts() == Counter(tail=8, read=8) and len(reads) == 8  # one data request per shard


def test_without_the_declaration_a_walk_waits_for_its_scan_to_be_recognised(site: Path) -> None:
    """The same walk without `will_read_all` (a mount's reader, which declares nothing) waits
    longer: its first reads come before read-ahead recognises the scan."""
    source = LatencySource(MemorySource.from_directory(site / "igneous"), LATENCY)

    async def main() -> float:
        async with opened(source) as session:
            directory = await resolve(session.tree, KEY)
            assert isinstance(directory, DirNode)
            start = trio.current_time()
            n = 0
            async for batch in directory.entries():
                for _name, node in batch:
                    assert isinstance(node, FileNode)
                    await read_file(node)
                    await trio.sleep(READ_TIME)
                    n += 1
            return (trio.current_time() - start - n * READ_TIME) / LATENCY

    assert run(main) > 3


def test_a_queued_plan_stays_within_its_budget_and_is_read_once() -> None:
    """A plan far larger than the budget: at most `ahead` bytes are declared and unread at any
    moment, each extent is fetched once, and what the reader takes frees room for the next."""
    from unshardfs.core.blob import Blob
    from unshardfs.sources.base import ObjectStat

    chunk, count, ahead = 4096, 512, 64 * 4096
    data = bytes(range(256)) * (chunk * count // 256)
    source = LatencySource(MemorySource({"big": data}), LATENCY)
    blob = Blob.of("big", ObjectStat(len(data), 0, False, (1,)))  # (MemorySource's first version)
    extents = [Extent(blob, i * chunk, chunk) for i in range(count)]
    peak = 0

    async def main() -> None:
        nonlocal peak
        fetcher = Fetcher(source, FetchPolicy(prefetch_bytes=8 * ahead))
        async with trio.open_nursery() as nursery:
            fetcher.attach(nursery)
            scan = DeclaredScan(fetcher, ahead=ahead)
            scan.queue(extents)
            for ext in extents:
                peak = max(peak, scan.outstanding)
                assert await fetcher.read(ext) == data[ext.start:ext.end]
                await trio.sleep(READ_TIME / 8)
            assert scan.outstanding == 0 and scan.read == count
            fetcher.attach(None)

    run(main)
    assert peak <= ahead
    fetched = sum(r.size for r in source.log if r.kind == "read")
    assert fetched == len(data)  # every byte once: nothing read twice, nothing beyond the plan


@pytest.fixture(scope="module")
def large_chunks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """16 chunks of 2 MiB (128 x 128 x 64 uint16, raw) in 4 shards of 2 minishards."""
    from unshardfs.testing.precomputed import Scale, sharding, write_volume

    return write_volume(tmp_path_factory.mktemp("large"), [Scale((256, 256, 256), (128, 128, 64),
                                                                  sharding(minishard=1, shard=2))], "uint16")


def test_a_declared_scan_of_chunks_larger_than_a_whole_read_fetches_them_ahead(large_chunks: dict[str, Path]) -> None:
    """Chunks of 2 MiB, past the size a mount's reader fetches whole: a walk reads each whole (in
    its pieces of 8 MiB), so they are declared too. The walk waits for the shard and minishard
    indexes and one data round trip (the budget keeps 32 MiB in flight): 3 round trips, not one
    per chunk (18)."""
    source = LatencySource(MemorySource.from_directory(large_chunks["sharded"]), LATENCY)
    files, waited, n = walked(source, "1_1_1", piece=PIECE)
    plain_dir = large_chunks["plain"] / "1_1_1"
    assert n == 16 and all(data == (plain_dir / name).read_bytes() for name, data in files.items())
    assert waited == 3, waited
