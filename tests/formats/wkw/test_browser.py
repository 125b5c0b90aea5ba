"""Neuroglancer's own client, in headless Chromium, renders `serve` of a WKW dataset exactly as
the unsharded twin served by a plain static server (the machinery of tests/http/test_browser.py):
the three-channel color layer as RGB (every channel's layout matters) and the uint64 segmentation."""

from __future__ import annotations

import threading
from functools import partial
from http.server import ThreadingHTTPServer

import numpy as np
import pytest

from tests.formats.wkw.datasets import MIXED, write_dataset
from tests.http.test_browser import CHROMIUM, _CorsHandler, screenshot
from tests.support.served import served

neuroglancer = pytest.importorskip("neuroglancer")
pytestmark = [pytest.mark.browser, pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/setup installs it)"),
              pytest.mark.timeout(400)]
RGB = "void main() { emitRGB(vec3(toNormalized(getDataValue(0)), toNormalized(getDataValue(1)), " \
      "toNormalized(getDataValue(2)))); }"
LAYERS = {"color": lambda source: neuroglancer.ImageLayer(source=source, shader=RGB),
          "segmentation": lambda source: neuroglancer.SegmentationLayer(source=source)}
POSITION = (30, 20, 18)  # inside both layers' boxes


def test_neuroglancer_renders_wkw_like_the_twin(tmp_path):
    # Voxels of 1 nm: the viewer's 1 nm display space then shows whole sections.
    data = write_dataset(tmp_path / "wkw", tmp_path / "twin", MIXED, voxel_size=(1.0, 1.0, 1.0))
    log = tmp_path / "serve.log"
    ours = {}
    with served(str(data.root), "--access-log", log=log) as url:
        for layer, make in LAYERS.items():
            ours[layer] = screenshot(f"precomputed://{url}/{layer}/", tmp_path / f"ours-{layer}", POSITION, make)
    fetched = [line for line in log.read_text().splitlines() if "GET /color/1/" in line]
    assert fetched, "the client fetched no chunk of the WKW layer"
    static = ThreadingHTTPServer(("127.0.0.1", 0), partial(_CorsHandler, directory=str(data.twin)))
    thread = threading.Thread(target=static.serve_forever, daemon=True)
    thread.start()
    try:
        for layer, make in LAYERS.items():
            reference = screenshot(f"precomputed://http://127.0.0.1:{static.server_port}/{layer}/",
                                   tmp_path / f"twin-{layer}", POSITION, make)
            assert ours[layer].shape == reference.shape and ours[layer].std() > 0, layer
            np.testing.assert_array_equal(ours[layer], reference, err_msg=layer)
    finally:
        static.shutdown()
        static.server_close()
