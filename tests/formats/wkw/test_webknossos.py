"""A WKW dataset written by webknossos-libs (the `webknossos` package, in .venv-webknossos: it pins
versions the project's venv must not take): mounted, every mag reads through TensorStore equal to
what webknossos itself reads back, inside the bounding box; outside it (the view's grid starts on a
block boundary) the voxels are webknossos' fill, 0."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.formats.wkw.test_mount import tensorstore_read

REPO = Path(__file__).resolve().parents[3]
PYTHON = REPO / ".venv-webknossos" / "bin" / "python"
pytestmark = [pytest.mark.legacy,
              pytest.mark.skipif(not PYTHON.exists(), reason="needs .venv-webknossos (scripts/setup makes it)")]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("webknossos")
    result = subprocess.run([str(PYTHON), str(Path(__file__).with_name("webknossos_writer.py")), str(root / "ds"),
                             str(root / "arrays.npz")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "ds", dict(np.load(root / "arrays.npz"))


def test_webknossos_dataset_reads_back(written, mount):
    root, arrays = written
    m = mount(root)
    checked = 0
    for layer in ("color", "segmentation"):
        info = json.loads((m.path / layer / "info").read_text())
        for i, scale in enumerate(info["scales"]):
            want = arrays[f"{layer}/{scale['key']}"]
            lo = arrays[f"{layer}/{scale['key']}:topleft"] - np.array(scale["voxel_offset"])
            got = tensorstore_read(f"file://{m.path}", layer, i)
            inside = tuple(slice(a, a + n) for a, n in zip(lo, want.shape[:3]))
            np.testing.assert_array_equal(got[inside], want, err_msg=f"{layer} {scale['key']}")
            outside = np.ones(got.shape[:3], dtype=bool)
            outside[inside] = False
            assert not got[outside].any()
            checked += 1
    assert checked == 3  # color 1 and 2-2-1, segmentation 1
    assert info["largest_segment_id"] == 76 and info["type"] == "segmentation"
    color = json.loads((m.path / "color" / "info").read_text())
    assert color["num_channels"] == 3 and color["scales"][1]["resolution"] == [22.4, 22.4, 25.0]
