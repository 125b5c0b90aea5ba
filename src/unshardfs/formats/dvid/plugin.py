"""DVID `export-shards` output as a format plug-in.

An export has `s0/*.arrow` shard files and no metadata of its own: it is
detected when `--info` gives the volume spec, or when an `info` sits beside
an `s0` directory of `.arrow` files (ahead of plain precomputed, which also
has an `info`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from unshardfs.core.registry import Dataset, FormatPlugin
from unshardfs.core.runtime import Runtime
from unshardfs.sources.base import ByteSource
from unshardfs.util.errors import ConfigError
from unshardfs.util.fdpath import open_argument


class DvidFormat(FormatPlugin):
    name = "dvid"
    description = "DVID export"
    marker = "s0/*.arrow shard files"
    priority = 20

    def add_options(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--info", dest="info_path", metavar="SPEC.json",
                           help="the Neuroglancer volume spec the export was made against (default: an info "
                                "file in SOURCE)")
        group.add_argument("--supervoxels", action="store_true",
                           help="show supervoxel ids instead of agglomerated labels")

    def options(self, args: argparse.Namespace) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if getattr(args, "info_path", None):
            out["info"] = os.path.abspath(args.info_path)
            os.close(open_argument(out["info"], "--info"))  # what it is, before anything runs
        if getattr(args, "supervoxels", False):
            out["supervoxels"] = True
        return out

    async def detect(self, source: ByteSource, options: dict[str, Any]) -> bool:
        from unshardfs.formats.dvid.export import looks_like_export

        if options.get("info"):
            return True
        if not source.listable or not await looks_like_export(source):
            return False
        st = await source.stat("info")
        if st is None or st.is_dir:
            raise ConfigError(f"{source.description} looks like a DVID export (s0/*.arrow) but has no info file; "
                              "give the volume spec it was exported against with --info SPEC.json")
        return True

    async def open(self, runtime: Runtime, options: dict[str, Any]) -> Dataset:
        from unshardfs.formats.dvid.export import DvidExport

        export = DvidExport(runtime, options.get("info"), bool(options.get("supervoxels")))
        return Dataset(await export.build(), export.inventory)

