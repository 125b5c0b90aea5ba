"""The cost of a cold chunk on local shards, pinned in counts (timings live in scripts/bench).

A first read of a chunk is lookup + open + read + release. On local shards
each backing read is a syscall that never waits, so none of it may go
through the machinery that hides latency: no task started, no yield to the
scheduler (the limiter, flights and batches of remote reads all yield), no
worker thread, one backing read per chunk asked alone. (When the core was
first written every read went through all of it, and first reads lost 30%.)
Driven through the FUSE operations in-process, so the counts are the
daemon's and nothing else's; the Python work per read is a figure of
scripts/bench (`--only calls`), not pinned here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyfuse3
import pytest
import trio

from unshardfs.app.opened import OpenedSource
from unshardfs.core import fetch
from unshardfs.fuse.pyfuse3_engine import Pyfuse3Operations
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.volume.grid import ChunkGrid, VolumeGeometry
from unshardfs.volume.morton import MortonCoder

KEY = "1_1_1"


class Scheduling(trio.abc.Instrument):
    def __init__(self) -> None:
        self.spawned = 0
        self.steps = 0

    def task_spawned(self, task) -> None:
        self.spawned += 1

    def before_task_step(self, task) -> None:
        self.steps += 1


@dataclass
class Cost:
    """What a run of first reads cost, in counts that do not depend on how the code is split."""

    scheduling: Scheduling  # tasks started and task steps (each a yield to the scheduler)
    hops: int  # calls handed to a worker thread
    backing_reads: int  # reads of the byte source (each a syscall here)
    batches: int  # read batches of the fetcher (a read of a local source counts as a batch of one)
    extents: int  # byte ranges the fetcher was asked for
    total: int  # bytes read, every one checked against the unsharded file


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> dict[str, Path]:
    # gzip minishard indexes (as the benchmark's), raw chunks: 512 chunks, 32 minishards.
    root = tmp_path_factory.mktemp("hot")
    return write_volume(root, [Scale((256, 256, 128), (32, 32, 16), sharding(minishard=3, shard=2,
                                                                              index_enc="gzip"))], "uint8")


def first_reads(volume: dict[str, Path], names: list[str], indexes_cached: bool = False,
                monkeypatch: pytest.MonkeyPatch | None = None) -> Cost:
    """Read `names` as a fresh mount's first reads, and count what they cost.

    With `indexes_cached`, every name is looked up once before counting (which reads and caches
    every shard and minishard index, and no chunk)."""
    instrument = Scheduling()
    hops: list[object] = []
    real = trio.to_thread.run_sync

    async def counted(*args, **kwargs):
        hops.append(args[0])
        return await real(*args, **kwargs)

    async def main() -> Cost:
        session = await OpenedSource.open(str(volume["sharded"]))
        total = 0
        try:
            async with session.running():
                ops = Pyfuse3Operations(session.tree)
                directory = (await ops.lookup(pyfuse3.ROOT_INODE, KEY.encode())).st_ino
                if indexes_cached:
                    for name in names:
                        await ops.lookup(directory, name.encode())
                fetched = session.runtime.fetcher.counters
                before = (session.source.counters.reads, fetched.batches, fetched.extents)
                trio.lowlevel.add_instrument(instrument)
                if monkeypatch is not None:
                    monkeypatch.setattr(trio.to_thread, "run_sync", counted)
                try:
                    for name in names:
                        attr = await ops.lookup(directory, name.encode())
                        fh = (await ops.open(attr.st_ino, os.O_RDONLY)).fh
                        data = await ops.read(fh, 0, 1 << 17)
                        await ops.release(fh)
                        assert data == (volume["plain"] / KEY / name).read_bytes()
                        total += len(data)
                finally:
                    if monkeypatch is not None:
                        monkeypatch.setattr(trio.to_thread, "run_sync", real)
                    trio.lowlevel.remove_instrument(instrument)
                reads, batches, extents = (session.source.counters.reads - before[0], fetched.batches - before[1],
                                           fetched.extents - before[2])
        finally:
            await session.aclose()
        return Cost(instrument, len(hops), reads, batches, extents, total)

    return trio.run(main)


def test_a_chunk_whose_indexes_are_cached_takes_no_latency_machinery(volume, monkeypatch):
    names = sorted(os.listdir(volume["plain"] / KEY))
    assert len(names) == 512
    cost = first_reads(volume, names, indexes_cached=True, monkeypatch=monkeypatch)
    assert cost.total == sum((volume["plain"] / KEY / n).stat().st_size for n in names)
    # Not one yield, task or thread in 512 first reads; one backing read each, asked alone.
    assert cost.scheduling.spawned == 0
    assert cost.scheduling.steps == 0
    assert cost.hops == 0
    assert (cost.backing_reads, cost.batches, cost.extents) == (512, 512, 512)


def test_cold_indexes_are_read_once_each_and_never_yield(volume, monkeypatch):
    names = sorted(os.listdir(volume["plain"] / KEY))
    cost = first_reads(volume, names, monkeypatch=monkeypatch)
    shards, minishards = 4, 32  # every one holds chunks
    # Each index is read once; a shard's minishard indexes in two batches, the first lookup's
    # alone and the rest with the second (local shards being scanned, `PrecomputedStore`'s scan
    # of the rest); small gzip minishard indexes are decoded inline (no worker thread), local
    # reads never wait.
    assert cost.extents == len(names) + shards + minishards
    assert cost.backing_reads == len(names) + shards + minishards
    assert cost.batches == len(names) + shards + 2 * shards
    assert cost.hops == 0
    assert cost.scheduling.spawned == 0 and cost.scheduling.steps == 0


def test_the_machinery_is_seen_when_it_runs(volume, monkeypatch):
    """The counts above can fail: with the direct path off, reads go through batches and runs
    again, and every one yields to the scheduler (its limiter)."""
    original = fetch.Fetcher.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.direct = False

    monkeypatch.setattr(fetch.Fetcher, "__init__", init)
    names = sorted(os.listdir(volume["plain"] / KEY))[:16]
    cost = first_reads(volume, names, monkeypatch=monkeypatch)
    assert cost.scheduling.steps >= 16  # the limiter yields once per read


def test_scalar_morton_decode_agrees_with_the_vectorised_one():
    rng = np.random.default_rng(0)
    for shape in [(1, 1, 1), (5, 3, 2), (16, 16, 16), (100, 7, 300), (2**20, 3, 2**21), (7,), (3, 9, 4, 2)]:
        coder = MortonCoder(shape)
        codes = rng.integers(0, 2 ** min(coder.total_bits + 2, 63), 2000, dtype=np.uint64)
        cells, valid = coder.decode_array(codes)
        for code, cell, ok in zip(codes.tolist(), cells.tolist(), valid.tolist()):
            assert coder.decode(code) == (tuple(cell) if ok else None)
    assert MortonCoder((4, 4, 4)).decode(-1) is None


def test_scalar_chunk_sizes_agree_with_the_arrays():
    grid = ChunkGrid((100, 70, 33), (32, 32, 16), (5, -3, 0))
    ids = np.arange(1 << (grid.coder.total_bits + 1), dtype=np.uint64)  # valid codes and invalid ones
    for raw, tables in ((True, False), (False, False), (True, True), (False, True)):
        if tables:  # a lookup's parse builds the per-axis tables, and sizes come from their extents
            assert grid.parse_id(grid.chunk_name((3, 2, 2))) is not None and grid.cell_extents() is not None
        geometry = VolumeGeometry(grid, 2, raw, limit=20_000)
        exact, cap = geometry.exact(ids), geometry.cap(ids)
        for i, chunk_id in enumerate(ids.tolist()):
            assert geometry.sizes_one(chunk_id) == (None if exact is None else int(exact[i]), int(cap[i]))
            assert geometry.exact_one(chunk_id) == (None if exact is None else int(exact[i]))
            assert geometry.cap_one(chunk_id) == int(cap[i])


def test_name_tables_parse_as_the_regex_does():
    """A lookup parses its name through per-axis tables (`ChunkGrid.parse_id`): the same ids as the
    regular expression and `coder.encode`, None for every spelling that is not canonical."""
    for size, chunk, offset in [((512, 512, 256), (32, 32, 16), (0, 0, 0)), ((100, 70, 33), (32, 32, 16), (5, -3, 0)),
                                ((1000, 7, 3000), (7, 3, 11), (-50, 2, 9))]:
        grid, reference = ChunkGrid(size, chunk, offset), ChunkGrid(size, chunk, offset)
        cells = [(x, y, z) for x in range(grid.shape[0]) for y in range(0, grid.shape[1]) for z in range(grid.shape[2])]
        names = [reference.chunk_name(c) for c in cells[:20000]]
        odd = ["0-32_0-32_0-16x", "00-32_0-32_0-16", "+0-32_0-32_0-16", "0-32_0-32", "0-31_0-32_0-16", "a_b_c", "",
               "___", names[0] + "_", "_" + names[-1], names[0].replace("_", "__", 1)]
        for name in names + odd:
            cell = reference.parse_chunk_name(name)
            chunk_id = grid.parse_id(name)
            assert chunk_id == (None if cell is None else reference.coder.encode(cell)), name
            if chunk_id is not None:
                assert grid.cell_of(chunk_id) == cell
    big = ChunkGrid((1 << 30, 64, 64), (16, 16, 16), (0, 0, 0))  # past the tables' bound: the regex path
    assert big.parse_id("32-48_16-32_0-16") == big.coder.encode((2, 1, 0))
    assert big.parse_id("32-48_16-32_0-17") is None and big._parser is None
