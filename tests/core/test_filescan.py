"""Files shown as they are stored, read ahead of scans over a remote source (core/filescan.py), in
process over a listable `LatencySource` (an object store's listings) under trio's MockClock.

(The key order of an OCDBT database, which needs no listing, is tested with the database in
tests/sources/test_coalesce.py.)
"""

from __future__ import annotations

from typing import Awaitable, Callable, TypeVar

import trio
import trio.testing

from unshardfs.testing.inprocess import opened, read_file, resolve
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.tree.nodes import DirNode, FileNode
from unshardfs.util.errors import StaleError

T = TypeVar("T")
LATENCY = 0.02
READ_TIME = 0.137 * LATENCY
FILES = 200
GROUP = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'


def store() -> MemorySource:
    """A Zarr group (a dataset) holding a directory of 200 plain files of 8 KiB."""
    files = {"zarr.json": GROUP}
    files.update({f"plain/f{i:04d}": bytes([i % 256]) * 8192 for i in range(FILES)})
    return MemorySource(files)


def run(main: Callable[[], Awaitable[T]]) -> T:
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def copy(memory: MemorySource, *args: str, change: Callable[[MemorySource], None] | None = None
         ) -> tuple[dict[str, bytes], float, int, dict[str, int]]:
    """`cp -r` of plain/ in process: its listing, then every file read in that order. The files
    read, the round trips the reader waited for after the listing, the reads the store saw, the
    fetch counters."""
    source = LatencySource(memory, LATENCY, listable=True)

    async def main() -> tuple[dict[str, bytes], float, dict[str, int]]:
        async with opened(source, *args) as session:
            directory = await resolve(session.tree, "plain")
            assert isinstance(directory, DirNode)
            nodes = [(name, node) async for batch in directory.entries() for name, node in batch]
            if change is not None:
                change(memory)
            source.reset_log()
            start = trio.current_time()
            got = {}
            for name, node in nodes:
                assert isinstance(node, FileNode)
                try:
                    got[name] = await read_file(node)
                except StaleError:
                    got[name] = b"<stale>"  # (a front end looks the name up again)
                await trio.sleep(READ_TIME)
            waited = (trio.current_time() - start - len(nodes) * READ_TIME) / LATENCY
            return got, waited, session.stats()["fetch"]

    got, waited, fetch = run(main)
    return got, waited, source.counts()["read"], fetch


def test_a_listed_directory_of_plain_files_is_read_ahead() -> None:
    """200 objects read in listing order: once two reads have followed each other, the next files are
    declared and read ahead concurrently (one request each: they are separate objects), so the reader
    waits a few round trips, not 200; each file is read once and nothing for nothing."""
    memory = store()
    got, waited, reads, fetch = copy(memory)
    assert got == {f"f{i:04d}": bytes([i % 256]) * 8192 for i in range(FILES)}
    assert waited <= 6, waited
    assert reads == FILES and fetch["prefetch_wasted_bytes"] == 0
    _, alone, reads_off, _ = copy(store(), "--no-read-ahead")
    assert round(alone) == FILES and reads_off == FILES


def test_a_file_changed_since_its_listing_is_read_as_it_is_now() -> None:
    """Files replaced between the listing and the reads: read-ahead, which holds the listing's version,
    never serves their old bytes (they are read from the source as they are now, or fail)."""
    def replace(memory: MemorySource) -> None:
        for i in range(0, FILES, 7):
            memory.put(f"plain/f{i:04d}", b"new" * 100)

    got, _, _, _ = copy(store(), change=replace)
    for i in range(FILES):
        data = got[f"f{i:04d}"]
        assert data in (b"new" * 100, b"<stale>") if i % 7 == 0 else data == bytes([i % 256]) * 8192, i
    assert any(got[f"f{i:04d}"] == b"<stale>" for i in range(0, FILES, 7))
