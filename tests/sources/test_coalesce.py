"""Ranges of one object read at the same moment go out as one ranged read (`RangeReads`), and OCDBT values
of neighbouring keys, which TensorStore stores side by side in a data file, are read that way: requests
and round trips pinned on trio's mock clock."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from tests.support.ocdbt import written
from unshardfs.sources.coalesce import GAP, RangeReads
from unshardfs.sources.ocdbt import open_ocdbt
from unshardfs.testing.inprocess import opened, read_file, resolve
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.util.errors import SourceError

LATENCY = 0.02
SHAPE = (64, 64, 16)  # 4 x 4 chunks of 16^3 uint8: 4 KiB each, stored out of line
CHUNKS = [f"c/{i}/{j}/0" for i in range(4) for j in range(4)]


def _clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def _write_unsharded(root: Path) -> None:
    """An unsharded Zarr v3 array `arr/` in one commit: each chunk its own key, TensorStore writing the
    values of one commit into one data file, in key order."""
    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{root}/", "path": "arr/"},
            "metadata": {"shape": list(SHAPE), "data_type": "uint8",
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [16, 16, 16]}},
                         "codecs": [{"name": "bytes"}]}}
    array = ts.open(spec, create=True).result()
    array[...] = np.arange(np.prod(SHAPE), dtype=np.uint64).reshape(SHAPE).astype(np.uint8)


@pytest.fixture(scope="module")
def unsharded_db(tmp_path_factory) -> Path:
    pytest.importorskip("tensorstore")
    return written(tmp_path_factory, "plain.ocdbt", _write_unsharded)


def test_neighbouring_values_read_together_are_one_request(unsharded_db):
    """16 chunk values of one commit read at once, after the B+tree is known: one ranged read of the data
    file (one round trip), each value byte for byte as a read alone gives it."""
    remote = LatencySource(MemorySource.from_directory(unsharded_db), LATENCY)

    async def main() -> tuple[dict[str, bytes], dict[str, bytes], int, int]:
        source = await open_ocdbt(remote, "", "arr", None, None)
        alone = {key: await source.read(key, 0, 1 << 20) for key in CHUNKS}  # one at a time
        remote.reset_log()
        together: dict[str, bytes] = {}

        async def one(key: str) -> None:
            together[key] = await source.read(key, 0, 1 << 20)

        async with trio.open_nursery() as nursery:
            for key in CHUNKS:
                nursery.start_soon(one, key)
        await source.aclose()
        return alone, together, len(remote.log), remote.round_trips()

    alone, together, requests, trips = trio.run(main, clock=_clock())
    assert together == alone and all(len(v) == 16 ** 3 for v in alone.values())
    assert (requests, trips) == (1, 1)


def test_neighbouring_chunk_files_read_together_through_a_mount_are_one_request(unsharded_db):
    """The same through the read path of a mount (the zarr format over the database): 16 readers of 16
    neighbouring chunk files at once cost one request for the values; one reader after another, 16."""
    async def main(together: bool) -> tuple[int, dict[str, bytes]]:
        remote = LatencySource(MemorySource.from_directory(unsharded_db), LATENCY)
        source = await open_ocdbt(remote, "", "", None, None)
        got: dict[str, bytes] = {}
        async with opened(source, "--no-read-ahead", named="zarr") as session:
            nodes = {key: await resolve(session.tree, "arr/" + key) for key in CHUNKS}
            remote.reset_log()

            async def one(key: str) -> None:
                got[key] = await read_file(nodes[key])  # type: ignore[arg-type]

            if together:
                async with trio.open_nursery() as nursery:
                    for key in CHUNKS:
                        nursery.start_soon(one, key)
            else:
                for key in CHUNKS:
                    await one(key)
            return len([r for r in remote.log if r.kind == "read"]), got

    (merged, a), (single, b) = (trio.run(main, flag, clock=_clock()) for flag in (True, False))
    assert a == b and len(a) == len(CHUNKS)
    assert (merged, single) == (1, len(CHUNKS))


class Recorded:
    """A reader of `data` ranges that logs each read and can be told to fail."""

    def __init__(self, data: bytes, latency: float = LATENCY) -> None:
        self.data = data
        self.latency = latency
        self.reads: list[tuple[int, int, bool]] = []
        self.fail = False

    async def __call__(self, path: str, offset: int, size: int, index: bool) -> bytes:
        self.reads.append((offset, size, index))
        await trio.sleep(self.latency)
        if self.fail:
            raise SourceError(f"{path}: injected failure")
        return self.data[offset:offset + size]


def _together(reads: RangeReads, ranges: list[tuple[int, int, bool]]) -> list[bytes | BaseException]:
    out: list[bytes | BaseException] = [b""] * len(ranges)

    async def one(i: int, offset: int, size: int, index: bool) -> None:
        try:
            out[i] = await reads.read("obj", offset, size, index)
        except SourceError as e:
            out[i] = e

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i, (offset, size, index) in enumerate(ranges):
                nursery.start_soon(one, i, offset, size, index)

    trio.run(main, clock=_clock())
    return out


def test_ranges_join_across_small_gaps_only():
    """Ranges at most GAP apart join (one read, the gap read too); farther ones, another object's and index
    reads stay apart; every reader gets exactly its bytes, a range past the end gets what there is."""
    data = bytes(range(256)) * 1024
    reader = Recorded(data)
    reads = RangeReads(reader)
    ranges = [(0, 100, False), (100, 50, False), (150 + GAP, 10, False), (200_000, 10, False),
              (0, 100, True), (len(data) - 5, 50, False)]
    out = _together(reads, ranges)
    assert out == [data[o:o + n] for o, n, _ in ranges]
    assert sorted(reader.reads) == [(0, 100, True), (0, 160 + GAP, False), (200_000, 10, False),
                                    (len(data) - 5, 50, False)]
    assert reads.counters.gap_bytes == GAP


def test_a_failed_read_fails_every_range_it_covers_and_no_other_time():
    """A read that fails gives each of its ranges' readers the error; the next reads ask again."""
    reader = Recorded(bytes(1000))
    reads = RangeReads(reader)
    reader.fail = True
    out = _together(reads, [(0, 10, False), (10, 10, False)])
    assert all(isinstance(e, SourceError) for e in out) and len(reader.reads) == 1
    reader.fail = False
    assert _together(reads, [(0, 10, False)]) == [bytes(10)] and len(reader.reads) == 2


