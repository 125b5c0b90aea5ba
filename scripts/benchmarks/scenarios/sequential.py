"""Big sequential reads: 2 MiB raw chunks against reading the shard files natively and the null fs."""

from __future__ import annotations

import os
from typing import Any

from ..context import KEY, Context
from ..mounts import mounted
from ..workloads import read_files, rel_files, timed, warm_page_cache


def run(ctx: Context) -> None:
    large, row = ctx.datasets["large"], ctx.report.row
    warm_page_cache(large["sharded"])
    shard_paths = [str(p) for p in sorted((large["sharded"] / KEY).glob("*.shard"))]
    shard_bytes = sum(os.path.getsize(p) for p in shard_paths)
    native = max(shard_bytes / timed(lambda: read_files(shard_paths)) for _ in range(3))
    files = rel_files(large["plain"], KEY)
    size = sum((large["plain"] / f).stat().st_size for f in files)

    def best(kind: str, source: Any) -> float:
        out = 0.0
        for _ in range(2):
            with mounted(kind, source, ctx.work) as m:
                out = max(out, size / timed(lambda: read_files([str(m / f) for f in files])))
        return out / 2**20

    ours = best("unshardfs", large["sharded"])
    row("sequential read, 2 MiB raw chunks", ours, "MiB/s", "native read of the shards", native / 2**20, ">= 0.5")
    row("sequential read, 2 MiB raw chunks", ours, "MiB/s", "null pyfuse3 fs", best("nullfs", large["plain"]))
