"""An on-disk cache of index reads, so remounting a remote dataset starts warm.

Only index structures go through it (shard indexes, minishard indexes, Zarr
shard indexes, DVID chunk indexes): small, reused on every lookup, and
expensive to fetch again one request per shard after a remount. The fetcher
asks it per index *extent* (object, version, offset, length), whatever
coalesced read later brought the bytes, so a remount whose reads are grouped
differently still hits. A changed object is simply a miss (the version is
part of the key). Files are written atomically; the directory is trimmed to
its byte budget, oldest first, as it grows.
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
        self.index_cache = self

    def _path(self, ident: tuple) -> Path:
        digest = hashlib.sha256(repr((self.inner.description, ident)).encode()).hexdigest()
        return self.directory / digest[:2] / digest

    def get(self, ident: tuple) -> bytes | None:
        try:
            data = self._path(ident).read_bytes()
        except OSError:
            self.misses += 1
            return None
        self.hits += 1
        return data

    def put(self, ident: tuple, data: bytes) -> None:
        path = self._path(ident)
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("index cache %s: cannot write (%s); continuing without it", self.directory, e)
            return
        self._written += len(data)
        if self._written > self.max_bytes // 16:
            self._written = 0
            self.trim()

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
