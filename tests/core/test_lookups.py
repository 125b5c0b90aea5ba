"""Lookups of one directory run concurrently in the core (no lock anywhere on the lookup path):
8 lookups that each need a payload round trip, issued together against a slow object store,
take one round trip, not 8. In process, under trio's MockClock (the store's latency costs no
real time); through FUSE the kernel may still serialise them: see tests/sources/test_latency.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing

from unshardfs.testing.inprocess import opened, resolve
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.tree.nodes import DirNode

LATENCY = 0.3


def test_lookups_of_one_directory_overlap(tmp_path: Path) -> None:
    # Segmentation, gzip data: a chunk file's size is in its payload's gzip trailer.
    scale = Scale((64, 64, 64), (16, 16, 16), sharding(minishard=1, shard=1, data_enc="gzip"),
                  encoding="compressed_segmentation", extra={"compressed_segmentation_block_size": [8, 8, 8]})
    volume = write_volume(tmp_path / "seg", [scale], "uint64", volume_type="segmentation")
    names = sorted(os.listdir(volume["plain"] / "1_1_1"))
    warm, wanted = names[::2], names[1::2][:8]
    source = LatencySource(MemorySource.from_directory(volume["sharded"]), LATENCY)

    async def main() -> tuple[list[int], float]:
        async with opened(source) as session:
            directory = await resolve(session.tree, "1_1_1")
            assert isinstance(directory, DirNode)
            for name in warm:  # every shard and minishard index read
                await directory.lookup(name)
            source.reset_log()
            sizes: dict[str, int] = {}

            async def lookup(name: str) -> None:
                node = await directory.lookup(name)
                assert node is not None, name
                sizes[name] = node.size

            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for name in wanted:
                    nursery.start_soon(lookup, name)
            return [sizes[n] for n in wanted], trio.current_time() - start

    sizes, elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sizes == [(volume["plain"] / "1_1_1" / n).stat().st_size for n in wanted]
    assert source.counts() == {"read": 8} and source.round_trips() == 1
    assert elapsed == pytest.approx(LATENCY)  # the lookups waited for one round trip together
