"""Sharded skeletons and multi-resolution meshes assembled by CloudVolume,
mounted and compared with the unsharded layout, then read back by CloudVolume."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import assert_same_tree
from datasets import sharding, write_objects

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
