"""How a sharded directory names its chunk files: id <-> file name, and child ids.

A format gives each sharded directory a `Naming`: canonical names only (the
exact spelling an unsharded writer produces), parsed without any listing.
Idents (the low 56 bits of computed inode numbers) default to the id.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from unshardfs.core.nameorder import NameOrder
from unshardfs.tree.nodes import CHILD_ID_BITS

CHILD_ID_LIMIT = 1 << CHILD_ID_BITS


class Naming(ABC):
    """Id <-> file name for the chunk files of one sharded directory (no I/O, no listing).

    `claims` says which names the directory computes (a source entry of that
    form is shadowed, never passed through); `parse` accepts only the
    canonical spelling (anything else: None, an absent file); `names` is its
    inverse over a listing batch. Idents (inode numbers) default to the id.
    """

    # Ids fill a range (grid cells): the id after k is k+1. Sparse ids
    # (segment ids) are not dense.
    dense: bool = False

    @abstractmethod
    def claims(self, name: str) -> bool:
        """Whether `name` has this directory's computed form (a source entry of that form is shadowed)."""

    @abstractmethod
    def parse(self, name: str) -> int | None:
        """The id of a canonical name, or None (no such chunk can exist). A name parsed is one
        `claims` claims: lookups parse first and ask `claims` only of the names that fail."""

    @abstractmethod
    def names(self, ids: np.ndarray) -> list[str | None]:
        """Names of the ids of one listing batch (None: not listable here)."""

    def name(self, chunk_id: int) -> str | None:
        return self.names(np.array([chunk_id], dtype=np.uint64))[0]

    def order(self) -> NameOrder | None:
        """The order of the chunk names as strings, where it is known without a listing (dense
        grids); read-ahead follows readers that split the sorted names between them."""
        return None

    def child_id(self, chunk_id: int) -> int | None:
        return chunk_id if chunk_id < CHILD_ID_LIMIT else None

    def child_ids(self, ids: np.ndarray) -> list[int | None]:
        if not len(ids) or int(ids.max()) < CHILD_ID_LIMIT:
            child_ids: list[int | None] = ids.tolist()
            return child_ids
        return [self.child_id(k) for k in ids.tolist()]

    def name_of_child_id(self, child_id: int) -> str:
        """The name of the file whose child_id is given (KeyError if none)."""
        name = self.name(child_id)
        if name is None:
            raise KeyError(child_id)
        return name


U64_MAX = (1 << 64) - 1


def parse_decimal(text: str) -> int | None:
    """A canonical base-10 uint64 (ASCII digits, no sign, no leading zeros), or None."""
    if not text.isdigit() or not text.isascii() or (len(text) > 1 and text[0] == "0") or len(text) > 20:
        return None
    value = int(text)
    return value if value <= U64_MAX else None


class DecimalNaming(Naming):
    """Files named by a decimal chunk id and an optional `suffix` (`123`, `123.index`).

    `also` lists other suffixes the directory computes (so `123.index` is
    not passed through where a sibling context names it). With `child_id_bits`,
    child_ids are `(id << child_id_bits) + child_id_add`: two files per id can share a
    directory (precomputed meshes: fragments and manifest).
    """

    def __init__(self, suffix: str = "", child_id_bits: int = 0, child_id_add: int = 0, also: tuple[str, ...] = ()) -> None:
        self.suffix = suffix
        self.child_id_bits = child_id_bits
        self.child_id_add = child_id_add
        self.claimed = tuple(dict.fromkeys((suffix, *also)))

    def claims(self, name: str) -> bool:
        return any(parse_decimal(name[:len(name) - len(s)] if s else name) is not None
                   for s in self.claimed if name.endswith(s))

    def parse(self, name: str) -> int | None:
        if self.suffix and not name.endswith(self.suffix):
            return None
        return parse_decimal(name[:len(name) - len(self.suffix)] if self.suffix else name)

    def names(self, ids: np.ndarray) -> list[str | None]:
        suffix = self.suffix
        return [f"{k}{suffix}" for k in ids.tolist()]

    def child_id(self, chunk_id: int) -> int | None:
        child_id = (chunk_id << self.child_id_bits) + self.child_id_add
        return child_id if child_id < CHILD_ID_LIMIT else None

    def child_ids(self, ids: np.ndarray) -> list[int | None]:
        if not self.child_id_bits:
            return super().child_ids(ids)
        return [self.child_id(k) for k in ids.tolist()]

    def name_of_child_id(self, child_id: int) -> str:
        if self.child_id_bits:
            return f"{child_id >> self.child_id_bits}{self.suffix}"
        return super().name_of_child_id(child_id)
