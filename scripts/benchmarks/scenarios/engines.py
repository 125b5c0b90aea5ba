"""The two FUSE engines side by side: each figure measured on the kernel engine and on pyfuse3 in one run.

Warm re-read against tmpfs, first read against each other and ratarmount, `ls -f` of 10^6 chunks,
8 processes looking up 200 names of one directory over a store answering after 20 ms, 8 parallel
readers over that store, and sequential 2 MiB chunks against a native read of the shards.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from ..context import KEY, Context
from ..mounts import PY, mounted
from ..workloads import in_processes, parallel_read, read_files, rel_files, timed, warm_page_cache, warmed_files
from .listing import ls_time
from .local import best_fresh, rate

ENGINES = ("kernel", "pyfuse3")
LATENCY = 0.02


def engine(name: str) -> tuple[str, ...]:
    return ("--fuse-engine", name)


def run(ctx: Context) -> None:
    small = ctx.datasets["small"]
    files = warmed_files(small, KEY)
    warm(ctx, files)
    first(ctx, files)
    listing(ctx)
    slow_store(ctx, files)
    sequential(ctx)


def warm(ctx: Context, files: list[str]) -> None:
    shm = Path(tempfile.mkdtemp(prefix="bench-", dir="/dev/shm"))
    try:
        shutil.copytree(ctx.datasets["small"]["plain"], shm / "plain")
        tmpfs = max(rate(shm / "plain", files) for _ in range(3))
        for name in ENGINES:
            with mounted("unshardfs", ctx.datasets["small"]["sharded"], ctx.work, *engine(name)) as m:
                rate(m, files)
                ours = max(rate(m, files) for _ in range(3))
            ctx.report.row(f"warm re-read, 16 KiB chunks [{name}]", ours, "files/s", "tmpfs", tmpfs, ">= 0.7")
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def first(ctx: Context, files: list[str]) -> None:
    small = ctx.datasets["small"]
    ours = {name: best_fresh(ctx, "unshardfs", small["sharded"], files, *engine(name)) for name in ENGINES}
    ctx.report.row("first read, fresh mount [kernel]", ours["kernel"], "files/s", "pyfuse3 engine",
                   ours["pyfuse3"], ">= 1.5")
    tar = ctx.work / "small.tar"
    if shutil.which("ratarmount", path=str(Path(PY).parent)):
        with tarfile.open(tar, "w") as t:
            t.add(small["plain"] / KEY, arcname=KEY)
        with mounted("ratarmount", tar, ctx.work):
            pass  # its index is built once, outside the timing
        rat = best_fresh(ctx, "ratarmount", tar, files)
        for name in ENGINES:
            ctx.report.row(f"first read, fresh mount [{name}]", ours[name], "files/s", "ratarmount (tar)", rat,
                           ">= 1.5")


def listing(ctx: Context) -> None:
    million = ctx.datasets["million"]
    warm_page_cache(million)
    seconds = {}
    for name in ENGINES:
        with mounted("unshardfs", million, ctx.work, *engine(name)) as m:
            seconds[name] = min(ls_time(m / "s0")[0] for _ in range(1))
    ctx.report.row("ls -f, 1,000,000 chunks [kernel]", seconds["kernel"], "s", "pyfuse3 engine", seconds["pyfuse3"],
                   "<= 1.5 s")


def _stat_proc(paths: list[str], queue: Any) -> None:
    for p in paths:
        os.stat(p)
    queue.put(len(paths))


def slow_store(ctx: Context, files: list[str]) -> None:
    """A store answering every request after 20 ms (the test HTTP server's delay)."""
    from unshardfs.testing.http_servers import DatasetServer

    small = ctx.datasets["small"]["sharded"]
    names = files[:200]
    ideal = len(names) / 8 * LATENCY
    with DatasetServer(small.parent) as server:
        url = f"{server.url}/{small.name}"
        times, readers = {}, {}
        for name in ENGINES:
            with mounted("unshardfs", url, ctx.work, *engine(name)) as m:
                server.faults.delay = LATENCY
                # Round-robin: process i looks up names i, i+8, ... (one directory).
                times[name] = in_processes(_stat_proc, [([str(m / n) for n in names[i::8]],) for i in range(8)])[0]
                server.faults.delay = 0
            with mounted("unshardfs", url, ctx.work, *engine(name)) as m:
                server.faults.delay = LATENCY
                readers[name] = len(files[:512]) / parallel_read([str(m / f) for f in files[:512]], 8)
                server.faults.delay = 0
    for name in ENGINES:
        ctx.report.row(f"8 procs stat 200 names of one dir, 20 ms store [{name}]", times[name], "s",
                       "200/8 x 20 ms", ideal, "<= 1.3x")
    ctx.report.row("8 parallel readers, 20 ms store [kernel]", readers["kernel"], "files/s", "pyfuse3 engine",
                   readers["pyfuse3"])


def sequential(ctx: Context) -> None:
    large = ctx.datasets["large"]
    warm_page_cache(large["sharded"])
    shard_paths = [str(p) for p in sorted((large["sharded"] / KEY).glob("*.shard"))]
    native = max(sum(os.path.getsize(p) for p in shard_paths) / timed(lambda: read_files(shard_paths))
                 for _ in range(2))
    files = rel_files(large["plain"], KEY)
    size = sum((large["plain"] / f).stat().st_size for f in files)
    for name in ENGINES:
        best = 0.0
        for _ in range(2):
            with mounted("unshardfs", large["sharded"], ctx.work, *engine(name)) as m:
                best = max(best, size / timed(lambda: read_files([str(m / f) for f in files])))
        ctx.report.row(f"sequential read, 2 MiB raw chunks [{name}]", best / 2**20, "MiB/s",
                       "native read of the shards", native / 2**20, ">= 0.5")
