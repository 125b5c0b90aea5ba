"""Neuroglancer precomputed as a format plug-in: detected by its root `info` file."""

from __future__ import annotations

from unshardfs.core.caches import SHARD_INDEX
from unshardfs.core.registry import Dataset, FormatPlugin, NoOptions
from unshardfs.core.runtime import Runtime
from unshardfs.sources.base import ByteSource
from unshardfs.volume.sharding import MINISHARD_INDEX


class PrecomputedFormat(FormatPlugin[NoOptions]):
    name = "precomputed"
    description = "Neuroglancer precomputed"
    marker = "an info file"
    prefixes = ("precomputed://",)
    index_levels = (SHARD_INDEX, MINISHARD_INDEX)
    json_names = ("info", "provenance")
    probes = ("info",)

    async def detect(self, source: ByteSource, options: NoOptions) -> bool:
        st = await source.stat("info")
        return st is not None and not st.is_dir

    async def open(self, runtime: Runtime, options: NoOptions) -> Dataset:
        from unshardfs.formats.precomputed.dataset import PrecomputedDataset

        dataset = PrecomputedDataset(runtime)
        return Dataset(await dataset.build(), dataset.inventory)

