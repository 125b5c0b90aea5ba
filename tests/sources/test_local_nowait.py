"""Local reads never wait on the disk on the event loop: bytes in the page cache are read there
(preadv2 with RWF_NOWAIT), the rest on a worker thread."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from unshardfs.sources import local
from unshardfs.sources.local import LocalSource

DATA = bytes(range(256)) * 256  # 64 KiB


@pytest.fixture
def source(tmp_path):
    (tmp_path / "f").write_bytes(DATA)
    src = LocalSource(str(tmp_path))
    yield src
    src.close()


def hops_of(monkeypatch) -> list:
    hops: list = []
    real = trio.to_thread.run_sync

    async def counted(*args, **kwargs):
        hops.append(args[0])
        return await real(*args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)
    return hops


def test_cached_bytes_are_read_on_the_loop(source, monkeypatch):
    with open(os.path.join(source.root, "f"), "rb") as f:
        f.read()  # its pages in the page cache
    hops = hops_of(monkeypatch)
    assert trio.run(source.read, "f", 100, 5000) == DATA[100:5100]
    assert trio.run(source.read, "f", len(DATA) - 10, 100) == DATA[-10:]  # short only at the end
    assert hops == [] and source.stats()["disk_waits"] == 0


def evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_what_is_not_cached_is_read_on_a_thread(source, monkeypatch, tmp_path):
    # Whether this file system drops pages on request and says so to a no-wait read, asked of
    # another file (a no-wait read that finds no pages may start reading them ahead).
    probe = tmp_path / "probe"
    probe.write_bytes(DATA)
    evict(probe)
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
        pytest.skip("this file system keeps (or cannot say it lacks) the pages")
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    evict(tmp_path / "f")
    hops = hops_of(monkeypatch)
    assert trio.run(source.read, "f", 4096, 8192) == DATA[4096:4096 + 8192]
    assert len(hops) == 1 and source.stats()["disk_waits"] == 1


def test_partly_cached_reads_join_both_parts(source, monkeypatch):
    real = os.preadv
    calls = []

    def half(fd, buffers, offset, flags=0):
        calls.append(offset)
        if len(calls) > 1:
            raise BlockingIOError(errno.EAGAIN, "not cached")
        view = memoryview(buffers[0])[:1000]
        return real(fd, [view], offset, flags)

    monkeypatch.setattr(os, "preadv", half)
    hops = hops_of(monkeypatch)
    assert trio.run(source.read, "f", 10, 3000) == DATA[10:3010]
    assert len(hops) == 1


def test_a_file_system_without_nowait_reads_is_read_as_before(source, monkeypatch):
    def unsupported(fd, buffers, offset, flags=0):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "preadv", unsupported)
    hops = hops_of(monkeypatch)
    assert trio.run(source.read, "f", 0, 100) == DATA[:100]
    assert trio.run(source.read, "f", 100, 100) == DATA[100:200]
    assert hops == [] and not source._nowait


def test_large_reads_are_read_as_before(source, monkeypatch):
    monkeypatch.setattr(local, "NOWAIT_MAX", 1000)
    monkeypatch.setattr(os, "preadv", None)  # never called
    assert trio.run(source.read, "f", 0, 5000) == DATA[:5000]
