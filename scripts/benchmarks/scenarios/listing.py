"""Listings at scale: ls -f / find / ls -l of a 1,000,000-chunk scale, daemon memory, mount time with 4096 shards."""

from __future__ import annotations

import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from ..context import Context
from ..mounts import UNSHARDFS, daemon_pid, memory_kib, mounted, unmount
from ..workloads import read_files, timed, warm_page_cache


def ls_time(root: Path) -> tuple[float, int]:
    start = time.perf_counter()
    out = subprocess.run(["ls", "-f", str(root)], capture_output=True, check=True).stdout
    return time.perf_counter() - start, out.count(b"\n")


def run(ctx: Context) -> None:
    million(ctx)
    if ctx.args.full:
        with mounted("unshardfs", ctx.datasets["tenmillion"], ctx.work) as m:
            t10, count10 = ls_time(m / "s0")
            mem10 = memory_kib(daemon_pid(m))
        ctx.report.fact("ls -f, 10,000,000 chunks", {"seconds": t10, "entries": count10, **mem10})
    mount_time(ctx)


def million(ctx: Context) -> None:
    """ls -f / find / ls -l of a 1,000,000-chunk scale, and the daemon's memory after it and 10k reads."""
    ds, work = ctx.datasets, ctx.work
    million_names = Path(str(ds["million"]) + ".names")
    warm_page_cache(ds["million"])
    with mounted("unshardfs", ds["million"], work) as m:
        ours_ls, count = ls_time(m / "s0")
        assert count >= 1_000_000, count
    with mounted("unshardfs", ds["million"], work) as m:
        ours_ls = min(ours_ls, ls_time(m / "s0")[0])
        find_count = int(subprocess.run(f"find {m}/s0 -type f | wc -l", shell=True, capture_output=True,
                                        text=True).stdout)
        lsl = subprocess.run(["ls", "-l", str(m / "s0")], capture_output=True, check=True).stdout.count(b"\n")
        pid = daemon_pid(m)
        paths = [str(m / "s0" / name) for name in random.Random(0).sample(
            million_names.read_text().split(), 10_000)]
        read_files(paths)
        mem = memory_kib(pid)
    null_ls = float("inf")
    for _ in range(2):
        with mounted("nullfs", million_names, work, "--flat") as m:
            null_ls = min(null_ls, ls_time(m)[0])
    ctx.report.row("ls -f, 1,000,000 chunks", ours_ls, "s", "null pyfuse3 fs", null_ls, "<= 8 s")
    ctx.report.fact("find / ls -l, 1,000,000 chunks", {"find": find_count, "ls -l lines": lsl})
    ctx.report.fact("daemon memory after 1M listing + 10k reads", mem)


def mount_time(ctx: Context) -> None:
    """Mount time with 4096 shards (nothing is scanned at start-up)."""
    times = []
    for _ in range(3):
        mnt = Path(tempfile.mkdtemp(dir=ctx.work))
        times.append(timed(lambda: subprocess.run([*UNSHARDFS, "mount", str(ctx.datasets["shards4096"]), str(mnt)],
                                                  check=True)))
        os.listdir(mnt / "s0")
        unmount(mnt)
    ctx.report.fact("mount time, 4096 shards (s)", {"min": min(times), "target": "<= 1 s"})