def test_a_reader_cancelled_while_others_wait_on_its_read_leaves_them_to_ask_again():
    """A reader is cancelled (a FUSE interrupt) while the readers of its moment gather, and another while
    its read is in flight: the readers waiting on them get their bytes from reads of their own, and
    nobody waits forever."""
    data = bytes(range(200))
    reader = Recorded(data)
    reads = RangeReads(reader)
    got: dict[str, bytes] = {}

    async def cancelled_reader(scope: trio.CancelScope, offset: int, size: int) -> None:
        with scope:
            await reads.read("obj", offset, size)

    async def main() -> None:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()
                nursery.start_soon(cancelled_reader, scope, 0, 10)
                nursery.start_soon(_store, got, "gathering", reads, 10, 10)
                await trio.sleep(0)
                scope.cancel()
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()
                nursery.start_soon(cancelled_reader, scope, 50, 20)
                await trio.sleep(LATENCY / 2)  # its read is in flight now
                nursery.start_soon(_store, got, "inside", reads, 55, 5)
                await trio.sleep(0)
                scope.cancel()

    trio.run(main, clock=_clock())
    assert got == {"gathering": data[10:20], "inside": data[55:60]}


async def _store(got: dict[str, bytes], name: str, reads: RangeReads, offset: int, size: int) -> None:
    got[name] = await reads.read("obj", offset, size)
