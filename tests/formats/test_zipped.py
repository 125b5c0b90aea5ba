"""Datasets inside zip archives, mounted (and served) through the zip layer.

Archives from independent writers: ngff-zarr's `.ozx` (RFC-9, sharded),
Python's `zipfile` over OME-Zarr directories (sharded image with labels by
ome-zarr-py; unsharded by ngff-zarr), zarr-python 3's ZipStore, and zips of a
TensorStore-written sharded precomputed volume with meshes and skeletons and
of a DVID export. Each mount must equal the mount of the same archive
unzipped (whose equality with the unsharded twin the format suites pin), in
every view; readers (zarr-python 3, TensorStore's zip kvstore on the source,
ome-zarr-py 0.11 on zarr 2.18, Debian's zarr 2.13) read it back.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.s3 import s3_endpoint  # noqa: F401 - a fixture
from tests.support.served import served
from unshardfs.testing.mounts import run_cli
from unshardfs.testing.trees import assert_same_tree, walk_files
from unshardfs.testing.zips import unzip, zip_tree

pytest.importorskip("ngff_zarr")
REPO = Path(__file__).resolve().parents[2]
OME04 = REPO / ".venv-ome04" / "bin" / "python"
READER = REPO / "tests" / "support" / "ome04_read.py"
DEBIAN_PYTHON = Path("/usr/bin/python3")


def _ngff(path: Path, sharded: bool) -> dict[str, np.ndarray]:
    import ngff_zarr

    from unshardfs.testing.ome import _image, arrays

    image = ngff_zarr.to_ngff_image(_image((32, 64, 64), 5), dims=["z", "y", "x"])
    multiscales = ngff_zarr.to_multiscales(image, scale_factors=[2], chunks=16)
    if sharded:
        ngff_zarr.to_ngff_zarr(str(path), multiscales, version="0.5", chunks_per_shard=2)
        return {}
    ngff_zarr.to_ngff_zarr(str(path), multiscales, version="0.5")
    return arrays(path)


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (archive, the archive unzipped)."""
    import zarr
    from zarr.storage import ZipStore

    from unshardfs.testing.ome import write_ome_zarr_py
    from unshardfs.testing.precomputed import Scale, sharding, write_objects, write_volume

    root = tmp_path_factory.mktemp("zipped")
    out: dict[str, tuple[Path, Path]] = {}
    # ngff-zarr writes the .ozx itself (RFC-9: STORED, zarr.json first, the comment).
    _ngff(root / "ngff.ozx", sharded=True)
    # ome-zarr-py: sharded image with a label image, zipped by zipfile the RFC-9 way.
    write_ome_zarr_py(root / "ome")
    zip_tree(root / "ome" / "image.ome.zarr", root / "image.ozx")
    # Unsharded OME-Zarr 0.5 (ngff-zarr to a directory), zipped by zipfile without directory entries.
    _ngff(root / "plain.ome.zarr", sharded=False)
    zip_tree(root / "plain.ome.zarr", root / "plain.ozx", directories=False)
    # zarr-python 3's ZipStore (STORED by default), a sharded array in a group.
    store = ZipStore(root / "store.zarr.zip", mode="w")
    group = zarr.open_group(store, mode="w", zarr_format=3)
    arr = group.create_array("raw", shape=(64, 96), chunks=(8, 16), shards=(32, 48), dtype="uint16")
    arr[...] = np.arange(64 * 96, dtype="uint16").reshape(64, 96)
    store.close()
    # TensorStore-written sharded precomputed volume, meshes and skeletons: three datasets in one zip.
    stage = root / "pc-stage"
    write_volume(root / "pc", [Scale((64, 64, 32), (16, 16, 16), sharding())], data_type="uint64",
                 volume_type="segmentation")
    shutil.copytree(root / "pc" / "sharded", stage / "seg")
    for kind, dirname in (("mesh", "mesh"), ("skeletons", "skel")):
        objects = write_objects(root / f"pc-{kind}", kind, sharding(minishard=1, shard=1))
        shutil.copytree(objects["sharded"], stage / dirname)
    zip_tree(stage, root / "precomputed.zip", comment=b"")
    for name in ("ngff.ozx", "image.ozx", "plain.ozx", "store.zarr.zip", "precomputed.zip"):
        out[name] = (root / name, unzip(root / name, root / f"{name}.d"))
    return out


