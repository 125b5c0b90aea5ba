"""The compact index of a zip archive's members: one bytes blob of sorted names and numpy columns.

Nothing is kept per entry but its name's bytes and a few fixed-size
columns (64 bytes per entry beside the name), so a central directory of
millions of entries costs tens of megabytes, not the gigabytes of one
object per entry.
"""

from __future__ import annotations

import bisect
from array import array
from collections import Counter

import numpy as np

from unshardfs.sources.zipformat import Skip


class _Names:
    """The sorted names as a sequence of bytes, for `bisect` (no object per entry kept)."""

    __slots__ = ("blob", "starts")

    def __init__(self, blob: bytes, starts: np.ndarray) -> None:
        self.blob = blob
        self.starts = array("Q")  # indexing an array gives ints faster than numpy scalars
        self.starts.frombytes(starts.astype(np.uint64).tobytes())

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i: int) -> bytes:
        return self.blob[self.starts[i]:self.starts[i + 1]]


class ZipIndex:
    """The usable entries of one central directory, sorted by name (UTF-8 bytes).

    Directory entries keep their trailing '/', so a directory's children are
    exactly the names under its prefix and listings are a walk over one
    contiguous range. Columns are numpy arrays; the local header's data offset
    is filled in on a member's first read (-1 until then).
    """

    def __init__(self, names: list[bytes], columns: dict[str, np.ndarray], cd_start: int) -> None:
        order = sorted(range(len(names)), key=names.__getitem__)
        lengths = np.fromiter((len(names[i]) for i in order), dtype=np.uint64, count=len(order))
        self.names = _Names(b"".join(names[i] for i in order), np.concatenate([[0], np.cumsum(lengths)]))
        pick = np.asarray(order, dtype=np.int64)
        self.header = np.asarray(columns["header"], dtype=np.uint64)[pick]
        self.csize = np.asarray(columns["csize"], dtype=np.uint64)[pick]
        self.usize = np.asarray(columns["usize"], dtype=np.uint64)[pick]
        self.method = np.asarray(columns["method"], dtype=np.uint16)[pick]
        self.crc = np.asarray(columns["crc"], dtype=np.uint32)[pick]
        # The central extra field's length: the local one is usually the same, so the data offset can be
        # guessed before the local header has been read.
        self.extra = np.asarray(columns["extra"], dtype=np.uint16)[pick]
        self.isdir = np.fromiter((names[i].endswith(b"/") for i in order), dtype=bool, count=len(order))
        self.data = np.full(len(order), -1, dtype=np.int64)
        # Where the next member's local header (or the central directory) starts:
        # a member's data must end there.
        self.limit = np.full(len(order), cd_start, dtype=np.uint64)
        if len(order):
            by_offset = np.argsort(self.header, kind="stable")
            self.limit[by_offset[:-1]] = self.header[by_offset[1:]]

    def __len__(self) -> int:
        return len(self.names)

    def find(self, name: bytes) -> int:
        i = bisect.bisect_left(self.names, name)
        return i if i < len(self.names) and self.names[i] == name else -1

    def is_dir(self, prefix: bytes) -> bool:
        """Whether any entry lies under `prefix` (a directory name ending in '/')."""
        i = bisect.bisect_left(self.names, prefix)
        return i < len(self.names) and self.names[i].startswith(prefix)


def build_index(names: list[bytes], columns: dict[str, array], cd_start: int, skip: Skip) -> ZipIndex:
    """The index of the parsed entries `names` / `columns` whose names are unambiguous.

    Ambiguous names are never paths (which of two members would a reader
    get?): a name that occurs twice, a file that is also a directory, and
    files sharing one local header (overlapping members) are told to `skip`.
    """
    header = columns["header"]
    counts = Counter(names)
    # Every directory some entry implies (its parents, and directory entries themselves).
    dirs: set[bytes] = set()
    for name in names:
        parent = name[:-1] if name.endswith(b"/") else name.rpartition(b"/")[0]
        while parent and parent not in dirs:
            dirs.add(parent)
            parent = parent.rpartition(b"/")[0]
    shared = Counter(header[i] for i, name in enumerate(names) if not name.endswith(b"/"))
    keep: list[int] = []
    listed: set[bytes] = set()
    for i, name in enumerate(names):
        if name.endswith(b"/"):
            if name not in listed:  # a repeated directory entry is harmless: shown once
                listed.add(name)
                keep.append(i)
            continue
        reason = ("the name occurs more than once" if counts[name] > 1 else
                  "the name is also a directory" if name in dirs else
                  "its local header is shared with another entry (overlapping members)" if shared[header[i]] > 1
                  else None)
        if reason is None:
            keep.append(i)
        else:
            skip(name.decode(), reason)
    pick = np.asarray(keep, dtype=np.int64)
    return ZipIndex([names[i] for i in keep],
                    {k: np.asarray(v, dtype=np.uint64)[pick] for k, v in columns.items()}, cd_start)
