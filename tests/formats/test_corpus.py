"""Data other projects commit (tests/data, each set with its README and licence), read through the
mount: each array equal to the values its writer's script documents, and to what zarr-python 3 and
TensorStore read from the stored files; the zarr2 view read by zarr-python 2; what unshardfs leaves
out of a view listed with its reason."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from unshardfs.testing.mounts import run_cli
from unshardfs.testing.trees import assert_same_tree, walk_files
from unshardfs.testing.zarr import ZARR2_PYTHON

CORPUS = Path(__file__).resolve().parents[1] / "data"
ZARRITA = CORPUS / "zarrita.js" / "fixtures" / "v3" / "data.zarr"
ZARRS = CORPUS / "zarrs" / "zarrs" / "tests" / "data" / "sharded_array_write_read.zarr"
ZARR_JAVA = CORPUS / "zarr-java" / "testdata" / "sharding_index_location"
NEUROGLANCER = CORPUS / "neuroglancer" / "testdata" / "datasource" / "zarr" / "ome_zarr"

# What scripts/generate-v3.py writes into each array of zarrita.js's fixture (sharded ones first).
ZARRITA_VALUES: dict[str, object] = {
    "1d.contiguous.compressed.sharded.i2": [1, 2, 3, 4],
    "1d.contiguous.compressed.sharded.i4": [1, 2, 3, 4],
    "1d.contiguous.compressed.sharded.u1": [255, 0, 255, 0],
    "1d.contiguous.compressed.sharded.f4": [-1000.5, 0, 1000.5, 0],
    "1d.contiguous.compressed.sharded.f8": [1.5, 2.5, 3.5, 4.5],
    "1d.contiguous.compressed.sharded.b1": [True, False, True, False],
    "1d.chunked.compressed.sharded.i2": [1, 2, 3, 4],
    "1d.chunked.filled.compressed.sharded.i2": [1, 2, 0, 0],
    "2d.contiguous.compressed.sharded.i2": np.arange(1, 5).reshape(2, 2).tolist(),
    "2d.chunked.compressed.sharded.filled.i2": np.arange(16).reshape(4, 4).tolist(),
    "2d.chunked.compressed.sharded.i2": (np.arange(16).reshape(4, 4) + 1).tolist(),
    "2d.chunked.ragged.compressed.sharded.i2": np.arange(1, 10).reshape(3, 3).tolist(),
    "3d.contiguous.compressed.sharded.i2": np.arange(27).reshape(3, 3, 3).tolist(),
    "3d.chunked.compressed.sharded.i2": np.arange(64).reshape(4, 4, 4).tolist(),
    "3d.chunked.mixed.compressed.sharded.i2": np.arange(27).reshape(3, 3, 3).tolist(),
    "1d.contiguous.raw.i2": [1, 2, 3, 4],
    "1d.chunked.ragged.i2": [1, 2, 3, 4, 5],
    "3d.chunked.mixed.i2.F": np.arange(27).reshape(3, 3, 3).tolist(),
    "1d.contiguous.delta.i4": [1, 2, 3, 4],
    "1d.contiguous.string.vlen": ["hello", "world", "zarr", "v3"],
    "1d.chunked.string.vlen": ["a", "bb", "ccc", "dddd"],
    "2d.chunked.string.vlen": [["hello", "world"], ["foo", "bar"]],
    "1d.string.empty": ["", "test", ""],
    "1d.string.unicode": ["hello", "世界", "🚀🎉", "Ñoño"],
    "1d.contiguous.string.compressed": ["compressed", "string", "test"],
    "consolidated/nested/1d.i2": [10, 20, 30, 40],
}
SHARDED = [name for name in ZARRITA_VALUES if ".sharded." in name]

ZARR2_READ = (
    "import json, sys, zarr\n"
    "assert zarr.__version__.startswith('2.'), zarr.__version__\n"
    "g = zarr.open_group(sys.argv[1], mode='r')\n"
    "print(json.dumps({name: g[name][...].tolist() for name in sys.argv[2:]}))\n"
)


def zarr3_values(root: Path, names: list[str]) -> dict[str, object]:
    import zarr

    return {name: zarr.open_array(str(root / name), mode="r")[...].tolist() for name in names}


def zarr2_values(root: Path, names: list[str]) -> dict[str, object]:
    done = subprocess.run([str(ZARR2_PYTHON), "-c", ZARR2_READ, str(root), *names], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    values: dict[str, object] = json.loads(done.stdout)
    return values


def tensorstore_values(root: Path, names: list[str]) -> dict[str, object]:
    ts = pytest.importorskip("tensorstore")
    return {name: ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / name)}},
                          read=True).result().read().result().tolist() for name in names}


@pytest.mark.filterwarnings("ignore:Numcodecs codecs are not in the Zarr version 3")
def test_zarrita_fixtures_unsharded(mount):
    """zarrita.js's fixture (zarr-python 3): the sharded arrays unsharded through the mount hold the values
    the generating script wrote, as zarr-python 3 and TensorStore read them; the stored files' own reading
    agrees."""
    import zarr

    m = mount(ZARRITA)
    names = list(ZARRITA_VALUES)
    assert zarr3_values(m.path, names) == ZARRITA_VALUES
    assert zarr3_values(ZARRITA, names) == ZARRITA_VALUES
    assert tensorstore_values(m.path, SHARDED) == {name: ZARRITA_VALUES[name] for name in SHARDED}
    for name in SHARDED:
        assert zarr.open_array(str(m.path / name), mode="r").shards is None, name
        assert zarr.open_array(str(ZARRITA / name), mode="r").shards is not None, name
    # what the v3 view shows unchanged (unsharded arrays, groups) is the stored files
    assert (m.path / "my group with spaces" / "zarr.json").read_bytes() == \
        (ZARRITA / "my group with spaces" / "zarr.json").read_bytes()


@pytest.mark.legacy
def test_zarrita_fixtures_through_the_zarr2_view(mount):
    """Every array v2 can express reads back with zarr-python 2, strings and delta included; the one
    it cannot (a transpose that is neither C nor F order, then delta) is left out, and `inspect` says
    why."""
    m = mount(ZARRITA, "--view", "zarr2")
    assert zarr2_values(m.path, list(ZARRITA_VALUES)) == ZARRITA_VALUES
    assert not (m.path / "3d.contiguous.delta.i4.mixed").exists()
    report = run_cli("inspect", "--json", "--view", "zarr2", str(ZARRITA))
    assert report.returncode == 0, report.stderr
    assert [(r["key"], r["reason"]) for r in json.loads(report.stdout) if "reason" in r] == [
        ("3d.contiguous.delta.i4.mixed",
         "3d.contiguous.delta.i4.mixed/zarr.json: transpose order [1, 0, 2] is neither C nor F order")]


def test_zarrs_sharded_array(mount):
    """zarrs' example store has no zarr.json at its root: a tree whose `group/` is the Zarr hierarchy."""
    m = mount(ZARRS)
    assert os.listdir(m.path) == ["group"]
    want = np.arange(64, dtype=np.uint16).reshape(8, 8).tolist()  # the example's `row * 8 + column`
    assert zarr3_values(m.path, ["group/array"]) == zarr3_values(ZARRS, ["group/array"]) == {"group/array": want}
    assert tensorstore_values(m.path, ["group/array"]) == {"group/array": want}
    assert json.loads((m.path / "group" / "zarr.json").read_bytes())["attributes"] == {"foo": "bar"}
    # 4 inner chunks of 4 x 4 per shard of 4 x 8 rows: c/0/0, c/0/1, c/1/0, c/1/1
    assert sorted(rel for rel in walk_files(m.path / "group" / "array") if rel.startswith("c/")) == [
        "c/0/0", "c/0/1", "c/1/0", "c/1/1"]


