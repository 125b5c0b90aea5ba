"""The core's final `locate` and `tables`, in-process over the shipped in-memory source: bad
entries are DataErrors with their reason, ids of other shards are dropped from listings, index
reads are cached per object version, shared by concurrent askers and bounded."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import trio

from unshardfs.abc import SHARD_INDEX, Blob, ChunkTable, DataError, IndexLevel, DataLimits, Runtime, ShardedStore
from unshardfs.core.blob import RECENT_BLOBS
from unshardfs.core.caches import Caches, CacheSizes
from unshardfs.core.store import shard_token
from unshardfs.testing.memory import MemorySource


def shard_bytes(entries: list[tuple[int, int, int]], data_size: int) -> bytes:
    """Payload bytes, then (id, offset, length) triples, then the count."""
    return bytes(data_size) + np.array(entries, "<u8").tobytes() + struct.pack("<Q", len(entries))


class Store(ShardedStore[int, ChunkTable]):
    """Chunk k in shard k % 2, file `<n>`: an index at the end of the file."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime, "d")
        self.index_reads = 0

    def shard_of(self, chunk_id: int) -> int:
        return chunk_id % 2

    async def shards(self, within: object = None):
        for n in (0, 1):
            yield n

    async def open_shard(self, shard: int) -> Blob | None:
        st = await self.source.stat(str(shard))
        return None if st is None else self.blob(str(shard), st)

    async def read_index(self, shard: int, blob: Blob) -> ChunkTable:
        self.index_reads += 1
        (n,) = struct.unpack("<Q", await self.read_index_bytes(blob, blob.size - 8, 8))
        raw = await self.read_index_bytes(blob, blob.size - 8 - 24 * n, 24 * n, level=SHARD_INDEX)
        e = np.frombuffer(raw, "<u8").reshape(-1, 3).T
        return ChunkTable.build(blob, e[0], e[1], e[2], 0, blob.size - 8 - 24 * n)


def store_over(files: dict[str, bytes], **kw) -> tuple[Store, MemorySource]:
    source = MemorySource(files)
    return Store(Runtime(source, **kw)), source  # type: ignore[arg-type]


FILES = {
    "0": shard_bytes([(0, 0, 10), (2, 10, 10), (4, 95, 10), (7, 20, 5)], 100),  # 4: past the data; 7: misplaced
    "1": shard_bytes([(1, 0, 50), (3, 50, 50)], 100),
}


def test_locate_finds_entries_and_fails_bad_ones_with_their_reason():
    store, _ = store_over(FILES)

    async def main() -> None:
        table, i = await store.locate(2)
        assert table.row(i) == (2, 10, 10)
        assert await store.locate(6) is None  # absent from its shard's index
        with pytest.raises(DataError) as e:
            await store.locate(4)
        assert str(e.value) == "0 chunk 4: byte range [95, +10) lies outside the data area [0, 100) of 0"

    trio.run(main)
    assert store.index_reads == 1  # both shard-0 lookups used one index read


def test_tables_drop_keys_of_other_shards():
    store, _ = store_over(FILES)

    async def main() -> None:
        assert [t.ids.tolist() for t in await store.tables(0)] == [[0, 2]]  # 7 belongs to shard 1
        assert await store.locate(7) is None  # ...where a lookup looks
        assert [t.ids.tolist() for t in await store.tables(1)] == [[1, 3]]

    trio.run(main)


def test_an_absent_shard_is_no_table_and_no_chunk():
    store, _ = store_over({"0": FILES["0"]})

    async def main() -> None:
        assert await store.tables(1) == [] and await store.locate(3) is None

    trio.run(main)


def test_concurrent_lookups_read_one_index_and_a_new_version_is_read_again():
    store, source = store_over(FILES)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for chunk_id in (0, 2, 0, 2, 4, 6):
                nursery.start_soon(lambda k=chunk_id: _quiet(store.locate(k)))
        assert store.index_reads == 1
        source.put("0", shard_bytes([(8, 0, 1)], 10))
        table, i = await store.locate(8)
        assert table.row(i) == (8, 0, 1) and store.index_reads == 2

    async def _quiet(aw) -> None:
        try:
            await aw
        except DataError:
            pass

    trio.run(main)


def test_index_reads_are_bounded_by_the_limit_and_the_level_budget():
    store, _ = store_over(FILES, limits=DataLimits(index_bytes=16))

    async def main() -> None:
        with pytest.raises(DataError) as e:
            await store.locate(0)
        assert e.value.reason == "index of 96 bytes exceeds the 1.52588e-05 MiB limit (--max-index-size)"

    trio.run(main)
    store, _ = store_over(FILES, caches=Caches(CacheSizes({"shard_index": 64})))

    async def small_cache() -> None:
        with pytest.raises(DataError) as e:
            await store.locate(0)
        assert e.value.reason.endswith("limit (the size of the cache that holds it)")

    trio.run(small_cache)


ENTRIES = IndexLevel("test_entries", "--test-entries-cache", 1 << 20, "test entries")


