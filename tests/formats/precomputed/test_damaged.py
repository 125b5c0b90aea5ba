"""Damaged shards on a real mount: affected files fail (EIO) or are absent,
the damage is logged with its path, every other file reads exactly, and the
daemon keeps serving."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from unshardfs.testing.precomputed import Scale, sharding, write_volume

SCALE_KEY = "1_1_1"
MINISHARD_BITS = 1


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("damage")
    spec = sharding(minishard=MINISHARD_BITS, shard=2, data_enc="gzip")
    return write_volume(root, [Scale((64, 64, 32), (16, 16, 8), spec)], "uint16")


def shard_index(path: Path) -> np.ndarray:
    return np.frombuffer(path.read_bytes()[: 16 << MINISHARD_BITS], dtype="<u8").reshape(-1, 2)


def first_minishard(path: Path) -> tuple[int, np.ndarray]:
    """(absolute offset of the first non-empty minishard index, its [3, n] array)."""
    base = 16 << MINISHARD_BITS
    for start, end in shard_index(path):
        if end > start:
            raw = path.read_bytes()[base + int(start): base + int(end)]
            return base + int(start), np.frombuffer(raw, dtype="<u8").reshape(3, -1).copy()
    raise AssertionError("no minishard")


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def damage_truncate(shard: Path) -> None:
    os.truncate(shard, shard.stat().st_size // 2)


def damage_empty(shard: Path) -> None:
    os.truncate(shard, 0)


def damage_delete(shard: Path) -> None:
    shard.unlink()


def damage_index_garbage(shard: Path) -> None:
    patch(shard, 0, np.random.default_rng(1).bytes(16 << MINISHARD_BITS))


def damage_minishard_length(shard: Path) -> None:
    index = shard_index(shard).copy()
    m = int(np.nonzero(index[:, 1] > index[:, 0])[0][0])
    index[m, 1] = index[m, 0] + 25  # not a multiple of 24
    patch(shard, 0, index.astype("<u8").tobytes())


def damage_offset_past_eof(shard: Path) -> None:
    offset, arr = first_minishard(shard)
    arr[2, -1] = 10**9  # last chunk's size runs off the end of the file
    patch(shard, offset, arr.astype("<u8").tobytes())


def damage_gzip_payload(shard: Path) -> None:
    offset, arr = first_minishard(shard)
    data_start = (16 << MINISHARD_BITS) + int(arr[1, 0])
    blob = bytearray(shard.read_bytes()[data_start: data_start + int(arr[2, 0])])
    blob[len(blob) // 2] ^= 0x55
    patch(shard, data_start, bytes(blob))


def damage_duplicate_ids(shard: Path) -> None:
    offset, arr = first_minishard(shard)
    if arr.shape[1] > 1:
        arr[0, 1] = 0  # second entry repeats the first id, pointing at other bytes
    patch(shard, offset, arr.astype("<u8").tobytes())


DAMAGES = [damage_truncate, damage_empty, damage_delete, damage_index_garbage, damage_minishard_length,
           damage_offset_past_eof, damage_gzip_payload, damage_duplicate_ids]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.removeprefix("damage_"))
def test_damage_never_yields_wrong_bytes(pristine, damage, tmp_path, mount):
    src = tmp_path / "src"
    shutil.copytree(pristine["sharded"], src)
    victim = sorted((src / SCALE_KEY).glob("*.shard"))[0]
    damage(victim)
    m = mount(src)
    reference = pristine["plain"] / SCALE_KEY
    listed = set(os.listdir(m.path / SCALE_KEY))
    assert listed <= set(os.listdir(reference))

    good = failed = absent = 0
    for name in sorted(os.listdir(reference)):
        want = (reference / name).read_bytes()
        try:
            got = (m.path / SCALE_KEY / name).read_bytes()
        except FileNotFoundError:
            absent += 1
            assert name not in listed
            continue
        except OSError as e:
            assert e.errno == errno.EIO, e
            failed += 1
            continue
        assert got == want, f"wrong bytes served for {name}"
        good += 1
    # The other three shards are intact and fully readable.
    assert good >= len(os.listdir(reference)) // 2
    if damage is not damage_duplicate_ids:
        assert failed + absent > 0
    if damage is not damage_delete and damage is not damage_duplicate_ids:
        assert failed > 0, "damage should surface as EIO, not silently vanish"
        assert victim.name in m.log_text()
    # The daemon is alive and serving.
    assert (m.path / "info").read_bytes()
    assert os.path.ismount(m.path)


def test_damage_logged_once(pristine, tmp_path, mount):
    src = tmp_path / "src"
    shutil.copytree(pristine["sharded"], src)
    victim = sorted((src / SCALE_KEY).glob("*.shard"))[0]
    damage_gzip_payload(victim)
    m = mount(src)
    eio_names = []
    for name in sorted(os.listdir(pristine["plain"] / SCALE_KEY)):
        try:
            (m.path / SCALE_KEY / name).read_bytes()
        except OSError:
            eio_names.append(name)
    assert eio_names
    for _ in range(3):
        with pytest.raises(OSError):
            (m.path / SCALE_KEY / eio_names[0]).read_bytes()
    lines = [line for line in m.log_text().splitlines() if "bad gzip" in line]
    assert len(lines) == len(eio_names), lines
