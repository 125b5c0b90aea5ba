"""An on-disk cache of index reads, so remounting a remote dataset starts warm.

Only `read_index` goes through it (shard indexes, minishard indexes, Zarr
shard indexes, DVID chunk indexes): small, reused on every lookup, and
expensive to fetch again one request per shard after a remount. Entries are
keyed by object, version (ETag or local inode/mtime), offset and size, so a
changed object is simply a miss. Files are written atomically; the
directory is trimmed to its byte budget, oldest first, as it grows.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from .base import ByteSource, SourceLayer

log = logging.getLogger(__name__)


class DiskCachedSource(SourceLayer):
    def __init__(self, inner: ByteSource, directory: str, max_bytes: int = 1 << 30) -> None:
        super().__init__(inner)
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._written = 0

    def _path(self, key: str, offset: int, size: int, version: tuple | None) -> Path:
        digest = hashlib.sha256(repr((self.inner.description, key, version, offset, size)).encode()).hexdigest()
        return self.directory / digest[:2] / digest

    async def read_index(self, key: str, offset: int, size: int, version: tuple | None = None) -> bytes:
        if not version:  # without a version a cached copy could be stale
            return await self.inner.read_index(key, offset, size, version)
        path = self._path(key, offset, size, version)
        try:
            data = path.read_bytes()
            self.hits += 1
            return data
        except OSError:
            pass
        self.misses += 1
        data = await self.inner.read_index(key, offset, size, version)
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            self._written += len(data)
            if self._written > self.max_bytes // 16:
                self._written = 0
                self.trim()
        except OSError as e:
            log.warning("index cache %s: cannot write (%s); continuing without it", self.directory, e)
        return data

    def trim(self) -> None:
        entries = []
        for sub in self.directory.iterdir():
            if sub.is_dir():
                for f in sub.iterdir():
                    try:
                        st = f.stat()
                    except OSError:
                        continue
                    entries.append((st.st_atime, st.st_size, f))
        total = sum(size for _, size, _ in entries)
        for _, size, f in sorted(entries):
            if total <= self.max_bytes:
                break
            f.unlink(missing_ok=True)
            total -= size

    def own_stats(self) -> dict[str, object]:
        return {"index_disk_cache": {"hits": self.hits, "misses": self.misses}}
