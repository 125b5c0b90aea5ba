"""Plain READDIR replies of computed-inode files are packed a reply at a time (numpy), with the
same bytes as entry by entry, and a listing builds no object per entry."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from unshardfs.core.chunks import ChunkContext
from unshardfs.fuse import abi
from unshardfs.fuse.kernel import DirentBuffer
from unshardfs.fuse.ops import ROOT
from unshardfs.testing.kernel import served
from unshardfs.testing.precomputed import Scale, sharding, write_volume


KEY = "1_1_1"


@pytest.mark.parametrize("size", [32, 100, 4096, 10_000, 1 << 17])
def test_packed_entries_are_the_bytes_added_one_by_one(size):
    names = [f"{i}-{i + 1}_0-{i % 7}_{'x' * (i % 13)}" for i in range(3000)]
    child_ids: list[int | None] = list(range(5, 3005))
    slot_bits = 3 << 56
    packed, single = DirentBuffer(size, False, None), DirentBuffer(size, False, None)  # type: ignore[arg-type]
    taken = packed.add_files(names, child_ids, 7, slot_bits, 100)
    one_by_one = 0
    for i in range(7, len(names)):
        if not single.add(names[i].encode(), slot_bits | i + 5, None, 0, 0, 100 + i - 7):
            break
        one_by_one += 1
    assert taken == one_by_one and bytes(packed.parts) == bytes(single.parts) and packed.used == single.used


def test_entries_that_cannot_be_packed_are_left_to_add():
    buffer = DirentBuffer(4096, False, None)  # type: ignore[arg-type]
    assert buffer.add_files(["a", "ü"], [1, 2], 0, 1 << 56, 1) is None  # not ASCII
    assert buffer.add_files(["a", "b"], [1, None], 0, 1 << 56, 1) is None  # an entry without an child_id
    assert DirentBuffer(4096, True, None).add_files(["a"], [1], 0, 1 << 56, 1) is None  # type: ignore[arg-type]
    assert buffer.used == 0


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("listing")
    return write_volume(root, [Scale((256, 256, 64), (16, 16, 16), sharding(minishard=2, shard=2))], "uint8")


def test_a_plain_listing_builds_no_object_per_entry(volume, monkeypatch):
    made, added = [], []
    real_make, real_add = ChunkContext.make, DirentBuffer.add
    monkeypatch.setattr(ChunkContext, "make", lambda *a, **k: made.append(1) or real_make(*a, **k))
    monkeypatch.setattr(DirentBuffer, "add", lambda *a, **k: added.append(1) or real_add(*a, **k))

    async def main() -> list[bytes]:
        listed = []
        async with served(volume["sharded"]) as (kernel, _):
            directory = await kernel.lookup(ROOT, KEY)
            error, opened = await kernel.ask(abi.Op.OPENDIR, directory, abi.OPEN_IN.pack(0, 0))
            assert error == 0
            fh = abi.OPEN_OUT.unpack_from(opened)[0]
            offset = 0
            while True:
                error, reply = await kernel.ask(abi.Op.READDIR, directory,
                                                abi.READ_IN.pack(fh, offset, 32 << 10, 0, 0, 0, 0))
                assert error == 0
                if not reply:
                    break
                at = 0
                while at < len(reply):
                    ino, offset, namelen, kind = abi.DIRENT.unpack_from(reply, at)
                    name = reply[at + abi.DIRENT.size:at + abi.DIRENT.size + namelen]
                    assert ino >> 56 and kind == 8 and offset == len(listed) + 1
                    listed.append(name)
                    at += abi.pad8(abi.DIRENT.size + namelen)
        return listed

    listed = trio.run(main)
    assert sorted(name.decode() for name in listed) == sorted(os.listdir(volume["plain"] / KEY))
    assert len(listed) == 1024
    assert made == [] and added == []  # no node, no entry-by-entry packing
