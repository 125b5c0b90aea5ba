"""Neuroglancer's own client, in headless Chromium, reading a served dataset across origins.

The client (shipped in the `neuroglancer` package) runs on the origin of
neuroglancer's Python server; the data comes from `unshardfs serve` on
another port, so every fetch is a CORS request. The view is rendered
(WebGL through SwiftShader) and compared with the same view of the unsharded
copy served by a plain static server.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tests.support.served import served
from unshardfs.testing.precomputed import Scale, sharding, write_volume

neuroglancer = pytest.importorskip("neuroglancer")
CHROMIUM = shutil.which("chromium")
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/setup installs it)")]
KEY = "1_1_1"


class _CorsHandler(SimpleHTTPRequestHandler):
    """A plain static server, plus the one header a browser viewer on another origin needs."""

    def end_headers(self) -> None:
        self.send_header("Access-Control-Allow-Origin", "*")
        super().end_headers()

    def log_message(self, *args) -> None:
        pass


def screenshot(source: str, profile, position=(64, 64, 32), layer=None) -> np.ndarray:
    """What the real client renders of `source` (a 400x400 cross-section at `position`), as RGBA
    pixels; `layer(source)` makes the layer (an image layer by default)."""
    from PIL import Image

    neuroglancer.set_server_bind_address("127.0.0.1")
    viewer = neuroglancer.Viewer()
    with viewer.txn() as s:
        s.dimensions = neuroglancer.CoordinateSpace(names=["x", "y", "z"], units="nm", scales=[1, 1, 1])
        s.layers["img"] = neuroglancer.ImageLayer(source=source) if layer is None else layer(source)
        s.layout = "xy"
        s.position = list(position)
        s.cross_section_scale = 0.3
    browser = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}", "--use-angle=swiftshader",
         "--enable-unsafe-swiftshader", "--window-size=800,600", "--remote-debugging-port=0",
         viewer.get_viewer_url()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(shot=viewer.screenshot(size=[400, 400])), daemon=True)
        worker.start()
        worker.join(timeout=90)  # the client answers once every visible chunk is loaded
        assert "shot" in result, "the viewer produced no screenshot"
        return np.asarray(Image.open(io.BytesIO(result["shot"].screenshot.image)).convert("RGBA"))
    finally:
        browser.kill()
        browser.wait()


def test_neuroglancer_client_reads_the_served_dataset(tmp_path):
    paths = write_volume(tmp_path / "vol", [Scale((128, 128, 64), (32, 32, 16),
                                                   sharding(minishard=1, shard=2, data_enc="gzip"))],
                         "uint8", blocky=True)
    log = tmp_path / "serve.log"
    with served(str(paths["sharded"]), "--access-log", log=log) as url:
        ours = screenshot(f"precomputed://{url}/", tmp_path / "profile1")
    lines = log.read_text().splitlines()
    fetched = [line for line in lines if "GET /" in line and "(origin http://127.0.0.1:" in line]
    assert any("GET /info " in line for line in fetched), lines[-20:]
    chunks = [line for line in fetched if f"GET /{KEY}/" in line]
    assert chunks, "the client fetched no chunk through CORS"
    reference = static_screenshot(paths["plain"], tmp_path / "profile2")
    assert ours.shape == reference.shape and ours.std() > 0  # an image, not a blank canvas
    np.testing.assert_array_equal(ours, reference)


def static_screenshot(directory, profile) -> np.ndarray:
    """`screenshot` of the precomputed dataset in `directory`, served by a plain static server."""
    static = ThreadingHTTPServer(("127.0.0.1", 0), partial(_CorsHandler, directory=str(directory)))
    thread = threading.Thread(target=static.serve_forever, daemon=True)
    thread.start()
    try:
        return screenshot(f"precomputed://http://127.0.0.1:{static.server_port}/", profile)
    finally:
        static.shutdown()
        static.server_close()
