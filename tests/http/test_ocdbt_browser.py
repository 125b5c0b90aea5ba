"""Neuroglancer's own client, in headless Chromium, renders a sharded precomputed volume kept in an
OCDBT database and served by `unshardfs serve` exactly as it renders TensorStore's own read of that
database, written out unsharded and served by a plain static server."""

from __future__ import annotations

import numpy as np
import pytest

from tests.http.test_browser import CHROMIUM, screenshot, static_screenshot
from tests.support.served import served

ts = pytest.importorskip("tensorstore")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/setup installs it)")

SIZE = [128, 128, 64]


def _spec(kvstore: dict | str, sharded: bool) -> dict:
    scale: dict = {"resolution": [1, 1, 1], "encoding": "raw", "chunk_size": [32, 32, 16], "size": SIZE,
                   "voxel_offset": [0, 0, 0]}
    if sharded:
        scale["sharding"] = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 1, "hash": "identity",
                             "minishard_bits": 1, "shard_bits": 2, "minishard_index_encoding": "gzip",
                             "data_encoding": "gzip"}
    return {"driver": "neuroglancer_precomputed", "kvstore": kvstore,
            "multiscale_metadata": {"type": "image", "data_type": "uint8", "num_channels": 1},
            "scale_metadata": scale}


def test_neuroglancer_renders_the_served_database_as_tensorstore_reads_it(tmp_path):
    db, plain = tmp_path / "db", tmp_path / "plain"
    db.mkdir()
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 255, size=(8, 8, 4, 1), dtype=np.uint8)
    data = np.kron(blocks, np.ones((16, 16, 16, 1), dtype=np.uint8))  # blocks: an image worth comparing
    ocdbt = {"driver": "ocdbt", "base": f"file://{db}/"}
    volume = ts.open(_spec(ocdbt, True), create=True).result()
    volume[:64].write(data[:64]).result()  # two commits: the newest version is what is served
    volume[64:].write(data[64:]).result()
    direct = ts.open({"driver": "neuroglancer_precomputed", "kvstore": ocdbt}, read=True).result().read().result()
    ts.open(_spec(f"file://{plain}/", False), create=True).result().write(direct).result()

    log = tmp_path / "serve.log"
    with served(str(db), "--access-log", log=log) as url:
        ours = screenshot(f"precomputed://{url}/", tmp_path / "profile1")
    fetched = [line for line in log.read_text().splitlines() if "GET /1_1_1/" in line and "(origin http://" in line]
    assert fetched, "the client fetched no chunk through CORS"
    reference = static_screenshot(plain, tmp_path / "profile2")
    assert ours.shape == reference.shape and ours.std() > 0  # an image, not a blank canvas
    np.testing.assert_array_equal(ours, reference)
