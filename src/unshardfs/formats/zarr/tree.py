"""Zarr directories as the views show them: arrays with unsharded chunk trees, groups.

A sharded array's directory shows its rewritten metadata and one file per
non-empty inner chunk under the view's key layout; the source's shard
objects are hidden, everything else in the directory passes through.
Nested key layouts ("c/1/2/3") become directories computed on demand: a
lookup needs only the index of the one shard it touches.
"""

from __future__ import annotations

import math
from typing import AsyncIterator, Awaitable, Callable, Literal

import numpy as np

from unshardfs.core.chunks import ChunkContext
from unshardfs.core.geometry import Geometry
from unshardfs.core.nameorder import NameOrder
from unshardfs.core.naming import Naming
from unshardfs.core.table import int_list
from unshardfs.formats.zarr.keys import KeyLayout, parse_index
from unshardfs.formats.zarr.store import ZarrStore
from unshardfs.sources.base import ByteSource, ObjectStat, join_path
from unshardfs.tree.nodes import Batch, DirNode, Node, Verdict
from unshardfs.tree.overlay import OverlayDir

BATCH = 1024


class FlatNaming(Naming):
    """Every chunk file in the array directory ("c.1.2", "1.2"): child_id = linear index."""

    dense = True

    def __init__(self, store: ZarrStore, layout: KeyLayout) -> None:
        self.store = store
        self.layout = layout

    def claims(self, name: str) -> bool:
        return self.layout.claims(name)

    def parse(self, name: str) -> int | None:
        index = self.layout.parse_flat(name)
        return None if index is None or not self.store.in_bounds(index) else self.store.id_of(index)

    def order(self) -> NameOrder | None:
        store = self.store
        if not store.grid:
            return None
        count = math.prod(store.grid)
        return NameOrder([[str(i) for i in range(n)] for n in store.grid],
                         lambda chunk_id: store.index_of(chunk_id) if 0 <= chunk_id < count else None, store.id_of)

    def names(self, ids: np.ndarray) -> list[str | None]:
        layout = self.layout
        return [layout.parts(tuple(index))[-1] for index in self.store.indices(ids).tolist()]


class LeafNaming(Naming):
    """The last level of a nested layout: files named by the last index, which is also their child_id."""

    dense = True

    def __init__(self, store: ZarrStore, prefix: tuple[int, ...]) -> None:
        self.store = store
        self.prefix = prefix

    def claims(self, name: str) -> bool:
        return parse_index(name) is not None

    def parse(self, name: str) -> int | None:
        i = parse_index(name)
        return None if i is None or i >= self.store.grid[-1] else self.store.id_of(self.prefix + (i,))

    def names(self, ids: np.ndarray) -> list[str | None]:
        return [str(i) for i in self.last(ids)]

    def last(self, ids: np.ndarray) -> list[int]:
        return int_list(ids.astype(np.int64) % self.store.grid[-1])

    def child_id(self, chunk_id: int) -> int | None:
        return chunk_id % self.store.grid[-1]

    def child_ids(self, ids: np.ndarray) -> list[int | None]:
        child_ids: list[int | None] = list(self.last(ids))
        return child_ids

    def name_of_child_id(self, child_id: int) -> str:
        return str(child_id)


class ChunkGeometry(Geometry):
    """Stored inner chunks are at most a little larger than their raw size (codecs may expand)."""

    def __init__(self, store: ZarrStore, itemsize: int | None, fallback: int) -> None:
        raw = None if itemsize is None else itemsize * math.prod(store.chunk_shape)
        super().__init__(fallback if raw is None else min(fallback, 2 * raw + (1 << 20)))


