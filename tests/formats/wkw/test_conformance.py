"""WKW datasets run the shared format conformance suite: a multi-channel raw color layer and an
LZ4HC uint64 segmentation, two mags each, written by the `wkw` package, against the unsharded
precomputed twin TensorStore writes of the same voxels (every block of every file that exists,
all-zero blocks included; see datasets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.formats.wkw.datasets import MIXED, SPAN, write_dataset
from unshardfs.testing.format_conformance import Damaged, FormatCase, FormatConformance, InProcessConformance


def chunks_of_file(data, layer: str, mag_index: int, f: tuple[int, int, int]) -> list[str]:
    """Twin-relative names of the chunk files whose blocks live in file `f`."""
    m = data.layers[layer][mag_index]
    names = []
    for path in sorted((data.twin / layer / m.key).iterdir()):
        lo = [int(part.split("-")[0]) for part in path.name.split("_")]
        if all(v // SPAN == c for v, c in zip(lo, f)):
            names.append(f"{layer}/{m.key}/{path.name}")
    return names


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FormatCase:
    root = tmp_path_factory.mktemp("wkw")
    data = write_dataset(root / "wkw", root / "twin", MIXED)
    target = (2, 1, 1)  # an LZ4HC segmentation file of mag 1, clipped at the volume's end

    def damage(source: Path) -> Damaged:
        """The file's header overwritten: nothing in it can be located."""
        shard = source / "segmentation" / "1" / "z1" / "y1" / "x2.wkw"
        with open(shard, "r+b") as f:
            f.write(b"NOTWKW\0\0")
        return Damaged(shard, frozenset(chunks_of_file(data, "segmentation", 0, target)))

    same = chunks_of_file(data, "color", 0, (1, 1, 1))
    return FormatCase(data.root, data.twin, damage, same, json_files=("datasource-properties.json",),
                      absent=["color/1/16-24_8-16_32-36",  # in the file that was never written
                              "color/1/48-56_8-16_16-24",  # beyond the volume
                              "color/1/1-8_8-16_16-24"])  # not on the block grid


class TestWkwConformance(FormatConformance):
    pass


class TestWkwInProcess(InProcessConformance):
    """The same checks over the node API, without a mount (the quick tier's)."""
