"""A directory of another source, as a source of its own (a dataset in a tree of datasets).

Paths are those below the directory; everything is read from the source
below with the directory's path put in front. Formats name what they read
by path and version (a blob's identity keys every cache, the disk cache
and the reads in flight), and two datasets of one tree repeat paths
(`0/0.shard` in each of two Zarr arrays): so the version of every object
is marked with the directory, and identities of two datasets never meet,
whatever versions the store gives (an HTTP server's weak ETags repeat).
Reads strip the mark before they go down. Closing it leaves the source
below open: the tree owns that.
"""

from __future__ import annotations

from typing import AsyncIterator

from unshardfs.sources.base import (
    BackingFiles,
    ByteSource,
    FdRange,
    ObjectStat,
    SourceLayer,
    UrlLocation,
    Version,
    end_listing,
    stored_at,
)
from unshardfs.util.maps import BoundedMap

# Stats made lately, by path: the same ObjectStat again while the source below answers with the same
# one (a local source does while the file is unchanged), so the core's recent blobs keep their hits.
RECENT_STATS = 1 << 12


class SubdirSource(SourceLayer):
    """The objects below `prefix` (a directory path of `inner`, never empty) by their paths there."""

    def __init__(self, inner: ByteSource, prefix: str) -> None:
        super().__init__(inner)
        if not prefix or prefix.startswith("/") or prefix.endswith("/"):
            raise ValueError(f"{prefix!r} is not a directory path")
        self.prefix = prefix
        self.description = f"{inner.description.rstrip('/')}/{prefix}"
        self.mark = ("in", prefix)  # the last element of every version this source gives
        self._recent: BoundedMap[str, tuple[ObjectStat, ObjectStat]] = BoundedMap(RECENT_STATS, lru=False,
                                                                                  counted=False)

    def below(self, path: str) -> str:
        """`path` as the source below names it."""
        return f"{self.prefix}/{path}" if path else self.prefix

    def _marked(self, path: str, st: ObjectStat | None) -> ObjectStat | None:
        if st is None or st.is_dir:
            return st  # a directory is no blob: nothing keys on its version
        recent = self._recent.get(path)
        if recent is not None and recent[0] is st:
            return recent[1]
        shown = ObjectStat(st.size, st.mtime_ns, False, (*st.version, self.mark))
        self._recent[path] = (st, shown)
        return shown

    def _below(self, version: Version | None) -> Version | None:
        """A version this source gave, as the source below gave it."""
        if version and version[-1] == self.mark:
            return version[:-1]
        return version

    async def stat(self, path: str) -> ObjectStat | None:
        st = await self.inner.stat(self.below(path))
        if not path and (st is None or not st.is_dir):  # the root is the directory (an object store's
            return await self.inner.stat_dir(self.prefix)  # `stat` knows no prefix)
        return self._marked(path, st)

    async def stat_dir(self, path: str) -> ObjectStat | None:
        return await self.inner.stat_dir(self.below(path))

    async def read(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return await self.inner.read(self.below(path), offset, size, self._below(version))

    async def read_index(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return await self.inner.read_index(self.below(path), offset, size, self._below(version))

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        listing = self.inner.list(self.below(path))
        try:
            async for name, st in listing:
                shown = self._marked(f"{path}/{name}" if path else name, st)
                assert shown is not None
                yield name, shown
        finally:
            await end_listing(listing)

    def cached_range(self, path: str, offset: int, size: int, version: Version | None = None) -> FdRange | None:
        below = self._cached_range_below
        return below(self.below(path), offset, size, self._below(version)) if below is not None else None

    def open_backing(self, path: str, version: Version) -> int | None:
        inner = self.inner
        if not isinstance(inner, BackingFiles):
            return None
        return inner.open_backing(self.below(path), self._below(version) or ())

    def read_now(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes | bytearray | None:
        below = self._read_now_below
        return below(self.below(path), offset, size, self._below(version)) if below is not None else None

    async def stat_tail(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        st, tail = await super().stat_tail(self.below(path), size)
        return self._marked(path, st), tail

    async def stat_head(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        st, head = await super().stat_head(self.below(path), size)
        return self._marked(path, st), head

    async def read_if_tagged(self, path: str, offset: int, size: int, etag: str,
                             version: Version | None = None) -> bytes | None:
        return await super().read_if_tagged(self.below(path), offset, size, etag, self._below(version))

    async def read_versioned(self, path: str, offset: int, size: int) -> tuple[bytes, Version | None]:
        data, version = await super().read_versioned(self.below(path), offset, size)
        return data, (*version, self.mark) if version is not None else None

    async def stored_at(self, path: str, version: Version | None) -> UrlLocation | None:
        return await stored_at(self.inner, self.below(path), self._below(version))

    async def aclose(self) -> None:
        """Nothing: the source below is shared with the rest of the tree, which closes it."""

    def stats(self) -> dict[str, object]:
        return {}  # counted below, once, with the rest of the tree
