"""A tree of datasets through every front end: a release directory (a sharded precomputed image, a
sharded Zarr v3 array, a precomputed segmentation two directories down, a README, an empty directory)
mounted, served, checked, exported (in one process and split into planned tasks), inspected, read as
fsspec and as kerchunk references; each equal to the twin release (the unsharded writes in the
datasets' places). And an OCDBT database whose only array lives under a key prefix (`DB|ocdbt:` when
the array is at `img/`), read back by TensorStore through the mount."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.support.served import get_body, served
from unshardfs.testing.mounts import run_cli
from unshardfs.testing.samples import write_samples
from unshardfs.testing.trees import assert_same_tree, exported_files, walk_files


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the release, its twin: what any front end must show for it)."""
    samples = tmp_path_factory.mktemp("samples")
    write_samples(samples)
    base = tmp_path_factory.mktemp("tree")
    root, twin = base / "release", base / "twin"
    for tree, variant in ((root, "sharded"), (twin, "plain")):
        shutil.copytree(samples / "precomputed" / variant, tree / "em")
        shutil.copytree(samples / "zarr" / variant, tree / "cells.zarr")
        shutil.copytree(samples / "precomputed" / variant, tree / "raw" / "deeper" / "seg")
        (tree / "README.txt").write_text("a release of three datasets\n")
        (tree / "empty").mkdir()
    return root, twin


def test_mounted(release, mount):
    root, twin = release
    m = mount(root)
    assert sorted(os.listdir(m.path)) == ["README.txt", "cells.zarr", "em", "empty", "raw"]
    assert assert_same_tree(m.path, twin) > 100
    assert os.listdir(m.path / "empty") == []
    # a chunk's xattrs name its shard inside the dataset; the tree's own files name their path
    chunk = next(p for p in (m.path / "em" / "8_8_40").iterdir())
    assert os.getxattr(chunk, "user.unshardfs.source").decode().startswith("8_8_40/")
    assert os.getxattr(m.path / "README.txt", "user.unshardfs.source") == b"README.txt"


def test_served(release):
    root, twin = release
    with served(str(root)) as url:
        status, body = get_body(url, "/?format=json")
        assert status == 200
        listing = body.decode()
        for name in ("README.txt", "cells.zarr", "em", "raw", "empty"):
            assert name in listing
        compared = 0
        for rel, path in walk_files(twin).items():
            assert get_body(url, "/" + rel) == (200, path.read_bytes()), rel
            compared += 1
        assert compared > 100
        assert get_body(url, "/raw/deeper/nope")[0] == 404
        assert get_body(url, "/%2e%2e/README.txt")[0] in (400, 404)


@pytest.mark.parametrize("split", [[], ["--jobs", "2", "--parts", "5"]], ids=["one-process", "planned-tasks"])
def test_exported_and_checked(release, tmp_path, split):
    root, twin = release
    dest = tmp_path / "out"
    done = run_cli("export", "-q", *split, str(root), str(dest), timeout=300)
    assert done.returncode == 0, done.stderr
    assert assert_same_tree(dest, twin) > 100
    assert sorted(os.listdir(dest)) == [".unshardfs", "README.txt", "cells.zarr", "em", "empty", "raw"]
    if split:
        # the datasets' shards were dealt into tasks by their directories in the tree
        tasks = [json.loads(line) for line in (dest / ".unshardfs" / "tasks.jsonl").read_text().splitlines()]
        dirs = {g["dir"] for t in tasks for g in t.get("groups", [])}
        assert dirs == {"em/8_8_40", "em/16_16_80", "raw/deeper/seg/8_8_40", "raw/deeper/seg/16_16_80",
                        "cells.zarr/em/c"}
    checked = run_cli("check", "-q", *split[:2], str(root), timeout=300)
    assert checked.returncode == 0 and "0 problem(s)" in checked.stdout, checked.stdout + checked.stderr
    verified = run_cli("check", "--manifest", str(dest / ".unshardfs" / "manifest.jsonl"), str(dest), timeout=300)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_damaged_dataset_fails_the_check(release, tmp_path):
    root, _ = release
    copy = tmp_path / "release"
    shutil.copytree(root, copy)
    (copy / "cells.zarr" / "zarr.json").write_text("[1, 2")
    checked = run_cli("check", "-q", str(copy), timeout=300)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "cells.zarr/: shown as stored" in checked.stdout + checked.stderr


