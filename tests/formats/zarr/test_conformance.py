"""Zarr v3 runs the shared format conformance suite: one sharded array written by zarr-python
(zstd inner chunks, crc32c-checked index at the end, a missing shard and an empty inner chunk)
in a group, against the same data written unsharded."""

from __future__ import annotations

from pathlib import Path

import pytest

from unshardfs.testing.format_conformance import Damaged, FormatCase, FormatConformance, InProcessConformance
from unshardfs.testing.trees import walk_files
from unshardfs.testing.zarr import BYTES_LE, CRC, ZCase, codec, sharding, write_case, write_group

ZSTD = codec("zstd", level=3, checksum=False)
SHARD, INNER = (16, 16), (8, 8)
# Rows 0-15 (the first row of shards) hold only the fill value: those shards are never written.
CASE = ZCase((48, 32), "uint16", SHARD, [sharding(INNER, [BYTES_LE, ZSTD], (BYTES_LE, CRC))], INNER,
             [BYTES_LE, ZSTD])
INDEX_BYTES = 16 * (SHARD[0] // INNER[0]) * (SHARD[1] // INNER[1]) + 4  # entries and their crc32c


def inner_chunks(twin: Path, shard: tuple[int, int]) -> list[str]:
    """Twin-relative paths of the inner chunks of one shard that hold data."""
    per = [s // i for s, i in zip(SHARD, INNER)]
    names = [f"arr/c/{shard[0] * per[0] + i}/{shard[1] * per[1] + j}" for i in range(per[0]) for j in range(per[1])]
    return [name for name in names if (twin / name).exists()]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FormatCase:
    root = tmp_path_factory.mktemp("zarr")
    for variant in ("sharded", "plain"):
        write_group(root / variant, {"description": "conformance"})
    write_case(root, "arr", CASE)
    twin = root / "plain"

    def damage(store: Path) -> Damaged:
        """One bit of the last shard's index flipped: its crc32c no longer matches."""
        shard = store / "arr/c/2/1"
        data = bytearray(shard.read_bytes())
        data[-INDEX_BYTES + 5] ^= 0x10
        shard.write_bytes(bytes(data))
        return Damaged(shard, frozenset(inner_chunks(twin, (2, 1))))

    json_files = tuple(rel for rel in walk_files(twin) if rel.endswith("zarr.json"))
    return FormatCase(root / "sharded", twin, damage, inner_chunks(twin, (1, 0)), json_files=json_files,
                      absent=["arr/c/0/0", "arr/c/5/0"])


class TestZarrConformance(FormatConformance):
    pass


class TestZarrInProcess(InProcessConformance):
    """The same checks over the node API, without a mount (the quick tier's)."""
