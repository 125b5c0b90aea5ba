"""A versioned store's other versions as directories beside its current tree.

The root of a mount of a versioned source (an OCDBT database; later Icechunk)
shows the current version's tree as usual, plus one read-only directory
`@NAME` per version (`@v1/ ... @v44/` for OCDBT generations), each the
complete tree of that version as the same format shows it, so
`diff -r @v3 @v4` compares two versions with plain tools. A version's tree is
opened on first lookup (its metadata read then) and kept for the most recent
`OPEN_VERSIONS`; a version whose data is not a dataset of the format (an
empty first commit, a version from before the metadata was written) shows its
keys as they are. Names in the current tree starting with '@' that equal a
version directory are shadowed by it.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Awaitable, Callable

from unshardfs.sources.base import ByteSource, ObjectStat, VersionedSource, VersionInfo
from unshardfs.tree.namespaced import NamespacedDir
from unshardfs.tree.nodes import Batch, DirNode, Entry, Node
from unshardfs.tree.passthrough import PassthroughDir
from unshardfs.util.errors import ConfigError, DataError, SourceError
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap

log = logging.getLogger(__name__)

OPEN_VERSIONS = 16  # version trees kept open (each holds its format's directory state)
PREFIX = "@"

# Opens the dataset tree of one version's source (the same format as the current tree).
OpenTree = Callable[[ByteSource], Awaitable[DirNode]]


class VersionDir(DirNode):
    """One version's tree, opened on first use (a plain listing of its keys if the format finds no dataset)."""

    __slots__ = ("owner", "info", "_tree")

    def __init__(self, owner: "VersionsRoot", info: VersionInfo) -> None:
        super().__init__(info.time_ns)
        self.owner = owner
        self.info = info
        self._tree: DirNode | None = None

    @property
    def stable_key(self) -> str:  # type: ignore[override]
        return f"{PREFIX}{self.info.name}"

    async def tree(self) -> DirNode:
        if self._tree is None:
            self._tree = NamespacedDir(await self.owner.open_version(self.info), self.stable_key)
        return self._tree

    async def lookup(self, name: str) -> Node | None:
        return await (await self.tree()).lookup(name)

    def child_name(self, child_id: int) -> str:
        if self._tree is None:
            raise KeyError(child_id)
        return self._tree.child_name(child_id)

    async def entries(self) -> AsyncIterator[Batch]:
        async for batch in (await self.tree()).entries():
            yield batch

    def xattrs(self) -> dict[str, bytes]:
        return {"user.unshardfs.version": self.info.name.encode(),
                "user.unshardfs.commit_time_ns": str(self.info.time_ns).encode()}


class VersionsRoot(DirNode):
    """`tree` (the current version's) with a directory `@NAME` for every version of `source`."""

    __slots__ = ("tree", "source", "open_tree", "_versions", "_open")

    def __init__(self, tree: DirNode, source: VersionedSource, open_tree: OpenTree) -> None:
        super().__init__(tree.mtime_ns)
        self.tree = tree
        self.source = source
        self.open_tree = open_tree
        self._versions: dict[str, VersionInfo] | None = None
        self._open: BoundedMap[str, VersionDir] = BoundedMap(OPEN_VERSIONS)

    @property
    def stable_key(self) -> str | None:  # type: ignore[override]
        return self.tree.stable_key

    def xattrs(self) -> dict[str, bytes]:
        return self.tree.xattrs()

    def child_name(self, child_id: int) -> str:
        return self.tree.child_name(child_id)

    async def versions(self) -> dict[str, VersionInfo]:
        """The versions by directory name (read once: a mount shows the versions it started with). When the
        store's version records are damaged there are none (logged): the current tree stays usable."""
        if self._versions is None:
            try:
                found = await self.source.versions()
            except (DataError, SourceError) as e:
                log_once(log, "versions:damaged", "no version directories: %s", e)
                found = []
            self._versions = {PREFIX + v.name: v for v in found}
        return self._versions

    async def lookup(self, name: str) -> Node | None:
        if name.startswith(PREFIX):
            info = (await self.versions()).get(name)
            if info is not None:
                node: VersionDir | None = self._open.get(name)
                if node is None:
                    node = self._open[name] = VersionDir(self, info)
                return node
        return await self.tree.lookup(name)

    async def entries(self) -> AsyncIterator[Batch]:
        versions = await self.versions()
        async for batch in self.tree.entries():
            kept = [entry for entry in batch if entry[0] not in versions]
            if kept:
                yield kept
        batch_out: list[Entry] = []
        for name in versions:
            node = await self.lookup(name)
            if node is not None:
                batch_out.append((name, node))
                if len(batch_out) >= 1024:
                    yield batch_out
                    batch_out = []
        if batch_out:
            yield batch_out

    async def open_version(self, info: VersionInfo) -> DirNode:
        source = await self.source.open_version(info.name)
        if source is None:
            raise DataError(f"{PREFIX}{info.name}", "the version is listed but cannot be opened")
        try:
            return await self.open_tree(source)
        except ConfigError as e:
            log_once(log, f"versions:{info.name}", "%s%s: shown as stored (%s)", PREFIX, info.name, e)
            return PassthroughDir(source, "", ObjectStat(0, info.time_ns, True, ()))
        except SourceError as e:
            raise DataError(f"{PREFIX}{info.name}", str(e)) from None
