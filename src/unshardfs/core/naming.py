"""How a sharded directory names its chunk files: key <-> file name, and inode idents.

A format gives each sharded directory a `Naming`: canonical names only (the
exact spelling an unsharded writer produces), parsed without any listing.
Idents (the low 56 bits of computed inode numbers) default to the key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..vtree import CHILD_ID_BITS

IDENT_LIMIT = 1 << CHILD_ID_BITS


class Naming(ABC):
    # Keys fill a range (grid cells): the key after k is k+1. Sparse keys
    # (segment ids) are not dense.
    dense: bool = False

    @abstractmethod
    def claims(self, name: str) -> bool:
        """Whether `name` has this directory's computed form (a source entry of that form is shadowed)."""

    @abstractmethod
    def parse(self, name: str) -> int | None:
        """The key of a canonical name, or None (no such chunk can exist)."""

    @abstractmethod
    def names(self, keys: np.ndarray) -> list[str | None]:
        """Names of the keys of one listing batch (None: not listable here)."""

    def name(self, key: int) -> str | None:
        return self.names(np.array([key], dtype=np.uint64))[0]

    def ident(self, key: int) -> int | None:
        return key if key < IDENT_LIMIT else None

    def idents(self, keys: np.ndarray) -> list[int | None]:
        if not len(keys) or int(keys.max()) < IDENT_LIMIT:
            return keys.tolist()
        return [self.ident(k) for k in keys.tolist()]

    def name_of_ident(self, ident: int) -> str:
        """The name of the file whose ident is given (KeyError if none)."""
        name = self.name(ident)
        if name is None:
            raise KeyError(ident)
        return name
