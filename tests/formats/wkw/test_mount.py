"""WKW datasets written by the `wkw` package, mounted and served as unsharded precomputed.

Two datasets in the two schemas of `datasource-properties.json` (webknossos-libs' older
`wkwResolutions`/`resolution` with a list `scale`, and the newer `mags` with `path` and a
`scale.factor`) cover raw, LZ4 and LZ4HC files; uint8 (three channels, and one), uint16, uint32
and uint64 segmentation; two mags (one anisotropic); bounding boxes off the block grid that end
inside their last file; and files of the box that were never written (absent chunks). The mount
equals TensorStore's unsharded twin file for file; TensorStore and CloudVolume read it (and
`serve`) equal to the numpy arrays; inspect, check and export work on it; over HTTP and S3 it is
the local mount.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.formats.wkw.datasets import MIXED, OLD, SPAN, WkwData, write_dataset
from tests.support.s3 import CREDENTIALS, moto_s3, upload
from tests.support.served import served
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.mounts import force_unmount, run_cli
from unshardfs.testing.trees import assert_same_tree, walk_files

JSON = ("datasource-properties.json",)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, WkwData]:
    root = tmp_path_factory.mktemp("wkw-datasets")
    return {"mixed": write_dataset(root / "mixed", root / "mixed-twin", MIXED, seed=1),
            "old": write_dataset(root / "old", root / "old-twin", OLD, old_schema=True, seed=2)}


def tensorstore_read(url: str, layer: str, scale: int) -> np.ndarray:
    import tensorstore as ts

    store = ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"{url}/{layer}/", "scale_index": scale,
                     "recheck_cached_data": False}, read=True).result()
    return store.read().result()


def assert_readers_see_the_voxels(url: str, data: WkwData) -> int:
    """TensorStore and CloudVolume read every scale of every layer equal to the written voxels."""
    from cloudvolume import CloudVolume

    compared = 0
    for layer, mags in data.layers.items():
        for i, m in enumerate(mags):
            np.testing.assert_array_equal(tensorstore_read(url, layer, i), m.voxels, err_msg=f"{layer} {m.key}")
            cv = CloudVolume(f"{url}/{layer}", mip=i, progress=False, fill_missing=True, cache=False)
            lo, hi = np.array(m.offset), np.array(m.offset) + m.size
            np.testing.assert_array_equal(np.asarray(cv[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]), m.voxels,
                                          err_msg=f"CloudVolume {layer} {m.key}")
            compared += 1
    return compared


def test_old_schema_mount_equals_twin(datasets, mount):
    data = datasets["old"]
    m = mount(data.root)
    assert assert_same_tree(m.path, data.twin, JSON) > 20
    info = json.loads((m.path / "seg32" / "info").read_text())
    assert info["type"] == "segmentation" and info["data_type"] == "uint32" and info["largest_segment_id"] == 1005
    assert json.loads((m.path / "em" / "info").read_text())["type"] == "image"
    assert sorted(os.listdir(m.path)) == ["datasource-properties.json", "em", "seg32", "small"]
    assert sorted(os.listdir(m.path / "em")) == ["1", "2-2-1", "info"]  # header.wkw and z*/ are not shown


@pytest.mark.parametrize("name", ["mixed", "old"])
def test_tensorstore_and_cloudvolume_read_the_mount(datasets, mount, name):
    data = datasets[name]
    m = mount(data.root)
    assert assert_readers_see_the_voxels(f"file://{m.path}", data) == sum(map(len, data.layers.values()))


def test_layout_of_a_multichannel_edge_chunk(datasets, mount):
    """Channel is the slowest axis (WKW interleaves channels per voxel); clipped at the volume's end."""
    data = datasets["mixed"]
    m = mount(data.root)
    color = data.layers["color"][0]  # offset (0, 8, 16), size (45, 27, 20)
    name = "40-45_32-35_32-36"
    want = color.voxels[40:45, 24:27, 16:20].transpose(3, 2, 1, 0).tobytes()
    path = m.path / "color" / "1" / name
    assert path.stat().st_size == 5 * 3 * 4 * 3 and path.read_bytes() == want
    xattrs = {k: os.getxattr(path, k) for k in os.listxattr(path)}
    assert xattrs["user.unshardfs.encoding"] == b"wkw-block"
    assert xattrs["user.unshardfs.source"] == b"color/1/z2/y2/x2.wkw"


