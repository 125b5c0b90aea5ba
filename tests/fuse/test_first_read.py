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
import sys
from collections import Counter
from pathlib import Path

import pytest
import trio

import unshardfs
from unshardfs.fuse.ops import ROOT
from unshardfs.testing.precomputed import Scale, sharding, write_volume

from ..core.test_hot_path import Scheduling as Spawns
from .inprocess import served

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


# Python calls of the daemon's own code (session, engine, operations, core, format, source) per
# first read (LOOKUP + READ) of a chunk whose indexes are cached: 100 on main (b531e1d), 79 since
# the name tables, cache probes and fewer coroutines of branch firstread2, 77 since branch
# firstread3 (a page-cached READ answered with no coroutine, calls inlined on the lookup's way).
# Each is ~0.3-1 us of a daemon that is one Python thread: first reads against ratarmount move
# with this number. Here every request finds the connection empty (the kernel's side, in this
# very thread, sends the next one only after the answer), and 10 of these calls per chunk are the
# session's waiting for it (`_read`, `_quick_wait`, and `serve` and `_reader` resumed), which a
# serial reader on a mount, whose next request is queued or comes within the quick wait, mostly
# does not cost: WAITING counts them, CALLS_PER_CHUNK - WAITING is the requests' own work (79 - 8
# on firstread2, which had no `_quick_wait`: 71 -> 67).
CALLS_PER_CHUNK = 77
WAITING = {"OpenedSource._read": 4, "OpenedSource._quick_wait": 2, "OpenedSource.serve": 2, "OpenedSource._reader": 2}


def test_a_cached_index_first_read_costs_few_python_calls(volume):
    """The daemon's Python work per chunk, counted (a timing would not be deterministic): every
    call of a function of the unshardfs package (a coroutine resumed counts as a call) while
    the chunks are looked up and read once more, their indexes cached by a first pass."""
    names = sorted(os.listdir(volume["plain"] / KEY))
    package = os.path.dirname(unshardfs.__file__)
    calls: Counter = Counter()

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls[frame.f_code.co_qualname] += 1

    async def main() -> None:
        async with served(volume["sharded"]) as (kernel, _):
            directory = await kernel.lookup(ROOT, KEY)
            for name in names:  # reads every index (and every chunk) once
                await kernel.read(await kernel.lookup(directory, name), 1 << 14)
            sys.setprofile(profile)
            try:
                for name in names:
                    await kernel.read(await kernel.lookup(directory, name), 1 << 14)
            finally:
                sys.setprofile(None)

    trio.run(main)
    per_chunk = sum(calls.values()) / len(names)
    assert per_chunk <= CALLS_PER_CHUNK, (per_chunk, calls.most_common(20))
    assert {name: calls[name] / len(names) for name in WAITING} == WAITING
    # A READ of page-cached bytes is read and answered where the request was read: no coroutine.
    assert calls["Bridge.read_now"] == len(names)
    assert calls["KernelHandlers._read"] == calls["Bridge.read"] == calls["ChunkFile.read"] == 0
    # The lookup's name is parsed once, through the per-axis tables, and its size found from the
    # cell the parse kept; nothing of the regular-expression path runs.
    assert calls["ChunkGrid.parse_id"] == len(names)
    assert calls["ChunkGrid.parse_chunk_name"] == 0 and calls["MortonCoder.decode"] == 0
    assert calls["ShardedStore.describe"] == 0  # a chunk is named only in messages


def test_a_scanned_shard_has_its_minishard_indexes_read_together(volume, monkeypatch):
    """Each minishard index read and decoded alone cost ~100 us of the daemon's Python (a dozen
    numpy calls, a batch, a flight): an eighth of a first read's work on the benchmark's shards.
    On local shards the first lookup that needs one of a shard's minishard indexes reads that one
    alone (a lookup here and there stays one index read); the second reads the rest of the
    shard's with it, decoded together. Every index is still read exactly once."""
    from unshardfs.formats.precomputed.shards import PrecomputedStore

    loads: list[list[int]] = []
    real = PrecomputedStore._load

    async def counted(self, blob, index, numbers, gap=None):
        loads.append(list(numbers))
        return await real(self, blob, index, numbers, gap)

    monkeypatch.setattr(PrecomputedStore, "_load", counted)
    _, _, matched = first_reads(volume, monkeypatch)
    assert matched == sum(p.stat().st_size for p in (volume["plain"] / KEY).iterdir())
    shards, minishards = 4, 4  # of each shard, every one holding chunks
    # Per shard: one alone, then the other three together.
    assert sorted(len(numbers) for numbers in loads) == [1] * shards + [minishards - 1] * shards
    read = [m for numbers in loads for m in numbers]
    assert len(read) == shards * minishards  # each minishard index of each shard once
