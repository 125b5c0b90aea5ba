"""`unshardfs refs`: kerchunk references to the unsharded view, read back by readers that know nothing
of unshardfs, and `check --refs` on references a changed shard invalidated."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fsspec.conftest import Datasets
from tests.support.s3 import CREDENTIALS, moto_s3, upload
from tests.fsspec.test_filesystem import mounted_view
from unshardfs.app.cli import main
from unshardfs.testing.http_servers import DatasetServer

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
REFS_PYTHON = ROOT / ".venv-refs" / "bin" / "python"
ZARR2_PYTHON = ROOT / ".venv-zarr2" / "bin" / "python"
READER = ROOT / "tests" / "support" / "refs_read.py"


def refs(source: str | Path, out: Path, *options: str) -> int:
    return main(["refs", "-q", str(source), "-o", str(out), *options])


def foreign(python: Path, refs_path: Path, out: Path, mode: str, names: list[str],
            options: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """The arrays `names` read through the references by `python`, a venv without unshardfs."""
    if not python.exists():
        pytest.skip(f"{python.parent.parent.name} missing (scripts/setup makes it)")
    argv = [str(python), str(READER), str(refs_path), str(out), mode, *names]
    if options:
        argv += ["--options", json.dumps(options)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd="/",
                            env={**os.environ, **(env or {}), "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(out) as loaded:
        return {k: loaded[k] for k in loaded.files}


def resolved(value: Any) -> bytes:
    """What fsspec's reference filesystem reads for one reference of a local dataset."""
    if isinstance(value, str):
        return base64.b64decode(value[7:]) if value.startswith("base64:") else value.encode()
    url, offset, length = value
    assert url.startswith("file://")
    with open(url[len("file://"):], "rb") as f:
        f.seek(offset)
        return f.read(length)


@pytest.mark.parametrize("view", ["zarr3", "zarr2"])
def test_every_file_is_a_range_of_its_shard(datasets: Datasets, tmp_path: Path, view: str) -> None:
    out = tmp_path / "refs.json"
    assert refs(datasets.hier, out, "--view", view, "--inline-threshold", "0") == 0
    doc = json.loads(out.read_text())
    expected = mounted_view(str(datasets.hier), "--view", view)
    assert doc["version"] == 1 and set(doc["refs"]) == set(expected)
    assert {k: resolved(v) for k, v in doc["refs"].items()} == expected
    chunks = [k for k in expected if "/c" in k or k.split("/")[-1][0].isdigit()]
    # No chunk's bytes copied: every chunk is a reference into a shard of the source.
    assert chunks and all(isinstance(doc["refs"][k], list) for k in chunks)
    assert all(v[0].startswith(f"file://{datasets.hier}/") for v in doc["refs"].values() if isinstance(v, list))
    objects = doc["unshardfs"]["objects"]
    assert {v[0] for v in doc["refs"].values() if isinstance(v, list)} <= set(objects)


