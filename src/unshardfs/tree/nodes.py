"""The virtual tree: what every format produces and the FUSE adapter serves.

A format turns a byte source into directories and files. The adapter knows
nothing about formats; it only calls these methods. Everything is async so a
remote byte source can sit underneath without changing the contract.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Protocol, Union, runtime_checkable

from unshardfs.sources.base import ByteSource, Version
from unshardfs.sources.base import FdRange as FdRange  # part of the node API (`FileNode.cached_range`)


class Node:
    """Attributes common to files and directories.

    `mtime_ns` must be stable (taken from backing objects), never "now", so
    that tools comparing timestamps (rsync, make, caches) behave.
    """

    __slots__ = ("mtime_ns", "child_id")
    is_dir = False

    def __init__(self, mtime_ns: int) -> None:
        self.mtime_ns = mtime_ns
        # Id of a computed child within its directory (< 2**CHILD_ID_BITS),
        # set by directories that implement `child_name`; None otherwise.
        self.child_id: int | None = None

    def xattrs(self) -> dict[str, bytes]:
        """Extended attributes describing where the bytes come from."""
        return {}


def size_of(node: Node) -> int:
    """A file's size; 0 for a directory (what stat shows for it here)."""
    return node.size if isinstance(node, FileNode) else 0


class FileNode(Node):
    __slots__ = ("size",)

    def __init__(self, size: int, mtime_ns: int) -> None:
        super().__init__(mtime_ns)
        self.size = size

    async def read(self, offset: int, size: int) -> bytes:
        raise NotImplementedError

    def cached_range(self, offset: int, size: int) -> FdRange | None:
        """Where the bytes `read(offset, size)` would return lie, if that is known without any
        I/O and they are all in the page cache; None otherwise (then `read` serves them).

        An extension point for files whose bytes are stored as they are shown: the descriptor is
        the backing file's, checked against the version the file was resolved from. Only valid
        until the next await. The default: None."""
        return None

    def read_now(self, offset: int, size: int) -> bytes | bytearray | None:
        """The bytes `read(offset, size)` returns (or a bytearray of them, handed over), if they
        can be had at once without waiting on anything (a local file stored as shown, its bytes
        in the page cache); None otherwise
        (then `read` serves them, and reports whatever stood in the way). Lets an engine answer
        a READ where it read the request, with no coroutine. The default: None."""
        return None

    def content_version(self) -> tuple[object, ...]:
        """What changes whenever this file's bytes may have (the version of the object they are stored
        in, or of the blob and range their payload lies in), beyond its size and mtime; () when nothing
        more tells. Front ends build validators on it (`serve`'s ETag), so a client never joins ranges of
        two contents under one tag. The default: ()."""
        return ()

    def span(self, offset: int, size: int) -> int:
        """How many bytes a read at `offset` of up to `size` returns (0 at or past the end)."""
        if offset >= self.size or size <= 0:
            return 0
        return min(size, self.size - offset)


@runtime_checkable
class WholeLocalFile(Protocol):
    """A capability of a `FileNode`: its bytes are exactly those of one local file, from the
    first to the last, which the kernel may then read itself (FUSE passthrough) instead of asking
    the daemon. Files that transform, assemble or slice their bytes must not have it."""

    def open_backing(self) -> int | None:
        """A new O_RDONLY descriptor of that file, if it is still the version this node was
        resolved from (same inode, size, mtime); None otherwise (then the file is read as any
        other). The caller closes it."""


@dataclass(frozen=True, slots=True)
class StoredRange:
    """A file's bytes as they are stored: exactly bytes [offset, offset + length) of the object at
    `path` of `source`, as of `version` (from that source's `stat`). Where that object lies for a
    reader elsewhere (a URL) is the source's to say (`sources.base.StoredAt`)."""

    source: ByteSource
    path: str
    offset: int
    length: int
    version: Version


