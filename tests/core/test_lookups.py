"""Lookups of one directory run concurrently in the core (no lock anywhere on the lookup path):
8 lookups that each need a payload round trip, issued together against a slow server, take one
round trip, not 8. (Through FUSE the kernel may still serialise them: see
tests/sources/test_latency.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import trio

from unshardfs.app.opened import OpenedSource
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.precomputed import Scale, sharding, write_volume

LATENCY = 0.3


def test_lookups_of_one_directory_overlap(tmp_path: Path):
    # Segmentation, gzip data: a chunk file's size is in its payload's gzip trailer.
    scale = Scale((64, 64, 64), (16, 16, 16), sharding(minishard=1, shard=1, data_enc="gzip"),
                  encoding="compressed_segmentation", extra={"compressed_segmentation_block_size": [8, 8, 8]})
    volume = write_volume(tmp_path / "seg", [scale], "uint64", volume_type="segmentation")
    names = sorted(os.listdir(volume["plain"] / "1_1_1"))
    warm, wanted = names[::2], names[1::2][:8]

    async def main(server: DatasetServer) -> tuple[list[int], float]:
        session = await OpenedSource.open(f"{server.url}/sharded")
        try:
            async with session.running():
                directory = await session.tree.lookup("1_1_1")
                for name in warm:  # every shard and minishard index read
                    await directory.lookup(name)
                server.faults.delay = LATENCY
                server.reset_log()
                sizes: dict[str, int] = {}

                async def lookup(name: str) -> None:
                    sizes[name] = (await directory.lookup(name)).size

                start = time.monotonic()
                async with trio.open_nursery() as nursery:
                    for name in wanted:
                        nursery.start_soon(lookup, name)
                return [sizes[n] for n in wanted], time.monotonic() - start
        finally:
            await session.aclose()

    with DatasetServer(tmp_path / "seg") as server:
        sizes, elapsed = trio.run(main, server)
        assert sizes == [(volume["plain"] / "1_1_1" / n).stat().st_size for n in wanted]
        assert len(server.requests()) == 8 and server.round_trips() == 1
        assert elapsed < 4 * LATENCY
