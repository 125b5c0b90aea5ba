"""OCDBT databases written by TensorStore (a Zarr v3 sharded array, a sharded precomputed volume),
mounted: the current version at the root and every version as `@vN/`, each read back through the mount
(unsharded) against TensorStore's own read of that version; `diff -r` between versions; a pinned
version; an HTTP base; `inspect` listing the versions."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.support.ocdbt import ts_keys, ts_versions, ts_zarr, write_precomputed, write_zarr, written
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.mounts import force_unmount, run_cli

ts = pytest.importorskip("tensorstore")


@pytest.fixture(scope="module")
def zarr_db(tmp_path_factory) -> Path:
    return written(tmp_path_factory, "zarr.ocdbt", write_zarr)


@pytest.fixture(scope="module")
def precomputed_db(tmp_path_factory) -> Path:
    return written(tmp_path_factory, "pre.ocdbt", write_precomputed)


def _mounted_zarr(path: Path) -> np.ndarray:
    """The (unsharded) array the mount shows at `path`, read by TensorStore."""
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    array = ts.open(spec, read=True).result()
    assert "sharding_indexed" not in str(array.codec.to_json())
    return array.read().result()


def _check_plain_keys(version_dir: Path, keys: dict[str, bytes]) -> int:
    """Keys that are not part of the array: each a file of the same bytes."""
    checked = 0
    for key, value in keys.items():
        if not key.startswith("arr/"):
            assert (version_dir / key).read_bytes() == value, key
            checked += 1
    return checked


def test_every_version_is_a_directory_matching_tensorstore(zarr_db, mount):
    m = mount(zarr_db)
    versions = ts_versions(zarr_db)
    names = sorted(os.listdir(m.path))
    assert [n for n in names if n.startswith("@")] == sorted(f"@v{n}" for n in versions)
    assert {"arr", "notes", "zarr.json"} <= set(names)
    np.testing.assert_array_equal(_mounted_zarr(m.path / "arr"), ts_zarr(f"file://{zarr_db}/"))
    arrays = 0
    for n in versions:
        keys = ts_keys(f"file://{zarr_db}/", n)
        here = m.path / f"@v{n}"
        if "arr/zarr.json" in keys:
            np.testing.assert_array_equal(_mounted_zarr(here / "arr"), ts_zarr(f"file://{zarr_db}/", n),
                                          err_msg=f"v{n}")
            arrays += 1
        _check_plain_keys(here, keys)
        if not keys:
            assert os.listdir(here) == []
    assert arrays >= 4
    # the newest version's directory is the root's tree
    newest = m.path / f"@v{versions[-1]}"
    assert subprocess.run(["diff", "-r", "-x", "@v*", str(m.path), str(newest)], capture_output=True,
                          timeout=60).returncode == 0
    # two versions differ where a commit wrote
    diff = subprocess.run(["diff", "-rq", str(m.path / f"@v{versions[-6]}"), str(newest)], capture_output=True,
                          text=True, timeout=60)
    assert diff.returncode == 1 and "arr/c/" in diff.stdout and "notes" in diff.stdout


def test_a_pinned_version_shows_no_version_directories(zarr_db, mount):
    versions = ts_versions(zarr_db)
    middle = versions[len(versions) // 2 + 1]
    m = mount(f"{zarr_db}|ocdbt:@v{middle}/|zarr3:")
    assert not [n for n in os.listdir(m.path) if n.startswith("@")]
    np.testing.assert_array_equal(_mounted_zarr(m.path / "arr"), ts_zarr(f"file://{zarr_db}/", middle))


def test_precomputed_versions_match_tensorstore(precomputed_db, mount):
    m = mount(precomputed_db)
    versions = ts_versions(precomputed_db)
    compared = 0
    for n in versions:
        keys = ts_keys(f"file://{precomputed_db}/", n)
        if "info" not in keys:
            continue
        reference = ts.open({"driver": "neuroglancer_precomputed",
                             "kvstore": {"driver": "ocdbt", "base": f"file://{precomputed_db}/", "version": n}},
                            read=True).result().read().result()
        here = m.path / f"@v{n}"
        info = (here / "info").read_text()
        assert "sharding" not in info  # the unsharded view
        shown = ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"file://{here}"},
                        read=True).result().read().result()
        np.testing.assert_array_equal(shown, reference, err_msg=f"v{n}")
        compared += 1
    assert compared >= 3
    np.testing.assert_array_equal(
        ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"file://{m.path}"}, read=True).result()
        .read().result(),
        ts.open({"driver": "neuroglancer_precomputed",
                 "kvstore": {"driver": "ocdbt", "base": f"file://{precomputed_db}/"}}, read=True).result()
        .read().result())


def test_over_http(zarr_db, mount):
    """A plain HTTP server cannot list, the database can: the whole hierarchy and its versions show."""
    with DatasetServer(zarr_db.parent) as srv:
        m = mount(f"{srv.url}/{zarr_db.name}/|ocdbt:|zarr3:")
        np.testing.assert_array_equal(_mounted_zarr(m.path / "arr"), ts_zarr(f"file://{zarr_db}/"))
        versions = ts_versions(zarr_db)
        keys = ts_keys(f"file://{zarr_db}/", versions[-2])
        assert _check_plain_keys(m.path / f"@v{versions[-2]}", keys) >= 3
        assert sorted(os.listdir(m.path / "notes")) == ["blob.bin", "many", "readme.txt"]


def test_inspect_lists_the_versions(zarr_db):
    result = run_cli("inspect", str(zarr_db))
    assert result.returncode == 0, result.stderr
    versions = ts_versions(zarr_db)
    lines = [line for line in result.stdout.splitlines() if line.strip().startswith("@v")]
    assert [line.split()[0] for line in lines] == [f"@v{n}" for n in versions]
    assert lines[-1].endswith("(shown, newest)") and " 0 keys " in lines[0]
    assert "arr/" in result.stdout and "each a directory @NAME" in result.stdout
    pinned = run_cli("inspect", f"{zarr_db}|ocdbt:@v{versions[2]}/")
    assert pinned.returncode == 0, pinned.stderr
    marks = [line.split()[0] for line in pinned.stdout.splitlines() if line.strip().endswith("(shown)")]
    assert marks == [f"@v{versions[2]}"] and f"@v{versions[2]} named: only it is shown" in pinned.stdout


def test_wrong_versions_are_one_line_errors(zarr_db):
    for url, message in ((f"{zarr_db}|ocdbt:@v9999/", "no version v9999"),
                         (f"{zarr_db}|ocdbt:@yesterday/", "OCDBT version 'yesterday'"),
                         (f"{zarr_db}/d|ocdbt:", "no manifest.ocdbt")):
        result = run_cli("inspect", url)
        assert result.returncode != 0 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_export_writes_the_named_version_only(zarr_db, tmp_path):
    versions = ts_versions(zarr_db)
    old = versions[-4]
    for url, dest, version in ((str(zarr_db), tmp_path / "newest", None),
                               (f"{zarr_db}|ocdbt:@v{old}/", tmp_path / "old", old)):
        result = run_cli("export", url, str(dest), "--quiet", timeout=120)
        assert result.returncode == 0, result.stderr
        assert not [p for p in os.listdir(dest) if p.startswith("@")]
        np.testing.assert_array_equal(_mounted_zarr(dest / "arr"), ts_zarr(f"file://{zarr_db}/", version))
        _check_plain_keys(dest, ts_keys(f"file://{zarr_db}/", version))


def test_served_over_http_with_versions(zarr_db):
    """`unshardfs serve`: TensorStore reads the newest array and an older version's from the server."""
    from tests.support.served import served

    versions = ts_versions(zarr_db)
    old = versions[-4]
    with served(str(zarr_db)) as url:
        for path, version in (("arr/", None), (f"@v{old}/arr/", old)):
            spec = {"driver": "zarr3", "kvstore": f"{url}/{path}"}
            np.testing.assert_array_equal(ts.open(spec, read=True).result().read().result(),
                                          ts_zarr(f"file://{zarr_db}/", version), err_msg=path)


def test_a_mountpoint_inside_the_database_is_refused(zarr_db, tmp_path):
    """The mount would read itself: a database names its data files anywhere beneath its directory."""
    db = tmp_path / "db"
    shutil.copytree(zarr_db, db)
    (db / "sub").mkdir()
    try:
        result = run_cli("mount", f"{db}|ocdbt:|zarr3:", str(db / "sub"), "--log-file", str(tmp_path / "log"))
        assert result.returncode != 0 and "lies inside the source" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and not os.path.ismount(db / "sub")
    finally:
        force_unmount(db / "sub")
