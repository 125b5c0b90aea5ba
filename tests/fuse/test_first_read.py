"""What a first read costs the kernel engine on local shards, in counts (timings live in scripts/bench).

The real session, operations layer and tree over a TensorStore-written
volume, with the kernel's side played by the other end of a SOCK_SEQPACKET
pair (as in test_session): every chunk is looked up and read once, as a
fresh mount's first reads are. A lookup or read whose bytes are in the page
cache must be answered in the task that read the request: no task started
per request, no worker thread, so no hop between threads or tasks (each
cost more than the request itself when every request had its own task).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from unshardfs.fuse.ops import ROOT
from unshardfs.testing.kernel import served
from unshardfs.testing.precomputed import Scale, sharding, write_volume

from ..core.test_hot_path import Scheduling as Spawns

KEY = "1_1_1"


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> dict[str, Path]:
    # gzip minishard indexes (as the benchmark's), raw 16 KiB chunks: 256 chunks, 16 minishards.
    root = tmp_path_factory.mktemp("first-read")
    return write_volume(root, [Scale((256, 256, 64), (32, 32, 16), sharding(minishard=2, shard=2,
                                                                             index_enc="gzip"))], "uint8")


def first_reads(volume: dict[str, Path], monkeypatch) -> tuple[Spawns, int, int]:
    """Look up and read every chunk once through the kernel engine's session: (spawns, thread hops,
    bytes that matched the unsharded files)."""
    names = sorted(os.listdir(volume["plain"] / KEY))
    hops = []
    real = trio.to_thread.run_sync

    async def counted(*args, **kwargs):
        hops.append(args[0])
        return await real(*args, **kwargs)

    async def main() -> tuple[Spawns, int]:
        spawns = Spawns()
        matched = 0
        async with served(volume["sharded"]) as (kernel, _):
            directory = await kernel.lookup(ROOT, KEY)
            monkeypatch.setattr(trio.to_thread, "run_sync", counted)
            trio.lowlevel.add_instrument(spawns)
            try:
                for name in names:
                    ino = await kernel.lookup(directory, name)
                    expected = (volume["plain"] / KEY / name).read_bytes()
                    assert await kernel.read(ino, 1 << 17) == expected, name
                    matched += len(expected)
            finally:
                trio.lowlevel.remove_instrument(spawns)
                monkeypatch.setattr(trio.to_thread, "run_sync", real)
        return spawns, matched

    spawns, matched = trio.run(main)
    return spawns, len(hops), matched


def test_first_reads_on_page_cached_shards_start_no_task_and_no_thread(volume, monkeypatch):
    for shard in (volume["sharded"] / KEY).iterdir():
        shard.read_bytes()  # in the page cache, as the benchmark's shards are
    spawns, hops, matched = first_reads(volume, monkeypatch)
    assert matched == sum(p.stat().st_size for p in (volume["plain"] / KEY).iterdir())
    # 256 lookups and 256 reads, every shard and minishard index read on the way: not one task
    # started, not one worker thread.
    assert spawns.spawned == 0
    assert hops == 0


def test_reads_that_must_wait_on_the_disk_go_to_a_thread_and_the_session_reads_on(volume, monkeypatch):
    """The counter above can fail: with the page cache said to be empty (every no-wait read
    answers EAGAIN), each backing read waits on a worker thread, and each request that waits
    has a new reader task take over."""
    real = os.preadv

    def cold(fd, buffers, offset, flags=0):
        if flags & os.RWF_NOWAIT:
            raise BlockingIOError(11, "not in the page cache")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", cold)
    spawns, hops, matched = first_reads(volume, monkeypatch)
    assert matched == sum(p.stat().st_size for p in (volume["plain"] / KEY).iterdir())
    chunks, shards, minishards = len(os.listdir(volume["plain"] / KEY)), 4, 16  # every one holds chunks
    # One thread hop per backing read: each chunk, each shard index and each minishard index.
    assert hops == chunks + shards + minishards
    # A new reader task per request that waited: every read, and each lookup that read minishard
    # indexes (and a shard index): per shard, the first alone, the second with the rest of the
    # shard's (`test_a_scanned_shard_has_its_minishard_indexes_read_together`).
    assert spawns.spawned == chunks + 2 * shards


def test_a_scanned_shard_has_its_minishard_indexes_read_together(volume, monkeypatch):
    """Each minishard index read and decoded alone cost ~100 us of the daemon's Python (a dozen
    numpy calls, a batch, a flight): an eighth of a first read's work on the benchmark's shards.
    On local shards the first lookup that needs one of a shard's minishard indexes reads that one
    alone (a lookup here and there stays one index read); the second reads the rest of the
    shard's with it, decoded together. Every index is still read exactly once."""
    from unshardfs.core.fetch import Fetcher

    batches: list[int] = []  # extents per batch of index reads
    real = Fetcher.read_many

    async def counted(self, extents, index=False, max_gap=None):
        if index:
            batches.append(len(extents))
        return await real(self, extents, index, max_gap)

    monkeypatch.setattr(Fetcher, "read_many", counted)
    _, _, matched = first_reads(volume, monkeypatch)
    assert matched == sum(p.stat().st_size for p in (volume["plain"] / KEY).iterdir())
    shards, minishards = 4, 4  # of each shard, every one holding chunks
    # Per shard: one alone, then the other three together; each minishard index of each shard once.
    assert sorted(batches) == [1] * shards + [minishards - 1] * shards
    assert sum(batches) == shards * minishards
