"""Zarr v3 as a format plug-in: detected by a root `zarr.json`; `--view zarr2` for legacy readers."""

from __future__ import annotations

from typing import Any

import argparse

from ...core.runtime import Runtime
from ...sources.base import ByteSource
from ..registry import Dataset, FormatPlugin

VIEWS = ("zarr3", "zarr2")


class ZarrFormat(FormatPlugin):
    name = "zarr"
    description = "Zarr v3"
    marker = "a zarr.json"
    prefixes = ("zarr3://", "zarr://")
    priority = 10
    json_names = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")

    def add_options(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--view", choices=VIEWS, default=None,
                           help="show unsharded Zarr v3 (default) or Zarr v2 for legacy readers")

    def options(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"view": args.view} if getattr(args, "view", None) else {}

    async def detect(self, source: ByteSource, options: dict[str, Any]) -> bool:
        st = await source.stat("zarr.json")
        return st is not None and not st.is_dir

    async def open(self, runtime: Runtime, options: dict[str, Any]) -> Dataset:
        from .hierarchy import ZarrHierarchy

        hierarchy = ZarrHierarchy(runtime, options.get("view") or "zarr3")
        return Dataset(await hierarchy.build(), hierarchy.inventory)

