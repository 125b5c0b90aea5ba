"""Damaged Zarr shards and metadata on a real mount: the affected chunks fail
with EIO (or are absent, for a missing shard), the damage is logged with its
path, every other chunk reads exactly, and the daemon keeps serving."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from unshardfs.testing.mounts import run_cli
from unshardfs.testing.trees import unstamped, walk_files
from unshardfs.testing.zarr import BYTES_LE, CRC, ZCase, codec, sharding, write_case, write_group

GZ = codec("gzip", level=1)
SHARD = (16, 16)
INNER = (4, 8)
ENTRIES = (SHARD[0] // INNER[0]) * (SHARD[1] // INNER[1])
WITH_CRC = ZCase((32, 32), "uint16", SHARD, [sharding(INNER, [BYTES_LE, GZ, CRC])], INNER, [BYTES_LE, GZ, CRC],
                 holes=False)
NO_CRC = ZCase((32, 32), "uint16", SHARD, [sharding(INNER, [BYTES_LE], (BYTES_LE,), "start")], INNER, [BYTES_LE],
               holes=False)
INDEX_CRC = 16 * ENTRIES + 4
VICTIM = "c/1/0"  # the damaged shard; holds inner chunks c/4..7/0..1


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("zdamage")
    for name, case in (("crc", WITH_CRC), ("nocrc", NO_CRC)):
        write_case(root, name, case)
    write_group(root / "sharded")
    return root


def fresh(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine / "sharded", tmp_path / "store")
    return tmp_path / "store"


def damage_index_bitflip(store: Path) -> None:
    shard = store / "crc" / VICTIM
    size = shard.stat().st_size
    patch(shard, size - INDEX_CRC + 5, bytes([shard.read_bytes()[size - INDEX_CRC + 5] ^ 0x10]))


def damage_checksum_bytes(store: Path) -> None:
    shard = store / "crc" / VICTIM
    patch(shard, shard.stat().st_size - 4, b"\0\0\0\0")


def damage_truncate(store: Path) -> None:
    shard = store / "crc" / VICTIM
    os.truncate(shard, shard.stat().st_size - 1)


def damage_tiny(store: Path) -> None:
    os.truncate(store / "crc" / VICTIM, 10)


DAMAGES = {"index_bitflip": damage_index_bitflip, "checksum": damage_checksum_bytes,
           "truncate": damage_truncate, "tiny": damage_tiny}


def chunk_names(prefix: str, rows: range, cols: range) -> list[str]:
    return [f"{prefix}/c/{i}/{j}" for i in rows for j in cols]


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_crc_shard_fails_only_its_chunks(pristine, tmp_path, mount, damage):
    store = fresh(pristine, tmp_path)
    DAMAGES[damage](store)
    m = mount(store)
    for rel in chunk_names("crc", range(4, 8), range(0, 2)):
        with pytest.raises(OSError) as e:
            (m.path / rel).read_bytes()
        assert e.value.errno == errno.EIO, rel
    plain = pristine / "plain"
    intact = chunk_names("crc", range(0, 4), range(0, 4)) + chunk_names("crc", range(4, 8), range(2, 4))
    for rel in intact:
        assert unstamped((m.path / rel).read_bytes()) == unstamped((plain / rel).read_bytes()), rel
    # Listing skips the damaged shard and shows the rest.
    listed = {rel for rel in walk_files(m.path / "crc") if rel.startswith("c/")}
    assert listed == {rel.removeprefix("crc/") for rel in intact}
    assert "crc/c/1/0" in m.log_text()
    assert (m.path / "nocrc/zarr.json").exists()  # still serving


def test_offsets_outside_the_shard_fail_their_chunk(pristine, tmp_path, mount):
    """Without a checksum, an index entry pointing past the data area fails that chunk alone."""
    store = fresh(pristine, tmp_path)
    shard = store / "nocrc" / VICTIM
    index = np.frombuffer(shard.read_bytes()[:16 * ENTRIES], "<u8").reshape(-1, 2).copy()
    index[0, 1] = 10**6  # entry 0: inner chunk (4, 0) runs off the end
    index[1, 0] = 0  # entry 1: inner chunk (4, 1) starts inside the index
    patch(shard, 0, index.astype("<u8").tobytes())
    m = mount(store)
    for rel in ("nocrc/c/4/0", "nocrc/c/4/1"):
        with pytest.raises(OSError) as e:
            (m.path / rel).read_bytes()
        assert e.value.errno == errno.EIO
    assert (m.path / "nocrc/c/5/0").read_bytes() == (pristine / "plain/nocrc/c/5/0").read_bytes()
    assert "point outside the shard" in m.log_text()


def test_chunk_crc_mismatch_is_eio_in_the_v2_view(pristine, tmp_path, mount):
    store = fresh(pristine, tmp_path)
    shard = store / "crc" / VICTIM
    size = shard.stat().st_size
    index = np.frombuffer(shard.read_bytes()[size - INDEX_CRC:size - 4], "<u8").reshape(-1, 2)
    offset, nbytes = (int(v) for v in index[0])
    patch(shard, offset + nbytes - 6, b"\xff")  # inside the gzip trailer, before the chunk's crc32c
    m2 = mount(store, "--view", "zarr2")
    with pytest.raises(OSError) as e:
        (m2.path / "crc/4/0").read_bytes()
    assert e.value.errno == errno.EIO
    assert "crc32c checksum mismatch" in m2.log_text()
    want = (pristine / "plain/crc/c/4/1").read_bytes()[:-4]
    assert unstamped((m2.path / "crc/4/1").read_bytes()) == unstamped(want)


def test_bad_child_metadata(pristine, tmp_path, mount):
    """v3 view: an array with unreadable metadata is shown as it is; v2 view: left out. Both logged."""
    store = fresh(pristine, tmp_path)
    (store / "nocrc" / "zarr.json").write_text("{not json")
    m = mount(store)
    assert (m.path / "nocrc/zarr.json").read_text() == "{not json"
    assert (m.path / "nocrc/c/1/0").exists()  # the shard itself, unchanged
    assert "nocrc/zarr.json" in m.log_text()
    m2 = mount(store, "--view", "zarr2")
    assert sorted(os.listdir(m2.path)) == [".zgroup", "crc"]


def test_metadata_is_read_once_per_version(pristine, tmp_path, mount):
    """Every listing resolves each child's zarr.json: a version of it (size, mtime) is read and
    built once -- a damaged one too, not once per request that meets it -- and read again once it
    changes."""
    store = fresh(pristine, tmp_path)
    good = (store / "nocrc" / "zarr.json").read_text()
    (store / "nocrc" / "zarr.json").write_text("{not json")
    m = mount(store, "--view", "zarr2")

    def reads() -> int:
        return m.stats()["source"]["reads"]

    assert sorted(os.listdir(m.path)) == [".zgroup", "crc"]
    before = reads()
    for _ in range(20):
        assert sorted(os.listdir(m.path)) == [".zgroup", "crc"]
    assert reads() == before
    assert m.stats()["caches"]["metadata"]["hits"] >= 40  # both arrays' zarr.json, each listing
    assert m.log_text().count("nocrc/zarr.json") == 1
    (store / "nocrc" / "zarr.json").write_text(good + " ")  # repaired: a new version
    assert sorted(os.listdir(m.path)) == [".zgroup", "crc", "nocrc"]
    assert reads() == before + 1


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "must be a JSON object"),
    ('{"zarr_format": 2, "node_type": "group"}', "zarr_format must be 3"),
    ('{"zarr_format": 3, "node_type": "array", "shape": [4], "data_type": "uint8", "codecs": [{"name": "bytes"}],'
     ' "chunk_grid": {"name": "rectilinear", "configuration": {}}, "fill_value": 0}', "regular"),
])
def test_bad_root_metadata_fails_the_mount(tmp_path, text, message):
    store = tmp_path / "store"
    store.mkdir()
    (store / "zarr.json").write_text(text)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = run_cli("mount", str(store), str(mnt))
    assert result.returncode == 1 and message in result.stderr and not os.path.ismount(mnt)


def test_whole_shard_codecs_are_shown_unchanged(pristine, tmp_path, mount):
    store = fresh(pristine, tmp_path)
    meta_path = store / "nocrc" / "zarr.json"
    text = meta_path.read_text().replace('"index_location": "start"}}]', '"index_location": "start"}}, '
                                         '{"name": "gzip", "configuration": {"level": 1}}]')
    assert text != meta_path.read_text()
    meta_path.write_text(text)
    m = mount(store)
    assert (m.path / "nocrc/zarr.json").read_text() == text
    assert (m.path / "nocrc/c/1/0").read_bytes() == (store / "nocrc/c/1/0").read_bytes()
    assert "encode whole shards" in m.log_text()


def test_check_reports_zarr_damage(pristine, tmp_path):
    store = fresh(pristine, tmp_path)
    result = run_cli("check", "-q", str(store))
    assert result.returncode == 0, result.stdout + result.stderr
    damage_index_bitflip(store)
    result = run_cli("check", "-q", str(store))
    assert result.returncode == 1 and "crc/c/1/0" in result.stdout and "checksum mismatch" in result.stdout
