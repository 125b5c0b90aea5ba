"""Ranges of one object read at the same moment go out as one ranged read (`RangeReads`), and OCDBT values
of neighbouring keys, which TensorStore stores side by side in a data file, are read that way: requests
and round trips pinned on trio's mock clock."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from tests.support.ocdbt import Crafted, Ref, leaf, ts_keys, written
from unshardfs.sources.coalesce import GAP, RangeReads
from unshardfs.sources.ocdbt import OcdbtSource, open_ocdbt
from unshardfs.testing.inprocess import opened, read_file, resolve
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.util import decompress
from unshardfs.util.errors import DataError, SourceError

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


INTERLEAVED = [f"k{i:02d}" for i in range(16)]


@pytest.fixture
def interleaved_db(tmp_path) -> Path:
    """16 values of 1,000 bytes whose keys' order is not their data file's: the even keys first, then the
    odd ones (as TensorStore may lay out a commit)."""
    db = Crafted(tmp_path / "db")
    refs = {i: db.put("d/data", bytes([i]) * 1000) for i in [*range(0, 16, 2), *range(1, 16, 2)]}
    entries: list[tuple[bytes, bytes | Ref]] = [(f"arr/{INTERLEAVED[i]}".encode(), refs[i]) for i in range(16)]
    entries.append((b"zarr.json", b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'))  # a dataset
    db.save(db.put("d/data", leaf(["d/data"], entries)))
    return db.root


async def _at_once(source: OcdbtSource, keys: list[str]) -> dict[str, bytes]:
    got: dict[str, bytes] = {}

    async def one(key: str) -> None:
        got[key] = await source.read(key, 0, 1 << 20)

    async with trio.open_nursery() as nursery:
        for key in keys:
            nursery.start_soon(one, key)
    return got


def _read_together(db: Path, keys: list[str]) -> tuple[dict[str, bytes], int, int]:
    """`keys` (under `arr/`) read at once, after their lookups: the bytes, and the requests and round trips
    their reads cost."""
    remote = LatencySource(MemorySource.from_directory(db), LATENCY)

    async def main() -> tuple[dict[str, bytes], int, int]:
        source = await open_ocdbt(remote, "", "arr", None, None, )
        for key in keys:
            await source.stat(key)  # lookups first: only value reads are counted
        remote.reset_log()
        got = await _at_once(source, keys)
        await source.aclose()
        return got, len(remote.log), remote.round_trips()

    return trio.run(main, clock=_clock())


def test_neighbouring_values_read_together_are_one_request(interleaved_db):
    """16 values lying side by side in a data file (in another order than their keys'), read at once:
    one ranged read (one round trip), each value exactly."""
    got, requests, trips = _read_together(interleaved_db, INTERLEAVED)
    assert got == {key: bytes([i]) * 1000 for i, key in enumerate(INTERLEAVED)}
    assert (requests, trips) == (1, 1)


def test_a_tensorstore_commit_read_together_is_one_round_trip(unsharded_db):
    """The 16 chunks of an unsharded array TensorStore wrote in one commit, read at once: one round trip of
    at most two requests (TensorStore may leave more than the 4 KiB gap between two runs of them), each
    chunk as TensorStore reads it."""
    truth = ts_keys(f"file://{unsharded_db}/")
    got, requests, trips = _read_together(unsharded_db, CHUNKS)
    assert got == {key: truth["arr/" + key] for key in CHUNKS}
    assert requests <= 2 and trips == 1


def test_neighbouring_files_read_together_through_a_mount_are_one_request(interleaved_db):
    """The same through the read path of a mount (the database's keys as plain files; read-ahead off): 16
    readers of 16 neighbouring files at once cost one request; one reader after another, 16."""
    async def main(together: bool) -> tuple[int, dict[str, bytes]]:
        remote = LatencySource(MemorySource.from_directory(interleaved_db), LATENCY)
        source = await open_ocdbt(remote, "", "", None, None, )
        got: dict[str, bytes] = {}
        async with opened(source, "--no-read-ahead") as session:
            nodes = {key: await resolve(session.tree, "arr/" + key) for key in INTERLEAVED}
            remote.reset_log()

            async def one(key: str) -> None:
                got[key] = await read_file(nodes[key])  # type: ignore[arg-type]

            if together:
                async with trio.open_nursery() as nursery:
                    for key in INTERLEAVED:
                        nursery.start_soon(one, key)
            else:
                for key in INTERLEAVED:
                    await one(key)
            return len([r for r in remote.log if r.kind == "read"]), got

    (merged, a), (single, b) = (trio.run(main, flag, clock=_clock()) for flag in (True, False))
    assert a == b == {key: bytes([i]) * 1000 for i, key in enumerate(INTERLEAVED)}
    assert (merged, single) == (1, len(INTERLEAVED))


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


def _scan(db: Path, order: list[str], *args: str, root: str = "") -> tuple[dict[str, bytes], int, dict[str, int]]:
    """Each key of `order` found by name and read whole, one after another, through the read path of a
    mount over a remote base of the database at `root`: the bytes, the reads the base was asked for
    after the lookups, and the fetch counters."""
    remote = LatencySource(MemorySource.from_directory(db), LATENCY)

    async def main() -> tuple[dict[str, bytes], int, dict[str, int]]:
        source = await open_ocdbt(remote, "", root, None, None)
        async with opened(source, *args) as session:
            nodes = {key: await resolve(session.tree, key) for key in order}
            remote.reset_log()
            got = {key: await read_file(node) for key, node in nodes.items()}  # type: ignore[arg-type]
            fetch = session.stats()["fetch"]
        return got, len([r for r in remote.log if r.kind == "read"]), fetch

    return trio.run(main, clock=_clock())


@pytest.fixture(autouse=True)
def inline_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes in the loop, not in a worker thread: while a thread works, the mock clock jumps to the
    next request's answer, and a count of requests could move with the machine's load."""
    monkeypatch.setattr(decompress, "THREAD_THRESHOLD", 1 << 62)


def test_a_scan_in_key_order_reads_ahead(interleaved_db):
    """16 values read one after another in key order (as `cp -r`, `tar` or `find` walk an unsharded
    array, or zarr-python reads it key by key), found by name: the first read starts a run of the
    database's keys from its B+tree, and once two reads have followed it, read-ahead declares the next
    values, which the database joins into one request of its data file (it interleaves them): 5
    requests instead of 16, nothing read for nothing. Scattered reads read nothing ahead."""
    keys = [f"arr/{key}" for key in INTERLEAVED]
    scanned, requests, fetch = _scan(interleaved_db, keys)
    assert scanned == {key: bytes([i]) * 1000 for i, key in enumerate(keys)}
    assert requests == 5 and fetch["prefetch_wasted_bytes"] == 0 and fetch["prefetch_hits"] == 12
    scattered, alone, quiet = _scan(interleaved_db, [keys[i] for i in (13, 2, 9, 6)])
    assert all(scanned[key] == value for key, value in scattered.items())
    assert (alone, quiet["prefetch_bytes"]) == (4, 0)


def test_a_scan_of_a_tensorstore_commit_reads_ahead(unsharded_db):
    """The 16 chunks of an unsharded array TensorStore wrote in one commit (each in a directory of its
    own: c/i/j/0), read in key order through a mount: the scan follows the database's key order across
    directories, at most 8 requests (6 to 8: TensorStore lays a commit out differently from run to run, and
    values of the run's next B+tree leaf come in a request of their own), each chunk as TensorStore reads
    it, nothing read for nothing."""
    truth = ts_keys(f"file://{unsharded_db}/")
    scanned, requests, fetch = _scan(unsharded_db, CHUNKS, root="arr")
    assert scanned == {key: truth["arr/" + key] for key in CHUNKS}
    assert requests <= 8 and fetch["prefetch_wasted_bytes"] == 0


def test_read_ahead_off_reads_each_value_alone(interleaved_db):
    """With --no-read-ahead, the same scan costs one request per file, and reads the same bytes."""
    keys = [f"arr/{key}" for key in INTERLEAVED]
    (got, requests, _), (same, single, _) = _scan(interleaved_db, keys), _scan(interleaved_db, keys, "--no-read-ahead")
    assert (requests, single) == (5, 16) and got == same == {key: bytes([i]) * 1000 for i, key in enumerate(keys)}


def test_a_value_after_the_scanned_one_past_the_data_file_end_fails_only_its_own_read(tmp_path):
    """Read ahead takes a following value that claims bytes past the data file's end (a hostile database):
    the scanned value still reads; the damaged one fails its own read (truncated), and only it."""
    db = Crafted(tmp_path / "db")
    values = [bytes([i]) * 100 for i in range(4)]
    refs = [db.put("d/data", v) for v in values]
    entries: list[tuple[bytes, bytes | Ref]] = [(b"arr/k%d" % i, ref) for i, ref in enumerate(refs)]
    entries.append((b"arr/k4", Ref(0, 400, 1 << 20)))
    db.save(db.put("d/data", leaf(["d/data"], entries)))
    remote = LatencySource(MemorySource.from_directory(db.root), LATENCY)

    async def main() -> list[bytes | str]:
        source = await open_ocdbt(remote, "", "arr", None, None)
        out: list[bytes | str] = []
        for i in range(5):
            try:
                out.append(await source.read(f"k{i}", 0, 1 << 21))
            except DataError as e:
                out.append(str(e))
        await source.aclose()
        return out

    got = trio.run(main, clock=_clock())
    assert got[:4] == values and "truncated" in str(got[4])