class ChunkView:
    """The chunk files of one array under one key layout."""

    def __init__(self, ctx: ChunkContext, layout: KeyLayout, stable_key: str, mtime_ns: int) -> None:
        self.ctx = ctx
        assert isinstance(ctx.store, ZarrStore)
        self.store = ctx.store
        self.layout = layout
        self.stable_key = stable_key
        self.mtime_ns = mtime_ns

    def will_read_all(self, prefix: tuple[int, ...] = ()) -> None:
        """Every chunk below `prefix` will be read (`DirNode.will_read_all`): declared at once."""
        if prefix:
            select, within = self._slab(prefix)
            self.ctx.will_read_all(within, select)
        else:
            self.ctx.will_read_all()

    def leaf(self, prefix: tuple[int, ...]) -> ChunkContext:
        return self.ctx.with_naming(LeafNaming(self.store, prefix))

    def _slab(self, prefix: tuple[int, ...]) -> tuple[Callable[[np.ndarray], np.ndarray], tuple[int, ...]]:
        """(mask of ids starting with `prefix`, the shards that can hold them)."""
        store = self.store
        want = np.array(prefix, dtype=np.int64)

        def select(ids: np.ndarray) -> np.ndarray:
            mask: np.ndarray = (store.indices(ids)[:, :len(prefix)] == want).all(axis=1)
            return mask

        return select, tuple(i // p for i, p in zip(prefix, store.per_shard))

    # -- nested layouts: one directory level per dimension ----------------------------------

    async def lookup_at(self, prefix: tuple[int, ...], name: str) -> Node | None:
        i = parse_index(name)
        depth = len(prefix)
        if i is None or i >= self.store.grid[depth]:
            return None
        if depth < len(self.store.grid) - 1:
            # Present whenever it is inside the grid: proving that it holds a
            # chunk would cost reading every shard index of the slab.
            return ChunkDir(self, prefix + (i,), i)
        return await self.leaf(prefix).file(self.store.id_of(prefix + (i,)))

    async def entries_at(self, prefix: tuple[int, ...]) -> AsyncIterator[Batch]:
        depth = len(prefix)
        select, within = self._slab(prefix)
        if depth == len(self.store.grid) - 1:
            async for batch in self.leaf(prefix).listing(select, within):
                yield batch
            return
        values: set[int] = set()
        async for _shard, tables in self.ctx.shard_tables(within):
            for table in tables:
                chosen = table.ids[select(table.ids)]
                values.update(self.store.indices(chosen)[:, depth].tolist())
        ordered = sorted(values)
        for at in range(0, len(ordered), BATCH):
            yield [(str(v), ChunkDir(self, prefix + (v,), v)) for v in ordered[at:at + BATCH]]


class ChunkDir(DirNode):
    """One level of a nested chunk key ("c/3/" holds the chunks whose first index is 3)."""

    __slots__ = ("view", "prefix", "stable_key")

    def __init__(self, view: ChunkView, prefix: tuple[int, ...], child_id: int | None = None) -> None:
        super().__init__(view.mtime_ns)
        self.view = view
        self.prefix = prefix
        self.child_id = child_id
        self.stable_key = f"{view.stable_key}/{'/'.join(map(str, prefix))}"

    async def lookup(self, name: str) -> Node | None:
        return await self.view.lookup_at(self.prefix, name)

    def entries(self) -> AsyncIterator[Batch]:
        return self.view.entries_at(self.prefix)

    def will_read_all(self) -> None:
        self.view.will_read_all(self.prefix)

    def child_name(self, child_id: int) -> str:
        return str(child_id)


class ArrayDir(OverlayDir):
    """An array directory: metadata files, the chunk tree, other files unchanged."""

    __slots__ = ("view", "hidden")

    def __init__(self, source: ByteSource, path: str, st: ObjectStat, fixed: dict[str, Node], view: ChunkView,
                 hidden: frozenset[str] = frozenset()) -> None:
        super().__init__(source, path, st, fixed, view.stable_key)
        self.view = view
        self.hidden = hidden

    def claims(self, name: str) -> bool:
        return self.view.layout.claims(name)

    def will_read_all(self) -> None:
        self.view.will_read_all()

    def hides(self, name: str) -> bool:
        # The source's own chunk (shard) keys are replaced by the view's.
        return name in self.hidden or self.view.store.is_shard_file(name)

    async def virtual_lookup(self, name: str) -> Node | None | Literal[Verdict.PASS]:
        view, layout = self.view, self.view.layout
        if not layout.claims(name):
            return Verdict.PASS
        if not layout.nested:
            chunk_id = view.ctx.naming.parse(name)
            return None if chunk_id is None else await view.ctx.file(chunk_id)
        if layout.lead:
            return ChunkDir(view, ()) if name == layout.lead else None
        return await view.lookup_at((), name)

    async def virtual_entries(self) -> AsyncIterator[Batch]:
        view, layout = self.view, self.view.layout
        if not layout.nested:
            async for listed in view.ctx.listing():
                yield listed
        elif layout.lead:
            # Listed when the source has shards at all (an array never
            # written has no "c" directory, sharded or not).
            if not self.source.listable or await self.source.stat_dir(join_path(self.path, layout.lead)):
                yield [(layout.lead, ChunkDir(view, ()))]
        else:
            async for batch in view.entries_at(()):
                yield batch

    def child_name(self, child_id: int) -> str:
        if self.view.layout.nested:
            return str(child_id)
        return self.view.ctx.naming.name_of_child_id(child_id)


class GroupDir(OverlayDir):
    """A group: its (possibly rewritten) metadata; children resolved by the hierarchy."""

    __slots__ = ("resolve", "hidden")

    def __init__(self, source: ByteSource, path: str, st: ObjectStat, fixed: dict[str, Node],
                 resolve: Callable[[str, ObjectStat | None], Awaitable[Node | Verdict]],
                 hidden: frozenset[str] = frozenset(), children: tuple[str, ...] = ()) -> None:
        # `children`: names known from consolidated metadata, listed when the source cannot list.
        super().__init__(source, path, st, fixed, f"zarr-group:{path}", lambda _path: children)
        self.resolve = resolve
        self.hidden = hidden

    def hides(self, name: str) -> bool:
        return name in self.hidden

    async def source_child(self, path: str, st: ObjectStat | None) -> Node | Verdict:
        if st is not None and not st.is_dir:
            return Verdict.PASS
        return await self.resolve(path, st)
