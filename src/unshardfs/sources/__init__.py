"""Byte sources: objects addressed by '/'-separated paths, read by byte range.

Formats only ever talk to a `ByteSource`; they never open files or sockets
themselves, so every format works over every backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unshardfs.sources.base import ByteSource, ObjectStat, join_path
from unshardfs.sources.counting import CountingSource, SourceCounters
from unshardfs.sources.http import HttpOptions
from unshardfs.sources.local import LocalSource

__all__ = ["ByteSource", "CountingSource", "ObjectStat", "LocalSource", "RemoteOptions", "SourceCounters",
           "join_path", "open_source"]


@dataclass(frozen=True)
class RemoteOptions:
    http: HttpOptions = field(default_factory=HttpOptions)
    s3_endpoint: str | None = None
    gcs_endpoint: str | None = None
    cache_dir: str | None = None  # on-disk index cache
    cache_dir_bytes: int = 1 << 30


def _bucket(rest: str, scheme: str) -> tuple[str, str]:
    from unshardfs.util.errors import ConfigError

    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ConfigError(f"{scheme}:// URL needs a bucket name")
    return bucket, prefix


def open_source(url: str, remote: RemoteOptions | None = None) -> ByteSource:
    """Resolve a user-given SOURCE: a path, file://, http(s)://, gs:// or s3:// URL
    (format prefixes such as precomputed:// already split off)."""
    from unshardfs.util.errors import ConfigError

    remote = remote or RemoteOptions()
    scheme, sep, rest = url.partition("://")
    source: ByteSource
    if not sep:
        return LocalSource(url)
    if scheme == "file":
        return LocalSource(rest)
    if scheme in ("http", "https"):
        from unshardfs.sources.http import HttpSource

        source = HttpSource(url, remote.http)
    elif scheme == "gs":
        from unshardfs.sources.objectstore import GcsSource

        bucket, prefix = _bucket(rest, scheme)
        # Without --gcs-endpoint, Google's: the only host that may see the user's Google credentials.
        source = GcsSource(bucket, prefix, remote.http, remote.gcs_endpoint)
    elif scheme == "s3":
        from unshardfs.sources.objectstore import S3Source

        bucket, prefix = _bucket(rest, scheme)
        source = S3Source(bucket, prefix, remote.http, remote.s3_endpoint)
    else:
        raise ConfigError(f"unsupported source scheme {scheme}:// (paths, file://, http(s)://, gs://, s3://)")
    if remote.cache_dir:
        from unshardfs.sources.diskcache import DiskCachedSource

        source = DiskCachedSource(source, remote.cache_dir, remote.cache_dir_bytes)
    return source
