"""A byte source over a dict of bytes, for unit tests of formats and of the core (no files, no server).

Directories are implied by keys ("a/b" makes "a" a directory). Every `put`
or `remove` gives the object a new version, so reads made with the version
of an earlier `stat` fail with `StaleError`, as the real sources do.
"""

from __future__ import annotations

import itertools
from typing import AsyncIterator, Mapping

from ..errors import SourceError, StaleError
from ..sources.base import IndexCache, ObjectStat, name_problem

_DIR = ObjectStat(0, 0, True, ())


class MemorySource:
    """A listable, local, versioned `ByteSource` over `files` (key -> bytes); counts its requests."""

    listable = True
    remote = False
    index_cache: IndexCache | None = None

    def __init__(self, files: Mapping[str, bytes] | None = None, description: str = "memory") -> None:
        self.description = description
        self._versions = itertools.count(1)
        self._files: dict[str, tuple[bytes, int]] = {}
        self.requests = {"stat": 0, "read": 0, "list": 0}
        for key, data in (files or {}).items():
            self.put(key, data)

    # -- changing it (behind a reader's back) ------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Create or replace the object at `key` (a new version)."""
        if not key or any(name_problem(part) for part in key.split("/")):
            raise ValueError(f"{key!r} is not a key")
        self._files[key] = (bytes(data), next(self._versions))

    def remove(self, key: str) -> None:
        del self._files[key]

    # -- the ByteSource contract ----------------------------------------------------------

    def _is_dir(self, key: str) -> bool:
        prefix = f"{key}/" if key else ""
        return key == "" or any(k.startswith(prefix) for k in self._files)

    async def stat(self, key: str) -> ObjectStat | None:
        self.requests["stat"] += 1
        found = self._files.get(key)
        if found is not None:
            return ObjectStat(len(found[0]), found[1], False, (found[1],))
        return _DIR if self._is_dir(key) else None

    async def stat_dir(self, key: str) -> ObjectStat | None:
        return _DIR if key not in self._files and self._is_dir(key) else None

    async def read(self, key: str, offset: int, size: int, version: tuple | None = None) -> bytes:
        self.requests["read"] += 1
        found = self._files.get(key)
        if found is None or (version is not None and version != (found[1],)):
            if version is not None:
                raise StaleError(key, "object changed or removed since it was opened")
            raise SourceError(f"{self.description}: no object {key!r}")
        return found[0][offset:offset + size]

    async def read_index(self, key: str, offset: int, size: int, version: tuple | None = None) -> bytes:
        return await self.read(key, offset, size, version)

    async def list(self, key: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        self.requests["list"] += 1
        if key in self._files:
            return
        prefix = f"{key}/" if key else ""
        seen: set[str] = set()
        for path in sorted(self._files):
            if not path.startswith(prefix):
                continue
            name, sep, _ = path[len(prefix):].partition("/")
            if name in seen:
                continue
            seen.add(name)
            if sep:
                yield name, _DIR
            else:
                data, version = self._files[path]
                yield name, ObjectStat(len(data), version, False, (version,))

    async def aclose(self) -> None:
        pass

    def stats(self) -> dict[str, object]:
        return {"memory": dict(self.requests)}