def _source(archives, name: str) -> tuple[str, Path]:
    """(SOURCE naming the archive, the directory it is the zip of, as a SOURCE's root)."""
    name, _, inside = name.partition("|")
    archive, unzipped = archives[name]
    if inside:
        return f"{archive}|zip:{inside}/|neuroglancer-precomputed:", unzipped / inside
    return str(archive), unzipped


@pytest.mark.parametrize("name", ["ngff.ozx", "image.ozx", "plain.ozx", "store.zarr.zip", "precomputed.zip|seg",
                                  "precomputed.zip|mesh", "precomputed.zip|skel"])
def test_mount_equals_unzipped(archives, mount, name):
    source, unzipped = _source(archives, name)
    got, want = mount(source).path, mount(unzipped).path
    assert assert_same_tree(got, want) > 3
    assert "zarr.json" not in {p.name for p in got.iterdir()} or (got / "zarr.json").read_bytes() == (
        want / "zarr.json").read_bytes()


@pytest.mark.parametrize("name", ["ngff.ozx", "image.ozx", "plain.ozx"])
def test_zarr2_view_equals_unzipped(archives, mount, name):
    source, unzipped = _source(archives, name)
    got = mount(source, "--view", "zarr2").path
    assert assert_same_tree(got, mount(unzipped, "--view", "zarr2").path) > 3
    assert json.loads((got / ".zattrs").read_text())["multiscales"][0]["version"] == "0.4"


def test_pipeline_spellings(archives, mount):
    """Neuroglancer's spellings of the same archive all mount the same tree."""
    archive, unzipped = archives["ngff.ozx"]
    want = walk_files(mount(unzipped).path)
    for source in (f"{archive}|zip:|zarr3:", f"file://{archive}|zip:", f"zarr3://{archive}", f"{archive}|zip:|zarr:"):
        got = mount(source).path
        assert sorted(walk_files(got)) == sorted(want), source


def test_readers_through_the_mount(archives, mount, tmp_path):
    """zarr-python 3 reads the mount as TensorStore's zip kvstore reads the archive itself."""
    import tensorstore as ts
    import zarr

    archive, _ = archives["ngff.ozx"]
    mnt = mount(f"{archive}|zip:|zarr3:").path
    group = zarr.open_group(str(mnt), mode="r")
    levels = [k for k, _ in group.members(max_depth=None) if isinstance(_, zarr.Array)]
    assert levels
    for level in levels:
        spec = {"driver": "zarr3", "kvstore": {"driver": "zip", "base": f"file://{archive}", "path": f"{level}/"}}
        from_zip = ts.open(spec, read=True).result().read().result()
        through = np.asarray(group[level][...])
        np.testing.assert_array_equal(through, from_zip, err_msg=level)
        assert zarr.open_array(str(mnt / level), mode="r").shards is None  # unsharded in the mount
    store, _ = archives["store.zarr.zip"]
    raw = zarr.open_array(str(mount(store).path / "raw"), mode="r")
    np.testing.assert_array_equal(raw[...], np.arange(64 * 96, dtype="uint16").reshape(64, 96))