@runtime_checkable
class StoredBytes(Protocol):
    """A capability of a `FileNode`: whether its bytes, first to last, are one byte range of one
    stored object, unchanged (a raw chunk in a shard, a file passed through), so that a reader that
    knows nothing of unshardfs can fetch them from the store itself (`unshardfs refs`). Files whose
    bytes are decoded, assembled or computed answer why not; files without the capability are not
    (in-memory metadata, `BytesFile`, is written out whole instead)."""

    def stored_range(self) -> StoredRange | str:
        """The range; or, when the bytes are not one, why (a short phrase for a message that names
        the directory: "its chunks are gzip-encoded")."""


Entry = tuple[str, Node]


class EntryBatch:
    """Directory entries produced together, whose nodes are built only on demand.

    A listing of a million chunks needs names, sizes and child ids, not
    a million objects: the FUSE adapter reads those three lists directly,
    and calls `node(i)` only where it must keep a node. Iterating a batch
    yields (name, node) pairs like a plain list of entries, so walkers need
    not know the difference. All entries of a batch are files sharing one
    mtime.
    """

    __slots__ = ("names", "sizes", "child_ids", "mtime_ns")

    def __init__(self, names: list[str], sizes: list[int], child_ids: list[int | None], mtime_ns: int) -> None:
        self.names = names
        self.sizes = sizes
        self.child_ids = child_ids
        self.mtime_ns = mtime_ns

    def __len__(self) -> int:
        return len(self.names)

    def node(self, i: int) -> "FileNode":
        raise NotImplementedError

    def __iter__(self) -> Iterator[Entry]:
        for i, name in enumerate(self.names):
            yield name, self.node(i)


# What `DirNode.entries` yields: plain (name, node) lists or lazy batches.
Batch = Union[list[Entry], EntryBatch]


class Verdict(enum.Enum):
    """Lookup answers other than a node or None (absent), for layered directories."""

    PASS = "pass"  # not this layer's name: the layer below decides
    HIDE = "hide"  # the name exists below but is hidden from the view

# Ids of computed children must fit in this many bits, leaving the rest of a
# 64-bit inode number to say which directory they belong to.
CHILD_ID_BITS = 56


class DirNode(Node):
    __slots__ = ()
    is_dir = True

    async def lookup(self, name: str) -> Node | None:
        """The child called `name`, or None when it does not exist."""
        raise NotImplementedError

    def entries(self) -> AsyncIterator[Batch]:
        """Children in a stable order, produced lazily in batches.

        Implementations must stream: a scale directory can hold a billion
        chunks, so nothing may build the whole listing in memory. Batches
        (e.g. one per minishard) keep the per-entry cost of async iteration
        out of large listings.
        """
        raise NotImplementedError

    # Directories whose children are computed from ids (chunk ids, segment
    # ids) set `child_id` on those children and map it back with `child_name`;
    # the FUSE adapter then derives inode numbers from the ids instead of
    # remembering every child the kernel has seen, so the daemon's memory
    # does not grow with the size of listed directories.

    stable_key: str | None = None  # identifies the directory across re-lookups

    def will_read_all(self) -> None:
        """The caller will read every file directly in this directory (and, for a directory of
        nested chunk keys, below it), whole, in listing order: an export or a check says so before
        it lists the directory. A directory that can fetch those files ahead in large reads (a
        sharded directory over a remote source) declares them now, in the background; the rest
        do nothing (each read is its own). Never required: reads work the same either way."""

    def child_name(self, child_id: int) -> str:
        """The name of the child whose `child_id` is given."""
        raise KeyError(child_id)


@runtime_checkable
class Closable(Protocol):
    """An iterator of `DirNode.entries` that holds something until it is closed (an async
    generator its frame and what that has open, a remote listing its connection). A listing
    abandoned part way (a directory handle released early) is closed through `aclose`; an
    iterator without one is just dropped."""

    async def aclose(self) -> None:
        """Release what the iteration holds; it yields nothing after."""


class BytesFile(FileNode):
    """A small file held in memory (rewritten metadata such as `info`)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes, mtime_ns: int) -> None:
        super().__init__(len(data), mtime_ns)
        self.data = data

    async def read(self, offset: int, size: int) -> bytes:
        return self.data[offset:offset + size]

    def content_version(self) -> tuple[object, ...]:
        return (zlib.crc32(self.data),)
