"""Zarr directories as the views show them: arrays with unsharded chunk trees, groups.

A sharded array's directory shows its rewritten metadata and one file per
non-empty inner chunk under the view's key layout; the source's shard
objects are hidden, everything else in the directory passes through.
Nested key layouts ("c/1/2/3") become directories computed on demand: a
lookup needs only the index of the one shard it touches.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

import numpy as np

from ...caches import Caches
from ...errors import DataError
from ...logonce import log_once
from ...overlay import NOT_VIRTUAL, OverlayDir
from ...sources.base import ByteSource, ObjectStat, join_key
from ...vtree import CHILD_ID_BITS, DirNode, Entry, Node
from .chunks import ArrayChunks, ChunkRef
from .files import ZarrChunkFile
from .keys import KeyLayout, parse_index

log = logging.getLogger(__name__)

BATCH = 1024


class ChunkView:
    """The chunk files of one array under one key layout."""

    def __init__(self, source: ByteSource, chunks: ArrayChunks, layout: KeyLayout, checksum: bool,
                 caches: Caches, stable_key: str, mtime_ns: int) -> None:
        self.source = source
        self.chunks = chunks
        self.layout = layout
        self.checksum = checksum
        self.caches = caches
        self.stable_key = stable_key
        self.mtime_ns = mtime_ns

    def file(self, index: tuple[int, ...], ref: ChunkRef, ident: int | None) -> ZarrChunkFile:
        where = f"{ref.blob.label} chunk {self.layout.key(index)}"
        return ZarrChunkFile(self.source, ref, self.checksum, self.caches, where, ident)

    async def file_at(self, index: tuple[int, ...], ident: int | None) -> ZarrChunkFile | None:
        if not self.chunks.in_bounds(index):
            return None
        ref = await self.chunks.locate(index)
        return None if ref is None else self.file(index, ref, ident)

    def files(self, indices: np.ndarray, refs: list[ChunkRef], ident_of) -> list[Entry]:
        out: list[Entry] = []
        for index, ref in zip(map(tuple, indices.tolist()), refs):
            try:
                node = self.file(index, ref, ident_of(index))
            except DataError as e:
                log_once(log, f"list:{e}", "listing %s: skipping %s", self.chunks.key or ".", e)
                continue
            out.append((self.layout.parts(index)[-1], node))
        return out

    # -- nested layouts: one directory level per dimension ---------------------

    async def lookup_at(self, prefix: tuple[int, ...], name: str) -> Node | None:
        i = parse_index(name)
        depth = len(prefix)
        if i is None or i >= self.chunks.grid[depth]:
            return None
        if depth < len(self.chunks.grid) - 1:
            # Present whenever it is inside the grid: proving that it holds a
            # chunk would cost reading every shard index of the slab.
            return ChunkDir(self, prefix + (i,), i)
        return await self.file_at(prefix + (i,), i)

    async def entries_at(self, prefix: tuple[int, ...]) -> AsyncIterator[list[Entry]]:
        depth = len(prefix)
        if depth == len(self.chunks.grid) - 1:
            async for indices, refs in self.chunks.chunks(prefix):
                batch = self.files(indices, refs, lambda index: index[-1])
                if batch:
                    yield batch
            return
        values: set[int] = set()
        async for indices, _refs in self.chunks.chunks(prefix):
            values.update(indices[:, depth].tolist())
        ordered = sorted(values)
        for at in range(0, len(ordered), BATCH):
            yield [(str(v), ChunkDir(self, prefix + (v,), v)) for v in ordered[at:at + BATCH]]

    # -- flat layouts: every chunk file in the array directory -----------------

    def flat_ident(self, index: tuple[int, ...]) -> int | None:
        if not index:
            return 0
        ident = int(np.ravel_multi_index(index, self.chunks.grid))
        return ident if ident < 1 << CHILD_ID_BITS else None

    def flat_name(self, ident: int) -> str:
        grid = self.chunks.grid
        index = tuple(int(i) for i in np.unravel_index(ident, grid)) if grid else ()
        return self.layout.parts(index)[-1]

    async def flat_entries(self) -> AsyncIterator[list[Entry]]:
        async for indices, refs in self.chunks.chunks(()):
            batch = self.files(indices, refs, self.flat_ident)
            if batch:
                yield batch


class ChunkDir(DirNode):
    """One level of a nested chunk key ("c/3/" holds the chunks whose first index is 3)."""

    __slots__ = ("view", "prefix", "stable_key")

    def __init__(self, view: ChunkView, prefix: tuple[int, ...], ident: int | None = None) -> None:
        super().__init__(view.mtime_ns)
        self.view = view
        self.prefix = prefix
        self.ident = ident
        self.stable_key = f"{view.stable_key}/{'/'.join(map(str, prefix))}"

    async def lookup(self, name: str) -> Node | None:
        return await self.view.lookup_at(self.prefix, name)

    def entries(self) -> AsyncIterator[list[Entry]]:
        return self.view.entries_at(self.prefix)

    def child_name(self, ident: int) -> str:
        return str(ident)


class ArrayDir(OverlayDir):
    """An array directory: metadata files, the chunk tree, other files unchanged."""

    __slots__ = ("view", "hidden")

    def __init__(self, source: ByteSource, key: str, st: ObjectStat, fixed: dict[str, Node], view: ChunkView,
                 hidden: frozenset[str] = frozenset()) -> None:
        super().__init__(source, key, st, fixed, view.stable_key)
        self.view = view
        self.hidden = hidden

    def claims(self, name: str) -> bool:
        return self.view.layout.claims(name)

    def hides(self, name: str) -> bool:
        # The source's own chunk (shard) keys are replaced by the view's.
        return name in self.hidden or self.view.chunks.source_keys.claims(name)

    async def virtual_lookup(self, name: str) -> object:
        layout = self.view.layout
        if not layout.claims(name):
            return NOT_VIRTUAL
        if not layout.nested:
            index = layout.parse_flat(name)
            return None if index is None else await self.view.file_at(index, self.view.flat_ident(index))
        if layout.lead:
            return ChunkDir(self.view, ()) if name == layout.lead else None
        return await self.view.lookup_at((), name)

    async def virtual_entries(self) -> AsyncIterator[list[Entry]]:  # type: ignore[override]
        layout = self.view.layout
        if not layout.nested:
            async for batch in self.view.flat_entries():
                yield batch
        elif layout.lead:
            # Listed when the source has shards at all (an array never
            # written has no "c" directory, sharded or not).
            if not self.source.listable or await self.source.stat_dir(join_key(self.key, layout.lead)):
                yield [(layout.lead, ChunkDir(self.view, ()))]
        else:
            async for batch in self.view.entries_at(()):
                yield batch

    def child_name(self, ident: int) -> str:
        if self.view.layout.nested:
            return str(ident)
        return self.view.flat_name(ident)


class GroupDir(OverlayDir):
    """A group: its (possibly rewritten) metadata; children resolved by the hierarchy."""

    __slots__ = ("resolve", "hidden")

    def __init__(self, source: ByteSource, key: str, st: ObjectStat, fixed: dict[str, Node], resolve,
                 hidden: frozenset[str] = frozenset(), children: tuple[str, ...] = ()) -> None:
        # `children`: names known from consolidated metadata, listed when the source cannot list.
        super().__init__(source, key, st, fixed, f"zarr-group:{key}", lambda _key: children)
        self.resolve = resolve
        self.hidden = hidden

    def hides(self, name: str) -> bool:
        return name in self.hidden

    async def source_child(self, key: str, st: ObjectStat | None) -> object:
        if st is not None and not st.is_dir:
            return None
        return await self.resolve(key, st)
