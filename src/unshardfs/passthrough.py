"""Source-backed directories and files, shown as they are.

Formats build on `PassthroughDir` by overriding a few names (a rewritten
`info`, a sharded scale directory) and hiding others (shard files); every
other file of the dataset (provenance, segment_properties/, annotations)
passes through unchanged.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Awaitable, Callable

from .errors import DataError, SourceError
from .sources.base import ByteSource, ObjectStat, join_key
from .vtree import DirNode, Entry, FileNode, Node

log = logging.getLogger(__name__)

# Given the source key of a child and its stat, return the node to show
# instead of a plain passthrough node, `HIDDEN` to hide it, or None.
Override = Callable[[str, ObjectStat], Awaitable["Node | object | None"]]
HIDDEN = object()
LIST_BATCH = 1024


class PassthroughFile(FileNode):
    __slots__ = ("source", "key")

    def __init__(self, source: ByteSource, key: str, st: ObjectStat) -> None:
        super().__init__(st.size, st.mtime_ns)
        self.source = source
        self.key = key

    async def read(self, offset: int, size: int) -> bytes:
        try:
            return await self.source.read(self.key, offset, size)
        except SourceError as e:
            raise DataError(self.key, str(e)) from e

    def xattrs(self) -> dict[str, bytes]:
        return {"user.unshardfs.source": self.key.encode()}


class PassthroughDir(DirNode):
    """A source directory; `override` lets a format replace or hide children."""

    __slots__ = ("source", "key", "override")

    def __init__(self, source: ByteSource, key: str, st: ObjectStat, override: Override | None = None) -> None:
        super().__init__(st.mtime_ns)
        self.source = source
        self.key = key
        self.override = override

    async def _child(self, name: str, st: ObjectStat) -> Node | None:
        key = join_key(self.key, name)
        if self.override is not None:
            replaced = await self.override(key, st)
            if replaced is HIDDEN:
                return None
            if replaced is not None:
                return replaced  # type: ignore[return-value]
        if st.is_dir:
            return PassthroughDir(self.source, key, st, self.override)
        return PassthroughFile(self.source, key, st)

    async def lookup(self, name: str) -> Node | None:
        st = await self.source.stat(join_key(self.key, name))
        if st is None:
            return None
        return await self._child(name, st)

    async def entries(self) -> AsyncIterator[list[Entry]]:  # type: ignore[override]
        # Streamed in the source's own order: an unchanged local directory
        # lists in the same order every time, which keeps readdir cookies
        # stable without holding a huge unsharded scale's names in memory.
        batch: list[Entry] = []
        async for name, st in self.source.list(self.key):
            node = await self._child(name, st)
            if node is not None:
                batch.append((name, node))
                if len(batch) >= LIST_BATCH:
                    yield batch
                    batch = []
        if batch:
            yield batch
