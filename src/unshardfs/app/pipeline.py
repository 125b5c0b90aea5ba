"""SOURCE as Neuroglancer and TensorStore name it: a URL pipeline.

    BASE[|zip:[PATH]][|ocdbt:[@VERSION/][PATH]][|FORMAT:]

BASE is a path or a file://, http(s)://, gs:// or s3:// URL (optionally
with an old-style format prefix, `precomputed://gs://...`); `zip:` reads
BASE as a ZIP archive and shows its members under PATH (default: all of
them); `ocdbt:` reads the directory before it as a TensorStore OCDBT
database and shows the keys under PATH of one version: the newest, or
VERSION (`v12`, a generation number, or `2024-12-31T10:23:45Z`, the newest
version committed by then); FORMAT is one of `neuroglancer-precomputed:`,
`zarr3:`, `zarr2:`, `zarr:` (Neuroglancer's names). A BASE ending in `.ozx`
or `.zip` is read as an archive without `|zip:`, and a directory holding
`manifest.ocdbt` as an OCDBT database without `|ocdbt:` (as Neuroglancer
detects it). Pipeline parts we do not read (`n5:`, `icechunk:`, ...) are a
one-line error naming the part.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from typing import Callable

from unshardfs.sources.base import ByteSource
from unshardfs.util.errors import ConfigError, DataError, SourceError
from unshardfs.util.limits import DataLimits

# Neuroglancer's format names -> our format plug-ins (Zarr v2 stores are shown by the zarr plug-in as stored).
FORMATS = {"neuroglancer-precomputed": "precomputed", "precomputed": "precomputed", "zarr3": "zarr",
           "zarr2": "zarr", "zarr": "zarr"}
# Parts Neuroglancer/TensorStore know that we do not read, with what they are (for the error).
KNOWN = {"icechunk": "Icechunk kvstore", "gzip": "gzip kvstore adapter",
         "byte_range": "byte_range kvstore adapter", "n5": "N5 format", "tiff": "TIFF format"}
ARCHIVE_SUFFIXES = (".ozx", ".zip")
OCDBT_MANIFEST = "manifest.ocdbt"


@dataclass(frozen=True)
class OcdbtPart:
    """`ocdbt:[@VERSION/][PATH]`: which version (None: the newest) and which key prefix."""

    version: str | None
    path: str


@dataclass(frozen=True)
class SourceSpec:
    """A parsed SOURCE: where the bytes are, whether through an archive or a database, and the format named."""

    base: str  # path or URL (of the archive when `zip_path` is not None)
    zip_path: str | None  # None: not an archive; "" its root; "seg" a directory inside
    format: str | None  # a format plug-in name, or None to detect
    ocdbt: OcdbtPart | None = None  # None: detected (a `manifest.ocdbt` at the root) or not a database


def parse_source(url: str) -> SourceSpec:
    """Parse SOURCE (see the module docstring); ConfigError names any part not supported."""
    from unshardfs.core.registry import split_format

    base, *parts = url.split("|")
    named, base = split_format(base)  # an old-style prefix: precomputed://, zarr3://
    if not base:
        raise ConfigError(f"{url!r}: no source before the first '|'")
    zip_path: str | None = None
    ocdbt: OcdbtPart | None = None
    for i, part in enumerate(parts):
        scheme, colon, rest = part.partition(":")
        last = i == len(parts) - 1
        if not colon:
            raise ConfigError(f"pipeline part {part!r} of {url!r} is not NAME:[...]")
        if scheme == "zip":
            if zip_path is not None:
                raise ConfigError(f"pipeline part {part!r}: a zip inside a zip is not supported")
            if ocdbt is not None:
                raise ConfigError(f"pipeline part {part!r}: a zip inside an OCDBT database is not supported")
            zip_path = rest
        elif scheme == "ocdbt":
            if ocdbt is not None:
                raise ConfigError(f"pipeline part {part!r}: an OCDBT database inside another is not supported")
            ocdbt = _ocdbt_part(part, rest)
        elif scheme in FORMATS:
            if rest.strip("/"):
                raise ConfigError(f"pipeline part {part!r}: a path after the format is not supported "
                                  f"(put it in the base URL, zip:PATH or ocdbt:PATH)")
            if not last:
                raise ConfigError(f"pipeline part {part!r}: the format must be the last part")
            if named is not None and named != FORMATS[scheme]:
                raise ConfigError(f"{url!r} names two formats ({named} and {scheme})")
            named = FORMATS[scheme]
        else:
            what = KNOWN.get(scheme)
            detail = f" ({what})" if what else ""
            raise ConfigError(f"pipeline part '{scheme}:'{detail} is not supported; unshardfs reads zip:, ocdbt: and the "
                              f"formats {', '.join(p + ':' for p in ('neuroglancer-precomputed', 'zarr3', 'zarr2', 'zarr'))}")
    if zip_path is None and _is_archive_name(base):
        zip_path = ""
    return SourceSpec(base, zip_path, named, ocdbt)


def _ocdbt_part(part: str, rest: str) -> OcdbtPart:
    """`[@VERSION/][PATH]` as Neuroglancer parses it: PATH percent-decoded, VERSION up to the first '/'."""
    version: str | None = None
    if rest.startswith("@"):
        version, _, rest = rest[1:].partition("/")
        if not version:
            raise ConfigError(f"pipeline part {part!r}: '@' names no version (vN or YYYY-MM-DDThh:mm:ssZ)")
    path = urllib.parse.unquote(rest, errors="strict") if "%" in rest else rest
    return OcdbtPart(version, path)


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


async def open_spec(spec: SourceSpec, open_base: Callable[[str], ByteSource],
                    limits: DataLimits | None = None) -> ByteSource:
    """The byte source of `spec`: `open_base(url)` opens a path or URL; an archive is read through `ZipSource`,
    a database (named, or found by its `manifest.ocdbt`) through `OcdbtSource`."""
    source = await _open_archive(spec, open_base, limits)
    try:
        part = spec.ocdbt
        if part is None and spec.format is None and await _is_ocdbt(source):
            part = OcdbtPart(None, "")
        if part is None:
            return source
        from unshardfs.sources.ocdbt import open_ocdbt

        url = spec.base.rstrip("/") + (f"|zip:{spec.zip_path}" if spec.zip_path else "")
        return await open_ocdbt(source, "", part.path, part.version, limits, description=f"{url}|ocdbt:")
    except BaseException:
        await source.aclose()
        raise


async def _is_ocdbt(source: ByteSource) -> bool:
    """Whether the root holds an OCDBT manifest (a missing one, or one the store will not show, is not)."""
    try:
        st = await source.stat(OCDBT_MANIFEST)
    except (SourceError, DataError):
        return False
    return st is not None and not st.is_dir


async def _open_archive(spec: SourceSpec, open_base: Callable[[str], ByteSource],
                        limits: DataLimits | None) -> ByteSource:
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
