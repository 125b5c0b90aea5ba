"""READ replies spliced from the shard: what a sequential read of a page-cached raw chunk costs, in
counts, and what a shard truncated under a spliced read answers (EIO, never fewer or other bytes)."""

from __future__ import annotations

import errno
import fcntl
import math
import os
import shutil
from pathlib import Path

import pytest
import trio

from unshardfs.fuse import abi, splice
from unshardfs.fuse.kernel import SPLICE_MIN, KernelHandlers
from unshardfs.fuse.ops import ROOT
from unshardfs.fuse.server import Connection
from unshardfs.sources.local import LocalSource
from unshardfs.testing.kernel import served
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.util.pagecache import page_cache


KEY = "1_1_1"
CHUNK = 2 << 20


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> dict[str, Path]:
    # Raw 2 MiB chunks (128^3 uint8), as the benchmark's sequential figure reads: 4 chunks, 2 shards.
    root = tmp_path_factory.mktemp("splice")
    return write_volume(root, [Scale((256, 256, 128), (128, 128, 128), sharding(minishard=1, shard=1))], "uint8")


def warm(volume: dict[str, Path]) -> None:
    for shard in (volume["sharded"] / KEY).iterdir():
        shard.read_bytes()


def test_sequential_read_of_a_page_cached_chunk_is_spliced_in_full_requests(volume, mount):
    warm(volume)
    m = mount(volume["sharded"], "--fuse-engine", "kernel")
    name = sorted(os.listdir(volume["plain"] / KEY))[0]
    before = m.stats()
    fd = os.open(m.path / KEY / name, os.O_RDONLY)
    try:
        pieces = []
        while piece := os.read(fd, 1 << 20):
            pieces.append(piece)
    finally:
        os.close(fd)
    assert b"".join(pieces) == (volume["plain"] / KEY / name).read_bytes()
    after = m.stats()
    fuse = after["fuse"]
    reads = fuse["reads"] - before["fuse"]["reads"]
    spliced = fuse["spliced"] - before["fuse"]["spliced"]
    assert after["disk_waits"] == before["disk_waits"] == 0  # no READ waited on a worker thread
    if fuse["features"].get("read_ahead_kib"):
        # Requests as large as the splice pipe allows, the whole chunk asked for at once: a
        # 1 MiB pipe (the default pipe-max-size) holds the header and 254 pages, so 3 READs
        # (254 + 254 + 4 pages); 2 where the pipe can hold 256 pages. Every full one is
        # spliced; a tail under SPLICE_MIN is copied.
        request = fuse["features"]["request_kib"] << 10
        assert reads == math.ceil(CHUNK / request)
        assert spliced == CHUNK // request + (CHUNK % request >= SPLICE_MIN)
    else:  # a user's mount: the kernel's default read-ahead (128 KiB requests), every one spliced
        assert spliced == reads


def spliced_session_reads(volume: dict[str, Path], monkeypatch, truncate: bool) -> list[tuple[str, int, bytes]]:
    """Look up the first chunk and READ its first MiB through the real session, whose spliced
    replies go to a pipe (the kernel's end reads both): [(where the reply came, errno, payload)].
    With `truncate`, the shard is cut short right before its bytes are spliced."""
    name = sorted(os.listdir(volume["plain"] / KEY))[0]
    real = os.splice
    shards = sorted((volume["sharded"] / KEY).glob("*.shard"))

    def splice_after_truncating(src, dst, count, offset_src=None, *args, **kwargs):
        if offset_src is not None:  # from the shard: the shard shrinks first
            for shard in shards:
                os.truncate(shard, 4096)
        return real(src, dst, count, offset_src, *args, **kwargs)

    async def main() -> list[tuple[str, int, bytes]]:
        out_r, out_w = os.pipe2(os.O_NONBLOCK)
        fcntl.fcntl(out_w, fcntl.F_SETPIPE_SZ, 1 << 20)  # a whole reply at once, as /dev/fuse takes it
        got = []

        def to_the_pipe(session: Connection) -> None:
            session.splicer = splice.Splicer(out_w, 1 << 20)

        try:
            async with served(volume["sharded"], to_the_pipe) as (kernel, session):
                ino = await kernel.lookup(await kernel.lookup(ROOT, KEY), name)
                size = min(1 << 20, session.splice_max)
                if truncate:
                    monkeypatch.setattr(os, "splice", splice_after_truncating)
                request = abi.READ_IN.pack(0, 0, size, 0, 0, 0, 0)
                kernel.sock.send(abi.IN_HEADER.pack(abi.IN_HEADER.size + len(request), abi.Op.READ, 7, ino,
                                                    0, 0, 0, 0, 0) + request)
                with trio.fail_after(10):
                    while not got:
                        await trio.sleep(0.01)
                        for where, read in (("socket", lambda: kernel.sock.recv(4 << 20)),
                                            ("pipe", lambda: os.read(out_r, 4 << 20))):
                            try:
                                data = read()
                            except BlockingIOError:
                                continue
                            if where == "pipe":  # the rest of a spliced reply, if any
                                while len(data) < abi.OUT_HEADER.unpack_from(data)[0]:
                                    data += os.read(out_r, 4 << 20)
                            length, error, unique = abi.OUT_HEADER.unpack_from(data)
                            assert (length, unique) == (len(data), 7)
                            got.append((where, -error, data[abi.OUT_HEADER.size:]))
        finally:
            monkeypatch.setattr(os, "splice", real)
            for fd in (out_r, out_w):
                os.close(fd)
        return got

    return trio.run(main)


