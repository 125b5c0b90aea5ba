"""Neuroglancer precomputed runs the shared format conformance suite: a volume with one sharded scale
(TensorStore, gzip data and minishard indexes, a quarter of the chunks never written) and one unsharded
scale that passes through."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.precomputed import chunk_locations
from unshardfs.testing.format_conformance import Damaged, FormatCase, FormatConformance, InProcessConformance
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.testing.trees import walk_files

KEY = "1_1_1"
SIZE, CHUNK = (64, 64, 32), (16, 16, 8)
SPEC = sharding(minishard=1, shard=2, index_enc="gzip", data_enc="gzip")
SCALES = [Scale(SIZE, CHUNK, SPEC, fill=0.75), Scale((32, 32, 16), (16, 16, 16), None, resolution=(2, 2, 2))]


def _by_shard(twin: Path) -> dict[tuple[str, int], list[str]]:
    """(shard file stem, minishard) -> twin-relative paths of the chunks written there."""
    written = walk_files(twin)
    groups = {loc: [f"{KEY}/{n}" for n in names if f"{KEY}/{n}" in written]
              for loc, names in chunk_locations(SPEC, SIZE, CHUNK).items()}
    return {loc: names for loc, names in groups.items() if names}


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FormatCase:
    paths = write_volume(tmp_path_factory.mktemp("precomputed"), SCALES, "uint16")
    twin = paths["plain"]
    groups = _by_shard(twin)

    def damage(root: Path) -> Damaged:
        """Garbage over the shard index: every minishard range points outside the file."""
        shard = min((root / KEY).glob("*.shard"))
        with open(shard, "r+b") as f:
            f.write(np.random.default_rng(1).bytes(16 << SPEC["minishard_bits"]))
        return Damaged(shard, frozenset(n for (s, _), names in groups.items() if s == shard.stem for n in names))

    return FormatCase(paths["sharded"], twin, damage, max(groups.values(), key=len),
                      absent=[f"{KEY}/48-64_0-16_0-8", f"{KEY}/0-16_0-16_32-40"])


class TestPrecomputedConformance(FormatConformance):
    pass


class TestPrecomputedInProcess(InProcessConformance):
    """The same checks over the node API, without a mount (the quick tier's)."""
