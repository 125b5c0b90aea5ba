"""The order of a grid directory's chunk names as strings, computed without a listing.

Tools that split a directory's files over several readers sort the names as
strings first (`sorted(os.listdir(...))`, `ls | split`, a Python script's
`files[i::8]`): together the readers walk the name order, which is neither
id order nor listing order. A grid's chunk names are one text per axis
joined by a separator, and comparing two names compares the first axis whose
texts differ, as texts: where one text is a prefix of the other (Zarr's "1"
and "10") the separator that follows it ("/" or ".") sorts below every digit,
as the shorter text does; precomputed texts ("begin-end") never are (equal
begins are one cell). So the name order is the lexicographic order of the
axes' ranks, each axis's texts sorted on their own: a name's position in it
is its ranks read as one mixed-radix number, and the names from a position on
are counted on those ranks like an odometer, without building a name.
"""

from __future__ import annotations

from typing import Callable, Sequence

Cell = tuple[int, ...]


class NameOrder:
    """Chunk ids of a dense grid in the string order of their names.

    `texts[d][g]` is how axis `d` spells grid index `g` in a name; `cell_of`
    maps a chunk id to its grid cell (None: not in the grid) and `id_of` back.
    Memory is the sum of the axes' lengths, not their product.
    """

    def __init__(self, texts: Sequence[Sequence[str]], cell_of: Callable[[int], Cell | None],
                 id_of: Callable[[Cell], int]) -> None:
        self._order = [sorted(range(len(axis)), key=axis.__getitem__) for axis in texts]
        self._rank = []
        for order in self._order:
            rank = [0] * len(order)
            for r, g in enumerate(order):
                rank[g] = r
            self._rank.append(rank)
        self._sizes = [len(order) for order in self._order]
        self.size = 1
        for n in self._sizes:
            self.size *= n
        if not self._order:
            self.size = 0
        self._cell_of = cell_of
        self._id_of = id_of

    def position(self, chunk_id: int) -> int | None:
        """Where the chunk's name is in the order (None: not in the grid)."""
        cell = self._cell_of(chunk_id)
        if cell is None or len(cell) != len(self._order) or not self._order:
            return None
        p = 0
        for rank, size, g in zip(self._rank, self._sizes, cell):
            p = p * size + rank[g]
        return p

    def ids(self, position: int, n: int) -> list[int]:
        """The ids of up to `n` names from `position` on, in order (fewer at the end)."""
        if position < 0 or position >= self.size or n <= 0:
            return []
        ranks = [0] * len(self._sizes)
        rest = position
        for d in range(len(self._sizes) - 1, -1, -1):
            rest, ranks[d] = divmod(rest, self._sizes[d])
        out = [self._id_at(ranks)]
        while len(out) < n:
            d = len(ranks) - 1
            while d >= 0 and ranks[d] + 1 == self._sizes[d]:  # carry
                ranks[d] = 0
                d -= 1
            if d < 0:
                break  # the last name
            ranks[d] += 1
            out.append(self._id_at(ranks))
        return out

    def after(self, chunk_id: int, n: int) -> list[int]:
        """Up to `n` ids whose names follow `chunk_id`'s, in order ([] if it is not in the grid)."""
        p = self.position(chunk_id)
        return [] if p is None else self.ids(p + 1, n)

    def _id_at(self, ranks: list[int]) -> int:
        return self._id_of(tuple(order[r] for order, r in zip(self._order, ranks)))