@pytest.mark.skipif(not OME04.exists(), reason="needs .venv-ome04 (scripts/setup makes it)")
@pytest.mark.legacy
def test_ome_zarr_py_011_reads_the_ozx(archives, mount, tmp_path):
    """An .ozx mounted --view zarr2 is the OME-Zarr 0.4 directory napari-ome-zarr's reader opens."""
    archive, unzipped = archives["image.ozx"]
    mnt = mount(archive, "--view", "zarr2").path
    result = subprocess.run([str(OME04), str(READER), str(mnt.parent), str(tmp_path), mnt.name,
                             f"{mnt.name}/labels/cells"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    import zarr

    source = zarr.open_group(str(unzipped), mode="r")
    for image, prefix in ((mnt.name, ""), (f"{mnt.name}/labels/cells", "labels/cells/")):
        group = source[prefix.rstrip("/")] if prefix else source
        paths = [d["path"] for d in group.attrs["ome"]["multiscales"][0]["datasets"]]
        assert found[image]["levels"] == len(paths) >= 3, found
        for i, path in enumerate(paths):
            got = np.load(tmp_path / f"{image.replace('/', '__')}__{i}.npy")
            np.testing.assert_array_equal(got, group[path][...])


@pytest.mark.skipif(not DEBIAN_PYTHON.exists(), reason="needs the system Python")
@pytest.mark.legacy
def test_debian_zarr_reads_the_ozx(archives, mount, tmp_path):
    """Debian's python3-zarr 2.13 (numcodecs 0.11) reads every level of an .ozx through --view zarr2."""
    from unshardfs.testing.zarr import DEBIAN_ZARR_PYTHON, read_with_zarr2

    probe = subprocess.run([str(DEBIAN_ZARR_PYTHON), "-c", "import zarr"], capture_output=True)
    if probe.returncode:
        pytest.skip("python3-zarr is not installed (scripts/setup installs it)")
    import zarr

    for name in ("ngff.ozx", "image.ozx"):
        archive, unzipped = archives[name]
        mnt = mount(archive, "--view", "zarr2").path
        source = zarr.open_group(str(unzipped), mode="r")
        for path, node in source.members(max_depth=None):
            if isinstance(node, zarr.Array):
                got = read_with_zarr2(mnt / path, tmp_path / "a.npy", python=DEBIAN_ZARR_PYTHON)
                np.testing.assert_array_equal(got, node[...], err_msg=f"{name}/{path}")


@pytest.mark.parametrize("name", ["precomputed.zip|mesh", "plain.ozx"])
def test_served_equals_unzipped(archives, mount, name):
    source, unzipped = _source(archives, name)
    want = mount(unzipped).path
    with served(source) as url, httpx.Client() as client:
        files = walk_files(want)
        assert len(files) > 10
        for rel, path in files.items():
            response = client.get(f"{url}/{rel}")
            assert response.status_code == 200, rel
            if rel.endswith("info"):
                assert json.loads(response.content) == json.loads(path.read_bytes()), rel
            else:
                assert response.content == path.read_bytes(), rel


def test_inspect_check_export(archives, tmp_path):
    archive, unzipped = archives["ngff.ozx"]
    result = run_cli("inspect", str(archive))
    assert result.returncode == 0, result.stderr
    assert "through zip" in result.stdout and "stored" in result.stdout, result.stdout
    assert '"ome": {"version": "0.5"' in result.stdout
    assert run_cli("inspect", "--json", str(archive)).returncode == 0
    check = run_cli("check", "-q", str(archive))
    assert check.returncode == 0, check.stdout + check.stderr
    dest = tmp_path / "exported"
    export = run_cli("export", "-q", str(archive), str(dest))
    assert export.returncode == 0, export.stderr
    reference = tmp_path / "reference"
    assert run_cli("export", "-q", str(unzipped), str(reference)).returncode == 0
    assert assert_same_tree(dest, reference) > 3


@pytest.mark.parametrize("pipeline, part", [("|ocdbt:", "ocdbt:"), ("|zip:|n5:", "n5:"), ("|zip:|zip:", "zip"),
                                            ("|zip:|zarr3:|zip:", "last"), ("|icechunk:|zarr3:", "icechunk:")])
def test_unsupported_pipelines_are_one_line_errors(archives, tmp_path, pipeline, part):
    archive, _ = archives["ngff.ozx"]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = run_cli("mount", f"{archive}{pipeline}", str(mnt))
    errors = [line for line in result.stderr.splitlines() if line.startswith("unshardfs:")]
    assert result.returncode != 0 and len(errors) == 1 and part in errors[0], result.stderr


def test_bad_archives_are_one_line_errors(tmp_path):
    truncated = tmp_path / "cut.ozx"
    blob = (Path(__file__).parent / "__init__.py").read_bytes()
    with zipfile.ZipFile(truncated, "w") as z:
        z.writestr("zarr.json", b"{}" * 1000)
        z.writestr("a", blob)
    data = truncated.read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    for source, words in ((truncated, "not a zip archive"), (tmp_path / "missing.zip", "does not exist")):
        result = run_cli("inspect", str(source))
        errors = [line for line in result.stderr.splitlines() if line.startswith("unshardfs:")]
        assert result.returncode != 0 and len(errors) == 1 and words in errors[0], result.stderr


def test_remote_archives(archives, mount, s3_endpoint):
    """The same .ozx and precomputed zip over plain HTTP (which cannot list: the zip's directory lists anyway),
    the GCS stand-in and S3 (moto): every mount equals the local one, reads are ranged."""
    from unshardfs.testing.http_servers import DatasetServer

    archive, unzipped = archives["ngff.ozx"]
    pc_archive, pc_unzipped = archives["precomputed.zip"]
    want = mount(unzipped).path
    want_pc = mount(pc_unzipped / "mesh").path
    endpoint, client = s3_endpoint
    client.create_bucket(Bucket="bkt")
    for path in (archive, pc_archive):
        client.put_object(Bucket="bkt", Key=f"data/{path.name}", Body=path.read_bytes())
    with DatasetServer(archive.parent) as http, DatasetServer(archive.parent.parent, gcs_bucket="gbkt") as gcs:
        bases = {"http": (f"{http.url}/", ()), "gcs": (f"gs://gbkt/{archive.parent.name}/", ("--gcs-endpoint", gcs.url)),
                 "s3": ("s3://bkt/data/", ("--s3-endpoint", endpoint))}
        for label, (base, options) in bases.items():
            got = mount(f"{base}{archive.name}|zip:|zarr3:", *options)
            assert assert_same_tree(got.path, want) > 3, label
            got = mount(f"{base}{pc_archive.name}|zip:mesh/|neuroglancer-precomputed:", *options)
            assert assert_same_tree(got.path, want_pc, ("info", "mesh/info")) > 3, label
            stats = json.loads(run_cli("stats", str(got.path)).stdout)
            # A member's bytes are ranges of the archive, never the whole archive per file.
            assert stats["zip"]["archive_bytes"] < 3 * pc_archive.stat().st_size, (label, stats["zip"])


def test_dvid_export_in_a_zip(tmp_path, mount):
    """A DVID export zipped (its Arrow files STORED) mounts like the export directory."""
    from tests.formats.dvid.test_mount import SHARDING, VARIANTS
    from unshardfs.testing.dvid import BLOCK, encode_volume, info_for, sample_volume, write_scale

    size = (128, 96, 64)
    write_scale(tmp_path / "export" / "s0", encode_volume(sample_volume(size, 3)),
                tuple(-(-s // BLOCK) for s in size), SHARDING, VARIANTS["csv-stream-zstd"])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(info_for([size], SHARDING)))
    archive = zip_tree(tmp_path / "export", tmp_path / "export.zip", comment=b"")
    got = mount(f"{archive}|zip:", "--info", str(spec)).path
    assert assert_same_tree(got, mount(tmp_path / "export", "--info", str(spec)).path, ("info",)) > 3


def test_zarr2_zipstore(tmp_path, mount):
    """A zarr-python 2 ZipStore (ome-zarr-py #298: napari-ome-zarr cannot open one) mounted with
    `|zip:|zarr2:` is the plain v2 directory zarr 2.18 reads; the same without the pipeline."""
    from unshardfs.testing.zarr import ZARR2_PYTHON, read_with_zarr2

    archive = tmp_path / "v2.zarr.zip"
    script = ("import sys, zarr, numpy as np\n"
              "store = zarr.ZipStore(sys.argv[1], mode='w')\n"
              "g = zarr.group(store=store)\n"
              "g.create_dataset('raw', data=np.arange(60 * 70, dtype='<i4').reshape(60, 70), chunks=(16, 16))\n"
              "store.close()\n")
    result = subprocess.run([str(ZARR2_PYTHON), "-c", script, str(archive)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    want = np.arange(60 * 70, dtype="<i4").reshape(60, 70)
    for source in (f"{archive}|zip:|zarr2:", str(archive)):
        mnt = mount(source).path
        assert (mnt / ".zgroup").exists() and (mnt / "raw" / ".zarray").exists()
        np.testing.assert_array_equal(read_with_zarr2(mnt / "raw", tmp_path / "raw.npy"), want)
