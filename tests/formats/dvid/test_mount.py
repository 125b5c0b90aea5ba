"""DVID export-shards output, written by the reference writer in every index
variant, mounted through FUSE as an unsharded precomputed segmentation and
read back by TensorStore and CloudVolume equal to the original labels."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct

import numpy as np
import pytest

from unshardfs.testing.dvid import (
    BLOCK,
    Variant,
    agglomerate,
    encode_block,
    encode_volume,
    info_for,
    sample_volume,
    write_scale,
    zero_subblock_block,
)
from unshardfs.testing.mounts import run_cli

SIZES = [(200, 130, 70), (100, 65, 35)]  # edge chunks clipped; scale 1 is a single shard
SHARDING = {"@type": "neuroglancer_uint64_sharded_v1", "hash": "identity", "preshift_bits": 3,
            "minishard_bits": 0, "shard_bits": 2, "minishard_index_encoding": "raw", "data_encoding": "raw"}
VARIANTS = {
    "footer-file-voxelkeys": Variant("footer", "file", False, "voxel"),
    "json-stream-zstd-blockkeys": Variant("json", "stream", True, "block"),
    "json-file-blockkeys": Variant("json", "file", False, "block"),
    "csv-stream-zstd": Variant("csv", "stream", True),
    "csv-stream-batches": Variant("csv", "stream", False, batch_size=3),
}


@pytest.fixture(scope="module")
def volumes():
    vols = [sample_volume(SIZES[0], 1)]
    vols.append(vols[0][::2, ::2, ::2].copy())
    return vols, [encode_volume(v) for v in vols]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def export(request, volumes, tmp_path_factory):
    vols, blocks = volumes
    root = tmp_path_factory.mktemp(request.param)
    for i, size in enumerate(SIZES):
        grid = tuple(-(-s // BLOCK) for s in size)
        write_scale(root / "export" / f"s{i}", blocks[i], grid, SHARDING, VARIANTS[request.param])
    spec = root / "spec.json"
    spec.write_text(json.dumps(info_for(SIZES, SHARDING)))
    return root / "export", spec, vols, blocks


def read_tensorstore(path, scale: int) -> np.ndarray:
    import tensorstore as ts

    store = ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"file://{path}", "scale_index": scale},
                    read=True).result()
    return store.read().result()[..., 0]


def test_mount_reads_back_as_precomputed(export, mount):
    path, spec, vols, blocks = export
    m = mount(path, "--info", str(spec))
    info = json.loads((m.path / "info").read_text())
    assert all("sharding" not in s and s["encoding"] == "raw" for s in info["scales"])
    assert "compressed_segmentation_block_size" not in info["scales"][0] and info["data_type"] == "uint64"
    assert sorted(os.listdir(m.path)) == ["16.0x16.0x16.0", "8.0x8.0x8.0", "info"]
    for i, vol in enumerate(vols):
        np.testing.assert_array_equal(read_tensorstore(m.path, i), agglomerate(vol), err_msg=f"scale {i}")
        names = os.listdir(m.path / info["scales"][i]["key"])
        assert len(names) == len(blocks[i])  # all-zero blocks are absent, as DVID skipped them
    # A clipped edge chunk: raw little-endian uint64, x fastest.
    edge = m.path / "8.0x8.0x8.0" / "192-200_128-130_64-70"
    want = agglomerate(vols[0][192:200, 128:130, 64:70]).transpose(2, 1, 0).astype("<u8").tobytes()
    assert edge.stat().st_size == 8 * 8 * 2 * 6 and edge.read_bytes() == want
    assert not (m.path / "8.0x8.0x8.0" / "128-192_64-128_0-64").exists()  # a skipped all-zero block


def test_supervoxels_view(export, mount):
    path, spec, vols, _ = export
    m = mount(path, "--info", str(spec), "--supervoxels")
    np.testing.assert_array_equal(read_tensorstore(m.path, 0), vols[0])


def test_cloudvolume_reads_the_mount(volumes, tmp_path, mount):
    """CloudVolume, with the info placed in the export instead of --info."""
    from cloudvolume import CloudVolume

    vols, blocks = volumes
    root = tmp_path / "export"
    for i, size in enumerate(SIZES):
        write_scale(root / f"s{i}", blocks[i], tuple(-(-s // BLOCK) for s in size), SHARDING,
                    VARIANTS["csv-stream-zstd"])
    (root / "info").write_text(json.dumps(info_for(SIZES, SHARDING)))
    m = mount(root)
    cv = CloudVolume(f"file://{m.path}", mip=0, progress=False, fill_missing=True)
    np.testing.assert_array_equal(np.asarray(cv[:, :, :])[..., 0], agglomerate(vols[0]))


def test_zero_subblock_block(tmp_path, mount):
    """A block with an empty (count 0) sub-block: those voxels read as 0."""
    root = tmp_path / "export"
    data = zero_subblock_block(5, 9)
    blocks = {(0, 0, 0): (data, np.array([5, 9], dtype=np.uint64))}
    write_scale(root / "s0", blocks, (1, 1, 1), SHARDING, VARIANTS["footer-file-voxelkeys"])
    (root / "info").write_text(json.dumps(info_for([(64, 64, 64)], SHARDING)))
    m = mount(root, "--supervoxels")
    got = np.frombuffer((m.path / "8.0x8.0x8.0" / "0-64_0-64_0-64").read_bytes(), "<u8").reshape(64, 64, 64)
    assert (got[:8, :8, :8] == 0).all() and got[8, 8, 8] == 5 and got[0, 0, 1] == 0


# -- damage ------------------------------------------------------------------


def _copy(export, tmp_path):
    path, spec, vols, blocks = export
    shutil.copytree(path, tmp_path / "export")
    return tmp_path / "export", spec, vols


def _first_shard(root):
    return sorted((root / "s0").glob("*.arrow"))[0]


def _assert_eio(path):
    with pytest.raises(OSError) as e:
        path.read_bytes()
    assert e.value.errno == errno.EIO, path


@pytest.mark.parametrize("variant", ["footer-file-voxelkeys", "csv-stream-zstd"])
def test_damaged_blocks_fail_alone(variant, volumes, tmp_path, mount):
    vols, blocks = volumes
    root = tmp_path / "export"
    write_scale(root / "s0", blocks[0], (4, 3, 2), SHARDING, VARIANTS[variant])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(info_for(SIZES[:1], SHARDING)))
    shard = root / "s0" / "0_0_0.arrow"
    data = bytearray(shard.read_bytes())
    # Damage the last record's block: inside the zstd frame, or (plain blocks carry no checksum, so
    # changed label values could not be told from real ones) its label count, which breaks its layout.
    if variant == "csv-stream-zstd":
        target = data.rfind(b"\x28\xb5\x2f\xfd")
        data[target + 20: target + 60] = bytes(40)
    else:
        target = data.rfind(b"\x08\x00\x00\x00\x08\x00\x00\x00\x08\x00\x00\x00")
        data[target + 12: target + 16] = (7777).to_bytes(4, "little")
    assert target > 0
    shard.write_bytes(bytes(data))
    m = mount(root, "--info", str(spec))
    scale = m.path / "8.0x8.0x8.0"
    failed = []
    for name in os.listdir(scale):
        try:
            got = np.frombuffer((scale / name).read_bytes(), "<u8")
        except OSError as e:
            assert e.errno == errno.EIO
            failed.append(name)
            continue
        (x0, x1), (y0, y1), (z0, z1) = (tuple(map(int, p.split("-"))) for p in name.split("_"))
        want = agglomerate(vols[0][x0:x1, y0:y1, z0:z1]).transpose(2, 1, 0).ravel()
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert len(failed) == 1, failed
    assert "0_0_0.arrow" in m.log_text()


def test_damaged_shard_files(export, tmp_path, mount):
    root, spec, vols = _copy(export, tmp_path)
    shards = sorted((root / "s0").glob("*.arrow"))
    os.truncate(shards[0], shards[0].stat().st_size // 2)  # truncated
    shards[1].write_bytes(b"garbage" * 10)  # not Arrow at all
    for sidecar in shards[2].parent.glob(shards[2].stem + ".*"):
        if sidecar.suffix != ".arrow":
            sidecar.unlink()  # its sidecar index is gone (footer variants: truncate instead)
    if not any(shards[2].parent.glob(shards[2].stem + ".csv")) and not any(
            shards[2].parent.glob(shards[2].stem + ".json")):
        os.truncate(shards[2], shards[2].stat().st_size - 3)
    m = mount(root, "--info", str(spec))
    scale = m.path / "8.0x8.0x8.0"
    listed = os.listdir(scale)
    assert 0 < len(listed) < len(export[3][0]), "only the intact shard is listed"
    # The solid block 7 at the origin lives in the truncated shard 0, in its first record batch.
    # Where the index gives each record's place without the file's end (a CSV sidecar's byte ranges,
    # a JSON sidecar over a stream walked from its start), only the records past the cut fail, each
    # with EIO; a footer or an Arrow file's own footer is cut off with it, and the whole shard fails.
    origin = scale / "0-64_0-64_0-64"
    if not any(shards[0].with_suffix(ext).exists() for ext in (".csv", ".json")) or \
            shards[0].read_bytes()[:6] == b"ARROW1":
        _assert_eio(origin)
    else:
        try:
            got = origin.read_bytes()
        except OSError as e:
            assert e.errno == errno.EIO
        else:
            assert got == agglomerate(vols[0][:64, :64, :64]).transpose(2, 1, 0).tobytes()
    for name in listed:
        got = np.frombuffer((scale / name).read_bytes(), "<u8")
        (x0, x1), (y0, y1), (z0, z1) = (tuple(map(int, p.split("-"))) for p in name.split("_"))
        np.testing.assert_array_equal(got, agglomerate(vols[0][x0:x1, y0:y1, z0:z1]).transpose(2, 1, 0).ravel())
    assert (m.path / "info").exists()


def test_cli_errors(tmp_path, volumes):
    _, blocks = volumes
    root = tmp_path / "export"
    write_scale(root / "s0", blocks[0], (4, 3, 2), SHARDING, VARIANTS["csv-stream-zstd"])
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = run_cli("mount", str(root), str(mnt))
    assert result.returncode == 1 and "--info SPEC.json" in result.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"scales": [{"key": "s", "size": [1, 1, 1], "chunk_sizes": [[64, 64, 64]]}]}))
    result = run_cli("mount", "--info", str(bad), str(root), str(mnt))
    assert result.returncode == 1 and "no sharding spec" in result.stderr


def test_block_codec_roundtrip_and_damage():
    from unshardfs.formats.dvid.block import decode_block

    rng = np.random.default_rng(3)
    for block in [np.full((64, 64, 64), 2**63 + 5, np.uint64), rng.integers(0, 3, (64, 64, 64)).astype(np.uint64),
                  rng.integers(0, 2**64 - 1, (16, 8, 24), dtype=np.uint64),
                  np.kron(rng.integers(0, 9, (8, 8, 8)), np.ones((8, 8, 8), np.int64)).astype(np.uint64)]:
        data = encode_block(block)
        np.testing.assert_array_equal(decode_block(data), block)
        for cut in (len(data) - 1, 20, 15):
            if cut < len(data):
                with pytest.raises(ValueError):
                    decode_block(data[:cut])
    many = encode_block(rng.integers(0, 3, (64, 64, 64)).astype(np.uint64))
    with pytest.raises(ValueError):
        decode_block(many + b"\0")
    relabeled = decode_block(encode_block(np.array([[[1, 2] * 4] * 8] * 8, np.uint64)), relabel=lambda ids: ids * 10)
    assert set(np.unique(relabeled).tolist()) == {10, 20}


def _set_footer_record(shard, cell_key: str, number: int) -> None:
    """Point one key of a CHUNKIDX JSON footer at record `number` (a new key if not there)."""
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[-16:-8])
    body, mapping = data[:-16 - length], json.loads(data[-16 - length:-16])
    mapping[cell_key] = number
    text = json.dumps(mapping).encode()
    shard.write_bytes(body + text + struct.pack("<Q", len(text)) + b"CHUNKIDX")


def _set_csv_offset(csv_path, cell: tuple[int, int, int], offset: int) -> None:
    lines = csv_path.read_text().splitlines()
    prefix = ",".join(map(str, cell)) + ","
    (i,) = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    x, y, z, _, size, batch = lines[i].split(",")
    lines[i] = ",".join([x, y, z, str(offset), size, batch])
    csv_path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("damage", ["record-missing", "past-the-end"])
def test_bad_index_entry_fails_its_chunk_alone(damage, volumes, tmp_path, mount):
    """A chunk index entry naming a record the file does not have, or a byte range past the end of
    the file, is EIO for that chunk (never absent), logged; every other chunk of the shard is exact."""
    vols, blocks = volumes
    root = tmp_path / "export"
    variant = "footer-file-voxelkeys" if damage == "record-missing" else "csv-stream-zstd"
    write_scale(root / "s0", blocks[0], (4, 3, 2), SHARDING, VARIANTS[variant])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(info_for(SIZES[:1], SHARDING)))
    shard = root / "s0" / "0_0_0.arrow"
    cell = (0, 0, 0)  # the solid block at the origin, in shard 0_0_0
    assert cell in blocks[0]
    if damage == "record-missing":
        assert "0_0_0" in json.loads(shard.read_bytes()[-16 - struct.unpack("<Q", shard.read_bytes()[-16:-8])[0]:-16])
        _set_footer_record(shard, "0_0_0", 999)
    else:
        _set_csv_offset(shard.with_suffix(".csv"), cell, shard.stat().st_size + 100)
    m = mount(root, "--info", str(spec))
    scale = m.path / "8.0x8.0x8.0"
    bad = scale / "0-64_0-64_0-64"
    _assert_eio(bad)
    listed = os.listdir(scale)
    assert bad.name not in listed and len(listed) == len(blocks[0]) - 1
    for name in listed:
        got = np.frombuffer((scale / name).read_bytes(), "<u8")
        (x0, x1), (y0, y1), (z0, z1) = (tuple(map(int, p.split("-"))) for p in name.split("_"))
        np.testing.assert_array_equal(got, agglomerate(vols[0][x0:x1, y0:y1, z0:z1]).transpose(2, 1, 0).ravel(),
                                      err_msg=name)
    _assert_eio(bad)  # again, from the cached index
    log = m.log_text()
    assert "0_0_0.arrow" in log and ("names record 999" if damage == "record-missing" else "outside the Arrow") in log
    assert os.path.ismount(m.path)


def test_json_chunk_index_honours_the_metadata_bounds(volumes, tmp_path, mount):
    """A JSON chunk index is a metadata document: beyond --max-metadata-values its shard's chunks
    fail with EIO, the cap named in the log (it was parsed under the defaults whatever the mount
    said)."""
    vols, blocks = volumes
    root = tmp_path / "export"
    write_scale(root / "s0", blocks[0], (4, 3, 2), SHARDING, VARIANTS["footer-file-voxelkeys"])
    shard = root / "s0" / "0_0_0.arrow"
    for i in range(100):  # keys of cells outside the grid: dropped once parsed, counted while parsing
        _set_footer_record(shard, f"{6400 + 64 * i}_0_0", 0)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(info_for(SIZES[:1], SHARDING)))  # 38 values
    m = mount(root, "--info", str(spec), "--max-metadata-values", "60")
    _assert_eio(m.path / "8.0x8.0x8.0" / "0-64_0-64_0-64")
    assert "--max-metadata-values" in m.log_text() and os.path.ismount(m.path)
