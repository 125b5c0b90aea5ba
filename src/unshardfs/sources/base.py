"""The byte-source contract shared by every backend."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class ObjectStat:
    """What a format needs to know about a backing object.

    `version` changes whenever the object's content may have changed (for a
    local file: device, inode, size and mtime), so caches keyed on it never
    mix an old index with new data.
    """

    size: int
    mtime_ns: int
    is_dir: bool
    version: tuple = ()


class ByteSource(Protocol):
    """Bytes by key. Keys are relative, '/'-separated, '' is the root."""

    description: str

    async def stat(self, key: str) -> ObjectStat | None:
        """None when the object does not exist."""

    async def read(self, key: str, offset: int, size: int, version: tuple | None = None) -> bytes:
        """Up to `size` bytes at `offset`; shorter only at end of object.

        With `version` (from an earlier `stat`), raise `StaleError` rather
        than read an object that has since been replaced or modified.
        """

    def list(self, key: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        """Direct children of a directory-like key, as (name, stat)."""


def join_key(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def normalize_key(key: str) -> str:
    """Resolve '.', '..' and redundant slashes; refuse anything escaping the root.

    Scale keys in an info file may hold '..' components; they are allowed only
    while they stay inside the mounted source, so a crafted info file cannot
    expose other files of the machine.
    """
    if key.startswith("/"):
        raise ConfigError(f"absolute key {key!r} is not allowed")
    norm = posixpath.normpath(key) if key else ""
    if norm in (".", ""):
        return ""
    if norm == ".." or norm.startswith("../"):
        raise ConfigError(f"key {key!r} points outside the source")
    return norm
