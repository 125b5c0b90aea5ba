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
axes' ranks, each axis's texts sorted on their own, and successors are
counted on those ranks like an odometer, without building a name.
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
        self._cell_of = cell_of
        self._id_of = id_of

    def after(self, chunk_id: int, n: int) -> list[int]:
        """Up to `n` ids whose names follow `chunk_id`'s, in order ([] if it is not in the grid)."""
        cell = self._cell_of(chunk_id)
        if cell is None or len(cell) != len(self._order) or not self._order:
            return []
        ranks = [rank[g] for rank, g in zip(self._rank, cell)]
        sizes = [len(order) for order in self._order]
        out: list[int] = []
        while len(out) < n:
            d = len(ranks) - 1
            while d >= 0 and ranks[d] + 1 == sizes[d]:  # carry
                ranks[d] = 0
                d -= 1
            if d < 0:
                break  # the last name
            ranks[d] += 1
            out.append(self._id_of(tuple(order[r] for order, r in zip(self._order, ranks))))
        return out
