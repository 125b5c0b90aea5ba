"""DVID exports run the shared format conformance suite: one scale written by the reference export
writer (CSV sidecar indexes, zstd blocks, all-zero blocks skipped), against its unsharded twin: a raw
uint64 precomputed scale of the agglomerated labels, one file per non-empty block."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.formats.dvid.test_mount import SHARDING, VARIANTS
from unshardfs.testing.dvid import BLOCK, agglomerate, encode_volume, info_for, sample_volume, shard_groups, write_scale
from unshardfs.testing.format_conformance import Damaged, FormatCase, FormatConformance, InProcessConformance

SIZE = (200, 130, 70)  # 4 x 3 x 2 blocks, edge blocks clipped
GRID = tuple(-(-s // BLOCK) for s in SIZE)
KEY = "8.0x8.0x8.0"
Cell = tuple[int, int, int]


def block_name(cell: Cell) -> str:
    return "_".join(f"{c * BLOCK}-{min((c + 1) * BLOCK, s)}" for c, s in zip(cell, SIZE))


def write_twin(root: Path, vol: np.ndarray, cells: list[Cell]) -> None:
    """The unsharded precomputed scale the mount shows: raw little-endian uint64 blocks, x fastest."""
    info = info_for([SIZE], SHARDING)
    for scale in info["scales"]:
        del scale["sharding"], scale["compressed_segmentation_block_size"]
        scale["encoding"] = "raw"
    (root / KEY).mkdir(parents=True)
    (root / "info").write_text(json.dumps(info))
    for cell in cells:
        x, y, z = (slice(c * BLOCK, (c + 1) * BLOCK) for c in cell)
        labels = agglomerate(vol[x, y, z]).transpose(2, 1, 0)
        (root / KEY / block_name(cell)).write_bytes(labels.astype("<u8").tobytes())


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FormatCase:
    root = tmp_path_factory.mktemp("dvid")
    vol = sample_volume(SIZE, 1)
    blocks = encode_volume(vol)
    write_scale(root / "export" / "s0", blocks, GRID, SHARDING, VARIANTS["csv-stream-zstd"])
    spec = root / "spec.json"
    spec.write_text(json.dumps(info_for([SIZE], SHARDING)))
    write_twin(root / "twin", vol, sorted(blocks))
    # Shard file stem (its first cell's voxel origin) -> the twin's files of its non-empty blocks.
    shards = {"_".join(str(min(c[d] for c in cells) * BLOCK) for d in range(3)):
              [f"{KEY}/{block_name(c)}" for c in cells if c in blocks]
              for cells in shard_groups(GRID, SHARDING).values()}

    def damage(export: Path) -> Damaged:
        """The first shard's Arrow file replaced by garbage: every block its index names lies outside it."""
        shard = min((export / "s0").glob("*.arrow"))
        shard.write_bytes(b"garbage" * 10)
        return Damaged(shard, frozenset(shards[shard.stem]))

    # Absent: an all-zero block DVID skipped, and a block beyond the volume.
    return FormatCase(root / "export", root / "twin", damage, max(shards.values(), key=len), ("--info", str(spec)),
                      absent=[f"{KEY}/128-192_64-128_0-64", f"{KEY}/256-320_0-64_0-64"])


class TestDvidConformance(FormatConformance):
    pass


class TestDvidInProcess(InProcessConformance):
    """The same checks over the node API, without a mount (the quick tier's)."""
