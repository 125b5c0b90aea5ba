"""The virtual tree: what every format produces and the FUSE adapter serves.

A format turns a byte source into directories and files. The adapter knows
nothing about formats; it only calls these methods. Everything is async so a
remote byte source can sit underneath without changing the contract.
"""

from __future__ import annotations

from typing import AsyncIterator


class Node:
    """Attributes common to files and directories.

    `mtime_ns` must be stable (taken from backing objects), never "now", so
    that tools comparing timestamps (rsync, make, caches) behave.
    """

    __slots__ = ("mtime_ns",)
    is_dir = False

    def __init__(self, mtime_ns: int) -> None:
        self.mtime_ns = mtime_ns

    def xattrs(self) -> dict[str, bytes]:
        """Extended attributes describing where the bytes come from."""
        return {}


class FileNode(Node):
    __slots__ = ("size",)

    def __init__(self, size: int, mtime_ns: int) -> None:
        super().__init__(mtime_ns)
        self.size = size

    async def read(self, offset: int, size: int) -> bytes:
        raise NotImplementedError


class DirNode(Node):
    __slots__ = ()
    is_dir = True

    async def lookup(self, name: str) -> Node | None:
        """The child called `name`, or None when it does not exist."""
        raise NotImplementedError

    def entries(self) -> AsyncIterator[tuple[str, Node]]:
        """Children in a stable order, produced lazily.

        Implementations must stream: a scale directory can hold a billion
        chunks, so nothing may build the whole listing in memory.
        """
        raise NotImplementedError


class BytesFile(FileNode):
    """A small file held in memory (rewritten metadata such as `info`)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes, mtime_ns: int) -> None:
        super().__init__(len(data), mtime_ns)
        self.data = data

    async def read(self, offset: int, size: int) -> bytes:
        return self.data[offset:offset + size]
