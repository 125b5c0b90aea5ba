"""What `inspect` reports about one sharded directory, from its indexes alone (no payload read)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from unshardfs.core.chunks import ChunkContext

Progress = Callable[[int], None]

SIZE_BUCKETS = [0] + [1 << k for k in range(6, 31, 2)]  # 0, 64 B, 256 B, ... 1 GiB


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
        sizes = sizes.astype(np.int64)
        self.chunks += len(sizes)
        self.stored += int(sizes.sum())
        lo, hi = int(sizes.min()), int(sizes.max())
        self.smallest = lo if self.smallest is None else min(self.smallest, lo)
        self.largest = max(self.largest, hi)
        self.histogram += np.bincount(np.searchsorted(SIZE_BUCKETS, sizes, side="right") - 1,
                                      minlength=len(SIZE_BUCKETS))

    def report(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "stored_bytes": self.stored,
                "stored_chunk_size": {"min": self.smallest or 0, "max": self.largest,
                                      "mean": self.stored / self.chunks if self.chunks else 0,
                                      "histogram": {f">={SIZE_BUCKETS[i]}": int(n)
                                                    for i, n in enumerate(self.histogram) if n}}}


class InventoryPart(ABC):
    """One sharded directory (or array) as `inspect` describes it."""

    kind: str
    path: str

    @abstractmethod
    async def report(self, progress: Progress | None = None) -> dict[str, Any]:
        """kind, key, layout, shards_expected/present, chunks, stored sizes, format details."""


@dataclass
class ChunkInventory(InventoryPart):
    """Any sharded directory built on the core: shards present, chunks, stored sizes."""

    kind: str
    path: str
    chunks: ChunkContext
    layout: str
    shards_expected: int | None
    details: dict[str, Any] = field(default_factory=dict)

    async def report(self, progress: Progress | None = None) -> dict[str, Any]:
        present = 0
        async for _ in self.chunks.store.shards():
            present += 1
        stats = SizeStats()
        async for _shard, tables in self.chunks.shard_tables():
            for table in tables:
                stats.add(table.lengths)
                if progress is not None:
                    progress(len(table))
        return {"kind": self.kind, "key": self.path or ".", "layout": self.layout,
                "shards_expected": self.shards_expected, "shards_present": present, **stats.report(),
                **self.details}


@dataclass
class NotShown(InventoryPart):
    """A directory the tree does not show as its format would (an array the view leaves out, or shows
    as it is stored), and why: `inspect` lists it beside the sharded directories."""

    kind: str  # what happened to it: "left out of the zarr2 view", "shown as stored"
    path: str
    reason: str

    async def report(self, progress: Progress | None = None) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.path or ".", "reason": self.reason}