def test_inspected(release):
    root, _ = release
    text = run_cli("inspect", "-q", str(root))
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0] == f"{root}: a tree of 3 datasets, 5 sharded directories"
    for line in ("cells.zarr/  (dataset: Zarr v3)", "em/  (dataset: Neuroglancer precomputed)",
                 "raw/deeper/seg/  (dataset: Neuroglancer precomputed)", "raw/deeper/seg/8_8_40/  (volume scale, raw)"):
        assert line in text.stdout.splitlines(), line
    shallow = json.loads(run_cli("inspect", "--json", "--depth", "1", str(root)).stdout)
    assert [(r["key"], r["format"]) for r in shallow if r["kind"] == "dataset"] == [("cells.zarr", "zarr"),
                                                                                  ("em", "precomputed")]
    nothing = run_cli("inspect", "-q", str(root / "empty"))
    assert nothing.returncode == 1 and "has neither" in nothing.stderr


def test_read_without_a_mount(release, tmp_path):
    """The fsspec filesystem, and kerchunk references to a tree of datasets whose chunks are stored as
    they are shown (the Zarr arrays: their inner chunks are zstd frames served unchanged)."""
    import fsspec

    root, twin = release
    fs = fsspec.filesystem("unshard", source=str(root))
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("", detail=False)) == ["README.txt", "cells.zarr", "em",
                                                                             "empty", "raw"]
    for rel, path in walk_files(twin).items():
        assert fs.cat(rel) == path.read_bytes(), rel
    # a path inside a dataset of the tree opens the dataset; one of the tree's own files, the tree
    scale = str(root / "em" / "8_8_40")
    chained = fsspec.filesystem("unshard", fo=scale)
    assert sorted(p.rsplit("/", 1)[-1] for p in chained.ls(scale, detail=False)) == sorted(
        os.listdir(twin / "em" / "8_8_40"))
    zarrs = tmp_path / "zarrs"
    shutil.copytree(root / "cells.zarr", zarrs / "a.zarr")
    shutil.copytree(root / "cells.zarr", zarrs / "b" / "b.zarr")
    (zarrs / "README.txt").write_text("two arrays\n")
    refs = tmp_path / "refs.json"
    made = run_cli("refs", str(zarrs), "-o", str(refs), timeout=300)
    assert made.returncode == 0, made.stderr
    by_refs = fsspec.filesystem("reference", fo=str(refs))
    compared = 0
    for name in ("a.zarr", "b/b.zarr"):
        for rel, path in walk_files(twin / "cells.zarr").items():
            assert by_refs.cat(f"{name}/{rel}") == path.read_bytes(), (name, rel)
            compared += 1
    assert compared > 50 and by_refs.cat("README.txt") == b"two arrays\n"


def test_ocdbt_array_under_a_key_prefix(tmp_path, mount):
    """`DB|ocdbt:` when the array is at `img/` (TensorStore wrote nothing at the root): a tree whose
    `img/` is the array, unsharded, as TensorStore reads it; `DB|ocdbt:img/` as before."""
    ts = pytest.importorskip("tensorstore")
    db = tmp_path / "db"
    kv = {"driver": "ocdbt", "base": f"file://{db}/"}
    spec = {"driver": "zarr3", "kvstore": {**kv, "path": "img/"},
            "metadata": {"shape": [32, 48], "data_type": "uint16",
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [16, 48]}},
                         "codecs": [{"name": "sharding_indexed", "configuration": {
                             "chunk_shape": [8, 16], "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                                                {"name": "zstd", "configuration": {"level": 1}}]}}]}}
    data = np.arange(32 * 48, dtype=np.uint16).reshape(32, 48)
    ts.open(spec, create=True).result()[...].write(data).result()
    ts.KvStore.open(kv).result().write("notes.txt", b"beside the array\n").result()
    for source in (f"{db}|ocdbt:", str(db)):
        m = mount(source)
        names = sorted(n for n in os.listdir(m.path) if not n.startswith("@"))
        assert names == ["img", "notes.txt"], names
        assert (m.path / "notes.txt").read_bytes() == b"beside the array\n"
        read = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(m.path / "img")}},
                       read=True).result()
        assert "sharding_indexed" not in json.dumps(read.codec.to_json())
        np.testing.assert_array_equal(read.read().result(), data)
    m = mount(f"{db}|ocdbt:img/")
    assert "zarr.json" in os.listdir(m.path)
    assert len([rel for rel in exported_files(m.path) if not rel.startswith("@")]) == 1 + 4 * 3
