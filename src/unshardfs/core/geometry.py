"""What a format's geometry says about a chunk's decoded size, per id.

A raw volume chunk has exactly voxels x bytes per voxel x channels bytes;
that is the only valid size of its file, known before any byte is read
(so `stat` needs no payload and a gzip trailer claiming 1.5 GiB is damage,
not a 1.5 GiB file). Where the encoding makes the size vary (jpeg,
compressed segmentation, meshes) the geometry gives an upper bound, and
decoding stops there.
"""

from __future__ import annotations

import numpy as np


class Geometry:
    """No geometry: no exact sizes, one cap for everything."""

    def __init__(self, cap: int) -> None:
        self._cap = cap

    def exact(self, ids: np.ndarray) -> np.ndarray | None:
        """Exact decoded size of each id's file, or None when the format does not fix it."""
        return None

    def cap(self, ids: np.ndarray) -> np.ndarray:
        """Largest decoded size each id's file may have."""
        return np.full(len(ids), self._cap, dtype=np.int64)

    # One id at a time (every lookup asks): the array versions by default;
    # a geometry with a cheaper scalar form overrides these too.
    def exact_one(self, chunk_id: int) -> int | None:
        if type(self).exact is Geometry.exact:
            return None
        sizes = self.exact(np.array([chunk_id], dtype=np.uint64))
        return None if sizes is None else int(sizes[0])

    def cap_one(self, chunk_id: int) -> int:
        if type(self).cap is Geometry.cap:
            return self._cap
        return int(self.cap(np.array([chunk_id], dtype=np.uint64))[0])

    def sizes_one(self, chunk_id: int) -> tuple[int | None, int]:
        """(`exact_one`, `cap_one`) of an id: what a lookup asks."""
        return self.exact_one(chunk_id), self.cap_one(chunk_id)


class FixedSize(Geometry):
    """Every chunk decodes to exactly `size` bytes: sizes are known from the index alone."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size

    def exact(self, ids: np.ndarray) -> np.ndarray:
        return np.full(len(ids), self.size, dtype=np.int64)