def test_serve_reads_like_the_arrays(datasets):
    data = datasets["mixed"]
    with served(str(data.root)) as url:
        assert assert_readers_see_the_voxels(url, data) == 4


def test_over_http_gs_and_s3_equal_to_local(datasets, mount, monkeypatch):
    data = datasets["old"]
    with DatasetServer(data.root.parent) as server:
        # Plain HTTP cannot list: files are found from the geometry, absent ones answer 404.
        remote = mount(f"{server.url}/old")
        assert assert_same_tree(remote.path, data.twin, JSON) > 20
        assert all(r.range for r in server.requests("GET")), "every GET is a range request"
    with DatasetServer(data.root.parent, gcs_bucket="bkt", page_size=2) as gcs:
        remote = mount("gs://bkt/old", "--gcs-endpoint", gcs.url)
        assert assert_same_tree(remote.path, data.twin, JSON) > 20
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    with moto_s3() as (endpoint, client):
        upload(client, "bkt", data.root, "data/old")
        remote = mount("s3://bkt/data/old", "--s3-endpoint", endpoint)
        assert assert_same_tree(remote.path, data.twin, JSON) > 20


def test_scan_is_read_ahead(datasets, mount):
    """Reading a mag's chunk files in listing order over HTTP: the core's read-ahead fetches the
    blocks that follow (one request for several), the cache then answers."""
    data = datasets["old"]
    with DatasetServer(data.root.parent) as server:
        m = mount(f"{server.url}/old")
        scale = m.path / "em" / "1"
        names = os.listdir(scale)
        server.reset_log()
        for name in names:
            assert (scale / name).read_bytes() == (data.twin / "em" / "1" / name).read_bytes()
        gets = server.requests("GET")
        fetch = json.loads(os.getxattr(m.path, "user.unshardfs.stats"))["fetch"]
        assert fetch["prefetch_hits"] > 0, fetch
        assert len(gets) < len(names) / 2, (len(gets), len(names))


def test_inspect_check_export(datasets, tmp_path):
    data = datasets["mixed"]
    result = run_cli("inspect", "--json", "-q", str(data.root))
    assert result.returncode == 0, result.stderr
    reports = {r["key"]: r for r in json.loads(result.stdout)}
    assert sorted(reports) == ["color/1", "color/2-2-1", "segmentation/1", "segmentation/2"]
    for layer, mags in data.layers.items():
        for m in mags:
            r = reports[f"{layer}/{m.key}"]
            assert r["kind"] == "wkw mag" and r["shards_present"] == len(m.files)
            assert r["chunks"] == len(os.listdir(data.twin / layer / m.key))  # blocks present
    assert reports["color/1"]["compression"] == "raw" and reports["segmentation/1"]["compression"] == "lz4hc"
    assert reports["color/1"]["shards_expected"] == 3 * 3 * 2 and reports["color/1"]["channels"] == 3
    check = run_cli("check", str(data.root))
    assert check.returncode == 0 and "intact" in check.stdout, check.stdout + check.stderr
    parallel = run_cli("check", "--jobs", "3", str(data.root))  # split by file: shard tokens across processes
    assert parallel.returncode == 0
    files = len(walk_files(data.twin))
    assert f"intact: {files:,} files" in check.stdout and f"intact: {files:,} files" in parallel.stdout
    dest = tmp_path / "out"
    exported = run_cli("export", str(data.root), str(dest))
    assert exported.returncode == 0, exported.stderr
    assert assert_same_tree(dest, data.twin, JSON) > 100
    # Damage one LZ4HC block (its bytes zeroed): check names the file, the others stay intact.
    src = tmp_path / "src"
    shutil.copytree(data.root, src)
    victim = src / "segmentation" / "1" / "z0" / "y1" / "x1.wkw"
    raw = bytearray(victim.read_bytes())
    start = int.from_bytes(raw[8:16], "little")
    end = int.from_bytes(raw[16:24], "little")
    raw[start:end] = b"\xff" * (end - start)
    victim.write_bytes(bytes(raw))
    damaged = run_cli("check", str(src))
    assert damaged.returncode == 1 and "z0/y1/x1.wkw" in damaged.stdout, damaged.stdout


