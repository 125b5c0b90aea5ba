"""export with N worker processes, N = 1, 2, 4, 8: over the Range server answering every request after
100 ms (an object store's first byte), and on local shards, into a local DEST with `--no-fsync` (the
cost of a flush is DEST's file system's, not the export's).

Each N runs on a Dask LocalCluster of N single-threaded worker processes (started before the timing,
as a real cluster would already be running) and, for comparison, in one process with `--jobs N`
concurrent writes. Every figure is in files/s and MiB/s, with its ratio to one Dask worker over the
same store, and to the target 0.8 x min(N x one worker's rate, one process's rate on local shards):
what N workers should reach if they scale until the cores (or the local reads) are the limit. The
timing covers the whole command: the client's start, the plan (one pass over the store), the tasks
and the manifest. The load average before each run is recorded (a shared machine skews figures).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .. import synthetic
from ..context import Context
from ..mounts import UNSHARDFS
from ..workloads import timed, warm_page_cache

LATENCY = 0.1
WORKERS = (1, 2, 4, 8)
ROUNDS = 1  # runs of each figure (the best is kept); raise on a quiet machine
GRID = (32, 32, 16)  # 16,384 chunks ...
SHARD_BITS = 6  # ... in 64 shards of 256 chunks ...
EDGE = 16
PAYLOAD = EDGE ** 3  # ... of 4 KiB each (16^3 uint8 voxels): 64 MiB


def dataset(data: Path) -> Path:
    root = data.resolve() / f"exportscale-{GRID[0] * GRID[1] * GRID[2]}"
    marker = root / "ready"
    if not marker.exists():
        print("building the export-scale dataset (once) ...", flush=True)
        synthetic.write_scale(root / "sharded", GRID, minishard_bits=2, shard_bits=SHARD_BITS, payload=PAYLOAD)
        # Chunks of 16^3 uint8 voxels (what a 4 KiB raw payload holds), not the writer's single voxel.
        info = json.loads((root / "sharded" / "info").read_text())
        info["scales"][0].update(chunk_sizes=[[EDGE] * 3], size=[g * EDGE for g in GRID])
        (root / "sharded" / "info").write_text(json.dumps(info))
        marker.write_text("ok")
    return root / "sharded"


def run(ctx: Context) -> None:
    import distributed

    from unshardfs.testing.http_servers import DatasetServer

    local_cluster: Any = distributed.LocalCluster  # (untyped)

    source = dataset(Path(ctx.args.data))
    warm_page_cache(source)
    files = GRID[0] * GRID[1] * GRID[2]
    size = files * PAYLOAD
    seconds: dict[tuple[str, str, int], float] = {}
    loads: dict[str, list[float]] = {}
    with DatasetServer(source.parent) as server:
        url = f"{server.url}/{source.name}"
        seconds[("local", "1 process", 1)] = _best(ctx, str(source), [], loads, "local, 1 process")
        for n in WORKERS:
            with local_cluster(n_workers=n, threads_per_worker=1, dashboard_address=None) as cluster:
                address = cluster.scheduler_address
                seconds[("local", "Dask", n)] = _best(ctx, str(source), ["--scheduler", address], loads,
                                                      f"local, Dask {n}")
                server.faults.delay = LATENCY
                seconds[("remote", "Dask", n)] = _best(ctx, url, ["--scheduler", address], loads, f"100 ms, Dask {n}",
                                                       server)
                server.faults.delay = 0
            seconds[("local", "--jobs", n)] = _best(ctx, str(source), ["--jobs", str(n)], loads, f"local, --jobs {n}")
            server.faults.delay = LATENCY
            seconds[("remote", "--jobs", n)] = _best(ctx, url, ["--jobs", str(n)], loads, f"100 ms, --jobs {n}",
                                                     server)
            server.faults.delay = 0
        planning(ctx, server, url)
    report(ctx, seconds, files, size)
    ctx.report.fact("export-scale load average (1 min) before each run", loads)
    ctx.report.fact("export-scale dataset", {"files": files + 1, "chunks": files, "shards": 1 << SHARD_BITS,
                                             "bytes": size, "latency_s": LATENCY, "rounds": ROUNDS})


def planning(ctx: Context, server: Any, url: str) -> None:
    """The client's plan alone over the store at 100 ms: its time and requests (a plain HTTP server
    cannot list: every possible shard name is probed, concurrently)."""
    from unshardfs.app.opened import OpenOptions
    from unshardfs.app.planner import plan_tasks

    server.faults.delay = LATENCY
    server.reset_log()
    seconds = timed(lambda: plan_tasks(url, OpenOptions(versions=False), max(WORKERS)))
    server.faults.delay = 0
    ctx.report.fact("export-scale planning at 100 ms", {
        "seconds": round(seconds, 3), "requests": len(server.log), "round_trips": server.round_trips()})


def _best(ctx: Context, source: str, options: list[str], loads: dict[str, list[float]], label: str,
          server: Any = None) -> float:
    """The best time of ROUNDS exports; over `server`, its requests of the last one are a fact."""
    dest = ctx.work / "export-scale"

    def once() -> None:
        shutil.rmtree(dest, ignore_errors=True)
        result = subprocess.run([*UNSHARDFS, "export", "-q", "--no-fsync", *options, source, str(dest)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"export {label} failed: {result.stderr[-2000:]}")

    best = float("inf")
    for _ in range(ROUNDS):
        loads.setdefault(label, []).append(round(os.getloadavg()[0], 2))
        if server is not None:
            server.reset_log()
        best = min(best, timed(once))
    if server is not None:
        log = server.log
        ctx.report.fact(f"export-scale requests, {label}", {
            "HEAD": sum(e.method == "HEAD" for e in log), "GET": sum(e.method == "GET" for e in log),
            "bytes": sum(e.sent for e in log), "round_trips": server.round_trips()})
    shutil.rmtree(dest, ignore_errors=True)
    return best


def report(ctx: Context, seconds: dict[tuple[str, str, int], float], files: int, size: int) -> None:
    local_one = files / seconds[("local", "1 process", 1)]
    for where, tag in (("remote", f"{LATENCY * 1000:.0f} ms"), ("local", "local")):
        one = files / seconds[(where, "Dask", 1)]
        for runner in ("Dask", "--jobs"):
            for n in WORKERS:
                rate = files / seconds[(where, runner, n)]
                mib = size / 2**20 / seconds[(where, runner, n)]
                target = 0.8 * min(n * one, local_one)
                name = f"export {tag}: Dask, {n} worker{'s' if n > 1 else ''}" if runner == "Dask" else \
                    f"export {tag}: 1 process, --jobs {n}"
                ctx.report.row(name, rate, "files/s", "Dask, 1 worker", one,
                               f">= {target:,.0f} files/s: {rate / target:.2f}x")
                ctx.report.row(f"{name} (MiB/s)", mib, "MiB/s", "Dask, 1 worker", one * size / files / 2**20)
    facts: dict[str, Any] = {f"{w} {r} {n}": round(s, 3) for (w, r, n), s in seconds.items()}
    ctx.report.fact("export-scale seconds", facts)