def test_a_batch_of_index_entries_is_one_read_cached_and_failures_are_remembered():
    # Four entries back to back in one object: "b" cannot be decoded, "d" is beyond the level's budget
    # (200 bytes: the others fit).
    source = MemorySource({"x": b"a" * 10 + b"BAD" + b"b" * 7 + b"c" * 10 + b"d" * 300})
    source.remote = True  # type: ignore[misc]  # coalesced reads, as from an object store
    store = Store(Runtime(source, caches=Caches(CacheSizes({"test_entries": 200}))))  # type: ignore[arg-type]
    decoded: list[str] = []

    async def decode(key, raw: bytes, where: str) -> bytes:
        decoded.append(key)
        if raw.startswith(b"BAD"):
            raise DataError(where, "undecodable")
        return raw

    def batch(*keys: str) -> list:
        at = {"a": (0, 10), "b": (10, 10), "c": (20, 10), "d": (30, 300)}
        return [(k, *at[k], f"x entry {k}") for k in keys]

    async def main() -> None:
        nonlocal blob
        blob = Blob.of("x", await source.stat("x"))
        reads = source.requests["read"]
        async with trio.open_nursery() as nursery:  # two ask at once: one batch
            for _ in range(2):
                nursery.start_soon(store.cached_batch, ENTRIES, blob, batch("a", "b", "c", "d"), decode)
        got = await store.cached_batch(ENTRIES, blob, batch("c"), decode)  # cached: no read, no decode
        assert source.requests["read"] - reads == 1 and decoded == ["a", "b", "c"] and got == [b"c" * 10]
        assert store.held(ENTRIES, "a") and store.held(ENTRIES, "b") and not store.held(ENTRIES, "d")
        assert store.recall(ENTRIES, "c") is not None and store.recall(ENTRIES, "d") is None
        with pytest.raises(DataError) as e:  # remembered: the same error, nothing read or decoded again
            store.recall(ENTRIES, "b")
        assert (e.value.where, e.value.reason) == ("x entry b", "undecodable")
        with pytest.raises(DataError) as e:  # wanted itself: the level's budget refuses it
            await store.cached_batch(ENTRIES, blob, batch("d", "a"), decode)
        assert e.value.reason.endswith("limit (the size of the cache that holds it)")
        assert source.requests["read"] - reads == 1 and decoded == ["a", "b", "c"]

    blob: Blob
    trio.run(main)


def test_recent_blobs_belong_to_their_session_and_are_bounded():
    """Two sessions over the same objects in one process (Dask workers, tests): each keeps the
    blobs it made (`Blob.of` kept them in one module-global map, where one session's shards
    evicted the other's and every session saw every other's), at most RECENT_BLOBS of them."""
    source = MemorySource(FILES)
    a, b = Store(Runtime(source)), Store(Runtime(source))  # type: ignore[arg-type]

    async def main() -> None:
        st = await source.stat("0")
        assert st is not None
        first = a.blob("0", st)
        assert a.blob("0", st) is first  # the same stat: the same blob
        assert (len(a.caches.blobs), len(b.caches.blobs)) == (1, 0)
        assert b.blob("0", st) is not first
        for n in range(2 * RECENT_BLOBS):  # b's shards fill b's map only
            b.blob(str(n), st)
            assert len(b.caches.blobs) <= RECENT_BLOBS
        assert a.blob("0", st) is first and len(a.caches.blobs) == 1

    trio.run(main)


def test_shard_tokens_are_stable_text():
    assert shard_token(12) == "12" and shard_token((1, 2, 3)) == "(1,2,3)" and shard_token("a") == "'a'"
    with pytest.raises(TypeError):
        shard_token(object())


@pytest.mark.slow
def test_the_type_checker_refuses_an_override_of_the_final_methods(tmp_path):
    """`locate`, `tables` and the index reads are the core's: a format that overrides one is an error."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import unshardfs

    (tmp_path / "fmt.py").write_text(
        "from unshardfs.abc import ChunkTable, ShardedStore\n\n\n"
        "class Mine(ShardedStore[int, ChunkTable]):\n"
        "    async def locate(self, chunk_id: int) -> tuple[ChunkTable, int] | None:\n"
        "        return None\n")
    env = {**os.environ, "MYPYPATH": str(Path(unshardfs.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--ignore-missing-imports",
                             "--config-file", os.devnull, str(tmp_path / "fmt.py")],
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert 'Cannot override final attribute "locate"' in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("at_end", [True, False])
def test_a_remote_shard_is_statted_with_its_index_once_and_never_past_the_seed_bound(at_end: bool) -> None:
    """`stat_shard`: the first open of a remote shard asks for its index with its stat (one request),
    and the index read after it takes those bytes; later opens are plain stats. An index larger
    than a seed may be (an absurd minishard count, say) is never asked for before the limits
    see it (`read_index_bytes`): a plain stat."""
    import trio.testing

    from unshardfs.core.fetch import SEED_MAX
    from unshardfs.testing.latency import LatencySource

    data = bytes(range(256)) * 64
    source = LatencySource(MemorySource({"s": data, "big": data}), latency=0.02)
    store = Store(Runtime(source))  # type: ignore[arg-type]
    kind = "tail" if at_end else "head"

    async def main() -> None:
        st = await store.stat_shard("s", 100, at_end)
        assert st is not None and source.counts() == {kind: 1}
        at = len(data) - 100 if at_end else 0
        blob = store.blob("s", st)
        assert await store.read_index_bytes(blob, at, 100) == data[at:at + 100]
        assert await store.stat_shard("s", 100, at_end) == st
        assert source.counts() == {kind: 1}  # the index came with the stat, and the stat is kept
        source.reset_log()
        assert await store.stat_shard("big", SEED_MAX + 1, at_end) is not None
        assert source.counts() == {"stat": 1}  # its index is read, if at all, once the limits allow it

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
