"""Sharded Neuroglancer annotations (`neuroglancer_annotations_v1`) shown unsharded.

An annotation set has three kinds of index, each optionally sharded with
`neuroglancer_uint64_sharded_v1` in the directory its `key` names:

- `by_id`: chunk id = annotation id, unsharded file `<id>` (base 10);
- `relationships[i]`: chunk id = related segment id, file `<segment id>`;
- `spatial[l]`: chunk id = the compressed Morton code of a grid cell over
  that level's `grid_shape`, in as many dimensions as the annotation space
  has; file `<i>_<j>_<k>...`.

Payloads are served decoded (`data_encoding` gzip removed), which is what
Neuroglancer's unsharded writer stores. Everything else (the shard machinery,
listings, damage) is the core's, as for volumes.
"""

from __future__ import annotations

import numpy as np

from unshardfs.core.naming import Naming
from unshardfs.util.fields import Fields, MetadataError
from unshardfs.volume.morton import MortonCoder

ANNOTATIONS_TYPE = "neuroglancer_annotations_v1"
MAX_RANK = 32  # Neuroglancer's own limit on coordinate-space rank


class CellNaming(Naming):
    """Spatial index cells named `i_j_k...` (one field per dimension), keyed by their Morton code."""

    dense = True

    def __init__(self, grid_shape: tuple[int, ...]) -> None:
        self.coder = MortonCoder(grid_shape)
        self.grid_shape = grid_shape

    def claims(self, name: str) -> bool:
        parts = name.split("_")
        return len(parts) == len(self.grid_shape) and all(p.isdigit() and p.isascii() for p in parts)

    def parse(self, name: str) -> int | None:
        if not self.claims(name):
            return None
        parts = name.split("_")
        if any(len(p) > 1 and p[0] == "0" for p in parts):
            return None  # not the canonical spelling
        cell = tuple(int(p) for p in parts)
        if any(c >= g for c, g in zip(cell, self.grid_shape)):
            return None
        return self.coder.encode(cell)

    def names(self, ids: np.ndarray) -> list[str | None]:
        cells, valid = self.coder.decode_array(ids)
        return ["_".join(map(str, cell)) if ok else None for cell, ok in zip(cells.tolist(), valid.tolist())]


def rank_of(info: Fields) -> int:
    dimensions = info.get("dimensions")
    if not isinstance(dimensions, dict) or not 0 < len(dimensions) <= MAX_RANK:
        raise MetadataError(info.at("dimensions"), f"must be an object of 1 to {MAX_RANK} dimensions")
    return len(dimensions)


def grid_of(level: Fields, rank: int) -> tuple[int, ...]:
    """A spatial level's grid shape; its Morton codes must fit in a uint64 chunk id."""
    shape = tuple(level.ints("grid_shape", rank, lo=1))
    if len(MortonCoder(shape).plan) > 64:
        raise MetadataError(level.at("grid_shape"), f"a grid of {list(shape)} cells needs more than 64 bits of chunk id")
    return shape