def test_a_page_cached_read_is_spliced_in_the_reading_task(volume, monkeypatch):
    warm(volume)
    hops = []
    real = trio.to_thread.run_sync

    async def counted(*args, **kwargs):
        hops.append(args[0])
        return await real(*args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)
    (reply,) = spliced_session_reads(volume, monkeypatch, truncate=False)
    name = sorted(os.listdir(volume["plain"] / KEY))[0]
    expected = (volume["plain"] / KEY / name).read_bytes()
    assert reply == ("pipe", 0, expected[:len(reply[2])]) and len(reply[2]) > 512 << 10
    assert hops == []


def test_a_shard_truncated_before_the_splice_answers_eio_not_fewer_bytes(volume, tmp_path, monkeypatch):
    copy = {"sharded": tmp_path / "sharded", "plain": volume["plain"]}
    shutil.copytree(volume["sharded"], copy["sharded"])
    warm(copy)
    replies = spliced_session_reads(copy, monkeypatch, truncate=True)
    # Nothing went out through the pipe; the request was answered once, with EIO.
    assert replies == [("socket", errno.EIO, b"")]


def test_pages_still_being_read_in_are_not_spliced(tmp_path, monkeypatch):
    """cachestat counts the pages read-ahead has added whose I/O is still in flight: a splice of
    those would wait for the disk on the loop. A range whose first or last page cannot be read
    without waiting is left to `read` (which waits on a worker thread)."""
    (tmp_path / "s.shard").write_bytes(os.urandom(1 << 20))
    (tmp_path / "s.shard").read_bytes()
    source = LocalSource(str(tmp_path))
    try:
        st = trio.run(source.stat, "s.shard")
        assert st is not None
        fd = source._fd("s.shard", st.version)
        if page_cache.cached(fd, 0, 1 << 20) is not True or not source._nowait:
            pytest.skip("no cachestat or RWF_NOWAIT here")
        assert source.cached_range("s.shard", 4096, 512 << 10, st.version) == (fd, 4096, 512 << 10)
        real = os.preadv
        in_flight = range(0, 0)

        def preadv(fd, buffers, offset, flags=0):
            if flags & os.RWF_NOWAIT and offset in in_flight:
                raise BlockingIOError(errno.EAGAIN, "in flight")
            return real(fd, buffers, offset, flags)

        monkeypatch.setattr(os, "preadv", preadv)
        for in_flight in (range(256 << 10, 1 << 20), range(0, 8192)):  # ahead of the reader; behind
            assert source.cached_range("s.shard", 4096, 512 << 10, st.version) is None
        in_flight = range(0, 0)
        assert source.cached_range("s.shard", 4096, 512 << 10, st.version) is not None
    finally:
        source.close()


