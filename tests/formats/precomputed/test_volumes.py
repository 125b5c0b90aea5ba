"""Sharded volumes written by TensorStore, mounted through FUSE, compared with
TensorStore's own unsharded write of the same data, and read back through the
mount by TensorStore and CloudVolume as ordinary unsharded datasets."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from unshardfs.testing.precomputed import Scale, read_all, sharding, write_volume
from unshardfs.testing.trees import assert_same_tree

CASES = {
    # name: (scales, data_type, num_channels, volume type)
    "raw-murmur-gzip-preshift-negoffset": (
        [Scale((100, 70, 45), (16, 16, 16), sharding(preshift=1, minishard=2, shard=2, index_enc="gzip",
                                                       data_enc="gzip"), voxel_offset=(-5, 3, -17), fill=0.8)],
        "uint8", 1, "image"),
    "raw-identity-shardbits0-multichannel-multiscale": (
        [Scale((64, 40, 33), (16, 8, 8), sharding(hash="identity", minishard=3, shard=0)),
         Scale((32, 20, 17), (16, 8, 8), sharding(hash="identity", preshift=2, minishard=0, shard=1,
                                                    data_enc="gzip"), resolution=(2, 2, 2)),
         Scale((16, 10, 9), (8, 8, 8), None, resolution=(4, 4, 4))],
        "uint16", 2, "image"),
    "jpeg-identity": (
        [Scale((70, 64, 20), (32, 32, 4), sharding(hash="identity", minishard=1, shard=3, index_enc="gzip"),
               encoding="jpeg", fill=0.6)],
        "uint8", 1, "image"),
    "compressed-segmentation-uint64": (
        [Scale((50, 45, 40), (16, 16, 16), sharding(minishard=1, shard=3, data_enc="gzip"),
               encoding="compressed_segmentation", extra={"compressed_segmentation_block_size": [8, 8, 8]})],
        "uint64", 1, "segmentation"),
    "compressed-segmentation-uint32-preshift": (
        [Scale((40, 40, 24), (8, 8, 8), sharding(preshift=3, minishard=2, shard=4),
               encoding="compressed_segmentation", voxel_offset=(10, -20, 30),
               extra={"compressed_segmentation_block_size": [4, 4, 2]}, fill=0.5)],
        "uint32", 1, "segmentation"),
    "float32-raw": (
        [Scale((33, 17, 9), (11, 17, 3), sharding(minishard=0, shard=0, index_enc="gzip"))],
        "float32", 1, "image"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def volume(request, tmp_path_factory):
    scales, dtype, channels, vtype = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    paths = write_volume(root, scales, dtype, channels, vtype)
    return paths, scales


def test_tree_matches_unsharded_write(volume, mount):
    paths, scales = volume
    m = mount(paths["sharded"])
    compared = assert_same_tree(m.path, paths["plain"])
    assert compared > 1 + len(scales)
    info = json.loads((m.path / "info").read_bytes())
    assert all("sharding" not in s for s in info["scales"])
    # No shard file leaks into the view.
    assert not [p for p in m.path.rglob("*") if p.suffix in (".shard",)]


def test_readers_see_same_volume_through_mount(volume, mount):
    paths, scales = volume
    m = mount(paths["sharded"])
    for i in range(len(scales)):
        expected = read_all(paths["sharded"], i)
        np.testing.assert_array_equal(read_all(m.path, i), expected)

    from cloudvolume import CloudVolume

    for i in range(len(scales)):
        through_mount = CloudVolume(f"file://{m.path}", mip=i, fill_missing=True, progress=False)
        assert "sharding" not in through_mount.scale
        direct = CloudVolume(f"file://{paths['sharded']}", mip=i, fill_missing=True, progress=False)
        np.testing.assert_array_equal(through_mount[:, :, :], direct[:, :, :])


def test_cp_r_equals_reference(volume, mount, tmp_path):
    paths, _ = volume
    m = mount(paths["sharded"])
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(m.path), str(copy)], check=True, timeout=120)
    result = subprocess.run(["diff", "-r", "-x", "info", str(copy), str(paths["plain"])],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[:2000]


def test_stat_sizes_and_mtimes(volume, mount):
    paths, scales = volume
    m = mount(paths["sharded"])
    key = json.loads((paths["sharded"] / "info").read_bytes())["scales"][0]["key"]
    shard_mtimes = {p.stat().st_mtime_ns for p in (paths["sharded"] / key).iterdir()}
    for entry in os.scandir(m.path / key):
        st = entry.stat()
        assert st.st_size == (paths["plain"] / key / entry.name).stat().st_size
        assert st.st_mtime_ns in shard_mtimes
        assert st.st_mode & 0o777 == 0o444


def test_absent_and_malformed_names(volume, mount):
    paths, scales = volume
    m = mount(paths["sharded"])
    info = json.loads((paths["sharded"] / "info").read_bytes())
    scale = info["scales"][0]
    key = scale["key"]
    present = sorted(os.listdir(paths["plain"] / key))
    name = present[0]
    candidates = [
        "0-1_0-1_0-1",                      # misaligned / wrong end
        name + "x",
        "+" + name,
        name.replace("_", "__", 1),
        "99999999-100000000_0-1_0-1",       # outside the grid
        "0.shard", "info.bak",
    ]
    for bad in candidates:
        if bad in present:
            continue
        assert not (m.path / key / bad).exists(), bad
    # Every chunk an unsharded writer did not write is absent from the mount too.
    size, chunk, offset = scale["size"], scale["chunk_sizes"][0], scale.get("voxel_offset", [0, 0, 0])
    all_names = set()
    for gx in range(-(-size[0] // chunk[0])):
        for gy in range(-(-size[1] // chunk[1])):
            for gz in range(-(-size[2] // chunk[2])):
                parts = []
                for d, g in enumerate((gx, gy, gz)):
                    b = g * chunk[d]
                    e = min(b + chunk[d], size[d])
                    parts.append(f"{b + offset[d]}-{e + offset[d]}")
                all_names.add("_".join(parts))
    for n in sorted(all_names - set(present))[:50]:
        assert not (m.path / key / n).exists(), n
    for n in present[:50]:
        assert (m.path / key / n).is_file(), n
