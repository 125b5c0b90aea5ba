"""FUSE passthrough: files stored whole in a local file are read by the kernel from that file,
the daemon answering only their OPEN; every other file as without it. In process (the
bookkeeping of backing ids, a kernel that refuses them) and through real mounts (READ counts)."""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from unshardfs.fuse import abi
from unshardfs.fuse.kernel import CACHED_FH, HELD_CACHED_FH, PASSTHROUGH_FH
from unshardfs.fuse.ops import ROOT
from unshardfs.fuse.server import Connection, may_register_backing_files
from unshardfs.testing.kernel import Kernel, served
from unshardfs.testing.precomputed import Scale, sharding, write_volume

KEY = "1_1_1"
EXTRA = "provenance.bin"  # a file of the dataset no format rewrites: shown as it is
EXTRA_SIZE = (3 << 20) + 123


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("passthrough")
    ds = write_volume(root, [Scale((256, 256, 128), (128, 128, 128), sharding(minishard=1, shard=1))], "uint8")
    (ds["sharded"] / EXTRA).write_bytes(os.urandom(EXTRA_SIZE))
    return ds


def init_body() -> bytes:
    return (abi.INIT_IN.pack(7, 40, 128 << 10, 0xFFFFFFFF) + abi.INIT_IN_FLAGS2.pack(abi.PASSTHROUGH >> 32)
            + bytes(44))


async def open_file(kernel: Kernel, ino: int) -> tuple[int, int, int]:
    """OPEN `ino` read-only: (fh, open_flags, backing_id) of the reply."""
    error, body = await kernel.ask(abi.Op.OPEN, ino, abi.OPEN_IN.pack(os.O_RDONLY, 0))
    assert error == 0
    return abi.OPEN_OUT.unpack(body)


async def release(kernel: Kernel, ino: int, fh: int) -> None:
    error, _ = await kernel.ask(abi.Op.RELEASE, ino, abi.RELEASE_IN.pack(fh, os.O_RDONLY, 0, 0))
    assert error == 0


class FakeDevice:
    """Backing-file ioctls as a kernel answers them: ids handed out, or one errno for every call."""

    def __init__(self, refuse: int | None = None) -> None:
        self.refuse = refuse
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.calls = 0

    def install(self, session: Connection) -> None:
        session.config = replace(session.config, passthrough=True)  # InitConfig is frozen
        session.on_init = session.dispatcher.negotiated  # type: ignore[attr-defined]  (as the engine does)
        session.backing_open = self.backing_open  # type: ignore[method-assign]
        session.backing_close = self.closed.append  # type: ignore[method-assign]

    def backing_open(self, fd: int) -> int:
        self.calls += 1
        os.fstat(fd)  # an open descriptor, the caller's to close
        if self.refuse is not None:
            raise OSError(self.refuse, os.strerror(self.refuse))
        self.opened.append(100 + len(self.opened))
        return self.opened[-1]


def session_opens(volume: dict[str, Path], device: FakeDevice, script) -> object:
    async def main() -> object:
        async with served(volume["sharded"], device.install) as (kernel, session):
            error, _ = await kernel.ask(abi.Op.INIT, 0, init_body())
            assert error == 0 and session.negotiated.has(abi.PASSTHROUGH)
            extra = await kernel.lookup(ROOT, EXTRA)
            chunk = await kernel.lookup(await kernel.lookup(ROOT, KEY), sorted(os.listdir(volume["plain"] / KEY))[0])
            return await script(kernel, session, extra, chunk)

    return trio.run(main)


def test_one_backing_id_per_file_while_it_is_open(volume):
    """The kernel refuses a second backing file for an inode open for passthrough (EBUSY): every
    open of it shares one id, dropped at its last RELEASE; a chunk (bytes assembled from a shard)
    is opened as without passthrough."""
    device = FakeDevice()

    async def script(kernel, session, extra, chunk):
        first = await open_file(kernel, extra)
        second = await open_file(kernel, extra)
        assert first == second == (PASSTHROUGH_FH, abi.FOPEN_PASSTHROUGH, 100)
        assert await open_file(kernel, chunk) == (CACHED_FH, abi.FOPEN_KEEP_CACHE, 0)
        await release(kernel, extra, PASSTHROUGH_FH)
        assert device.closed == []
        await release(kernel, extra, PASSTHROUGH_FH)
        assert device.closed == [100]
        # A later open registers the file again (it may have been replaced meanwhile).
        assert await open_file(kernel, extra) == (PASSTHROUGH_FH, abi.FOPEN_PASSTHROUGH, 101)
        return session.dispatcher.counters

    counters = session_opens(volume, device, script)
    assert device.calls == 2 and counters["passthrough_opens"] == 3 and counters["reads"] == 0


