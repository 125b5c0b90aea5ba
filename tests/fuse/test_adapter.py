"""The FUSE adapter driven in-process (no kernel): computed inodes outlive the
bounded set of recent nodes, and the inode table stays small."""

from __future__ import annotations

import errno
import os
import shutil

import pyfuse3
import pytest
import trio

from unshardfs.app.opened import OpenedSource
from unshardfs.fuse.pyfuse3_engine import Pyfuse3Operations
from unshardfs.testing.precomputed import Scale, sharding, write_volume

KEY = "1_1_1"


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter")
    return write_volume(root, [Scale((48, 32, 16), (8, 8, 8), sharding(minishard=2, shard=1, data_enc="gzip"))],
                        "uint16")


async def _ops(source) -> Pyfuse3Operations:
    ops = Pyfuse3Operations((await OpenedSource.open(str(source))).tree)
    ops.inodes.recent.maxsize = 4  # far fewer than the chunks looked up below
    return ops


def test_evicted_computed_inodes_are_rebuilt(volume):
    names = sorted(os.listdir(volume["plain"] / KEY))

    async def main() -> None:
        ops = await _ops(volume["sharded"])
        scale = await ops.lookup(pyfuse3.ROOT_INODE, KEY.encode())
        inos = {}
        for name in names:
            attr = await ops.lookup(scale.st_ino, name.encode())
            inos[name] = attr.st_ino
        assert len(set(inos.values())) == len(names)
        assert len(ops.inodes.recent) <= 4
        assert len(ops.inodes.nodes) <= 3  # root, scale dir: nothing per chunk
        for name, ino in inos.items():  # most were evicted: rebuilt from the directory
            attr = await ops.getattr(ino)
            assert attr.st_size == (volume["plain"] / KEY / name).stat().st_size
            info = await ops.open(ino, os.O_RDONLY)
            assert await ops.read(info.fh, 0, 1 << 20) == (volume["plain"] / KEY / name).read_bytes()
            await ops.release(info.fh)

    trio.run(main)


def test_vanished_chunk_inode_is_stale(volume, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(volume["sharded"], src)
    names = sorted(os.listdir(volume["plain"] / KEY))

    async def main() -> None:
        ops = await _ops(src)
        scale = await ops.lookup(pyfuse3.ROOT_INODE, KEY.encode())
        inos = [(await ops.lookup(scale.st_ino, n.encode())).st_ino for n in names]
        for shard in (src / KEY).glob("*.shard"):
            shard.unlink()
        stale = 0
        for ino in inos:
            try:
                await ops.getattr(ino)
            except pyfuse3.FUSEError as e:
                assert e.errno == errno.ESTALE
                stale += 1
        assert stale >= len(inos) - 4  # all but the few still held as recent nodes

    trio.run(main)
