"""SOURCE as Neuroglancer and TensorStore name it: a URL pipeline.

    BASE[|zip:[PATH]][|FORMAT:]

BASE is a path or a file://, http(s)://, gs:// or s3:// URL (optionally
with an old-style format prefix, `precomputed://gs://...`); `zip:` reads
BASE as a ZIP archive and shows its members under PATH (default: all of
them); FORMAT is one of `neuroglancer-precomputed:`, `zarr3:`, `zarr2:`,
`zarr:` (Neuroglancer's names). A BASE ending in `.ozx` or `.zip` is read as
an archive without `|zip:`. Pipeline parts we do not read (`ocdbt:`, `n5:`,
...) are a one-line error naming the part.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from unshardfs.sources.base import ByteSource
from unshardfs.util.errors import ConfigError
from unshardfs.util.limits import DataLimits

# Neuroglancer's format names -> our format plug-ins (Zarr v2 stores are shown by the zarr plug-in as stored).
FORMATS = {"neuroglancer-precomputed": "precomputed", "precomputed": "precomputed", "zarr3": "zarr",
           "zarr2": "zarr", "zarr": "zarr"}
# Parts Neuroglancer/TensorStore know that we do not read, with what they are (for the error).
KNOWN = {"ocdbt": "OCDBT kvstore", "icechunk": "Icechunk kvstore", "gzip": "gzip kvstore adapter",
         "byte_range": "byte_range kvstore adapter", "n5": "N5 format", "tiff": "TIFF format"}
ARCHIVE_SUFFIXES = (".ozx", ".zip")


@dataclass(frozen=True)
class SourceSpec:
    """A parsed SOURCE: where the bytes are, whether through an archive, and the format named."""

    base: str  # path or URL (of the archive when `zip_path` is not None)
    zip_path: str | None  # None: not an archive; "" its root; "seg" a directory inside
    format: str | None  # a format plug-in name, or None to detect


def parse_source(url: str) -> SourceSpec:
    """Parse SOURCE (see the module docstring); ConfigError names any part not supported."""
    from unshardfs.core.registry import split_format

    base, *parts = url.split("|")
    named, base = split_format(base)  # an old-style prefix: precomputed://, zarr3://
    if not base:
        raise ConfigError(f"{url!r}: no source before the first '|'")
    zip_path: str | None = None
    for i, part in enumerate(parts):
        scheme, colon, rest = part.partition(":")
        last = i == len(parts) - 1
        if not colon:
            raise ConfigError(f"pipeline part {part!r} of {url!r} is not NAME:[...]")
        if scheme == "zip":
            if zip_path is not None:
                raise ConfigError(f"pipeline part {part!r}: a zip inside a zip is not supported")
            zip_path = rest
        elif scheme in FORMATS:
            if rest.strip("/"):
                raise ConfigError(f"pipeline part {part!r}: a path after the format is not supported "
                                  f"(put it in the base URL or in zip:PATH)")
            if not last:
                raise ConfigError(f"pipeline part {part!r}: the format must be the last part")
            if named is not None and named != FORMATS[scheme]:
                raise ConfigError(f"{url!r} names two formats ({named} and {scheme})")
            named = FORMATS[scheme]
        else:
            what = KNOWN.get(scheme)
            detail = f" ({what})" if what else ""
            raise ConfigError(f"pipeline part '{scheme}:'{detail} is not supported; unshardfs reads zip: and the "
                              f"formats {', '.join(p + ':' for p in ('neuroglancer-precomputed', 'zarr3', 'zarr2', 'zarr'))}")
    if zip_path is None and _is_archive_name(base):
        zip_path = ""
    return SourceSpec(base, zip_path, named)


def _is_archive_name(base: str) -> bool:
    """A BASE ending in .ozx/.zip is an archive (a local directory of that name is not)."""
    if not base.lower().rstrip("/").endswith(ARCHIVE_SUFFIXES) or base.endswith("/"):
        return False
    scheme, sep, rest = base.partition("://")
    local = rest if scheme == "file" else base if not sep else None
    return local is None or not os.path.isdir(local)


def split_archive(base: str) -> tuple[str, str]:
    """(the URL of the archive's parent, the archive's name) for opening the parent as a source."""
    scheme, sep, rest = base.partition("://")
    if not sep or scheme == "file":
        path = os.path.abspath(os.path.expanduser(rest if sep else base))
        if not os.path.exists(path):
            raise ConfigError(f"source {path} does not exist")
        if not os.path.isfile(path):
            raise ConfigError(f"source {path} is not a file (a zip archive was expected)")
        return os.path.dirname(path), os.path.basename(path)
    parent, _, name = rest.rstrip("/").rpartition("/")
    if not parent or not name:
        raise ConfigError(f"{base!r} names no archive object")
    return f"{scheme}://{parent}", name


async def open_spec(spec: SourceSpec, open_base, limits: DataLimits | None = None) -> ByteSource:
    """The byte source of `spec`: `open_base(url)` opens a path or URL; an archive is read through `ZipSource`."""
    if spec.zip_path is None:
        return open_base(spec.base)
    from unshardfs.sources.zip import ZipSource

    parent, name = split_archive(spec.base)
    inner = open_base(parent)
    try:
        return await ZipSource(inner, name, spec.zip_path, limits, url=spec.base.rstrip("/")).open()
    except BaseException:
        await inner.aclose()
        raise
