"""A sharded directory shown unsharded: computed chunk names over the source directory.

Lookups of computed names go straight to the shard indexes (no listing);
listings stream the chunk files shard by shard; the shard files themselves
are hidden and every other file of the source directory passes through.
Formats only choose the store, naming and codec (a `ChunkContext`).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Coroutine, Literal

from unshardfs.core.chunks import ChunkContext
from unshardfs.sources.base import ByteSource, ObjectStat
from unshardfs.tree.nodes import Batch, DirNode, Node, Verdict
from unshardfs.tree.overlay import OverlayDir


class ShardedDir(OverlayDir):
    __slots__ = ("chunks",)

    def __init__(self, source: ByteSource, path: str, st: ObjectStat, chunks: ChunkContext,
                 fixed: dict[str, Node] | None = None) -> None:
        super().__init__(source, path, st, fixed or {}, f"sharded:{path}")
        self.chunks = chunks

    def claims(self, name: str) -> bool:
        return self.chunks.naming.claims(name)

    def hides(self, name: str) -> bool:
        return self.chunks.store.is_shard_file(name)

    def virtual_lookup(self, name: str) -> Coroutine[Any, Any, Node | None | Literal[Verdict.PASS]]:
        return self.chunks.lookup(name)  # its coroutine, awaited by the caller (no frame of ours per lookup)

    def virtual_entries(self) -> AsyncIterator[Batch]:
        return self.chunks.listing()

    def will_read_all(self) -> None:
        self.chunks.will_read_all()

    def child_name(self, child_id: int) -> str:
        return self.chunks.naming.name_of_child_id(child_id)


class ChunksDir(DirNode):
    """A directory of chunk files only, with no source directory behind it (DVID scales)."""

    __slots__ = ("chunks", "stable_key")

    def __init__(self, chunks: ChunkContext, mtime_ns: int, stable_key: str) -> None:
        super().__init__(mtime_ns)
        self.chunks = chunks
        self.stable_key = stable_key

    async def lookup(self, name: str) -> Node | None:
        found = await self.chunks.lookup(name)
        return None if found is Verdict.PASS else found

    def entries(self) -> AsyncIterator[Batch]:
        return self.chunks.listing()

    def will_read_all(self) -> None:
        self.chunks.will_read_all()

    def child_name(self, child_id: int) -> str:
        return self.chunks.naming.name_of_child_id(child_id)
