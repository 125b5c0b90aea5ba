"""Zarr v3 as a format plug-in: detected by a root `zarr.json`; `--view zarr2` for legacy readers."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, AsyncIterator

from unshardfs.core.registry import Dataset, FormatPlugin
from unshardfs.core.runtime import Runtime
from unshardfs.sources.base import ByteSource
from unshardfs.util.errors import ConfigError

VIEWS = ("zarr3", "zarr2")
# A Zarr v2 store (a zarr-python 2 ZipStore, `x.zip|zip:|zarr2:`) has no sharding: it is shown as stored.
V2_MARKERS = (".zgroup", ".zarray")


async def _v2_store(runtime: Runtime) -> Dataset:
    """A Zarr v2 store, shown as stored (its files unchanged): what v2 readers of a zipped store need."""
    from unshardfs.tree.passthrough import PassthroughDir

    st = await runtime.source.stat("")
    if st is None or not st.is_dir:
        raise ConfigError(f"{runtime.source.description}: not a directory")

    async def nothing_sharded() -> AsyncIterator[Any]:
        return
        yield

    return Dataset(PassthroughDir(runtime.source, "", st), nothing_sharded)


@dataclass(frozen=True)
class ZarrOptions:
    view: str | None = None  # --view: "zarr3" (None: the same) or "zarr2"


class ZarrFormat(FormatPlugin[ZarrOptions]):
    name = "zarr"
    description = "Zarr v3"
    marker = "a zarr.json"
    prefixes = ("zarr3://", "zarr://")
    priority = 10
    json_names = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")
    probes = ("zarr.json", *V2_MARKERS)

    def add_options(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--view", choices=VIEWS, default=None,
                           help="show unsharded Zarr v3 (default) or Zarr v2 for legacy readers")

    options_type = ZarrOptions

    def options(self, args: argparse.Namespace) -> ZarrOptions:
        return ZarrOptions(getattr(args, "view", None))

    async def detect(self, source: ByteSource, options: ZarrOptions) -> bool:
        for marker in ("zarr.json", *V2_MARKERS):
            st = await source.stat(marker)
            if st is not None and not st.is_dir:
                return True
        return False

    async def open(self, runtime: Runtime, options: ZarrOptions) -> Dataset:
        from unshardfs.formats.zarr.hierarchy import ZarrHierarchy

        if await runtime.source.stat("zarr.json") is None:
            return await _v2_store(runtime)
        hierarchy = ZarrHierarchy(runtime, options.view or "zarr3")
        return Dataset(await hierarchy.build(), hierarchy.inventory)

