"""Read-ahead for files shown as they are stored (passthrough), over a remote source.

An unsharded part of a dataset -- a plain Zarr array, an unsharded
precomputed scale, the keys of an OCDBT database, metadata files beside the
shards -- is one object per file: a reader copying a directory (`cp -r`,
`tar`, `find | xargs`) or an array (zarr-python reading an unsharded array
key by key) reads them one after another, each a round trip to the store.
`ScannedFiles` is a layer over the source formats build their trees from: it
gives the files a reader reads positions in an order, follows their
whole-file reads with the same read-ahead as chunk files (`ScanScope`), and
declares the files a scan reads next to the mount's fetcher, which reads them
ahead concurrently within the prefetch budget. A source that joins
neighbouring values of one object (an OCDBT database's data files,
`sources/coalesce.py`) turns those reads into one request.

The order is the source's key order where it keeps one (`KeyOrder`: an OCDBT
database's B+tree), across directories, however the reader found its files: a
*run* of keys starts at a file read that no run holds, and is extended from
the index a few keys at a time. Elsewhere it is a directory's listing order,
for directories somebody listed. A file is read ahead whole, and only one no
larger than the fetcher's whole read, with the version its run or listing
gave it (a file changed since is read from the source as it is now). Every
other read, and every read once read-ahead is off, goes straight to the
source.
"""

from __future__ import annotations

from typing import AsyncIterator, Hashable

import numpy as np

from unshardfs.core.blob import Blob
from unshardfs.core.fetch import Extent, Fetcher
from unshardfs.core.nameorder import NameOrder
from unshardfs.core.policy import POLICY
from unshardfs.core.readahead import ScanScope
from unshardfs.core.table import ChunkTable
from unshardfs.sources.base import ByteSource, KeyOrder, ObjectStat, SourceLayer, Version, end_listing, join_path
from unshardfs.util.maps import BoundedMap

WHOLE_READ_MAX = POLICY.whole_read_max
RUNS_MAX = 64  # runs (or listed directories) followed at once, the most recently begun
FILES_MAX = 1 << 16  # files per run or directory
KEYS_STEP = 64  # keys a run takes from the index at a time
KEPT_BYTES = 16 << 20  # files read ahead and read in more than one piece: the rest of each, until read


class _Files:
    """Files at positions 0, 1, ... (a `ScanTarget`: positions are the ids of its scans, dense,
    so id order is their order): a directory's listing, or a run of a source's keys."""

    dense = True
    name_order: NameOrder | None = None

    def __init__(self, fetcher: Fetcher) -> None:
        self.fetcher = fetcher
        self.paths: list[str] = []
        self.stats: list[ObjectStat | None] = []
        self.position: dict[str, int] = {}
        self.scope = ScanScope(self)

    def add(self, path: str, st: ObjectStat | None) -> None:
        if len(self.paths) < FILES_MAX and (st is None or not st.is_dir) and path not in self.position:
            self.position[path] = len(self.paths)
            self.paths.append(path)
            self.stats.append(st)

    async def more(self) -> bool:
        """Take more files into the order (a run from its index); whether any came."""
        return False

    async def locate(self, chunk_id: int) -> tuple[ChunkTable, int] | None:
        while chunk_id >= len(self.paths) and len(self.paths) < FILES_MAX:
            if not await self.more():
                break
        if not 0 <= chunk_id < len(self.paths):
            return None
        st = self.stats[chunk_id]
        if st is None:
            return None  # (the run's first file: being read, not read ahead)
        ids = np.array([chunk_id], np.uint64)
        blob = Blob.of(self.paths[chunk_id], st)
        return ChunkTable(blob, ids, np.zeros(1, np.uint64), np.array([st.size], np.uint64)), 0

    def table_of(self, chunk_id: int) -> Hashable | None:
        return None  # no index table to read: the order says all there is

    def has_payload(self, ext: Extent) -> bool:
        return False


class _ReadOnKeys(_Files):
    """Keys of a `KeyOrder` source from one a reader read on, taken from its index as scans reach them."""

    def __init__(self, fetcher: Fetcher, source: KeyOrder, first: str) -> None:
        super().__init__(fetcher)
        self.source = source
        self.add(first, None)
        self.ended = False

    async def more(self) -> bool:
        if self.ended:
            return False
        got = await self.source.keys_after(self.paths[-1], KEYS_STEP)
        self.ended = not got
        for path, st in got:
            self.add(path, st)
        return bool(got)


class ScannedFiles(SourceLayer):
    """`inner` with scans of its files read ahead (see the module's docstring); `fetcher` reads from
    `inner`."""

    def __init__(self, inner: ByteSource, fetcher: Fetcher) -> None:
        super().__init__(inner)
        self.fetcher = fetcher
        self._keyed = inner if isinstance(inner, KeyOrder) and inner.key_order() else None
        self._orders: BoundedMap[Hashable, _Files] = BoundedMap(RUNS_MAX, counted=False)
        # Files read ahead whose first piece was read: the rest, for the pieces after it.
        self._kept: BoundedMap[tuple[str, object], bytes] = BoundedMap(KEPT_BYTES, getsizeof=len, counted=False)

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        listed = _Files(self.fetcher) if self.fetcher.can_prefetch and self._keyed is None else None
        if listed is not None:
            self._orders[("dir", path)] = listed
        listing = self.inner.list(path)
        try:
            async for name, st in listing:
                if listed is not None:
                    listed.add(join_path(path, name), st)
                yield name, st
        finally:
            await end_listing(listing)

    def _placed(self, path: str) -> tuple[_Files, int] | None:
        """The order holding `path` and its position there (the most recent first)."""
        for files in reversed(list(self._orders.values())):
            i = files.position.get(path)
            if i is not None:
                return files, i
        return None

    async def read(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        if size <= 0 or not self.fetcher.can_prefetch:
            return await self.inner.read(path, offset, size, version)
        placed = self._placed(path)
        if placed is None:
            if offset == 0 and self._keyed is not None:
                # A run begins here; its next keys come from the index (in the background, before
                # the reader's next read: the one this read costs).
                run = self._orders[("run", path)] = _ReadOnKeys(self.fetcher, self._keyed, path)
                self.fetcher.spawn(run.more)
            return await self.inner.read(path, offset, size, version)
        files, i = placed
        st = files.stats[i]
        if st is None or (version is not None and version != st.version) or st.size > WHOLE_READ_MAX:
            if offset == 0:
                files.scope.note(i)
            return await self.inner.read(path, offset, size, version)
        kept = self._kept.get((path, st.version))
        if kept is not None:
            if offset + size >= len(kept):
                self._kept.pop((path, st.version), None)  # its last piece: not needed again
            return kept[offset:offset + size]
        if offset:
            return await self.inner.read(path, offset, size, version)
        files.scope.note(i)
        ext = Extent(Blob.of(path, st), 0, st.size)
        if not self.fetcher.holds(ext):  # neither read ahead nor on its way
            return await self.inner.read(path, offset, size, version)
        whole = await self.fetcher.read(ext)
        if size < len(whole):
            self._kept[(path, st.version)] = whole
        return whole[:size]
