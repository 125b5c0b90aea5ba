"""DVID `export-shards` output as a format plug-in.

An export has `s0/*.arrow` shard files and no metadata of its own: it is
detected when `--info` gives the volume spec, or when an `info` sits beside
an `s0` directory of `.arrow` files (ahead of plain precomputed, which also
has an `info`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from unshardfs.core.registry import Dataset, FormatPlugin
from unshardfs.core.runtime import Runtime
from unshardfs.sources.base import ByteSource
from unshardfs.util.errors import ConfigError
from unshardfs.util.fdpath import open_argument


@dataclass(frozen=True)
class DvidOptions:
    info: str | None = None  # --info: the volume spec (an absolute path)
    supervoxels: bool = False  # --supervoxels: supervoxel ids instead of agglomerated labels


class DvidFormat(FormatPlugin[DvidOptions]):
    name = "dvid"
    description = "DVID export"
    marker = "s0/*.arrow shard files"
    priority = 20
    probes = ("s0",)

    def add_options(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--info", dest="info_path", metavar="SPEC.json",
                           help="the Neuroglancer volume spec the export was made against (default: an info "
                                "file in SOURCE)")
        group.add_argument("--supervoxels", action="store_true",
                           help="show supervoxel ids instead of agglomerated labels")

    options_type = DvidOptions

    def options(self, args: argparse.Namespace) -> DvidOptions:
        info = None
        if getattr(args, "info_path", None):
            info = os.path.abspath(args.info_path)
            os.close(open_argument(info, "--info"))  # what it is, before anything runs
        return DvidOptions(info, bool(getattr(args, "supervoxels", False)))

    async def detect(self, source: ByteSource, options: DvidOptions) -> bool:
        from unshardfs.formats.dvid.export import looks_like_export

        if options.info:
            return True
        if not source.listable or not await looks_like_export(source):
            return False
        st = await source.stat("info")
        if st is None or st.is_dir:
            raise ConfigError(f"{source.description} looks like a DVID export (s0/*.arrow) but has no info file; "
                              "give the volume spec it was exported against with --info SPEC.json")
        return True

    async def open(self, runtime: Runtime, options: DvidOptions) -> Dataset:
        from unshardfs.formats.dvid.export import DvidExport

        export = DvidExport(runtime, options.info, options.supervoxels)
        return Dataset(await export.build(), export.inventory)