def test_block_type_may_differ_per_file(datasets, tmp_path, mount):
    """A raw mag with one file recompressed (LZ4HC, by the wkw package): each file's own header decides."""
    import wkw

    data = datasets["old"]
    root = tmp_path / "old"
    shutil.copytree(data.root, root)
    victim = root / "seg32" / "1" / "z1" / "y1" / "x1.wkw"
    wkw.File.compress(str(victim), str(tmp_path / "x1.wkw"))
    assert (tmp_path / "x1.wkw").read_bytes()[5] == 3  # LZ4HC, in a mag whose header.wkw says raw
    shutil.move(tmp_path / "x1.wkw", victim)
    m = mount(root)
    assert assert_same_tree(m.path, data.twin, JSON) > 20


def test_float64_layer_is_left_out(datasets, tmp_path, mount):
    """Precomputed has no float64: such a layer is not shown (logged why); the others are."""
    import wkw

    data = datasets["old"]
    root = tmp_path / "old"
    shutil.copytree(data.root, root)
    with wkw.Dataset.create(str(root / "f64" / "1"), wkw.Header(np.float64, block_len=8, file_len=2)) as ds:
        ds.write((0, 0, 0), np.ones((1, 16, 16, 16), dtype=np.float64))
    props = json.loads((root / "datasource-properties.json").read_text())
    props["dataLayers"].append({"name": "f64", "category": "color", "dataFormat": "wkw", "elementClass": "double",
                                "boundingBox": {"topLeft": [0, 0, 0], "width": 16, "height": 16, "depth": 16},
                                "wkwResolutions": [{"resolution": 1}]})
    (root / "datasource-properties.json").write_text(json.dumps(props))
    m = mount(root)
    assert not (m.path / "f64" / "info").exists()
    assert (m.path / "em" / "info").exists()
    assert "f64 mag 1-1-1: float64 voxels cannot be shown as precomputed" in m.log_text()


def test_bare_layer_directory(datasets, mount):
    """A layer directory without properties: mags found by their header.wkw, the bounding box
    spans the files present, resolution is the mag."""
    data = datasets["old"]
    m = mount(data.root / "em")
    info = json.loads((m.path / "info").read_text())
    assert [s["key"] for s in info["scales"]] == ["1", "2-2-1"]
    assert info["scales"][0]["voxel_offset"] == [0, 0, 0] and info["scales"][0]["size"] == [2 * SPAN] * 3
    assert info["scales"][1]["resolution"] == [2, 2, 1] and info["data_type"] == "uint16"
    got = tensorstore_read(f"file://{m.path}", "", 0)
    want = data.layers["em"][0].voxels
    np.testing.assert_array_equal(got[:want.shape[0], :want.shape[1], :want.shape[2]], want)
    assert not got[want.shape[0]:].any() and not got[:, want.shape[1]:].any()


def test_mount_errors(datasets, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    bad = tmp_path / "bad"
    shutil.copytree(datasets["old"].root, bad)
    props = json.loads((bad / "datasource-properties.json").read_text())
    props["dataLayers"][0]["boundingBox"]["width"] = "wide"
    (bad / "datasource-properties.json").write_text(json.dumps(props))
    try:
        result = run_cli("mount", str(bad), str(mnt))
        assert result.returncode == 1 and "dataLayers[0].boundingBox.width" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        # A mag directory is a WKW layer by its header.wkw: a garbled one is a one-line error naming
        # it (a directory `1/` without one is no dataset, and shows as a tree of datasets).
        layer = tmp_path / "layer"
        (layer / "1").mkdir(parents=True)
        (layer / "1" / "header.wkw").write_bytes(b"garbage")
        result = run_cli("mount", str(layer), str(mnt))
        assert result.returncode == 1 and "1/header.wkw" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    finally:
        force_unmount(mnt)  # a mount that should have failed and did not
