"""Sharded skeletons and multi-resolution meshes assembled by CloudVolume,
mounted and compared with the unsharded layout, then read back by CloudVolume."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from unshardfs.testing.precomputed import sharding, write_objects
from unshardfs.testing.trees import assert_same_tree

SPECS = {
    "murmur-raw": sharding(minishard=2, shard=2),
    "murmur-gzip-preshift": sharding(preshift=2, minishard=3, shard=1, index_enc="gzip", data_enc="gzip"),
    "identity-shardbits0": sharding(hash="identity", minishard=4, shard=0, data_enc="gzip"),
}


@pytest.fixture(scope="module", params=[(k, s) for k in ("skeletons", "mesh") for s in sorted(SPECS)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def objects(request, tmp_path_factory):
    kind, spec_name = request.param
    root = tmp_path_factory.mktemp(f"{kind}-{spec_name}")
    return kind, write_objects(root, kind, SPECS[spec_name], seed=len(spec_name))


def test_tree_matches_unsharded_layout(objects, mount):
    kind, paths = objects
    m = mount(paths["sharded"])
    n = assert_same_tree(m.path, paths["plain"])
    assert n > 20
    assert "sharding" not in json.loads((m.path / kind / "info").read_bytes())
    assert (m.path / "provenance").read_bytes() == (paths["sharded"] / "provenance").read_bytes()


def test_lookup_without_listing(objects, mount):
    kind, paths = objects
    m = mount(paths["sharded"])
    names = sorted(os.listdir(paths["plain"] / kind))
    # Fresh mount, no readdir: computed names resolve straight from the indexes.
    for name in names[:10]:
        assert (m.path / kind / name).read_bytes() == (paths["plain"] / kind / name).read_bytes()
    for absent in ("12345678901", "007", "1.index.index", "18446744073709551616"):
        assert not (m.path / kind / absent).exists()


def test_cloudvolume_reads_through_mount(objects, mount):
    from cloudvolume import CloudVolume

    kind, paths = objects
    m = mount(paths["sharded"])
    mounted = CloudVolume(f"file://{m.path}", progress=False)
    direct = CloudVolume(f"file://{paths['sharded']}", progress=False)
    segids = sorted(int(n) for n in os.listdir(paths["plain"] / kind) if n.isdigit())[:8]
    assert segids
    if kind == "skeletons":
        for segid in segids:
            a, b = mounted.skeleton.get(segid), direct.skeleton.get(segid)
            np.testing.assert_array_equal(a.vertices, b.vertices)
            np.testing.assert_array_equal(a.edges, b.edges)
            np.testing.assert_array_equal(a.radius, b.radius)
    else:
        for segid in segids:
            a, b = mounted.mesh.get(segid)[segid], direct.mesh.get(segid)[segid]
            np.testing.assert_array_equal(a.vertices, b.vertices)
            np.testing.assert_array_equal(a.faces, b.faces)
            assert len(a.vertices) > 0


@pytest.mark.parametrize("damage", ["truncate", "flip-gzip-manifests"])
def test_damaged_object_shards(tmp_path, mount, damage):
    import shutil

    kind = "mesh"
    paths = write_objects(tmp_path / "objs", kind, SPECS["murmur-gzip-preshift"], seed=5, n=30)
    src = tmp_path / "src"
    shutil.copytree(paths["sharded"], src)
    victim = sorted((src / kind).glob("*.shard"))[0]
    blob = bytearray(victim.read_bytes())
    if damage == "truncate":
        blob = blob[: len(blob) * 2 // 3]
    else:
        # gzip magic marks each encoded manifest; damage the byte after each header
        pos = blob.find(b"\x1f\x8b\x08", 16)
        while pos != -1:
            blob[pos + 12] ^= 0xFF
            pos = blob.find(b"\x1f\x8b\x08", pos + 3)
    victim.write_bytes(bytes(blob))
    m = mount(src)
    ok = failed = 0
    for name in sorted(set(os.listdir(paths["plain"] / kind)) - {"info"}):
        want = (paths["plain"] / kind / name).read_bytes()
        try:
            got = (m.path / kind / name).read_bytes()
        except OSError:
            failed += 1
            continue
        assert got == want, name
        ok += 1
    assert failed > 0 and ok > 0
