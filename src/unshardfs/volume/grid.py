"""The chunk grid of one volume scale and its unsharded chunk file names.

`<x0>-<x1>_<y0>-<y1>_<z0>-<z1>` in voxels, voxel offset applied, clipped at
the volume edge: the names an unsharded precomputed writer uses. Any format
that shows a volume as unsharded precomputed (sharded scales, DVID exports)
names and parses its chunk files here.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from unshardfs.core.geometry import Geometry
from unshardfs.core.nameorder import NameOrder
from unshardfs.core.naming import Naming
from unshardfs.core.table import int_list
from unshardfs.volume.morton import MortonCoder

_NAME_FORMAT = "%d-%d_%d-%d_%d-%d"
_CHUNK_NAME = re.compile(r"^(-?\d+)-(-?\d+)_(-?\d+)-(-?\d+)_(-?\d+)-(-?\d+)$")

Cell = tuple[int, int, int]


def as_cell(values: Sequence[int]) -> Cell:
    """Three values as a cell (metadata parsing has checked there are three)."""
    x, y, z = values
    return (x, y, z)


class ChunkGrid:
    __slots__ = ("size", "chunk_size", "voxel_offset", "shape", "coder", "chunk_array", "size_array", "_offset",
                 "_texts", "_decoded", "_parser", "_parsed", "_extents")

    # Axes up to this many cells keep their spelled-out "begin-end" texts (`names`).
    TEXTS_MAX = 1 << 16
    # Grids of up to this many cells along all axes together parse names through per-axis
    # tables (`parse_id`), a few MB at most.
    PARSE_TABLES_MAX = 1 << 16

    def __init__(self, size: Sequence[int], chunk_size: Sequence[int], voxel_offset: Sequence[int]) -> None:
        self.size = as_cell(size)
        self.chunk_size = as_cell(chunk_size)
        self.voxel_offset = as_cell(voxel_offset)
        self.shape = as_cell([-(-s // c) for s, c in zip(size, chunk_size)])
        self.coder = MortonCoder(self.shape)
        self.chunk_array = np.array(chunk_size, dtype=np.int64)
        self.size_array = np.array(size, dtype=np.int64)
        self._offset = np.array(voxel_offset, dtype=np.int64)
        self._texts: list[list[str]] | None = None
        self._decoded: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._parser: tuple[list[dict[str, int]], list[list[int]]] | None = None
        self._parsed: tuple[int, Cell] = (-1, (0, 0, 0))  # the last id `parse_id` returned, and its cell
        self._extents: list[list[int]] | None = None  # `extents`, per axis, once `parse_id` has tables

    def cells(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`coder.decode_array(ids)`, read-only, kept for the last `ids` array: a listing batch
        asks twice (its names, its sizes)."""
        last = self._decoded
        if last is not None and last[0] is ids:
            return last[1], last[2]
        cells, valid = self.coder.decode_array(ids)
        cells.flags.writeable = valid.flags.writeable = False
        self._decoded = (ids, cells, valid)
        return cells, valid

    def extent(self, cell: Cell) -> Cell:
        """The chunk's voxel counts per axis (smaller at the volume edge)."""
        return as_cell([min(c, s - g * c) for g, c, s in zip(cell, self.chunk_size, self.size)])

    def chunk_name(self, cell: Sequence[int]) -> str:
        parts = []
        for d in range(3):
            begin = cell[d] * self.chunk_size[d]
            end = min(begin + self.chunk_size[d], self.size[d])
            parts.append(f"{begin + self.voxel_offset[d]}-{end + self.voxel_offset[d]}")
        return "_".join(parts)

    def names(self, cells: np.ndarray) -> list[str]:
        """Names of an (n, 3) array of in-grid cells.

        Listings name every chunk: each name is three per-axis texts spelled out once per grid
        (a fifth of the cost of formatting six numbers per name)."""
        if self._texts is None and max(self.shape) <= self.TEXTS_MAX:
            self._texts = [self.axis_texts(d) for d in range(3)]
        if self._texts is not None:
            xs, ys, zs = self._texts
            return [f"{xs[x]}_{ys[y]}_{zs[z]}"
                    for x, y, z in zip(cells[:, 0].tolist(), cells[:, 1].tolist(), cells[:, 2].tolist())]
        begins = cells * self.chunk_array
        ends = np.minimum(begins + self.chunk_array, self.size_array) + self._offset
        begins += self._offset
        bounds = np.stack([begins[:, 0], ends[:, 0], begins[:, 1], ends[:, 1], begins[:, 2], ends[:, 2]], axis=1)
        return [_NAME_FORMAT % tuple(b) for b in bounds.tolist()]

    @staticmethod
    def claims(name: str) -> bool:
        """Whether `name` looks like a chunk name at all."""
        return _CHUNK_NAME.match(name) is not None

    def parse_chunk_name(self, name: str) -> Cell | None:
        """Grid cell of a canonical chunk name inside the volume, else None."""
        m = _CHUNK_NAME.match(name)
        if m is None:
            return None
        cell = []
        for d in range(3):
            begin = int(m.group(2 * d + 1)) - self.voxel_offset[d]
            if begin < 0 or begin % self.chunk_size[d]:
                return None
            g = begin // self.chunk_size[d]
            if g >= self.shape[d]:
                return None
            cell.append(g)
        cell_t = (cell[0], cell[1], cell[2])
        # Only the exact spelling an unsharded writer uses names a chunk
        # (no leading zeros, '+', or wrong clipped end).
        return cell_t if self.chunk_name(cell_t) == name else None

    def parse_id(self, name: str) -> int | None:
        """The Morton code of the chunk `name` names (`parse_chunk_name`, then `coder.encode`).

        Every lookup parses one name: on grids small enough, through one table per axis from
        its "begin-end" text to the cell index, and from the cell index to the bits it adds to
        the code (a name is canonical exactly when its three '_'-separated parts are texts of
        the three axes: a text never holds a '_'). The cell of the id returned is remembered
        for `cell_of`, which the lookup's size check asks next."""
        parser = self._parser
        if parser is None:
            if sum(self.shape) > self.PARSE_TABLES_MAX:
                cell = self.parse_chunk_name(name)
                return None if cell is None else self.coder.encode(cell)
            parser = self._parser = self._parse_tables()
        parts = name.split("_")
        if len(parts) != 3:
            return None
        (xs, ys, zs), (bx, by, bz) = parser
        x, y, z = xs.get(parts[0]), ys.get(parts[1]), zs.get(parts[2])
        if x is None or y is None or z is None:
            return None
        chunk_id = bx[x] | by[y] | bz[z]
        self._parsed = (chunk_id, (x, y, z))
        return chunk_id

    def _parse_tables(self) -> tuple[list[dict[str, int]], list[list[int]]]:
        indexes = [{text: g for g, text in enumerate(self.axis_texts(d))} for d in range(3)]
        bits = []
        for d in range(3):
            cells = np.arange(self.shape[d], dtype=np.uint64)
            code = np.zeros(self.shape[d], dtype=np.uint64)
            for j, (dim, i) in enumerate(self.coder.plan):  # what `coder.encode` ORs in for axis d
                if dim == d:
                    code |= ((cells >> np.uint64(i)) & np.uint64(1)) << np.uint64(j)
            bits.append(int_list(code))
        return indexes, bits

    def cell_extents(self) -> list[list[int]] | None:
        """The voxel count of each grid index along each axis (smaller at the volume edge), on
        grids that parse through tables (`parse_id`); None on others."""
        if self._extents is None and self._parser is not None:
            self._extents = [[max(min(c, s - g * c), 0) for g in range(n)]
                             for c, s, n in zip(self.chunk_size, self.size, self.shape)]
        return self._extents

    def cell_of(self, chunk_id: int) -> tuple[int, ...] | None:
        """`coder.decode(chunk_id)`, without decoding the id `parse_id` just returned."""
        parsed_id, cell = self._parsed
        return cell if parsed_id == chunk_id else self.coder.decode(chunk_id)

    def axis_texts(self, d: int) -> list[str]:
        """How chunk names spell each grid index of axis `d` ("begin-end", clipped at the edge)."""
        c, s, o = self.chunk_size[d], self.size[d], self.voxel_offset[d]
        return [f"{g * c + o}-{min(g * c + c, s) + o}" for g in range(self.shape[d])]

    def name_of_code(self, code: int) -> str:
        """The name of the chunk whose compressed Morton code is `code` (KeyError if none)."""
        cell = self.coder.decode(code)
        if cell is None:
            raise KeyError(code)
        return self.chunk_name(cell)


