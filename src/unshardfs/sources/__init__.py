"""Byte sources: objects addressed by '/'-separated keys, read by byte range.

Formats only ever talk to a `ByteSource`; they never open files themselves, so
that a remote store can later stand in for a local directory unchanged.
"""

from .base import ByteSource, ObjectStat, join_key
from .counting import CountingSource, SourceCounters
from .local import LocalSource

__all__ = ["ByteSource", "CountingSource", "ObjectStat", "LocalSource", "SourceCounters", "join_key", "open_source"]


def open_source(url: str) -> ByteSource:
    """Resolve a user-given SOURCE (path or file:// URL; format prefixes already split off)."""
    from ..errors import ConfigError

    if url.startswith("file://"):
        url = url[len("file://"):]
    elif "://" in url:
        scheme = url.split("://", 1)[0]
        raise ConfigError(f"unsupported source scheme {scheme}:// (local paths and file:// only so far)")
    return LocalSource(url)
