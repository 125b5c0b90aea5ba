"""`unshardfs inspect`: what a sharded dataset holds, from its indexes alone.

No chunk payload is read: shard indexes and minishard indexes give the
chunk count, stored bytes and size distribution of every sharded directory.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

import numpy as np

from ..formats.precomputed import ShardedPart

SIZE_BUCKETS = [0] + [1 << k for k in range(6, 31, 2)]  # 0, 64 B, 256 B, ... 1 GiB


async def inspect_part(part: ShardedPart, progress: Callable[[int], None] | None = None) -> dict:
    spec = part.store.spec
    shards_present = 0
    async for _ in part.store.shard_numbers():
        shards_present += 1
    chunks = 0
    stored = 0
    smallest, largest = None, 0
    histogram = np.zeros(len(SIZE_BUCKETS), dtype=np.int64)
    async for _shard, mini in part.store.listing():
        sizes = mini.sizes
        chunks += len(sizes)
        stored += int(sizes.sum())
        lo, hi = int(sizes.min()), int(sizes.max())
        smallest = lo if smallest is None else min(smallest, lo)
        largest = max(largest, hi)
        histogram += np.bincount(np.searchsorted(SIZE_BUCKETS, sizes, side="right") - 1,
                                 minlength=len(SIZE_BUCKETS))
        if progress is not None:
            progress(len(sizes))
    report = {
        "kind": part.kind,
        "key": part.key,
        "sharding": asdict(spec),
        "shards_expected": 1 << spec.shard_bits,
        "shards_present": shards_present,
        "chunks": chunks,
        "stored_bytes": stored,
        "stored_chunk_size": {"min": smallest or 0, "max": largest,
                              "mean": stored / chunks if chunks else 0,
                              "histogram": {f">={SIZE_BUCKETS[i]}": int(n) for i, n in enumerate(histogram) if n}},
        **part.details,
    }
    return report


def format_report(reports: list[dict], source: str) -> str:
    lines = [f"{source}: {len(reports)} sharded director{'y' if len(reports) == 1 else 'ies'}"]
    for r in reports:
        s = r["sharding"]
        lines.append("")
        lines.append(f"{r['key']}/  ({r['kind']}{', ' + r['encoding'] if r.get('encoding') else ''})")
        lines.append(f"  sharding      {s['hash']}, preshift {s['preshift_bits']}, minishard_bits "
                     f"{s['minishard_bits']}, shard_bits {s['shard_bits']}; minishard index "
                     f"{s['minishard_index_encoding']}, data {s['data_encoding']}")
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

