"""Shards replaced or deleted while mounted: never a mix of an old index and new data."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from unshardfs.testing.precomputed import Scale, sharding, write_volume

KEY = "1_1_1"


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


def replace_shards(src, new_sharded) -> None:
    for shard in sorted((new_sharded / KEY).glob("*.shard")):
        tmp = src / KEY / (shard.name + ".tmp")
        shutil.copyfile(shard, tmp)
        os.rename(tmp, src / KEY / shard.name)


def test_replaced_shards_are_reread_not_mixed(versions, tmp_path, mount):
    old, new = versions
    src = tmp_path / "src"
    shutil.copytree(old["sharded"], src)
    m = mount(src)
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
    assert "re-resolved" in m.log_text()


def test_deleted_shard_while_mounted(versions, tmp_path, mount):
    old, _ = versions
    src = tmp_path / "src"
    shutil.copytree(old["sharded"], src)
    m = mount(src, "--cache-timeout", "0")
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