@pytest.mark.parametrize("failure", ["file EAGAIN half way", "file shrank half way", "device ENOENT"])
def test_a_reply_abandoned_half_way_leaves_nothing_for_the_next(tmp_path, monkeypatch, failure):
    """Whatever a failed reply left in the pipe (its header, part of its bytes) never reaches the
    device ahead of the next reply: the pipe is replaced."""
    data = os.urandom(1 << 20)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    out_r, out_w = os.pipe2(os.O_NONBLOCK)
    fcntl.fcntl(out_w, fcntl.F_SETPIPE_SZ, 1 << 20)
    splicer = splice.Splicer(out_w, 256 << 10)
    real = os.splice
    calls = []

    def failing(src, dst, count, offset_src=None, *args, **kwargs):
        calls.append(src)
        if len(calls) == 2 and failure.startswith("file"):  # the file's second piece
            if failure == "file EAGAIN half way":
                raise BlockingIOError(errno.EAGAIN, "pipe full")
            return 0
        if dst == out_w and len(calls) == 3:
            raise FileNotFoundError(errno.ENOENT, "interrupted")
        return real(src, dst, min(count, 64 << 10) if len(calls) == 1 else count, offset_src, *args, **kwargs)

    try:
        monkeypatch.setattr(os, "splice", failing)
        with pytest.raises(FileNotFoundError if failure == "device ENOENT" else splice.SpliceFailed):
            splicer.reply(1, fd, 0, 200 << 10)
        monkeypatch.setattr(os, "splice", real)
        with pytest.raises(BlockingIOError):
            os.read(out_r, 1 << 20)  # nothing of the failed reply went out
        splicer.reply(2, fd, 4096, 128 << 10)
        got = os.read(out_r, 1 << 20)
        assert got == abi.OUT_HEADER.pack(abi.OUT_HEADER.size + (128 << 10), 0, 2) + data[4096:4096 + (128 << 10)]
    finally:
        splicer.close()
        for f in (fd, out_r, out_w):
            os.close(f)


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EPERM])
def test_a_kernel_without_cachestat_reads_as_before(tmp_path, monkeypatch, code):
    """cachestat missing (before Linux 6.5: ENOSYS) or filtered (seccomp: EPERM): asked once,
    then never; ranges `read` would copy without waiting are left to it, larger ones (which
    `read` too reads on the loop) may be spliced."""
    import ctypes

    (tmp_path / "s.shard").write_bytes(os.urandom(1 << 20))
    asked = []

    def missing(*args):
        asked.append(args[0])
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(page_cache, "_syscall", missing)
    source = LocalSource(str(tmp_path))
    try:
        st = trio.run(source.stat, "s.shard")
        assert st is not None
        assert source.cached_range("s.shard", 0, 128 << 10, st.version) is None
        assert source.cached_range("s.shard", 0, 512 << 10, st.version) is not None
        assert len(asked) == 1 and page_cache.cached(0, 0, 4096) is None
    finally:
        source.close()


def test_a_read_whose_splice_failed_is_counted_once(volume, monkeypatch):
    """A spliced reply that could not be sent is answered through `read`: one READ, counted once
    (`read_cached` counted it too, so it was two reads and twice the bytes)."""
    warm(volume)
    name = sorted(os.listdir(volume["plain"] / KEY))[0]
    expected = (volume["plain"] / KEY / name).read_bytes()
    real = os.splice

    def refused_from_the_file(src, dst, count, offset_src=None, *args, **kwargs):
        if offset_src is not None:
            raise OSError(errno.EIO, "refused")
        return real(src, dst, count, offset_src, *args, **kwargs)

    async def main() -> tuple[bytes, dict, int]:
        out_r, out_w = os.pipe2(os.O_NONBLOCK)
        fcntl.fcntl(out_w, fcntl.F_SETPIPE_SZ, 1 << 20)
        try:
            async with served(volume["sharded"],
                              lambda session: setattr(session, "splicer", splice.Splicer(out_w, 1 << 20))
                              ) as (kernel, session):
                ino = await kernel.lookup(await kernel.lookup(ROOT, KEY), name)
                size = 128 << 10  # a reply the socket standing for /dev/fuse carries whole
                assert SPLICE_MIN <= size <= session.splice_max
                monkeypatch.setattr(os, "splice", refused_from_the_file)
                with trio.fail_after(10):
                    data = await kernel.read(ino, size)
                monkeypatch.setattr(os, "splice", real)
                assert isinstance(session.dispatcher, KernelHandlers)
                return data, dict(session.dispatcher.ops.counters), size
        finally:
            monkeypatch.setattr(os, "splice", real)
            for fd in (out_r, out_w):
                os.close(fd)

    data, counters, size = trio.run(main)
    assert data == expected[:size]
    assert (counters["reads"], counters["read_bytes"]) == (1, size)
