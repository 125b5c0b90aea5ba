"""Sharded Neuroglancer annotations shown unsharded: equal to Neuroglancer's unsharded writer, byte for
byte, and read back through the mount by Neuroglancer's own AnnotationReader."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from unshardfs.testing.mounts import run_cli
from unshardfs.testing.precomputed import sharding
from unshardfs.testing.trees import assert_same_tree

pytest.importorskip("neuroglancer")

CASES = [("point", 3, sharding(minishard=1, shard=1, data_enc="gzip", index_enc="gzip")),
         ("line", 2, sharding(hash="identity", minishard=2, shard=1)),
         ("axis_aligned_bounding_box", 4, sharding(preshift=1, minishard=1, shard=2, data_enc="gzip")),
         ("ellipsoid", 3, sharding(minishard=0, shard=0, index_enc="gzip"))]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}d")
def annotations(request, tmp_path_factory):
    from unshardfs.testing.annotations import write_annotation_set

    kind, rank, spec = request.param
    return write_annotation_set(tmp_path_factory.mktemp(kind), kind, rank, spec)


def test_mount_equals_the_unsharded_writer(annotations, mount):
    m = mount(annotations["sharded"])
    assert assert_same_tree(m.path, annotations["plain"]) > 20
    info = json.loads((m.path / "info").read_text())
    assert info == json.loads((annotations["plain"] / "info").read_text())  # every `sharding` removed
    assert len(info["spatial"]) == 2 and max(info["spatial"][1]["grid_shape"]) > 1
    some = next(iter(sorted(os.listdir(m.path / "by_id"))))
    assert os.getxattr(m.path / "by_id" / some, "user.unshardfs.source").endswith(b".shard")


def test_neuroglancer_reads_it_through_the_mount(annotations, mount):
    from neuroglancer.read_precomputed_annotations import AnnotationReader

    m = mount(annotations["sharded"])
    ours, theirs = AnnotationReader(f"file://{m.path}/"), AnnotationReader(f"file://{annotations['plain']}/")
    ids = [int(n) for n in os.listdir(annotations["plain"] / "by_id")]
    assert ids and all(ours.by_id[i] == theirs.by_id[i] for i in ids)
    for rel in ("segment", "partner"):
        segments = [int(n) for n in os.listdir(annotations["plain"] / f"rel_{rel}")]
        assert all(ours.relationships[rel][s] == theirs.relationships[rel][s] for s in segments)
    # Neuroglancer reading the *sharded* original directly agrees too (TensorStore's sharded kvstore).
    direct = AnnotationReader(f"file://{annotations['sharded']}/")
    assert all(direct.by_id[i] == ours.by_id[i] for i in ids[:10])
    rank = len(json.loads((annotations["plain"] / "info").read_text())["dimensions"])
    lower, upper = ours.lower_bound, ours.upper_bound
    assert sorted(a.id for a in ours.get_within_spatial_bounds(lower_bound=lower, upper_bound=upper)) == \
        sorted(a.id for a in theirs.get_within_spatial_bounds(lower_bound=lower, upper_bound=upper))
    assert rank == len(lower)


def test_inspect_lists_every_index(annotations):
    result = run_cli("inspect", "--json", str(annotations["sharded"]))
    assert result.returncode == 0, result.stderr
    kinds = sorted(part["kind"] for part in json.loads(result.stdout))
    assert kinds[0] == "annotation relationship 'partner'" and "annotations by_id" in kinds
    assert sum(k.startswith("annotation spatial level") for k in kinds) == 2
    by_id = next(p for p in json.loads(result.stdout) if p["kind"] == "annotations by_id")
    assert by_id["chunks"] == len(os.listdir(annotations["plain"] / "by_id"))


def test_damaged_shard_fails_only_its_annotations(annotations, tmp_path, mount):
    src = tmp_path / "src"
    shutil.copytree(annotations["sharded"], src)
    victim = sorted((src / "by_id").glob("*.shard"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size * 2 // 3])
    m = mount(src)
    plain = annotations["plain"] / "by_id"
    good = bad = 0
    for name in sorted(os.listdir(plain)):
        try:
            data = (m.path / "by_id" / name).read_bytes()
        except OSError as e:
            assert e.errno in (errno.EIO, errno.ENOENT), name
            bad += 1
            continue
        assert data == (plain / name).read_bytes(), name
        good += 1
    assert bad and (good or len(list((src / "by_id").glob("*.shard"))) == 1)
    assert assert_same_tree(m.path / "spatial1", annotations["plain"] / "spatial1") > 1  # other indexes intact
