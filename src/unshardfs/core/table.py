"""The index abstraction every format decodes into: chunk ids -> byte ranges of one blob.

A minishard index, one level of a Zarr shard index, a DVID shard's record
index: each becomes a `ChunkTable` of sorted unique uint64 ids with the
absolute byte range of each entry in its blob. Ranges are validated when the
table is built (inside the data area, no overflow); entries that fail are
kept out of the table and remembered in `bad`, so looking them up fails
loudly (EIO) instead of pretending the chunk is absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from unshardfs.core.blob import Blob

U64 = np.uint64


def int_list(values: np.ndarray) -> list[int]:
    """An integer array as Python ints (numpy's `tolist` is untyped)."""
    out: list[int] = values.tolist()
    return out
MAX_BAD_REASONS = 1000  # per table; a garbage index must not grow a huge dict


@dataclass(frozen=True, slots=True, eq=False)
class ChunkTable:
    blob: Blob
    ids: np.ndarray  # uint64, sorted, unique
    starts: np.ndarray  # uint64, absolute offsets in `blob`
    lengths: np.ndarray  # uint64
    bad: Mapping[int, str] = field(default_factory=dict)
    # Per-entry extra column a format needs to find a chunk in its range
    # (DVID: the row inside an Arrow record batch); None when unused.
    extra: np.ndarray | None = None
    # Which table of its shard this is, in the format's terms (a minishard number); 0 when a
    # shard has one table. Lets `ShardedStore.placed` check an id belongs to this very table.
    part: int = 0

    @property
    def nbytes(self) -> int:
        extra = 0 if self.extra is None else self.extra.nbytes
        return self.ids.nbytes + self.starts.nbytes + self.lengths.nbytes + extra + 96 * len(self.bad) + 256

    def __len__(self) -> int:
        return len(self.ids)

    def find(self, chunk_id: int) -> int | None:
        """Position of `chunk_id`, or None when the table does not hold it."""
        ids = self.ids
        if not len(ids) or chunk_id < 0 or chunk_id >= 1 << 64:
            return None
        i = int(ids.searchsorted(U64(chunk_id)))
        return i if i < len(ids) and ids.item(i) == chunk_id else None

    def row(self, i: int) -> tuple[int, int, int]:
        """(id, start, length) of entry `i`."""
        return int(self.ids[i]), int(self.starts[i]), int(self.lengths[i])

    def where(self, mask: np.ndarray) -> "ChunkTable":
        """The entries selected by a boolean mask (same blob, no reasons)."""
        return ChunkTable(self.blob, self.ids[mask], self.starts[mask], self.lengths[mask], {},
                          None if self.extra is None else self.extra[mask], self.part)

    @classmethod
    def build(cls, blob: Blob, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
              data_lo: int, data_hi: int, extra: np.ndarray | None = None,
              reasons: dict[int, str] | None = None, part: int = 0) -> "ChunkTable":
        """Validate ranges against the data area [data_lo, data_hi) of `blob`, sort, deduplicate.

        All arithmetic is modulo 2**64 (as the formats define it); a range
        whose end wraps around is outside by construction. On duplicate ids
        the first entry wins, as a sequential reader of the index would find.
        """
        ids = np.asarray(ids, dtype=U64)
        starts = np.asarray(starts, dtype=U64)
        lengths = np.asarray(lengths, dtype=U64)
        ends = starts + lengths  # wraps on overflow; caught by ends >= starts
        ok = (ends >= starts) & (starts >= U64(max(data_lo, 0))) & (ends <= U64(max(data_hi, 0)))
        n = len(ids)
        in_order = n <= 1 or bool((ids[1:] > ids[:-1]).all())  # writers usually sort
        if in_order:
            keep = None
        else:
            order = np.argsort(ids, kind="stable")
            _, first = np.unique(ids[order], return_index=True)
            keep = order[first]
        bad: dict[int, str] = dict(reasons or {})
        if not ok.all():
            picked = np.arange(n) if keep is None else keep
            for i in picked[~ok[picked]][:MAX_BAD_REASONS].tolist():
                bad.setdefault(int(ids[i]), f"byte range [{int(starts[i])}, +{int(lengths[i])}) lies outside the "
                                             f"data area [{data_lo}, {data_hi}) of {blob.label}")
            keep = picked[ok[picked]]
        if keep is None:
            return cls(blob, ids, starts, lengths, bad, extra, part)
        return cls(blob, ids[keep], starts[keep], lengths[keep], bad, None if extra is None else extra[keep], part)

    @classmethod
    def empty(cls, blob: Blob, part: int = 0) -> "ChunkTable":
        nothing = np.zeros(0, dtype=U64)
        return cls(blob, nothing, nothing, nothing, part=part)