def test_zarr_java_index_at_start_and_end(mount):
    """The same array with its shard index at the start and at the end: the same unsharded tree, as
    zarr-python 3 and TensorStore read the stored files."""
    m = mount(ZARR_JAVA)
    assert sorted(os.listdir(m.path)) == ["end", "start"]
    stored = zarr3_values(ZARR_JAVA, ["start", "end"])
    assert stored["start"] == stored["end"]
    assert zarr3_values(m.path, ["start", "end"]) == stored
    assert tensorstore_values(m.path, ["start"]) == {"start": stored["start"]}
    assert assert_same_tree(m.path / "start", m.path / "end", json_files=("zarr.json",)) == 1 + 2 * 4 * 2
    start = json.loads((m.path / "start" / "zarr.json").read_bytes())
    assert [c["name"] for c in start["codecs"]] == ["transpose", "bytes", "blosc"]


@pytest.mark.legacy
def test_neuroglancer_ome_zarr_as_directory_ocdbt_and_zip(mount):
    """Neuroglancer's OME-Zarr 0.5 example as a directory, as TensorStore's OCDBT database of the same
    files and as a STORED zip: the same tree; its finest level the generator's values; the zarr2 view
    OME-Zarr 0.4, read by zarr-python 2."""
    directory = mount(NEUROGLANCER / "simple_0.5")
    want = np.arange(100, dtype=np.uint16).reshape(10, 10).tolist()  # the generator's data
    assert zarr3_values(directory.path, ["scale0/image"]) == {"scale0/image": want}
    for other in (NEUROGLANCER / "simple_0.5.ocdbt", NEUROGLANCER / "simple_0.5.zip"):
        m = mount(other)
        names = [n for n in os.listdir(m.path) if not n.startswith("@")]
        assert sorted(names) == sorted(os.listdir(directory.path)), other.name
        assert assert_same_tree(m.path / "scale0", directory.path / "scale0") == 3, other.name
    v2 = mount(NEUROGLANCER / "simple_0.5.ocdbt", "--view", "zarr2")
    attrs = json.loads((v2.path / ".zattrs").read_bytes())
    assert attrs["multiscales"][0]["version"] == "0.4"
    assert [d["path"] for d in attrs["multiscales"][0]["datasets"]] == ["scale0/image", "scale1/image", "scale2/image"]
    assert zarr2_values(v2.path, ["scale0/image"]) == {"scale0/image": want}
