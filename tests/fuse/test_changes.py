"""Shards replaced or deleted while mounted: never a mix of an old index and new data."""

from __future__ import annotations

import errno
import os
import shutil
import time
from contextlib import asynccontextmanager

import pytest
import trio

from unshardfs.app.opened import OpenedSource
from unshardfs.fuse.abi import FsError
from unshardfs.fuse.ops import ROOT, SERVED_MAX, Bridge
from unshardfs.testing.mounts import wait_for
from unshardfs.testing.precomputed import Scale, sharding, write_volume

KEY = "1_1_1"
ENGINES = ["kernel", "pyfuse3"]


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two datasets of identical geometry and different contents.

    The second compresses far better, so its payloads sit at other offsets:
    reading it through the first one's index would give wrong bytes.
    """
    root = tmp_path_factory.mktemp("versions")
    spec = sharding(minishard=1, shard=1, data_enc="gzip")
    scales = [Scale((48, 32, 16), (16, 16, 8), spec)]
    return [write_volume(root / f"v{i}", scales, "uint16", seed=10 * i, blocky=bool(i)) for i in range(2)]


def read_or_none(path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def replace_shards(src, new_sharded) -> None:
    for shard in sorted((new_sharded / KEY).glob("*.shard")):
        tmp = src / KEY / (shard.name + ".tmp")
        shutil.copyfile(shard, tmp)
        os.rename(tmp, src / KEY / shard.name)


def test_replaced_shards_are_reread_not_mixed(versions, tmp_path, mount, engine):
    old, new = versions
    src = tmp_path / "src"
    shutil.copytree(old["sharded"], src)
    m = mount(src, "--fuse-engine", engine)
    names = sorted(os.listdir(old["plain"] / KEY))
    assert names == sorted(os.listdir(m.path / KEY))
    # Handles opened (and resolved) against the old shards, nothing read yet.
    fds = {name: os.open(m.path / KEY / name, os.O_RDONLY) for name in names}
    try:
        replace_shards(src, new["sharded"])
        # A listing makes the daemon stat the shards again and notice the change.
        os.listdir(m.path / KEY)
        served_new = 0
        for name, fd in fds.items():
            want_new = (new["plain"] / KEY / name).read_bytes()
            want_old = (old["plain"] / KEY / name).read_bytes()
            got = os.pread(fd, len(want_new) + 10, 0)
            assert got in (want_new, want_old), name
            served_new += got == want_new
        assert served_new == len(names), "open handles should follow the replaced shards"
    finally:
        for fd in fds.values():
            os.close(fd)
    if engine == "pyfuse3":  # its handles resolved the old shards at open; no-open resolves at the first read
        assert "re-resolved" in m.log_text()


def test_deleted_shard_while_mounted(versions, tmp_path, mount, engine):
    old, _ = versions
    src = tmp_path / "src"
    shutil.copytree(old["sharded"], src)
    m = mount(src, "--cache-timeout", "0", "--fuse-engine", engine)
    names = sorted(os.listdir(m.path / KEY))
    victim = sorted((src / KEY).glob("*.shard"))[0]
    victim.unlink()
    remaining = set(os.listdir(m.path / KEY))
    assert remaining < set(names)
    for name in names:
        try:
            got = (m.path / KEY / name).read_bytes()
        except OSError as e:
            assert e.errno in (errno.ENOENT, errno.EIO)
            assert name not in remaining
            continue
        assert got == (old["plain"] / KEY / name).read_bytes()


@pytest.fixture(scope="module")
def big_versions(tmp_path_factory):
    """Two versions of a volume whose chunks span many pages (2 MiB decoded)."""
    root = tmp_path_factory.mktemp("bigversions")
    spec = sharding(minishard=0, shard=0, data_enc="gzip")
    scales = [Scale((128, 128, 128), (128, 128, 64), spec)]
    return [write_volume(root / f"v{i}", scales, "uint16", seed=10 * i, blocky=bool(i)) for i in range(2)]


def test_replaced_under_cached_pages_is_new_or_eio_never_mixed(big_versions, tmp_path, mount, engine):
    """The kernel holds the first page of each file (no-open keeps pages across opens); the
    shards are replaced; a whole read is then the old bytes, the new bytes or EIO -- never the
    old first page followed by new bytes -- and once the attributes are revalidated (after
    --cache-timeout: new size and mtime), only new bytes."""
    old, new = big_versions
    m, names = _replaced_under_cached_pages(big_versions, tmp_path, mount, "--fuse-engine", engine,
                                            "--cache-timeout", "1")
    outcomes = {"old": 0, "new": 0, "eio": 0}
    for name in names:
        want_old = (old["plain"] / KEY / name).read_bytes()
        want_new = (new["plain"] / KEY / name).read_bytes()
        assert want_old[:4096] != want_new[:4096]
        try:
            got = (m.path / KEY / name).read_bytes()
        except OSError as e:
            assert e.errno == errno.EIO, name
            outcomes["eio"] += 1
        else:
            assert got in (want_old, want_new), f"{name}: a mix of two versions"
            outcomes["old" if got == want_old else "new"] += 1
        # Attributes revalidated (or the daemon saw the change itself and had the kernel drop its
        # pages): new bytes.
        assert wait_for(lambda: read_or_none(m.path / KEY / name) == want_new), (name, outcomes)
    # Which of old, new or EIO each read gets depends on timing (whether the kernel asked for
    # the attributes again first); the tests below drive each path on purpose.


def test_after_the_attribute_timeout_only_new_bytes(big_versions, tmp_path, mount, engine):
    """Pages cached, shards replaced, the attribute timeout passed: the kernel fetches the
    attributes again (new mtime) and drops its pages, or the daemon refuses once: new or EIO."""
    _, new = big_versions
    m, names = _replaced_under_cached_pages(big_versions, tmp_path, mount, "--fuse-engine", engine,
                                            "--cache-timeout", "1")
    time.sleep(1.5)
    for name in names:
        want_new = (new["plain"] / KEY / name).read_bytes()
        got = read_or_none(m.path / KEY / name)
        assert got in (None, want_new), f"{name}: not the new bytes"
        assert wait_for(lambda: read_or_none(m.path / KEY / name) == want_new), name


def test_noticed_by_the_daemon_under_cached_pages_is_eio_then_new(big_versions, tmp_path, mount, engine):
    """Pages cached and the kernel's attributes still valid (long --cache-timeout); the daemon
    notices the replaced shards itself (a listing stats them). The first read of each file is
    EIO -- its old first page is still cached, new bytes after it would be a mix -- and once the
    daemon has had the pages dropped, reads give the new bytes. (On either engine the first read may
    also be the new bytes whole: see below.)"""
    _, new = big_versions
    # No decoded-chunk cache: the old chunks are not kept whole in the daemon either, so every
    # read reaches the shards and finds them changed.
    m, names = _replaced_under_cached_pages(big_versions, tmp_path, mount, "--fuse-engine", engine,
                                            "--cache-timeout", "600", "--chunk-cache", "0")
    os.listdir(m.path / KEY)
    for name in names:
        want_new = (new["plain"] / KEY / name).read_bytes()
        try:
            got = (m.path / KEY / name).read_bytes()
        except OSError as e:
            assert e.errno == errno.EIO, name
        else:
            # The listing may hand the kernel the new attributes (READDIRPLUS, on either engine,
            # when the daemon has already seen the new shard): the kernel then drops the old pages
            # itself, and the new bytes are whole. Never the old bytes, never a mix.
            assert got == want_new, name
        assert wait_for(lambda: read_or_none(m.path / KEY / name) == want_new), name
        got = read_or_none(m.path / KEY / name)
        assert got == want_new, name


def _replaced_under_cached_pages(big_versions, tmp_path, mount, *options):
    """A copy of the old version mounted with `options`, the first page of each chunk file
    cached by the kernel (and nothing after it), then the shards replaced by the new version's.
    Returns the mount and the chunk names."""
    old, new = big_versions
    src = tmp_path / "src"
    shutil.copytree(old["sharded"], src)
    m = mount(src, *options)
    names = sorted(os.listdir(old["plain"] / KEY))
    for name in names:
        fd = os.open(m.path / KEY / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: just the first page
            assert os.pread(fd, 4096, 0) == (old["plain"] / KEY / name).read_bytes()[:4096]
        finally:
            os.close(fd)
    replace_shards(src, new["sharded"])
    return m, names


@asynccontextmanager
async def _served_chunk(versions, tmp_path):
    """In-process: Bridge over a copy of the old version, its first chunk looked up and marked
    served (the kernel may hold its pages), invalidations recorded instead of sent. Yields
    (ops, the chunk's inode, its name, the invalidations asked, the copy's directory)."""
    old, _ = versions
    src = tmp_path / "src"
    shutil.copytree(old["sharded"], src)
    name = sorted(os.listdir(old["plain"] / KEY))[0]
    source = await OpenedSource.open(str(src))
    try:
        async with source.running():
            ops = Bridge(source.tree)
            asked: list = []
            ops.invalidate = lambda ino, done: asked.append((ino, done))
            scale = await ops.lookup(ROOT, KEY.encode())
            assert scale is not None
            found = await ops.lookup(scale[0], name.encode())
            assert found is not None
            ops.served[found[0]] = True  # as after a READ: the kernel may hold its pages
            yield ops, found[0], name, asked, src
    finally:
        await source.aclose()


def test_reads_fail_until_the_kernel_has_dropped_old_pages(versions, tmp_path):
    """In-process: a read finds the shard replaced while the kernel may hold old pages. It
    fails and asks the engine to drop them; every read fails until the engine says they are
    dropped (a read answered meanwhile would follow old cached pages with new bytes); then the
    new bytes."""
    _, new = versions

    async def main() -> None:
        async with _served_chunk(versions, tmp_path) as (ops, ino, name, asked, src):
            replace_shards(src, new["sharded"])
            for _ in range(3):
                with pytest.raises(FsError) as caught:
                    await ops.read(ino, 0, 1 << 20)
                assert caught.value.errno == errno.EIO
                assert ops.read_cached(ino, 0, 4096) is None
            assert [ino for ino, _ in asked] == [ino]
            asked[0][1]()  # the engine: dropped
            assert ops.dropping == {}
            _, data = await ops.read(ino, 0, 1 << 20)
            assert data == (new["plain"] / KEY / name).read_bytes()

    trio.run(main)


def test_an_inode_forgotten_by_the_served_record_still_may_hold_pages(versions, tmp_path):
    """In-process: the record of inodes whose pages the kernel may hold is bounded (an LRU of
    65,536). A file read before 65,536 others were read was forgotten there and looked as if
    the kernel held none of its pages: its replaced shard was served new bytes at once, after
    whatever old pages the kernel still had. Now EIO and a page drop, as for one remembered."""
    _, new = versions

    async def main() -> tuple[int, bool]:
        async with _served_chunk(versions, tmp_path) as (ops, ino, _, asked, src):
            for other in range(SERVED_MAX):  # as after READs of as many other files
                ops.served[(1 << 62) + other] = True
            assert ino not in ops.served
            replace_shards(src, new["sharded"])
            try:
                await ops.read(ino, 0, 1 << 20)
                error = 0
            except FsError as e:
                error = e.errno
            return error, ino in ops.dropping and [i for i, _ in asked] == [ino]

    # Before: (0, False), the new bytes served at once.
    assert trio.run(main) == (errno.EIO, True)
