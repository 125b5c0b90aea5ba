"""Compressed Morton codes of grid cells, in any number of dimensions.

Volume chunks use 3-D grids; annotation spatial indexes use one dimension
per axis of their coordinate space. Bits that are zero for every cell of the
grid are skipped, so the code depends on the grid shape. Encoding is scalar (one lookup at a time); decoding is
vectorised because listings turn whole minishard indexes into names, and
scalar for a lookup's one id.
"""

from __future__ import annotations

import numpy as np


def bit_plan(grid_shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """For each output bit j, the (dim, source bit) it carries."""
    plan: list[tuple[int, int]] = []
    nbits = max(max(((s - 1).bit_length() for s in grid_shape), default=0), 0)
    for i in range(nbits):
        for dim in range(len(grid_shape)):
            # A dimension contributes bit i while some cell needs it, i.e.
            # while 2**i < grid_shape[dim].
            if (1 << i) < grid_shape[dim]:
                plan.append((dim, i))
    return plan


class MortonCoder:
    def __init__(self, grid_shape: tuple[int, ...]) -> None:
        self.grid_shape = tuple(int(s) for s in grid_shape)
        self.ndim = len(self.grid_shape)
        self.plan = bit_plan(self.grid_shape)
        self.total_bits = len(self.plan)
        # Decoding one byte of code at a time through 256-entry tables costs
        # a few numpy calls per minishard instead of a few per code bit.
        self.byte_tables = []
        values = np.arange(256, dtype=np.int64)
        for k in range((self.total_bits + 7) // 8):
            table = np.zeros((256, self.ndim), dtype=np.int64)
            for j in range(8 * k, min(8 * k + 8, self.total_bits)):
                dim, i = self.plan[j]
                table[:, dim] |= ((values >> (j - 8 * k)) & 1) << i
            self.byte_tables.append(table)
        # The same tables as tuples, for one code at a time (a lookup's size check).
        self.byte_rows = [[tuple(row) for row in table.tolist()] for table in self.byte_tables]

    def encode(self, cell: tuple[int, ...]) -> int:
        code = 0
        for j, (dim, i) in enumerate(self.plan):
            code |= ((cell[dim] >> i) & 1) << j
        return code

    def decode(self, code: int) -> tuple[int, ...] | None:
        """The grid cell of one code, or None where `decode_array` calls it invalid."""
        if code < 0 or code >> self.total_bits:
            return None
        cell = [0] * self.ndim
        for rows in self.byte_rows:
            row = rows[code & 0xFF]
            for d in range(self.ndim):
                cell[d] |= row[d]
            code >>= 8
        for c, s in zip(cell, self.grid_shape):
            if c >= s:
                return None
        return tuple(cell)

    def decode_array(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Grid cells of `codes` as an (n, ndim) int64 array, plus a validity mask.

        A code is valid when it has no bits beyond the grid's and its cell lies
        inside the grid; invalid ids in a minishard index are damaged data and
        must not show up as files.
        """
        codes = np.asarray(codes, dtype=np.uint64)
        cells = np.zeros((len(codes), self.ndim), dtype=np.int64)
        as_bytes = codes.astype("<u8").view(np.uint8).reshape(-1, 8)
        for k, table in enumerate(self.byte_tables):
            cells |= table[as_bytes[:, k]]
        if self.total_bits < 64:
            valid = (codes >> np.uint64(self.total_bits)) == 0
        else:
            valid = np.ones(len(codes), dtype=bool)
        for d, size in enumerate(self.grid_shape):  # column by column: numpy reduces a short axis slowly
            valid &= cells[:, d] < size
        return cells, valid
