"""A byte source over a dict of bytes, for unit tests of formats and of the core (no files, no server).

Directories are implied by paths ("a/b" makes "a" a directory). Every `put`
or `remove` gives the object a new version, so reads made with the version
of an earlier `stat` fail with `StaleError`, as the real sources do.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import AsyncIterator, Mapping

from unshardfs.sources.base import IndexCache, ObjectStat, name_problem
from unshardfs.util.errors import SourceError, StaleError

_DIR = ObjectStat(0, 0, True, ())


class MemorySource:
    """A listable, local, versioned `ByteSource` over `files` (path -> bytes); counts its requests."""

    listable = True
    remote = False
    index_cache: IndexCache | None = None

    def __init__(self, files: Mapping[str, bytes] | None = None, description: str = "memory") -> None:
        self.description = description
        self._versions = itertools.count(1)
        self._files: dict[str, tuple[bytes, int]] = {}
        self.requests = {"stat": 0, "read": 0, "list": 0}
        for path, data in (files or {}).items():
            self.put(path, data)

    @classmethod
    def from_directory(cls, root: Path, description: str | None = None) -> "MemorySource":
        """The files below `root` (a dataset written by a reference writer), by their relative paths."""
        files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        return cls(files, description or f"memory copy of {root.name}")

    # -- changing it (behind a reader's back) ------------------------------------------

    def put(self, path: str, data: bytes) -> None:
        """Create or replace the object at `path` (a new version)."""
        if not path or any(name_problem(part) for part in path.split("/")):
            raise ValueError(f"{path!r} is not a path")
        self._files[path] = (bytes(data), next(self._versions))

    def remove(self, path: str) -> None:
        del self._files[path]

    # -- the ByteSource contract ----------------------------------------------------------

    def _is_dir(self, path: str) -> bool:
        prefix = f"{path}/" if path else ""
        return path == "" or any(k.startswith(prefix) for k in self._files)

    async def stat(self, path: str) -> ObjectStat | None:
        self.requests["stat"] += 1
        found = self._files.get(path)
        if found is not None:
            return ObjectStat(len(found[0]), found[1], False, (found[1],))
        return _DIR if self._is_dir(path) else None

    async def stat_dir(self, path: str) -> ObjectStat | None:
        return _DIR if path not in self._files and self._is_dir(path) else None

    async def read(self, path: str, offset: int, size: int, version: tuple[object, ...] | None = None) -> bytes:
        self.requests["read"] += 1
        found = self._files.get(path)
        if found is None or (version is not None and version != (found[1],)):
            if version is not None:
                raise StaleError(path, "object changed or removed since it was opened")
            raise SourceError(f"{self.description}: no object {path!r}")
        return found[0][offset:offset + size]

    async def read_index(self, path: str, offset: int, size: int, version: tuple[object, ...] | None = None) -> bytes:
        return await self.read(path, offset, size, version)

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        self.requests["list"] += 1
        if path in self._files:
            return
        prefix = f"{path}/" if path else ""
        seen: set[str] = set()
        for stored in sorted(self._files):
            if not stored.startswith(prefix):
                continue
            name, sep, _ = stored[len(prefix):].partition("/")
            if name in seen:
                continue
            seen.add(name)
            if sep:
                yield name, _DIR
            else:
                data, version = self._files[stored]
                yield name, ObjectStat(len(data), version, False, (version,))

    async def aclose(self) -> None:
        pass

    def stats(self) -> dict[str, object]:
        return {"memory": dict(self.requests)}
