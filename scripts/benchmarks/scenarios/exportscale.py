"""export with N worker processes, N = 1, 2, 4, 8: over the store stand-in (nginx, `store.NginxStore`)
answering every request after 100 ms (an object store's first byte), and on local shards, into a local DEST with `--no-fsync` (the
cost of a flush is DEST's file system's, not the export's). DEST is on a memory file system
(/dev/shm) where there is one: files created and renamed in one directory of a disk file system
wait for that directory's lock, so several writers there measure the disk's metadata rate, not
the export's scaling. The Dask runs over the store with DEST on the disk are reported beside them.

Each N runs on a Dask LocalCluster of N single-threaded worker processes (started before the timing,
as a real cluster would already be running) and, for comparison, in one process with `--jobs N`
concurrent writes. Every figure is in files/s and MiB/s, with its ratio to one Dask worker over the
same store, and to the target 0.8 x min(N x one worker's rate, one process's rate on local shards):
what N workers should reach if they scale until the cores (or the local reads) are the limit. The
timing covers the whole command: the client's start, the plan (one pass over the store), the tasks
and the manifest. The load average before each run is recorded (a shared machine skews figures).

Each row carries what bounds it: the CPU seconds of the export's client process (`getrusage` of
the reaped child), of the Dask workers (`/proc/PID/stat` of their processes, before and after), of
this process (the LocalCluster's scheduler lives here), and of the store; their CPU per file; and
the store's requests and round trips on the critical path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import profiling, synthetic
from ..context import Context
from ..cpu import own_seconds, tree_cpu_seconds
from ..mounts import UNSHARDFS
from ..store import NginxStore
from ..workloads import timed, warm_page_cache

LATENCY = 0.1
WORKERS = (1, 2, 4, 8)
ROUNDS = 2  # runs of each figure (the best is kept)
MEMORY_FS = Path("/dev/shm")
GRID = (32, 32, 16)  # 16,384 chunks ...
SHARD_BITS = 6  # ... in 64 shards of 256 chunks ...
EDGE = 16
PAYLOAD = EDGE ** 3  # ... of 4 KiB each (16^3 uint8 voxels): 64 MiB


# Chunks as large as a whole-brain segmentation's (the 100 TB projection in BENCHMARKS.md), of
# random bytes (zeros are written as holes): 512 chunks of 256 KiB (64^3 uint8) in 8 shards, 128 MiB.
LARGE_GRID = (8, 8, 8)
LARGE_SHARD_BITS = 3
LARGE_EDGE = 64


def dataset(data: Path, large: bool = False) -> Path:
    grid, edge, bits = (LARGE_GRID, LARGE_EDGE, LARGE_SHARD_BITS) if large else (GRID, EDGE, SHARD_BITS)
    root = data.resolve() / f"exportscale-{grid[0] * grid[1] * grid[2]}{'-large' if large else ''}"
    marker = root / "ready"
    if not marker.exists():
        print("building the export-scale dataset (once) ...", flush=True)
        synthetic.write_scale(root / "sharded", grid, minishard_bits=2, shard_bits=bits, payload=edge ** 3,
                              noise=large)
        # Chunks of edge^3 uint8 voxels (what the raw payload holds), not the writer's single voxel.
        info = json.loads((root / "sharded" / "info").read_text())
        info["scales"][0].update(chunk_sizes=[[edge] * 3], size=[g * edge for g in grid])
        (root / "sharded" / "info").write_text(json.dumps(info))
        marker.write_text("ok")
    return root / "sharded"


@dataclass
class Export:
    """One export run: its seconds and where its CPU went (seconds; None: not there)."""

    seconds: float
    client_cpu: float  # the `unshardfs export` process (and its children)
    workers_cpu: float | None = None  # the Dask worker processes
    scheduler_cpu: float | None = None  # this process: the LocalCluster's scheduler
    store_cpu: float | None = None
    counts: dict[str, Any] = field(default_factory=dict)  # the store's requests, round trips, bytes

    def detail(self, files: int) -> dict[str, Any]:
        cpu = self.client_cpu + (self.workers_cpu or 0.0)
        out: dict[str, Any] = {"seconds": round(self.seconds, 3), "files": files,
                               "daemon_cpu_s": round(cpu, 3), "daemon_cpu_us_per_file": round(cpu / files * 1e6),
                               "client_cpu_s": round(self.client_cpu, 3)}
        for name, value in (("workers_cpu_s", self.workers_cpu), ("scheduler_cpu_s", self.scheduler_cpu),
                            ("store_cpu_s", self.store_cpu)):
            if value is not None:
                out[name] = round(value, 3)
        return {**out, **self.counts}


def run(ctx: Context) -> None:
    import distributed

    local_cluster: Any = distributed.LocalCluster  # (untyped)
    client_class: Any = distributed.Client

    source = dataset(Path(ctx.args.data))
    warm_page_cache(source)
    files = GRID[0] * GRID[1] * GRID[2]
    size = files * PAYLOAD
    runs: dict[tuple[str, str, int], Export] = {}
    loads: dict[str, list[float]] = {}
    with NginxStore(source.parent, 0, ctx.work) as server:
        url = f"{server.url}/{source.name}"
        runs[("local", "1 process", 1)] = _best(ctx, str(source), [], loads, "local, 1 process")
        for n in WORKERS:
            with local_cluster(n_workers=n, threads_per_worker=1, dashboard_address=None) as cluster, \
                    client_class(cluster) as client:
                address = cluster.scheduler_address
                workers = sorted(client.run(os.getpid).values())
                runs[("local", "Dask", n)] = _best(ctx, str(source), ["--scheduler", address], loads,
                                                   f"local, Dask {n}", workers=workers)
                server.delay = LATENCY
                runs[("remote", "Dask", n)] = _best(ctx, url, ["--scheduler", address], loads, f"100 ms, Dask {n}",
                                                    server, workers=workers)
                if n <= 4:
                    runs[("disk", "Dask", n)] = _best(ctx, url, ["--scheduler", address], loads,
                                                      f"100 ms, Dask {n}, DEST on disk", server, workers=workers,
                                                      on_disk=True)
                server.delay = 0
            runs[("local", "--jobs", n)] = _best(ctx, str(source), ["--jobs", str(n)], loads, f"local, --jobs {n}")
            server.delay = LATENCY
            runs[("remote", "--jobs", n)] = _best(ctx, url, ["--jobs", str(n)], loads, f"100 ms, --jobs {n}", server)
            server.delay = 0
        planning(ctx, server, url)
    report(ctx, runs, files, size)
    large_chunks(ctx, local_cluster, client_class, loads)
    ctx.report.fact("export-scale load average (1 min) before each run", loads)
    ctx.report.fact("export-scale dataset", {"files": files + 1, "chunks": files, "shards": 1 << SHARD_BITS,
                                             "bytes": size, "latency_s": LATENCY, "rounds": ROUNDS})


def large_chunks(ctx: Context, local_cluster: Any, client_class: Any, loads: dict[str, list[float]]) -> None:
    """The export's cost per byte: 256 KiB chunks of random bytes over the store at 100 ms (one Dask
    worker, and one process with `--jobs 1`) against one process on the local shards, in MiB/s and
    in CPU per chunk (client and worker)."""
    source = dataset(Path(ctx.args.data), large=True)
    warm_page_cache(source)
    files = LARGE_GRID[0] * LARGE_GRID[1] * LARGE_GRID[2]
    mib = files * LARGE_EDGE ** 3 / 2**20
    runs: dict[str, Export] = {"local": _best(ctx, str(source), [], loads, "256 KiB chunks, local, 1 process")}
    with NginxStore(source.parent, LATENCY, ctx.work) as server:
        url = f"{server.url}/{source.name}"
        with local_cluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as cluster, \
                client_class(cluster) as client:
            workers = sorted(client.run(os.getpid).values())
            runs["Dask"] = _best(ctx, url, ["--scheduler", cluster.scheduler_address], loads,
                                 "256 KiB chunks, 100 ms, Dask 1", server, workers=workers)
        runs["--jobs"] = _best(ctx, url, ["--jobs", "1"], loads, "256 KiB chunks, 100 ms, --jobs 1", server)
    local = runs["local"]
    for label, key in (("Dask, 1 worker", "Dask"), ("1 process, --jobs 1", "--jobs")):
        got = runs[key]
        ctx.report.row(f"export 256 KiB chunks, {LATENCY * 1000:.0f} ms: {label}", mib / got.seconds, "MiB/s",
                       "1 process, local shards", mib / local.seconds,
                       detail={"ours": got.detail(files), "baseline": local.detail(files)})
    ctx.report.fact("export-scale large chunks", {
        "files": files, "chunk_bytes": LARGE_EDGE ** 3, "mib": mib,
        "cpu_us_per_chunk": {k: round((e.client_cpu + (e.workers_cpu or 0.0)) / files * 1e6) for k, e in runs.items()},
        "seconds": {k: round(e.seconds, 3) for k, e in runs.items()}})


def planning(ctx: Context, server: NginxStore, url: str) -> None:
    """The client's plan alone over the store at 100 ms: its time and requests (a plain HTTP server
    cannot list: every possible shard name is probed, concurrently)."""
    from unshardfs.app.opened import OpenOptions
    from unshardfs.app.planner import plan_tasks

    server.delay = LATENCY
    server.reset_log()
    seconds = timed(lambda: plan_tasks(url, OpenOptions(versions=False), max(WORKERS)))
    server.delay = 0
    counts = server.counts()
    ctx.report.fact("export-scale planning at 100 ms", {
        "seconds": round(seconds, 3), "requests": counts["requests"], "round_trips": counts["round_trips"]})


def _best(ctx: Context, source: str, options: list[str], loads: dict[str, list[float]], label: str,
          server: NginxStore | None = None, workers: list[int] | None = None, on_disk: bool = False) -> Export:
    """The fastest of ROUNDS exports, with its CPU (`Export`); over `server`, its requests too.
    DEST on the memory file system, if there is one and not `on_disk`."""
    memory = MEMORY_FS.is_dir() and os.access(MEMORY_FS, os.W_OK) and not on_disk
    base = MEMORY_FS / f"unshardfs-bench-{os.getpid()}" if memory else ctx.work
    base.mkdir(parents=True, exist_ok=True)
    dest = base / "export-scale"
    name = f"export {label}"

    def once() -> Export:
        shutil.rmtree(dest, ignore_errors=True)
        if server is not None:
            server.reset_log()
            store_before = server.cpu_seconds()
        workers_before = sum(tree_cpu_seconds(p) for p in workers or [])
        recordings = [profiling.attach(p) for p in workers or []] if profiling.ACTIVE is not None else []
        own_before = own_seconds()
        start = time.perf_counter()
        proc = subprocess.Popen([*UNSHARDFS, "export", "-q", "--no-fsync", *options, source, str(dest)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        recording = profiling.attach(proc.pid) if profiling.ACTIVE is not None else None
        assert proc.stderr is not None
        error = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        scheduler = own_seconds() - own_before
        workers_cpu = sum(tree_cpu_seconds(p) for p in workers or []) - workers_before
        profiling.stop(recording)
        for r in recordings:
            if r is not None:
                r.proc.send_signal(2)  # the workers live on: py-spy writes what it has on SIGINT
            profiling.stop(r)
        if proc.returncode != 0:
            raise RuntimeError(f"export {label} failed: {error.decode(errors='replace')[-2000:]}")
        run = Export(seconds, usage.ru_utime + usage.ru_stime, workers_cpu if workers else None,
                     scheduler if workers else None)
        if server is not None:
            log = server.requests()
            run.store_cpu = server.cpu_seconds() - store_before
            run.counts = {"HEAD": sum(e.method == "HEAD" for e in log), "GET": sum(e.method == "GET" for e in log),
                          "bytes": sum(e.sent for e in log), "requests": len(log),
                          "round_trips": server.round_trips()}
        return run

    best: Export | None = None
    with profiling.figure(name):
        for _ in range(ROUNDS):
            loads.setdefault(label, []).append(round(os.getloadavg()[0], 2))
            run = once()
            if best is None or run.seconds < best.seconds:
                best = run
    assert best is not None
    if server is not None:
        ctx.report.fact(f"export-scale requests, {label}", best.counts)
    shutil.rmtree(base if memory else dest, ignore_errors=True)
    return best


def report(ctx: Context, runs: dict[tuple[str, str, int], Export], files: int, size: int) -> None:
    local_one = files / runs[("local", "1 process", 1)].seconds
    for where, tag in (("remote", f"{LATENCY * 1000:.0f} ms"), ("local", "local"),
                       ("disk", f"{LATENCY * 1000:.0f} ms, DEST on disk")):
        one = files / runs[(where, "Dask", 1)].seconds
        for runner in ("Dask", "--jobs"):
            for n in WORKERS:
                got = runs.get((where, runner, n))
                if got is None:
                    continue  # (DEST on disk: Dask runs only)
                rate = files / got.seconds
                mib = size / 2**20 / got.seconds
                target = 0.8 * min(n * one, local_one)
                name = f"export {tag}: Dask, {n} worker{'s' if n > 1 else ''}" if runner == "Dask" else \
                    f"export {tag}: 1 process, --jobs {n}"
                ctx.report.row(name, rate, "files/s", "Dask, 1 worker", one,
                               f">= {target:,.0f} files/s: {rate / target:.2f}x",
                               detail={"ours": got.detail(files), "baseline": runs[(where, "Dask", 1)].detail(files)})
                ctx.report.row(f"{name} (MiB/s)", mib, "MiB/s", "Dask, 1 worker", one * size / files / 2**20)
    facts: dict[str, Any] = {f"{w} {r} {n}": round(e.seconds, 3) for (w, r, n), e in runs.items()}
    ctx.report.fact("export-scale seconds", facts)
