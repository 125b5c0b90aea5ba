"""Neuroglancer precomputed as a format plug-in: detected by its root `info` file."""

from __future__ import annotations

from typing import Any

from ...caches import SHARD_INDEX
from ...core.runtime import Runtime
from ...sources.base import ByteSource
from ..registry import Dataset, FormatPlugin
from .sharding import MINISHARD_INDEX


class PrecomputedFormat(FormatPlugin):
    name = "precomputed"
    description = "Neuroglancer precomputed"
    marker = "an info file"
    prefixes = ("precomputed://",)
    index_levels = (SHARD_INDEX, MINISHARD_INDEX)
    json_names = ("info", "provenance")

    async def detect(self, source: ByteSource, options: dict[str, Any]) -> bool:
        st = await source.stat("info")
        return st is not None and not st.is_dir

    async def open(self, runtime: Runtime, options: dict[str, Any]) -> Dataset:
        from .dataset import PrecomputedDataset

        dataset = PrecomputedDataset(runtime)
        return Dataset(await dataset.build(), dataset.inventory)