@pytest.mark.parametrize("refused, for_good", [(errno.EPERM, True), (errno.ENOTTY, True), (errno.ELOOP, False)])
def test_a_refused_backing_file_is_read_through_the_daemon(volume, refused, for_good):
    """EPERM (no CAP_SYS_ADMIN) or ENOTTY (no such ioctl) turn passthrough off for the session;
    ELOOP (a backing file on a stacked file system) only for that file. The file is then opened
    with its pages kept, as without passthrough, and reads as it does there."""
    device = FakeDevice(refused)

    async def script(kernel, session, extra, chunk):
        first = await open_file(kernel, extra)
        # While it is open through its page cache, the kernel would refuse passthrough (ETXTBSY).
        second = await open_file(kernel, extra)
        assert first == second == (HELD_CACHED_FH, abi.FOPEN_KEEP_CACHE, 0)
        assert device.calls == 1
        data = await kernel.read(extra, 1 << 16)
        await release(kernel, extra, HELD_CACHED_FH)
        await release(kernel, extra, HELD_CACHED_FH)
        third = await open_file(kernel, extra)
        return data, third, session.dispatcher.counters

    data, third, counters = session_opens(volume, device, script)
    assert data == (volume["sharded"] / EXTRA).read_bytes()[:1 << 16]
    assert counters["passthrough_refused"] == device.calls == (1 if for_good else 2)
    # Asked again only where the refusal was this file's (and refused again here).
    assert third == (HELD_CACHED_FH, abi.FOPEN_KEEP_CACHE, 0)
    assert device.closed == []


# -- through the kernel ---------------------------------------------------------------------------

needs_root = pytest.mark.skipif(not may_register_backing_files(), reason="passthrough needs CAP_SYS_ADMIN")


def read_extra(path: Path) -> tuple[bytes, bytes, bytes]:
    """The file read by two descriptors open at once, then once more mapped."""
    with open(path, "rb") as f, open(path, "rb") as g:
        a, b = f.read(), g.read()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        c = bytes(m)
    return a, b, c


@needs_root
def test_a_whole_local_file_is_read_by_the_kernel_not_the_daemon(volume, mount):
    m = mount(volume["sharded"], "--fuse-passthrough")
    features = m.stats()["fuse"]["features"]
    if not features["passthrough"]:
        pytest.skip(f"the kernel offers no passthrough (protocol {features['protocol']})")
    assert features["no_open"] is False  # OPEN is where passthrough is chosen
    expected = (volume["sharded"] / EXTRA).read_bytes()
    before = m.stats()["fuse"]
    assert read_extra(m.path / EXTRA) == (expected, expected, expected)
    after = m.stats()["fuse"]
    assert after["reads"] == before["reads"] and after["read_bytes"] == before["read_bytes"]
    assert after["passthrough_opens"] - before["passthrough_opens"] == 3
    assert after["passthrough_refused"] == 0
    # Everything else through the daemon, as without passthrough: a chunk's bytes come from a shard.
    name = sorted(os.listdir(volume["plain"] / KEY))[0]
    assert (m.path / KEY / name).read_bytes() == (volume["plain"] / KEY / name).read_bytes()
    assert m.stats()["fuse"]["reads"] > after["reads"]


def test_without_the_option_every_file_is_read_through_the_daemon(volume, mount):
    m = mount(volume["sharded"])
    features = m.stats()["fuse"]["features"]
    assert features["passthrough"] is False and features["no_open"] is True
    expected = (volume["sharded"] / EXTRA).read_bytes()
    before = m.stats()["fuse"]["read_bytes"]
    assert read_extra(m.path / EXTRA) == (expected, expected, expected)
    assert m.stats()["fuse"]["read_bytes"] - before == EXTRA_SIZE  # once: its pages stay cached