class GridNaming(Naming):
    """Chunk files of a volume scale, keyed by the compressed Morton code of their grid cell."""

    dense = True

    def __init__(self, grid: ChunkGrid) -> None:
        self.grid = grid

    def claims(self, name: str) -> bool:
        return ChunkGrid.claims(name)

    def parse(self, name: str) -> int | None:
        return self.grid.parse_id(name)

    def name(self, chunk_id: int) -> str | None:
        cell = self.grid.coder.decode(chunk_id)
        return None if cell is None else self.grid.chunk_name(cell)

    def order(self) -> NameOrder:
        coder = self.grid.coder
        return NameOrder([self.grid.axis_texts(d) for d in range(3)], coder.decode, coder.encode)

    def names(self, ids: np.ndarray) -> list[str | None]:
        cells, valid = self.grid.cells(ids)
        if valid.all():
            every: list[str | None] = list(self.grid.names(cells))
            return every
        names = iter(self.grid.names(cells[valid]))
        return [next(names) if ok else None for ok in valid.tolist()]


class VolumeGeometry(Geometry):
    """Decoded chunk sizes of a volume scale: exact for raw data, bounded otherwise; never
    beyond `limit` (--max-payload-size: a decoded chunk is held in memory whole)."""

    # Non-raw encodings (jpeg, compressed_segmentation, png) of a chunk stay
    # well below this multiple of its raw size plus a constant.
    SLACK, EXTRA = 2, 1 << 20

    def __init__(self, grid: ChunkGrid, voxel_bytes: int, raw: bool, limit: int) -> None:
        super().__init__(limit)
        self.grid = grid
        self.voxel_bytes = voxel_bytes
        self.raw = raw

    def _raw_sizes(self, ids: np.ndarray) -> np.ndarray:
        cells, valid = self.grid.cells(ids)
        extents = np.minimum(self.grid.chunk_array, self.grid.size_array - cells * self.grid.chunk_array)
        np.maximum(extents, 0, out=extents)
        sizes = extents[:, 0] * extents[:, 1] * extents[:, 2] * self.voxel_bytes  # not prod(axis=1): slow on 3
        return np.where(valid, sizes, 0)

    def _raw_size(self, chunk_id: int) -> int:
        """`_raw_sizes` of one id, without arrays (every lookup asks)."""
        grid = self.grid
        parsed_id, parsed = grid._parsed  # `grid.cell_of`, inline (one call fewer per lookup)
        cell: tuple[int, ...] | None = parsed
        if parsed_id != chunk_id:
            cell = grid.coder.decode(chunk_id)
        if cell is None:
            return 0
        extents = grid._extents if grid._extents is not None else grid.cell_extents()
        if extents is not None:  # a decoded cell lies inside the grid
            return self.voxel_bytes * extents[0][cell[0]] * extents[1][cell[1]] * extents[2][cell[2]]
        size = self.voxel_bytes
        for g, c, s in zip(cell, self.grid.chunk_size, self.grid.size):
            size *= max(min(c, s - g * c), 0)
        return size

    def exact(self, ids: np.ndarray) -> np.ndarray | None:
        return self._raw_sizes(ids) if self.raw else None

    def cap(self, ids: np.ndarray) -> np.ndarray:
        raw = self._raw_sizes(ids)
        caps: np.ndarray = np.minimum(raw if self.raw else raw * self.SLACK + self.EXTRA, self._cap)
        return caps

    def exact_one(self, chunk_id: int) -> int | None:
        return self._raw_size(chunk_id) if self.raw else None

    def cap_one(self, chunk_id: int) -> int:
        return self.sizes_one(chunk_id)[1]

    def sizes_one(self, chunk_id: int) -> tuple[int | None, int]:
        raw = self._raw_size(chunk_id)
        if self.raw:
            return raw, min(raw, self._cap)
        return None, min(raw * self.SLACK + self.EXTRA, self._cap)
