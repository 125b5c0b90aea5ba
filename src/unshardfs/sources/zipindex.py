"""The compact index of a zip archive's members: one byte string of sorted names and numpy columns.

Nothing is kept per entry but its name's bytes and a few fixed-size
columns (57 bytes per entry beside the name), and building it creates no
Python object per entry either: a central directory of a million entries
costs tens of megabytes, not the gigabytes of one object per entry.

Names are kept in *path order*: byte order with '/' sorting before every
other byte, so that everything under `a/` follows `a` directly (`a`,
`a/b`, `a-b`, not `a`, `a-b`, `a/b`). A directory's children are then one
contiguous range, listed in name order, and a file that is also a
directory sits right before its own children. To compare with plain
`bytes` comparisons the names are stored mapped (`KEY`: '/' becomes 0x01,
the bytes below it move up by one); every name goes in and out through it.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Iterator

import numpy as np

from unshardfs.sources.zipformat import Entries, Skip, gather

# Path order as plain byte order: '/' -> 0x01, 0x01..0x2e -> 0x02..0x2f, the rest unchanged
# (a name never holds NUL). `UNKEY` maps back.
_SLASH = ord("/")
_TABLE = bytes([0, *range(2, _SLASH + 1), 1, *range(_SLASH + 1, 256)])
KEY = bytes.maketrans(bytes(range(256)), _TABLE)
UNKEY = bytes.maketrans(_TABLE, bytes(range(256)))
SEP = b"\x01"  # '/' as stored
ROWS = 1 << 16  # names moved at once while the sorted name string is built (bounds the temporaries)


class _Names:
    """The sorted (mapped) names as a sequence of bytes, for `bisect` (no object per entry kept)."""

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
    """The usable entries of one central directory, in path order.

    Directory entries keep their trailing '/'. Columns are numpy arrays; the
    local header's data offset is filled in on a member's first read (-1
    until then).
    """

    def __init__(self, names: _Names, columns: dict[str, np.ndarray], cd_start: int) -> None:
        self.names = names
        self.header = columns["header"].astype(np.uint64, copy=False)
        self.csize = columns["csize"].astype(np.uint64, copy=False)
        self.usize = columns["usize"].astype(np.uint64, copy=False)
        self.method = columns["method"].astype(np.uint16, copy=False)
        self.crc = columns["crc"].astype(np.uint32, copy=False)
        # The central extra field's length: the local one is usually the same, so the data offset can be
        # guessed before the local header has been read.
        self.extra = columns["extra"].astype(np.uint16, copy=False)
        ends = np.frombuffer(names.starts, dtype=np.uint64)[1:].astype(np.int64) - 1
        blob = np.frombuffer(names.blob, dtype=np.uint8)
        self.isdir = blob[ends] == SEP[0] if len(ends) else np.zeros(0, dtype=bool)
        self.data = np.full(len(names), -1, dtype=np.int64)
        # Where the next member's local header (or the central directory) starts:
        # a member's data must end there.
        self.limit = np.full(len(names), cd_start, dtype=np.uint64)
        if len(names):
            by_offset = np.argsort(self.header, kind="stable")
            self.limit[by_offset[:-1]] = self.header[by_offset[1:]]

    def __len__(self) -> int:
        return len(self.names)

    def name(self, i: int) -> bytes:
        """Entry i's name as the archive has it (under the pipeline's root)."""
        return self.names[i].translate(UNKEY)

    def find(self, name: bytes) -> int:
        key = name.translate(KEY)
        i = bisect.bisect_left(self.names, key)
        return i if i < len(self.names) and self.names[i] == key else -1

    def is_dir(self, prefix: bytes) -> bool:
        """Whether any entry lies under `prefix` (a directory name ending in '/')."""
        key = prefix.translate(KEY)
        i = bisect.bisect_left(self.names, key)
        return i < len(self.names) and self.names[i].startswith(key)

    def children(self, prefix: bytes) -> Iterator[tuple[bytes, int | None]]:
        """The children of the directory `prefix` ('' or a name ending in '/'), in name order: (name,
        entry) for a file, (name, None) for a directory (which needs no entry of its own); one step
        per file or child directory."""
        names = self.names
        key = prefix.translate(KEY)
        i = bisect.bisect_left(names, key)
        while i < len(names):
            name = names[i]
            if not name.startswith(key):
                break
            rest = name[len(key):]
            child, slash, _ = rest.partition(SEP)
            if not rest:  # the directory's own entry
                i += 1
            elif slash:
                yield child.translate(UNKEY), None
                # Past every name under key/child/: the next byte up from the stored '/'.
                i = bisect.bisect_left(names, key + child + b"\x02", i + 1)
            else:
                yield child.translate(UNKEY), i
                i += 1


def build_index(entries: Entries, cd_start: int, skip: Skip) -> ZipIndex:
    """The index of `entries` whose names are unambiguous (`entries` is consumed).

    Ambiguous names are never paths (which of two members would a reader
    get?): a file name that occurs twice, a file that is also a directory,
    and files sharing one local header (overlapping members) are told to
    `skip`; a directory entry given twice is kept once.
    """
    n = len(entries)
    # Path order is plain byte order from here on (bytes.translate: no index array as numpy's take would make).
    keys = np.frombuffer(entries.names.tobytes().translate(KEY), dtype=np.uint8)
    entries.names = np.zeros(0, dtype=np.uint8)
    first, size = entries.starts[:-1], np.diff(entries.starts)
    order, same = path_order(keys, first, size)
    first, size = first[order], size[order]
    sep = SEP[0]
    isdir = keys[first + size - 1] == sep if n else np.zeros(0, dtype=bool)
    # Runs of equal names: `dup` marks every member of a run of two or more.
    dup = same.copy()
    dup[:-1] |= same[1:]
    # A file directly followed by a name under it (path order puts it right after its run).
    nxt = np.flatnonzero(~isdir[:-1] & ~same[1:] & (size[1:] > size[:-1]))
    nxt = nxt[keys[first[nxt + 1] + size[nxt]] == sep]
    under = np.zeros(n, dtype=bool)
    for i in nxt:  # candidates only: a name with a '/' right after this file's length
        a, b, m = int(first[i]), int(first[i + 1]), int(size[i])
        under[i] = bool(np.array_equal(keys[a:a + m], keys[b:b + m]))
    if under.any():  # every member of such a file's run
        run = np.cumsum(~same) - 1
        under = np.isin(run, run[under])
    files = np.flatnonzero(~isdir)
    header = entries.columns["header"][order[files]]
    by_header = np.sort(header)
    shared = np.zeros(n, dtype=bool)
    shared[files] = np.isin(header, by_header[1:][by_header[1:] == by_header[:-1]])
    del files, header, by_header
    refused = ~isdir & (dup | under | shared)
    for i in np.flatnonzero(refused):
        reason = ("the name occurs more than once" if dup[i] else "the name is also a directory" if under[i] else
                  "its local header is shared with another entry (overlapping members)")
        skip(keys[first[i]:first[i] + size[i]].tobytes().translate(UNKEY).decode(), reason)
    keep = np.flatnonzero(~refused & ~(isdir & same))  # a repeated directory entry is harmless: shown once
    del dup, under, shared, refused, isdir, same
    first, size = first[keep], size[keep]
    starts = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(size, out=starts[1:])
    blob = b"".join(gather(keys, first[at:at + ROWS], size[at:at + ROWS]).tobytes()
                    for at in range(0, len(keep), ROWS))
    del keys, first, size
    rows = order[keep]
    del order, keep
    columns = {k: entries.columns.pop(k)[rows] for k in list(entries.columns)}
    return ZipIndex(_Names(blob, starts), columns, cd_start)


def path_order(keys: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, same): the permutation sorting the byte strings `keys[starts[i]:starts[i] + lengths[i]]`
    (none holding a zero byte), stable; same[j] tells whether sorted string j equals string j - 1.

    A most-significant-digit radix sort eight bytes at a time: each round sorts, by its next eight
    bytes, only the strings still tied with another, so the work is bounded by the bytes that
    decide the order, and the temporaries by a few integers per string.
    """
    n = len(lengths)
    index = np.int32 if n < (1 << 31) else np.int64
    order = np.arange(n, dtype=index)
    group = np.zeros(n, dtype=index)  # per sorted position: where its run of strings tied so far starts
    active = np.arange(n, dtype=index) if n > 1 else np.zeros(0, dtype=index)
    depth = 0
    while len(active):
        rows = order[active]
        word = _word(keys, starts[rows], lengths[rows], depth)
        perm = np.lexsort((word, group[active]))
        rows, word = rows[perm], word[perm]
        tied = group[active][perm]
        order[active] = rows
        new = np.ones(len(active), dtype=bool)
        new[1:] = (tied[1:] != tied[:-1]) | (word[1:] != word[:-1])
        heads = np.flatnonzero(new)
        group[active] = active[heads][np.cumsum(new) - 1]
        depth += 8
        # Runs of two or more of which some string goes on: the next round's.
        count = np.diff(np.append(heads, len(active)))
        longest = np.maximum.reduceat(lengths[rows], heads)
        going = np.repeat((count > 1) & (longest > depth), count)
        active = active[going]
        del rows, word, tied, perm, new, heads, count, longest, going
    same = np.zeros(n, dtype=bool)
    same[1:] = group[1:] == group[:-1]
    return order, same


def _word(keys: np.ndarray, starts: np.ndarray, lengths: np.ndarray, depth: int) -> np.ndarray:
    """Bytes depth..depth+7 of each string as one big-endian integer (zeros past its end)."""
    word = np.empty(len(starts), dtype=np.uint64)
    step = depth + np.arange(8)
    for at in range(0, len(starts), ROWS):  # a few bytes of temporaries per string, not 128
        part = slice(at, at + ROWS)
        octets = keys[np.minimum(starts[part, None] + step, len(keys) - 1)]
        octets[lengths[part, None] <= step] = 0
        word[part] = octets.view(">u8")[:, 0]
    return word
