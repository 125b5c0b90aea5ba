"""OME-Zarr 0.5 (sharded Zarr v3) shown as OME-Zarr 0.4 (Zarr v2) by --view zarr2.

Written by two independent writers (ome-zarr-py with sharding, ngff-zarr with
chunks_per_shard), read back through the mount by ome-zarr-py 0.11 on
zarr-python 2 in its own venv (a 0.4-era reader), validated as 0.4 by
ome-zarr-models.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ome_zarr")
pytest.importorskip("ngff_zarr")

REPO = Path(__file__).resolve().parents[3]
OME04 = REPO / ".venv-ome04" / "bin" / "python"
READER = REPO / "tests" / "support" / "ome04_read.py"


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    from unshardfs.testing.ome import write_ngff_zarr, write_ome_zarr_py

    root = tmp_path_factory.mktemp("ome")
    return root, {**write_ome_zarr_py(root), **write_ngff_zarr(root)}


def zattrs(path: Path) -> dict:
    return json.loads((path / ".zattrs").read_text())


def test_metadata_is_ome_04(stores, mount):
    root, _ = stores
    image = mount(root / "image.ome.zarr", "--view", "zarr2").path
    attrs = zattrs(image)
    assert "ome" not in attrs and attrs["multiscales"][0]["version"] == "0.4"
    assert [d["path"] for d in attrs["multiscales"][0]["datasets"]] == ["s0", "s1", "s2"]
    assert not (image / "zarr.json").exists() and "zarr.json" not in os.listdir(image)
    assert json.loads((image / ".zgroup").read_text()) == {"zarr_format": 2}
    level = json.loads((image / "s0" / ".zarray").read_text())
    assert level["dimension_separator"] == "/" and level["zarr_format"] == 2
    assert zattrs(image / "s0")["_ARRAY_DIMENSIONS"] == ["c", "z", "y", "x"]
    assert zattrs(image / "labels")["labels"] == ["cells"]
    label = zattrs(image / "labels" / "cells")
    assert label["image-label"]["version"] == "0.4" and label["multiscales"][0]["version"] == "0.4"
    plate = mount(root / "plate.ome.zarr", "--view", "zarr2").path
    assert zattrs(plate)["plate"]["version"] == "0.4"
    assert zattrs(plate / "A" / "1")["well"]["version"] == "0.4"


def test_validated_as_04_by_ome_zarr_models(stores, mount):
    models = pytest.importorskip("ome_zarr_models.v04")
    import zarr

    root, _ = stores
    for store, model in (("image.ome.zarr", models.Image), ("ngff.ome.zarr", models.Image),
                         ("plate.ome.zarr", models.HCS)):
        path = mount(root / store, "--view", "zarr2").path
        model.from_zarr(zarr.open_group(str(path), mode="r", zarr_format=2))
    image = mount(root / "image.ome.zarr", "--view", "zarr2").path
    models.ImageLabel.from_zarr(zarr.open_group(str(image / "labels" / "cells"), mode="r", zarr_format=2))


@pytest.mark.skipif(not OME04.exists(), reason="needs .venv-ome04 (scripts/setup makes it)")
@pytest.mark.legacy
def test_ome_zarr_py_011_reads_every_level(stores, mount, tmp_path):
    root, written = stores
    images = {"image.ome.zarr": ["image.ome.zarr"], "ngff.ome.zarr": ["ngff.ome.zarr"],
              "plate.ome.zarr": ["plate.ome.zarr/A/1/0"]}
    for store, groups in images.items():
        mnt = mount(root / store, "--view", "zarr2").path
        out = tmp_path / store
        out.mkdir()
        rel = [str(Path(store, *Path(g).parts[1:])) for g in groups]
        result = subprocess.run([str(OME04), str(READER), str(mnt.parent), str(out),
                                 *[mnt.name + g[len(store):] for g in rel]],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        found = json.loads(result.stdout.strip().splitlines()[-1])
        for group in groups:
            attrs = zattrs(mnt.parent / (mnt.name + group[len(store):]))
            paths = [d["path"] for d in attrs["multiscales"][0]["datasets"]]
            key = mnt.name + group[len(store):]
            assert found[key]["levels"] == len(paths), found
            for i, p in enumerate(paths):
                got = np.load(out / f"{key.replace('/', '__')}__{i}.npy")
                np.testing.assert_array_equal(got, written[f"{group}/{p}"])
