"""`unshardfs inspect`: what a sharded dataset holds, from its indexes alone.

No chunk payload is read: shard indexes (and minishard indexes) give the
chunk count, stored bytes and size distribution of every sharded directory
of a precomputed dataset or sharded array of a Zarr store.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Callable

import numpy as np

from ..formats.precomputed import ShardedPart
from ..vtree import DirNode

SIZE_BUCKETS = [0] + [1 << k for k in range(6, 31, 2)]  # 0, 64 B, 256 B, ... 1 GiB
Progress = Callable[[int], None]


class SizeStats:
    """Count, total and distribution of stored chunk sizes, fed a batch at a time."""

    def __init__(self) -> None:
        self.chunks = 0
        self.stored = 0
        self.smallest: int | None = None
        self.largest = 0
        self.histogram = np.zeros(len(SIZE_BUCKETS), dtype=np.int64)

    def add(self, sizes: np.ndarray) -> None:
        if not len(sizes):
            return
        self.chunks += len(sizes)
        self.stored += int(sizes.sum())
        lo, hi = int(sizes.min()), int(sizes.max())
        self.smallest = lo if self.smallest is None else min(self.smallest, lo)
        self.largest = max(self.largest, hi)
        self.histogram += np.bincount(np.searchsorted(SIZE_BUCKETS, sizes, side="right") - 1,
                                      minlength=len(SIZE_BUCKETS))

    def report(self) -> dict:
        return {"chunks": self.chunks, "stored_bytes": self.stored,
                "stored_chunk_size": {"min": self.smallest or 0, "max": self.largest,
                                      "mean": self.stored / self.chunks if self.chunks else 0,
                                      "histogram": {f">={SIZE_BUCKETS[i]}": int(n)
                                                    for i, n in enumerate(self.histogram) if n}}}


async def inspect_part(part: ShardedPart, progress: Progress | None = None) -> dict:
    spec = part.store.spec
    shards_present = 0
    async for _ in part.store.shard_numbers():
        shards_present += 1
    stats = SizeStats()
    async for _shard, mini in part.store.listing():
        stats.add(mini.sizes)
        if progress is not None:
            progress(len(mini.sizes))
    s = asdict(spec)
    return {"kind": part.kind, "key": part.key, "sharding": s,
            "layout": f"{s['hash']}, preshift {s['preshift_bits']}, minishard_bits {s['minishard_bits']}, "
                      f"shard_bits {s['shard_bits']}; minishard index {s['minishard_index_encoding']}, "
                      f"data {s['data_encoding']}",
            "shards_expected": 1 << spec.shard_bits, "shards_present": shards_present,
            **stats.report(), **part.details}


async def zarr_arrays(tree: DirNode, hierarchy) -> list:
    """Resolve every group and array of a Zarr tree (without entering chunk directories)."""
    from ..formats.zarr.tree import GroupDir

    async def visit(node: DirNode) -> None:
        async for batch in node.entries():
            for _name, child in batch:
                if isinstance(child, GroupDir):
                    await visit(child)

    if isinstance(tree, GroupDir):
        await visit(tree)
    return sorted(hierarchy.sharded.items())


async def inspect_zarr_array(key: str, chunks, progress: Progress | None = None) -> dict:
    """One sharded Zarr array: shards present, non-empty inner chunks and their stored sizes."""
    shards_present = 0
    async for _ in chunks.existing_shards(()):
        shards_present += 1
    stats = SizeStats()
    async for _indices, refs in chunks.chunks(()):
        stats.add(np.array([r.length for r in refs], dtype=np.int64))
        if progress is not None:
            progress(len(refs))
    levels = " > ".join(f"{'x'.join(map(str, lvl.counts))} per shard (index at "
                        f"{'start' if lvl.at_start else 'end'}{', crc32c' if lvl.checksum else ''})"
                        for lvl in chunks.levels)
    return {"kind": "zarr array", "key": key or ".", "layout": f"inner chunks {list(chunks.chunk_shape)}, {levels}",
            "shards_expected": math.prod(chunks.shard_grid), "shards_present": shards_present,
            "grid_cells": math.prod(chunks.grid), "data_type": chunks.meta.data_type, "shape": list(chunks.meta.shape),
            **stats.report()}


def format_report(reports: list[dict], source: str) -> str:
    lines = [f"{source}: {len(reports)} sharded director{'y' if len(reports) == 1 else 'ies'}"]
    for r in reports:
        lines.append("")
        lines.append(f"{r['key']}/  ({r['kind']}{', ' + r['encoding'] if r.get('encoding') else ''})")
        lines.append(f"  sharding      {r['layout']}")
        lines.append(f"  shards        {r['shards_present']:,} present of {r['shards_expected']:,}")
        cells = f" of {r['grid_cells']:,} grid cells" if "grid_cells" in r else ""
        lines.append(f"  chunks        {r['chunks']:,}{cells}")
        size = r["stored_chunk_size"]
        lines.append(f"  stored bytes  {r['stored_bytes']:,} (chunk sizes {size['min']:,} .. {size['max']:,}, "
                     f"mean {size['mean']:,.0f})")
        if size["histogram"]:
            hist = ", ".join(f"{k[2:]}+: {v:,}" for k, v in size["histogram"].items())
            lines.append(f"  size buckets  {hist}")
    return "\n".join(lines)
