"""A dataset's directories with their identities kept apart from those of the datasets beside it."""

from __future__ import annotations

from typing import AsyncIterator

from unshardfs.tree.nodes import Batch, DirNode, Node


def inner_dir(node: DirNode) -> DirNode:
    """The directory a `NamespacedDir` (or several) shows, as its format built it."""
    while isinstance(node, NamespacedDir):
        node = node.inner
    return node


class NamespacedDir(DirNode):
    """A directory of a dataset shown beside others (a version of a versioned store, a dataset of a tree
    of datasets), its `stable_key` (and its subdirectories') prefixed with `namespace`: the front ends
    derive inode numbers from stable keys, and a format builds them from paths, which every version and
    every dataset repeats."""

    __slots__ = ("inner", "namespace")

    def __init__(self, inner: DirNode, namespace: str) -> None:
        super().__init__(inner.mtime_ns)
        self.inner = inner
        self.namespace = namespace
        self.child_id = inner.child_id

    @property
    def stable_key(self) -> str | None:  # type: ignore[override]
        key = self.inner.stable_key
        return None if key is None else f"{self.namespace}/{key}"

    def xattrs(self) -> dict[str, bytes]:
        return self.inner.xattrs()

    def child_name(self, child_id: int) -> str:
        return self.inner.child_name(child_id)

    def will_read_all(self) -> None:
        self.inner.will_read_all()

    def wrap(self, node: Node | None) -> Node | None:
        return NamespacedDir(node, self.namespace) if isinstance(node, DirNode) else node

    async def lookup(self, name: str) -> Node | None:
        return self.wrap(await self.inner.lookup(name))

    async def entries(self) -> AsyncIterator[Batch]:
        async for batch in self.inner.entries():
            if isinstance(batch, list):
                yield [(name, NamespacedDir(node, self.namespace) if isinstance(node, DirNode) else node)
                       for name, node in batch]
            else:
                yield batch  # files only