def test_inline_threshold_as_kerchunk(datasets: Datasets, tmp_path: Path) -> None:
    out = tmp_path / "refs.json"
    sizes = {k: len(v) for k, v in mounted_view(str(datasets.raw)).items()}
    threshold = sorted(sizes.values())[len(sizes) // 2]
    assert refs(datasets.raw, out, "--inline-threshold", str(threshold)) == 0
    doc = json.loads(out.read_text())["refs"]
    assert {k for k, v in doc.items() if isinstance(v, str)} == {k for k, n in sizes.items() if n < threshold} | {"info"}


@pytest.mark.legacy
@pytest.mark.parametrize("view", ["zarr3", "zarr2"])
def test_zarr3_and_xarray_read_them_without_unshardfs(datasets: Datasets, tmp_path: Path, view: str) -> None:
    out = tmp_path / "refs.json"
    assert refs(datasets.hier, out, "--view", view) == 0
    arrays = foreign(REFS_PYTHON, out, tmp_path / "a.npz", "zarr", ["em", "seg"])
    assert np.array_equal(arrays["em"], datasets.em) and np.array_equal(arrays["seg"], datasets.seg)
    ds = foreign(REFS_PYTHON, out, tmp_path / "x.npz", "xarray", ["em", "seg"])
    assert np.array_equal(ds["em"], datasets.em) and list(ds["em.dims"]) == ["z", "y", "x"]
    assert np.array_equal(ds["seg"], datasets.seg) and list(ds["seg.dims"]) == ["t", "v", "u"]


@pytest.mark.legacy
def test_zarr_python_2_reads_the_zarr2_view_refs(datasets: Datasets, tmp_path: Path) -> None:
    out = tmp_path / "refs.json"
    assert refs(datasets.hier, out, "--view", "zarr2") == 0
    arrays = foreign(ZARR2_PYTHON, out, tmp_path / "a.npz", "zarr", ["em", "seg"])
    assert np.array_equal(arrays["em"], datasets.em) and np.array_equal(arrays["seg"], datasets.seg)


@pytest.mark.legacy
@pytest.mark.parametrize("inline", ["0", "100000"])
def test_parquet_layout_read_by_fsspec_lazy_references(datasets: Datasets, tmp_path: Path, inline: str) -> None:
    out = tmp_path / "refs.parq"
    assert refs(datasets.dotted, out, "--view", "zarr2", "--format", "parquet", "--record-size", "7",
                "--inline-threshold", inline) == 0
    assert len(list((out / "em").glob("refs.*.parq"))) == 7  # 48 chunks, 7 per record
    meta = json.loads((out / ".zmetadata").read_text())
    assert meta["record_size"] == 7 and "em/.zarray" in meta["metadata"]
    arrays = foreign(REFS_PYTHON, out, tmp_path / "a.npz", "zarr", ["em"])
    assert np.array_equal(arrays["em"], datasets.em)


def test_refused_with_one_line_and_nothing_written(datasets: Datasets, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cases = [([str(datasets.gzip)], "1_1_1: its chunks are stored gzip-encoded"),
             ([str(datasets.hier), "--view", "zarr2", "--format", "parquet"], "'.'-separated chunk keys"),
             ([str(datasets.dotted), "--format", "parquet"], "Zarr v2"),
             ([str(datasets.deflated_zip)], "em: its files are stored where no reader can fetch them by URL"),
             ([str(datasets.odd), "--view", "zarr2"], "twisted/zarr.json: transpose order [2, 0, 1] is neither")]
    for args, reason in cases:
        out = tmp_path / "refs"
        assert main(["refs", "-q", *args, "-o", str(out)]) == 1
        # The one line that ends the run (a part of the tree left out of a view is logged before it).
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("unshardfs: ") and reason in last, last
        assert list(tmp_path.iterdir()) == []  # no output, no temporary


@pytest.mark.parametrize("layout", ["json", "parquet"])
def test_check_refs_names_what_a_changed_shard_invalidated(datasets: Datasets, tmp_path: Path, layout: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "ds"
    shutil.copytree(datasets.dotted, copy)
    out = tmp_path / f"refs.{layout}"
    assert refs(copy, out, "--view", "zarr2", "--format", layout, "--record-size", "10") == 0
    capsys.readouterr()
    assert main(["check", "--refs", str(out)]) == 0
    assert "unchanged" in capsys.readouterr().out
    shard = copy / "em" / "c.1.0.0"
    expected = sum(1 for k, v in _refs(out).items() if v == f"file://{shard}")
    shard.write_bytes(shard.read_bytes())  # rewritten in place: same bytes, another version
    (copy / "em" / "c.2.1.1").unlink()
    assert main(["check", "--refs", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    changed = [line for line in lines if str(shard) in line]
    assert len(changed) == 1 and f": {expected:,} references invalidated" in changed[0] and "em/2." in changed[0]
    assert any("c.2.1.1 is gone" in line for line in lines)
    assert "2 of" in lines[-1]


def _refs(out: Path) -> dict[str, str]:
    """Key -> referenced URL, for either layout (the parquet one through fsspec's own reader)."""
    if out.is_dir():
        import pyarrow.parquet as pq

        meta = json.loads((out / ".zmetadata").read_text())
        size = meta["record_size"]
        zarray = meta["metadata"]["em/.zarray"]
        grid = [-(-s // c) for s, c in zip(zarray["shape"], zarray["chunks"])]
        found = {}
        for f in (out / "em").glob("refs.*.parq"):
            record = int(f.name.split(".")[1])
            for row, url in enumerate(pq.read_table(f).column("path").to_pylist()):
                if url:
                    found[".".join(map(str, np.unravel_index(record * size + row, grid)))] = url
        return found
    return {k: v[0] for k, v in json.loads(out.read_text())["refs"].items() if isinstance(v, list)}


def test_a_store_failing_mid_refs_writes_nothing(datasets: Datasets, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with DatasetServer(datasets.hier.parent) as server:
        server.faults.error_every = 7  # a store failing now and then: a listing would skip a shard
        out = tmp_path / "refs.json"
        code = refs(f"{server.url}/sharded", out, "--retries", "0", "--inline-threshold", "0")
        assert code == 1 and not out.exists() and list(tmp_path.iterdir()) == []
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("would leave files out" in err or "HTTP 500" in err), err


@pytest.mark.legacy
def test_remote_references_keep_the_http_url(datasets: Datasets, tmp_path: Path) -> None:
    with DatasetServer(datasets.hier.parent) as server:
        out = tmp_path / "refs.json"
        assert refs(f"{server.url}/sharded", out, "--view", "zarr2") == 0
        urls = {v[0] for v in json.loads(out.read_text())["refs"].values() if isinstance(v, list)}
        assert urls and all(u.startswith(f"{server.url}/sharded/") for u in urls)
        server.reset_log()
        # zarr 3 opens the reference filesystem asynchronous: its remote filesystem must be too.
        arrays = foreign(REFS_PYTHON, out, tmp_path / "a.npz", "zarr", ["em", "seg"],
                         {"remote_options": {"asynchronous": True}})
        assert np.array_equal(arrays["em"], datasets.em) and np.array_equal(arrays["seg"], datasets.seg)
        assert server.requests("GET") and all(r.range for r in server.requests("GET"))  # ranges of shards


@pytest.mark.legacy
def test_remote_references_keep_the_s3_url(datasets: Datasets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    with moto_s3() as (endpoint, client):
        upload(client, "bucket", datasets.hier, "em.zarr")
        out = tmp_path / "refs.json"
        assert refs("s3://bucket/em.zarr", out, "--s3-endpoint", endpoint) == 0
        urls = {v[0] for v in json.loads(out.read_text())["refs"].values() if isinstance(v, list)}
        assert urls and all(u.startswith("s3://bucket/em.zarr/") for u in urls)
        options = {"remote_protocol": "s3", "remote_options": {"endpoint_url": endpoint, "key": "testing",
                                                               "secret": "testing", "asynchronous": True}}
        arrays = foreign(REFS_PYTHON, out, tmp_path / "a.npz", "zarr", ["em", "seg"], options)
        assert np.array_equal(arrays["em"], datasets.em) and np.array_equal(arrays["seg"], datasets.seg)
        capsys.readouterr()
        assert main(["check", "--refs", str(out), "--s3-endpoint", endpoint]) == 0
        shard = sorted(u for u in urls if "/em/c" in u)[0]
        client.put_object(Bucket="bucket", Key=shard[len("s3://bucket/"):], Body=b"replaced")
        assert main(["check", "--refs", str(out), "--s3-endpoint", endpoint]) == 1
        assert f"{shard} changed" in capsys.readouterr().out


def test_zip_members_stored_are_ranges_of_the_archive(datasets: Datasets, tmp_path: Path) -> None:
    out = tmp_path / "refs.json"
    assert refs(datasets.stored_zip, out, "--inline-threshold", "0") == 0
    doc = json.loads(out.read_text())
    assert {v[0] for v in doc["refs"].values() if isinstance(v, list)} == {f"file://{datasets.stored_zip}"}
    assert {k: resolved(v) for k, v in doc["refs"].items()} == mounted_view(str(datasets.stored_zip))
    import zarr

    group = zarr.open_group("reference://", mode="r", storage_options={"fo": str(out)})
    assert np.array_equal(group["em"][...], datasets.em)


def test_a_damaged_index_fails_the_run(datasets: Datasets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "ds"
    shutil.copytree(datasets.dotted, copy)
    shard = copy / "em" / "c.1.0.0"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # in the shard index: its crc32c no longer holds
    shard.write_bytes(bytes(data))
    out = tmp_path / "refs.json"
    assert refs(copy, out) == 1 and not out.exists()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "would leave files out" in last and "c.1.0.0" in last, last


@pytest.mark.legacy
def test_ome_zarr_05_as_04_read_by_zarr_python_2(datasets: Datasets, tmp_path: Path) -> None:
    image = datasets.ome / "image.ome.zarr"
    out = tmp_path / "refs.json"
    assert refs(image, out, "--view", "zarr2") == 0
    attrs = json.loads(json.loads(out.read_text())["refs"][".zattrs"])
    assert attrs["multiscales"][0]["version"] == "0.4"
    names = ["s0", "s2", "labels/cells/s0"]
    arrays = foreign(ZARR2_PYTHON, out, tmp_path / "a.npz", "zarr", names)
    for name in names:
        assert np.array_equal(arrays[name], datasets.ome_arrays[f"image.ome.zarr/{name}"]), name


def test_object_store_urls_are_the_stores_own() -> None:
    import trio

    from unshardfs.sources.objectstore import GcsSource, S3Source

    async def main() -> list[Any]:
        out = []
        for source in (GcsSource("bucket", "pre/fix/"), S3Source("bucket", "", endpoint="http://127.0.0.1:9")):
            out.append(await source.stored_at("a/b c", ("tag", 3)))
            await source.aclose()
        return out

    gcs, s3 = trio.run(main)
    assert (gcs.root, gcs.url, gcs.offset, gcs.version) == ("gs://bucket/pre/fix", "gs://bucket/pre/fix/a/b c", 0,
                                                           ("tag", 3))
    assert (s3.root, s3.path, s3.url) == ("s3://bucket", "a/b c", "s3://bucket/a/b c")


def test_operator_mistakes_are_one_line(datasets: Datasets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "taken").write_text("a file where the parquet directory should go")
    garbled = tmp_path / "garbled.json"
    garbled.write_text('{"version": 1, "refs": {}, "unshardfs": {"objects": {"x": 3}}}')
    runs = [(["refs", str(datasets.dotted), "-o", str(tmp_path / "no" / "such" / "dir.json")], "cannot write"),
            (["refs", str(datasets.dotted), "--view", "zarr2", "--format", "parquet", "-o", str(tmp_path / "taken")],
             "cannot write"),
            (["refs", str(datasets.dotted), "--inline-threshold", "-1", "-o", str(tmp_path / "x.json")], "not negative"),
            (["check", "--refs", str(tmp_path / "missing.json")], "No such file"),
            (["check", "--refs", str(garbled)], "damaged"),
            (["check", "--refs", str(datasets.dotted / "zarr.json")], "no unshardfs record")]
    for argv, reason in runs:
        assert main([argv[0], "-q", *argv[1:]] if argv[0] == "refs" else argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and reason in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbled.json", "taken"]
