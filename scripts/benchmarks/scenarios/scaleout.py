"""check and export of a many-shard dataset: one process, --jobs 2, and a Dask LocalCluster of 1 and 2
workers (this machine has 2 cores), as ratios to the single process. The clusters are started before
the timing, as a real cluster would already be running."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from ..context import Context
from ..mounts import UNSHARDFS
from ..workloads import timed, warm_page_cache


def run(ctx: Context) -> None:
    from distributed import LocalCluster

    source = ctx.datasets["shards4096"]  # 65,536 chunks in 4,096 shards
    warm_page_cache(source)
    chunks = 64 * 64 * 16
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as one, \
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as two:
        runs = {"1 process": [], "--jobs 2": ["--jobs", "2"], "Dask, 1 worker": ["--scheduler", one.scheduler_address],
                "Dask, 2 workers": ["--scheduler", two.scheduler_address]}
        for command in ("check", "export"):
            measure(ctx, command, source, runs, chunks)


def measure(ctx: Context, command: str, source: Any, runs: dict[str, list[str]], chunks: int) -> None:
    times = {}
    for label, options in runs.items():
        if command == "export" and label == "--jobs 2":
            continue  # export's --jobs is concurrent writes in one process, not a split
        dest = ctx.work / "export"

        def once() -> None:
            shutil.rmtree(dest, ignore_errors=True)
            args = [*UNSHARDFS, command, "-q", *options, str(source)] + ([str(dest)] if command == "export" else [])
            subprocess.run(args, check=command == "export", capture_output=True)

        times[label] = min(timed(once) for _ in range(2))
    base = times["1 process"]
    for label, seconds in times.items():
        if label != "1 process":
            ctx.report.row(f"{command}, {chunks:,} chunks: {label}", chunks / seconds, "files/s",
                           "1 process", chunks / base)
