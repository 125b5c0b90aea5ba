"""SOURCE as Neuroglancer and TensorStore name it: a URL pipeline.

    BASE[|zip:[PATH]][|ocdbt:[@VERSION/][PATH]|icechunk:[@REF/][PATH]][|FORMAT:[PATH]]

BASE is a path or a file://, http(s)://, gs:// or s3:// URL (optionally
with an old-style format prefix, `precomputed://gs://...`); `zip:` reads
BASE as a ZIP archive and shows its members under PATH (default: all of
them); `ocdbt:` reads the directory before it as a TensorStore OCDBT
database and shows the keys under PATH of one version: the newest, or
VERSION (`v12`, a generation number, or `2024-12-31T10:23:45Z`, the newest
version committed by then); `icechunk:` reads the directory before it as an
Icechunk repository and shows the Zarr v3 hierarchy under PATH of one
snapshot: branch main's, or REF's (`branch.NAME`, `tag.NAME` or a snapshot
id); FORMAT is one of `neuroglancer-precomputed:`, `zarr3:`, `zarr2:`,
`zarr:` (Neuroglancer's names); a PATH after it is allowed after
`icechunk:` (`|icechunk:|zarr3:path/to/array/`, as Neuroglancer writes it)
and joins the repository path. A BASE ending in `.ozx` or `.zip` is read as
an archive without `|zip:`, a directory holding `manifest.ocdbt` as an OCDBT
database without `|ocdbt:`, and one holding `refs/branch.main/ref.json` (spec
version 1) or a `repo` object that is an Icechunk repo info (spec version 2)
as an Icechunk repository without `|icechunk:` (as Neuroglancer detects them).
Pipeline parts we do not read (`n5:`, `gzip:`, ...) are a one-line error
naming the part.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from unshardfs.core.registry import detection_probes
from unshardfs.sources.base import ByteSource, stat_all, stat_and_head
from unshardfs.sources.icechunk.source import IcechunkOptions
from unshardfs.sources.ocdbt.source import OcdbtOptions
from unshardfs.util.errors import ConfigError, DataError, SourceError
from unshardfs.util.limits import DataLimits

if TYPE_CHECKING:
    from unshardfs.sources.zip import ZipSummary

# Neuroglancer's format names -> our format plug-ins (Zarr v2 stores are shown by the zarr plug-in as stored).
FORMATS = {"neuroglancer-precomputed": "precomputed", "precomputed": "precomputed", "zarr3": "zarr",
           "zarr2": "zarr", "zarr": "zarr"}
# Parts Neuroglancer/TensorStore know that we do not read, with what they are (for the error).
KNOWN = {"gzip": "gzip kvstore adapter",
         "byte_range": "byte_range kvstore adapter", "n5": "N5 format", "tiff": "TIFF format"}
ARCHIVE_SUFFIXES = (".ozx", ".zip")
OCDBT_MANIFEST = "manifest.ocdbt"
ICECHUNK_MAIN = "refs/branch.main/ref.json"
ICECHUNK_REPO = "repo"  # spec version 2 (Icechunk 2.x): an Icechunk object of type repo info
ICECHUNK_SPECS = {"icechunk": 1, "icechunk2": 2}  # `found_store`'s answers: the spec version each marker says


@dataclass(frozen=True)
class OcdbtPart:
    """`ocdbt:[@VERSION/][PATH]`: which version (None: the newest) and which key prefix."""

    version: str | None
    path: str


@dataclass(frozen=True)
class IcechunkPart:
    """`icechunk:[@REF/][PATH]`: which ref (None: branch main) and which node path."""

    version: str | None
    path: str


@dataclass(frozen=True)
class SourceSpec:
    """A parsed SOURCE: where the bytes are, whether through an archive or a database, and the format named."""

    base: str  # path or URL (of the archive when `zip_path` is not None)
    zip_path: str | None  # None: not an archive; "" its root; "seg" a directory inside
    format: str | None  # a format plug-in name, or None to detect
    ocdbt: OcdbtPart | None = None  # None: detected (a `manifest.ocdbt` at the root) or not a database
    icechunk: IcechunkPart | None = None  # None: detected (branch main's ref at the root) or not a repository


def parse_source(url: str) -> SourceSpec:
    """Parse SOURCE (see the module docstring); ConfigError names any part not supported."""
    from unshardfs.core.registry import split_format

    base, *parts = url.split("|")
    named, base = split_format(base)  # an old-style prefix: precomputed://, zarr3://
    if not base:
        raise ConfigError(f"{url!r}: no source before the first '|'")
    zip_path: str | None = None
    ocdbt: OcdbtPart | None = None
    icechunk: IcechunkPart | None = None
    for i, part in enumerate(parts):
        scheme, colon, rest = part.partition(":")
        last = i == len(parts) - 1
        if not colon:
            raise ConfigError(f"pipeline part {part!r} of {url!r} is not NAME:[...]")
        if scheme == "zip":
            if zip_path is not None:
                raise ConfigError(f"pipeline part {part!r}: a zip inside a zip is not supported")
            if ocdbt is not None or icechunk is not None:
                raise ConfigError(f"pipeline part {part!r}: a zip inside {_store(ocdbt)} is not supported")
            zip_path = rest
        elif scheme == "ocdbt":
            if ocdbt is not None or icechunk is not None:
                inside = "another" if ocdbt is not None else _store(ocdbt)
                raise ConfigError(f"pipeline part {part!r}: an OCDBT database inside {inside} is not supported")
            ocdbt = _ocdbt_part(part, rest)
        elif scheme == "icechunk":
            if ocdbt is not None or icechunk is not None:
                inside = "another" if icechunk is not None else _store(ocdbt)
                raise ConfigError(f"pipeline part {part!r}: an Icechunk repository inside {inside} is not supported")
            icechunk = _icechunk_part(part, rest)
        elif scheme in FORMATS:
            if icechunk is not None and rest.strip("/") and last:
                # Neuroglancer writes the array's path after the format: `|icechunk:|zarr3:path/to/array/`.
                sub = _decoded(part, rest)
                icechunk = IcechunkPart(icechunk.version, f"{icechunk.path.rstrip('/')}/{sub}".lstrip("/"))
            elif rest.strip("/"):
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
            raise ConfigError(f"pipeline part '{scheme}:'{detail} is not supported; unshardfs reads zip:, ocdbt:, "
                              f"icechunk: and the "
                              f"formats {', '.join(p + ':' for p in ('neuroglancer-precomputed', 'zarr3', 'zarr2', 'zarr'))}")
    if zip_path is None and _is_archive_name(base):
        zip_path = ""
    return SourceSpec(base, zip_path, named, ocdbt, icechunk)


def _ocdbt_part(part: str, rest: str) -> OcdbtPart:
    """`[@VERSION/][PATH]` as Neuroglancer parses it: PATH percent-decoded, VERSION up to the first '/'."""
    version: str | None = None
    if rest.startswith("@"):
        version, _, rest = rest[1:].partition("/")
        if not version:
            raise ConfigError(f"pipeline part {part!r}: '@' names no version (vN or YYYY-MM-DDThh:mm:ssZ)")
    path = urllib.parse.unquote(rest, errors="strict") if "%" in rest else rest
    return OcdbtPart(version, path)


def _store(ocdbt: OcdbtPart | None) -> str:
    """The versioned store a pipeline part would sit inside (the one already parsed)."""
    return "an OCDBT database" if ocdbt is not None else "an Icechunk repository"


def _decoded(part: str, text: str) -> str:
    try:
        return urllib.parse.unquote(text, errors="strict") if "%" in text else text
    except UnicodeDecodeError:
        raise ConfigError(f"pipeline part {part!r}: a percent-encoded path that is not UTF-8") from None


def _icechunk_part(part: str, rest: str) -> IcechunkPart:
    """`[@REF/][PATH]` as Neuroglancer parses it: REF up to the first '/' (a branch or tag name in it
    percent-decoded), PATH percent-decoded."""
    version: str | None = None
    if rest.startswith("@"):
        version, _, rest = rest[1:].partition("/")
        kind, dot, name = version.partition(".")
        if dot and kind in ("branch", "tag"):
            version = f"{kind}.{_decoded(part, name)}"
        if not version:
            raise ConfigError(f"pipeline part {part!r}: '@' names no ref (branch.NAME, tag.NAME or a snapshot id)")
    return IcechunkPart(version, _decoded(part, rest))


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
                    limits: DataLimits | None = None, icechunk: IcechunkOptions | None = None,
                    ocdbt: OcdbtOptions | None = None) -> ByteSource:
    """The byte source of `spec`: `open_base(url)` opens a path or URL; an archive is read through `ZipSource`,
    a database (named, or found by its `manifest.ocdbt`) through `OcdbtSource` (`ocdbt`: how its values are
    read), a repository (named, or found by branch main's ref) through `IcechunkSource` (`icechunk`: how its
    virtual references are read)."""
    source = await _open_archive(spec, open_base, limits)
    try:
        ice = spec.icechunk
        found: str | None = None
        if ice is None and spec.ocdbt is None:
            found = await found_store(source, spec.format)
            if found in ICECHUNK_SPECS:
                ice = IcechunkPart(None, "")
            elif found == "ocdbt":
                return await _open_ocdbt(source, spec, OcdbtPart(None, ""), limits, ocdbt)
        if ice is not None:
            from unshardfs.sources.icechunk import open_icechunk

            url = spec.base.rstrip("/") + (f"|zip:{spec.zip_path}" if spec.zip_path else "")
            return await open_icechunk(source, "", ice.path, ice.version, limits, description=f"{url}|icechunk:",
                                       url=None if spec.zip_path is not None else as_url(spec.base),
                                       options=icechunk, open_url=open_base, spec=ICECHUNK_SPECS.get(found or ""))
        if spec.ocdbt is None:
            return source
        return await _open_ocdbt(source, spec, spec.ocdbt, limits, ocdbt)
    except BaseException:
        await source.aclose()
        raise


async def _open_ocdbt(source: ByteSource, spec: SourceSpec, part: OcdbtPart, limits: DataLimits | None,
                      ocdbt: OcdbtOptions | None) -> ByteSource:
    from unshardfs.sources.ocdbt import open_ocdbt

    url = spec.base.rstrip("/") + (f"|zip:{spec.zip_path}" if spec.zip_path else "")
    return await open_ocdbt(source, "", part.path, part.version, limits, description=f"{url}|ocdbt:", options=ocdbt)


async def found_store(source: ByteSource, named: str | None) -> str | None:
    """Which versioned store the root of `source` holds, by its marker, as SOURCE's is found: "icechunk"
    (branch main's ref) or "icechunk2" (a repo info object; neither when a format other than zarr is
    named), "ocdbt" (`manifest.ocdbt`; not when a format is named), or None. Over a remote source the
    markers and the format probes are statted at once (one round trip), and the stats kept for the
    detection that follows."""
    probe_icechunk = named in (None, "zarr")
    probe_ocdbt = named is None
    if source.remote and (probe_icechunk or probe_ocdbt):
        # The stores' markers and the format's own, in one round trip instead of one each.
        await stat_all(source, [*([ICECHUNK_MAIN, ICECHUNK_REPO] if probe_icechunk else []),
                                *([OCDBT_MANIFEST] if probe_ocdbt else []), *detection_probes(named)])
    if probe_icechunk and await _exists(source, ICECHUNK_MAIN):
        return "icechunk"
    if probe_icechunk and await _is_repo_info(source):
        return "icechunk2"
    if probe_ocdbt and await _is_ocdbt(source):
        return "ocdbt"
    return None


def store_probes() -> list[str]:
    """What `found_store` and format detection stat in a directory (with no format named)."""
    return [ICECHUNK_MAIN, ICECHUNK_REPO, OCDBT_MANIFEST, *detection_probes()]


async def open_found_store(source: ByteSource, limits: DataLimits | None, icechunk: IcechunkOptions | None,
                           ocdbt: OcdbtOptions | None, url: str | None = None,
                           open_url: Callable[[str], ByteSource] | None = None) -> ByteSource:
    """The store at the root of `source` (a directory of a tree of datasets) by the rules SOURCE's is
    found by: its Icechunk repository (branch main) or OCDBT database (newest version), else `source`.
    `url`: where a reader elsewhere finds that directory (virtual references into it)."""
    found = await found_store(source, None)
    if found in ICECHUNK_SPECS:
        from unshardfs.sources.icechunk import open_icechunk

        return await open_icechunk(source, "", "", None, limits, description=f"{source.description}|icechunk:",
                                   url=url, options=icechunk, open_url=open_url, spec=ICECHUNK_SPECS[found or ""])
    if found == "ocdbt":
        from unshardfs.sources.ocdbt import open_ocdbt

        return await open_ocdbt(source, "", "", None, limits, description=f"{source.description}|ocdbt:",
                                options=ocdbt)
    return source


def as_url(base: str) -> str:
    """BASE as the URL a virtual reference into it would name (`file:///abs/path` for a local path)."""
    scheme, sep, rest = base.partition("://")
    if sep and scheme != "file":
        return base
    return "file://" + os.path.abspath(os.path.expanduser(rest if sep else base))


async def _is_ocdbt(source: ByteSource) -> bool:
    """Whether the root holds an OCDBT manifest (a missing one, or one the store will not show, is not)."""
    return await _exists(source, OCDBT_MANIFEST)


async def _is_repo_info(source: ByteSource) -> bool:
    """Whether the root holds Icechunk's repo info object (spec version 2): a file `repo` whose header is
    an Icechunk one of that type (any other file of that name is not; one the store will not show is not).
    Its first bytes come with its stat where the source gives them so (one request)."""
    from unshardfs.sources.icechunk.format import FILE_REPO_INFO, HEADER, MAGIC

    try:
        st, head = await stat_and_head(source, ICECHUNK_REPO, HEADER)
        if st is None or st.is_dir or st.size < HEADER:
            return False
        if head is None or len(head) < HEADER:
            head = await source.read(ICECHUNK_REPO, 0, HEADER, st.version)
    except (SourceError, DataError):
        return False
    return head[:len(MAGIC)] == MAGIC and head[HEADER - 2] == FILE_REPO_INFO


async def _exists(source: ByteSource, path: str) -> bool:
    """Whether `path` is a file of `source` (a missing one, or one the store will not show, is not)."""
    try:
        st = await source.stat(path)
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


def ome_comment(comment: bytes) -> dict[str, Any] | None:
    """The `ome` object of an RFC-9 (Zipped OME-Zarr) archive comment, or None when the comment is not one."""
    text = comment.decode("utf-8", "replace")
    try:
        value = json.loads(text) if text.lstrip().startswith("{") else None
    except ValueError:
        return None
    ome = value.get("ome") if isinstance(value, dict) else None
    return ome if isinstance(ome, dict) else None


def archive_lines(summary: "ZipSummary") -> list[str]:
    """`inspect`'s lines on the archive a source reads through, its comment read the RFC-9 way."""
    out = summary.lines()
    ome = ome_comment(summary.comment)
    if ome is not None:
        out.append(f"  RFC-9 comment {json.dumps({'ome': ome})}")
    elif summary.comment:
        out.append(f"  comment       {summary.comment.decode('utf-8', 'replace')[:200]!r}")
    return out
