"""A source directory with computed children laid over it.

Formats show a few fixed files (rewritten metadata), a family of computed
names (chunk files) answered without listing, and everything else of the
source directory unchanged, minus what the computed view replaces (shard
files, the original metadata). Both the precomputed and the zarr formats
build their special directories on this.
"""

from __future__ import annotations

from typing import AsyncIterator, Literal

from unshardfs.sources.base import ByteSource, ObjectStat
from unshardfs.tree.nodes import Batch, DirNode, Node, Verdict
from unshardfs.tree.passthrough import Declared, PassthroughDir


class OverlayDir(DirNode):
    __slots__ = ("source", "path", "fixed", "stable_key", "rest")

    def __init__(self, source: ByteSource, path: str, st: ObjectStat, fixed: dict[str, Node],
                 stable_key: str, declared: Declared | None = None) -> None:
        super().__init__(st.mtime_ns)
        self.source = source
        self.path = path
        self.fixed = fixed
        self.stable_key = stable_key
        self.rest = PassthroughDir(source, path, st, self._override, declared)

    async def _override(self, path: str, st: ObjectStat | None) -> Node | Verdict:
        parent, _, name = path.rpartition("/")
        if parent != self.path:
            return Verdict.PASS  # deeper levels pass through untouched
        if name in self.fixed or self.claims(name) or self.hides(name):
            return Verdict.HIDE
        return await self.source_child(path, st)

    # -- what subclasses define ---------------------------------------------

    def claims(self, name: str) -> bool:
        """Whether `name` has the computed form; such source entries are shadowed."""
        return False

    def hides(self, name: str) -> bool:
        """Source entries replaced by the computed view (shard files, old metadata)."""
        return False

    async def source_child(self, path: str, st: ObjectStat | None) -> Node | Verdict:
        """What to show for a remaining source entry (`st` None: not known to the source):
        a node, Verdict.HIDE, or Verdict.PASS (as it is, or absent)."""
        return Verdict.PASS

    async def virtual_lookup(self, name: str) -> Node | None | Literal[Verdict.PASS]:
        """The computed child, None if absent, or Verdict.PASS for names not of the computed form."""
        return Verdict.PASS

    async def virtual_entries(self) -> AsyncIterator[Batch]:
        return
        yield

    # -- the DirNode contract -------------------------------------------------

    async def lookup(self, name: str) -> Node | None:
        node = self.fixed.get(name)
        if node is not None:
            return node
        found = await self.virtual_lookup(name)
        if found is not Verdict.PASS:
            return found
        return await self.rest.lookup(name)

    async def entries(self) -> AsyncIterator[Batch]:
        if self.fixed:
            yield list(self.fixed.items())
        async for batch in self.virtual_entries():
            yield batch
        async for batch in self.rest.entries():
            yield batch
