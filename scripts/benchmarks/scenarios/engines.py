"""The FUSE engines side by side: each figure measured on the kernel engine and on pyfuse3 in one run,
and on the kernel engine over io_uring where the machine offers it (root, the fuse module's
`enable_uring`, set for the scenario and restored after).

Warm re-read against tmpfs, first read against each other and ratarmount, `ls -f` of 10^6 chunks,
8 processes looking up 200 names of one directory over a store answering after 20 ms, 8 parallel
readers over that store, and sequential 2 MiB chunks against a native read of the shards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Iterator

from ..context import KEY, Context
from ..mounts import PY, mounted
from ..store import NginxStore
from ..workloads import parallel_read, read_files, rel_files, stat_lists, timed, warm_page_cache, warmed_files
from .listing import ls_time
from .local import best_fresh, rate

ENGINES = ("kernel", "pyfuse3")
URING = "kernel-uring"
LATENCY = 0.02


def engine(name: str) -> tuple[str, ...]:
    if name == URING:
        return ("--fuse-engine", "kernel", "--fuse-transport", "uring")
    return ("--fuse-engine", name)


@contextlib.contextmanager
def uring_offered(ctx: Context) -> Iterator[bool]:
    """`enable_uring` set while the scenario runs, if this machine can (root, Linux 6.14 or later),
    and a probe mount granted FUSE over io_uring; restored after."""
    from unshardfs.testing.mounts import stats
    from unshardfs.testing.setups import ENABLE_URING, module_parameter

    if os.geteuid() != 0 or not ENABLE_URING.exists():
        ctx.report.fact("io_uring", "not measured: needs root and a fuse module with enable_uring")
        yield False
        return
    with module_parameter(ENABLE_URING, "Y"):
        with mounted("unshardfs", ctx.datasets["small"]["sharded"], ctx.work, *engine(URING)) as m:
            granted = bool(stats(m)["fuse"]["features"].get("io_uring"))
        if not granted:
            ctx.report.fact("io_uring", "not measured: the kernel did not grant FUSE over io_uring")
        yield granted


def run(ctx: Context) -> None:
    small = ctx.datasets["small"]
    files = warmed_files(small, KEY)
    with uring_offered(ctx) as uring:
        engines = (*ENGINES, URING) if uring else ENGINES
        warm(ctx, files, engines)
        first(ctx, files, engines)
        listing(ctx, engines)
        slow_store(ctx, files, engines)
        sequential(ctx, engines)


def warm(ctx: Context, files: list[str], engines: tuple[str, ...]) -> None:
    shm = Path(tempfile.mkdtemp(prefix="bench-", dir="/dev/shm"))
    try:
        shutil.copytree(ctx.datasets["small"]["plain"], shm / "plain")
        tmpfs = max(rate(shm / "plain", files) for _ in range(3))
        for name in engines:
            with mounted("unshardfs", ctx.datasets["small"]["sharded"], ctx.work, *engine(name)) as m:
                rate(m, files)
                ours = max(rate(m, files) for _ in range(3))
            ctx.report.row(f"warm re-read, 16 KiB chunks [{name}]", ours, "files/s", "tmpfs", tmpfs, ">= 0.7")
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def first(ctx: Context, files: list[str], engines: tuple[str, ...]) -> None:
    small = ctx.datasets["small"]
    ours = {name: best_fresh(ctx, "unshardfs", small["sharded"], files, *engine(name)) for name in engines}
    ctx.report.row("first read, fresh mount [kernel]", ours["kernel"], "files/s", "pyfuse3 engine",
                   ours["pyfuse3"], ">= 1.5")
    if URING in ours:
        ctx.report.row(f"first read, fresh mount [{URING}]", ours[URING], "files/s", "kernel engine, /dev/fuse",
                       ours["kernel"])
    tar = ctx.work / "small.tar"
    if shutil.which("ratarmount", path=str(Path(PY).parent)):
        with tarfile.open(tar, "w") as t:
            t.add(small["plain"] / KEY, arcname=KEY)
        with mounted("ratarmount", tar, ctx.work):
            pass  # its index is built once, outside the timing
        rat = best_fresh(ctx, "ratarmount", tar, files)
        for name in engines:
            ctx.report.row(f"first read, fresh mount [{name}]", ours[name], "files/s", "ratarmount (tar)", rat,
                           ">= 1.5")


def listing(ctx: Context, engines: tuple[str, ...]) -> None:
    million = ctx.datasets["million"]
    warm_page_cache(million)
    seconds = {}
    for name in engines:
        with mounted("unshardfs", million, ctx.work, *engine(name)) as m:
            seconds[name] = min(ls_time(m / "s0")[0] for _ in range(1))
    ctx.report.row("ls -f, 1,000,000 chunks [kernel]", seconds["kernel"], "s", "pyfuse3 engine", seconds["pyfuse3"],
                   "<= 1.5 s")
    if URING in seconds:
        ctx.report.row(f"ls -f, 1,000,000 chunks [{URING}]", seconds[URING], "s", "kernel engine, /dev/fuse",
                       seconds["kernel"])


def slow_store(ctx: Context, files: list[str], engines: tuple[str, ...]) -> None:
    """A store answering every request after 20 ms (the nginx stand-in's delay, `store.NginxStore`)."""
    small = ctx.datasets["small"]["sharded"]
    names = files[:200]
    ideal = len(names) / 8 * LATENCY
    with NginxStore(small.parent, 0, ctx.work) as server:
        url = f"{server.url}/{small.name}"
        times, readers = {}, {}
        for name in engines:
            with mounted("unshardfs", url, ctx.work, *engine(name)) as m:
                server.delay = LATENCY
                # Round-robin: process i looks up names i, i+8, ... (one directory).
                times[name] = stat_lists([[str(m / n) for n in names[i::8]] for i in range(8)])
                server.delay = 0
            with mounted("unshardfs", url, ctx.work, *engine(name)) as m:
                server.delay = LATENCY
                readers[name] = len(files[:512]) / parallel_read([str(m / f) for f in files[:512]], 8)
                server.delay = 0
    for name in engines:
        ctx.report.row(f"8 procs stat 200 names of one dir, 20 ms store [{name}]", times[name], "s",
                       "200/8 x 20 ms", ideal, "<= 1.3x")
    ctx.report.row("8 parallel readers, 20 ms store [kernel]", readers["kernel"], "files/s", "pyfuse3 engine",
                   readers["pyfuse3"])
    if URING in readers:
        ctx.report.row(f"8 parallel readers, 20 ms store [{URING}]", readers[URING], "files/s",
                       "kernel engine, /dev/fuse", readers["kernel"])


def sequential(ctx: Context, engines: tuple[str, ...]) -> None:
    large = ctx.datasets["large"]
    warm_page_cache(large["sharded"])
    shard_paths = [str(p) for p in sorted((large["sharded"] / KEY).glob("*.shard"))]
    native = max(sum(os.path.getsize(p) for p in shard_paths) / timed(lambda: read_files(shard_paths))
                 for _ in range(2))
    files = rel_files(large["plain"], KEY)
    size = sum((large["plain"] / f).stat().st_size for f in files)
    for name in engines:
        best = 0.0
        for _ in range(2):
            with mounted("unshardfs", large["sharded"], ctx.work, *engine(name)) as m:
                best = max(best, size / timed(lambda: read_files([str(m / f) for f in files])))
        ctx.report.row(f"sequential read, 2 MiB raw chunks [{name}]", best / 2**20, "MiB/s",
                       "native read of the shards", native / 2**20, ">= 0.5")
