"""Formats turn a byte source into a virtual tree; `open_tree` picks the format.

The format is the one a URL prefix names (`precomputed://`, `zarr3://`,
`zarr://`, as Neuroglancer writes them), else the one whose root metadata
file exists: `zarr.json` for Zarr v3, `info` for precomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..caches import Caches
from ..errors import ConfigError
from ..sources import RemoteOptions
from ..sources.base import ByteSource
from ..vtree import DirNode

PREFIXES = {"precomputed://": "precomputed", "zarr3://": "zarr", "zarr://": "zarr"}
FORMATS = ("precomputed", "zarr", "dvid")


def split_format(url: str) -> tuple[str | None, str]:
    """(format named by a URL prefix or None, the rest of the URL)."""
    for prefix, name in PREFIXES.items():
        if url.startswith(prefix):
            return name, url[len(prefix):]
    return None, url


@dataclass
class FormatOptions:
    format: str | None = None  # None: detect
    view: str | None = None  # zarr only: "zarr3" (default) or "zarr2"
    info_path: str | None = None  # dvid only: the volume spec the export was made against
    supervoxels: bool = False  # dvid only: raw supervoxel ids instead of agglomerated labels


async def detect(source: ByteSource, options: "FormatOptions") -> str:
    if options.info_path is not None:
        return "dvid"
    from .dvid import looks_like_export

    for key, name in (("zarr.json", "zarr"), ("info", "precomputed")):
        st = await source.stat(key)
        if st is not None and not st.is_dir:
            if name == "precomputed" and await looks_like_export(source):
                return "dvid"
            return name
    if await looks_like_export(source):
        raise ConfigError(f"{source.description} looks like a DVID export (s0/*.arrow) but has no info file; "
                          "give the volume spec it was exported against with --info SPEC.json")
    hint = " (or the store refuses to let us read them: check the URL and credentials)" if source.remote else ""
    raise ConfigError(f"{source.description} has neither an info file (precomputed) nor a zarr.json (Zarr v3)"
                      + hint)


async def open_tree(source: ByteSource, caches: Caches, options: FormatOptions | None = None
                    ) -> tuple[object, DirNode]:
    """(the format's dataset object, for `inspect`; the root of its virtual tree)."""
    options = options or FormatOptions()
    name = options.format or await detect(source, options)
    if options.view not in (None, "zarr3") and name != "zarr":
        raise ConfigError(f"--view {options.view} applies to Zarr stores only; this is {name}")
    if (options.info_path is not None or options.supervoxels) and name != "dvid":
        raise ConfigError(f"--info and --supervoxels apply to DVID exports only; this is {name}")
    if name == "zarr":
        from .zarr import ZarrHierarchy

        hierarchy = ZarrHierarchy(source, caches, options.view or "zarr3")
        return hierarchy, await hierarchy.build()
    if name == "dvid":
        from .dvid import DvidExport

        export = DvidExport(source, caches, options.info_path, options.supervoxels)
        return export, await export.build()
    if name == "precomputed":
        from .precomputed import open_dataset

        return await open_dataset(source, caches)
    raise ConfigError(f"unknown format {name!r} (choose from {', '.join(FORMATS)})")


def resolve(url: str, view: str | None = None, info_path: str | None = None, supervoxels: bool = False,
            remote: "RemoteOptions | None" = None) -> tuple[ByteSource, FormatOptions]:
    """The byte source and format options a user-given SOURCE stands for."""
    from ..sources import open_source

    name, rest = split_format(url)
    return open_source(rest, remote), FormatOptions(name, view, info_path, supervoxels)
