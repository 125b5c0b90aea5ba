"""Opening a remote source costs one round trip, its format named or not: the probes of the versioned
stores (Icechunk's branch ref, OCDBT's manifest) and of every format are statted together, each with
its first bytes, and detection and the format's open take their answers (the metadata file whole)
from what that round trip brought."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

from unshardfs.app.opened import OpenedSource
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.precomputed import Scale, sharding, write_volume

LATENCY = 0.05  # long enough that requests sent together are told apart from a chain


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import zarr

    root = tmp_path_factory.mktemp("detect")
    pre = write_volume(root / "pre", [Scale((64, 64, 64), (16, 16, 16), sharding(minishard=1, shard=1))])
    arr = zarr.create_array(str(root / "vol.zarr"), shape=(64, 64, 64), chunks=(16, 16, 16), shards=(32, 32, 32),
                            dtype="uint8", compressors=None, zarr_format=3)
    arr[...] = np.arange(64 ** 3, dtype=np.uint64).reshape(64, 64, 64).astype(np.uint8)
    return {"precomputed": pre["sharded"], "zarr": root / "vol.zarr"}


def open_costs(server: DatasetServer, url: str) -> tuple[int, int, str]:
    """Round trips and requests of opening `url`, and the format found."""
    server.reset_log()
    server.faults.delay = LATENCY

    async def main() -> str:
        session = await OpenedSource.open(url)
        try:
            return str(session.dataset.format)
        finally:
            await session.aclose()

    try:
        found = trio.run(main)
    finally:
        server.faults.delay = 0
    return server.round_trips(), len(server.requests()), found


@pytest.mark.parametrize("fmt, prefix", [("precomputed", "precomputed://"), ("zarr", "zarr3://")])
def test_detection_costs_no_round_trip_of_its_own(served: dict[str, Path], fmt: str, prefix: str) -> None:
    root = served[fmt].parent
    with DatasetServer(root) as server:
        url = f"{server.url}/{served[fmt].name}"
        named_trips, _, named_format = open_costs(server, prefix + url)
        detected_trips, requests, detected_format = open_costs(server, url)
    assert named_format == detected_format == fmt
    assert detected_trips == named_trips == 1, (detected_trips, named_trips, requests)
