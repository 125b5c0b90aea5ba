"""Source-backed directories and files, shown as they are.

Formats build on `PassthroughDir` by overriding a few names (a rewritten
`info`, a sharded scale directory) and hiding others (shard files); every
other file of the dataset (provenance, segment_properties/, annotations)
passes through unchanged.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Awaitable, Callable, Iterable

from unshardfs.sources.base import BackingFiles, ByteSource, ObjectStat, join_path, name_problem
from unshardfs.tree.nodes import Batch, DirNode, Entry, FileNode, Node, StoredRange, Verdict
from unshardfs.util.errors import DataError, SourceError

log = logging.getLogger(__name__)

# Given the source path of a child and its stat (None when the source has no
# such object, or cannot tell, as for a directory on a plain HTTP server),
# return the node to show instead of a plain passthrough node, Verdict.HIDE
# to hide it, or Verdict.PASS to show the source entry as it is.
Override = Callable[[str, "ObjectStat | None"], Awaitable["Node | Verdict"]]
# Names a format knows to exist in a directory path: the listing of sources
# that cannot list.
Declared = Callable[[str], Iterable[str]]
LIST_BATCH = 1024


class PassthroughFile(FileNode):
    """A source object shown as it is; over a local source, a `WholeLocalFile`.

    Reads carry the version the object had when this node was made, so a
    file never serves part of one version and part of another: once the
    object changed (a local file rewritten, an object replaced on a server,
    a zip archive rewritten around its members) a read fails with
    StaleError and the front end resolves the name again.

    An object the source refuses (`ObjectStat.refused`: a link leading
    outside the source, a FIFO) is such a file too, listed and found by
    name, and every read of it fails with the reason: never absent.
    """

    __slots__ = ("source", "path", "version", "refused")

    def __init__(self, source: ByteSource, path: str, st: ObjectStat) -> None:
        super().__init__(st.size, st.mtime_ns)
        self.source = source
        self.path = path
        self.version = st.version
        self.refused = st.refused

    def open_backing(self) -> int | None:
        source = self.source
        if not isinstance(source, BackingFiles) or not self.version or self.refused is not None:
            return None
        return source.open_backing(self.path, self.version)

    async def read(self, offset: int, size: int) -> bytes:
        if self.refused is not None:
            raise DataError(self.path, f"refused: {self.refused}")
        try:
            return await self.source.read(self.path, offset, size, self.version or None)
        except SourceError as e:
            raise DataError(self.path, str(e)) from e

    def content_version(self) -> tuple[object, ...]:
        return self.version

    def xattrs(self) -> dict[str, bytes]:
        return {"user.unshardfs.source": self.path.encode()}

    def stored_range(self) -> StoredRange | str:
        """The whole object (`StoredBytes`); none for one the source refuses (a reader elsewhere must not
        be sent where the mount would not go)."""
        if self.refused is not None:
            return f"it is refused: {self.refused}"
        return StoredRange(self.source, self.path, 0, self.size, self.version)


class PassthroughDir(DirNode):
    """A source directory; `override` lets a format replace or hide children."""

    __slots__ = ("source", "path", "override", "declared")

    def __init__(self, source: ByteSource, path: str, st: ObjectStat, override: Override | None = None,
                 declared: Declared | None = None) -> None:
        super().__init__(st.mtime_ns)
        self.source = source
        self.path = path
        self.override = override
        self.declared = declared

    async def _child(self, name: str, st: ObjectStat | None) -> Node | None:
        path = join_path(self.path, name)
        if self.override is not None:
            replaced = await self.override(path, st)
            if replaced is Verdict.HIDE:
                return None
            if replaced is not Verdict.PASS:
                return replaced
        if st is None:
            return None
        if st.is_dir:
            return PassthroughDir(self.source, path, st, self.override, self.declared)
        return PassthroughFile(self.source, path, st)

    async def lookup(self, name: str) -> Node | None:
        if name_problem(name) is not None:
            return None  # never a path: `..` or an embedded `/` would leave this directory
        path = join_path(self.path, name)
        if not self.source.listable and self.override is not None:
            # Such a source cannot tell a directory exists (and asking costs a
            # round trip): what the format knows comes first.
            known = await self.override(path, None)
            if known is Verdict.HIDE:
                return None
            if known is not Verdict.PASS:
                return known
        st = await self.source.stat(path)
        if st is None:
            st = await self.source.stat_dir(path)
        return await self._child(name, st)

    async def entries(self) -> AsyncIterator[Batch]:
        if not self.source.listable:
            # Only what the format's metadata names can be shown.
            known: list[Entry] = []
            for name in (self.declared(self.path) if self.declared else ()):
                node = await self.lookup(name)
                if node is not None:
                    known.append((name, node))
            if known:
                yield known
            return
        # Streamed in the source's own order: an unchanged local directory
        # lists in the same order every time, which keeps readdir cookies
        # stable without holding a huge unsharded scale's names in memory.
        batch: list[Entry] = []
        async for name, st in self.source.list(self.path):
            node = await self._child(name, st)
            if node is not None:
                batch.append((name, node))
                if len(batch) >= LIST_BATCH:
                    yield batch
                    batch = []
        if batch:
            yield batch
