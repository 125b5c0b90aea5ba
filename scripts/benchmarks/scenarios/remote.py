"""Object-store latency: a store that answers every request after a delay (20 ms and 100 ms, a
typical object-store first byte; nginx serving the shard files, the delay a timer that costs it no
CPU: `store.NginxStore`), serving a 1,024-chunk TensorStore-written sharded volume (32 KiB raw
chunks, 4 shards x 8 minishards), the same voxels as a sharded Zarr v3 array (zarr-python, 8 shards),
and multi-LOD meshes. Baselines in the same run: TensorStore through its http kvstore on the same
store, and the same commands through a mount of the local shards.

Every row carries what bounds it (`measure.Measured`): the wall time, the CPU seconds of the daemon,
the store and the readers, the daemon's CPU per file, and the store's requests and round trips on
the critical path; for the local baseline the same without the store.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import profiling
from ..context import KEY, Context
from ..cpu import own_seconds
from ..measure import Measured, through, typical
from ..mounts import mounted
from ..store import NginxStore
from ..workloads import parallel_read, read_lists, stat_lists, timed, xargs_read

LATENCIES = (0.02, 0.1)
READERS = 8
VIEWER_CHUNKS = 500
LOOKUPS = 200  # names looked up by READERS processes (`segmentation_lookups`)
ROUNDS = 5  # local and remote runs of a figure, alternating


@dataclass
class Dataset:
    name: str  # "precomputed" / "zarr3"
    root: Path  # served directory (sharded)
    chunk_dir: str  # the chunk directory inside the mount
    files: list[str]  # chunk files, relative to the mount root
    ts_spec: dict[str, Any]  # TensorStore spec minus its kvstore


def build(ctx: Context) -> tuple[list[Dataset], dict[str, Path]]:
    return datasets_at(Path(ctx.args.data))


def datasets_at(data: Path) -> tuple[list[Dataset], dict[str, Path]]:
    """The volumes (precomputed, Zarr v3) and the meshes under `data`/remote, built once."""
    from unshardfs.testing.precomputed import Scale, read_all, sharding, write_objects, write_volume

    base = data.resolve() / "remote"
    marker = base / "ready"
    pre = base / "precomputed"
    zroot = base / "zarr"
    meshes = base / "meshes"
    if not marker.exists():
        print("building remote benchmark datasets (once) ...", flush=True)
        write_volume(pre, [Scale((512, 256, 256), (32, 32, 32), sharding(minishard=3, shard=2))], "uint8")
        _write_zarr(zroot / "vol.zarr", read_all(pre / "plain")[..., 0])
        write_objects(meshes, "mesh", sharding(preshift=1, minishard=2, shard=2, data_enc="gzip"), n=200)
        marker.write_text("ok")
    pre_files = sorted(f"{KEY}/{name}" for name in os.listdir(pre / "plain" / KEY))
    zarr_files = sorted(str(p.relative_to(zroot / "plain.zarr")) for p in (zroot / "plain.zarr" / "c").rglob("*")
                        if p.is_file())
    datasets = [
        Dataset("precomputed", pre / "sharded", KEY, pre_files, {"driver": "neuroglancer_precomputed"}),
        Dataset("zarr3", zroot / "vol.zarr", "c", zarr_files, {"driver": "zarr3"}),
    ]
    return datasets, {"meshes": meshes / "sharded"}


def _write_zarr(path: Path, data: Any) -> None:
    """The same voxels as a sharded Zarr v3 array (zarr-python), and unsharded beside it."""
    import zarr

    for target, shards in ((path, (256, 128, 128)), (path.parent / "plain.zarr", None)):
        arr = zarr.create_array(str(target), shape=data.shape, chunks=(32, 32, 32), shards=shards,
                                dtype=data.dtype, compressors=None, zarr_format=3)
        arr[...] = data


@contextmanager
def served(root: Path, latency: float, workdir: Path | None = None) -> Iterator[NginxStore]:
    """The store stand-in serving `root`, answering every request after `latency` seconds."""
    with NginxStore(root, latency, workdir) as store:
        yield store


def run(ctx: Context) -> None:
    datasets, extra = build(ctx)
    for latency in LATENCIES:
        for ds in datasets:
            with served(ds.root, latency, ctx.work) as server:
                measure(ctx, ds, server, latency)
        with served(extra["meshes"], latency, ctx.work) as server:
            meshes(ctx, extra["meshes"], server, latency)


def run_readers(ctx: Context) -> None:
    """`--only remote-readers`: the 8 readers of `measure` alone (both volumes, both latencies, and
    with no delay: the run that removes the store's latency, leaving what the daemon's CPU costs),
    and 8 processes looking up 200 names of one directory of a compressed_segmentation + gzip
    volume at 20 ms against the ideal (each process one lookup per round trip)."""
    datasets, _ = build(ctx)
    for latency in (*LATENCIES, 0.0):
        for ds in datasets:
            with served(ds.root, latency, ctx.work) as server:
                readers_rows(ctx, ds, server, latency)
    segmentation_lookups(ctx)


def segmentation_lookups(ctx: Context) -> None:
    """Each size is in its payload's gzip trailer, so each lookup reads a payload: 200 lookups by
    8 processes take at least 200/8 round trips. The first 200 names split round-robin (a joint
    walk in name order, as the engines scenario's lookups) and 200 scattered names."""
    from unshardfs.testing.precomputed import Scale, sharding, write_volume

    root = Path(ctx.args.data).resolve() / "remote" / "segmentation"
    if not (root / "ready").exists():
        scale = Scale((256, 256, 128), (16, 16, 16), sharding(minishard=3, shard=2, data_enc="gzip", index_enc="gzip"),
                      encoding="compressed_segmentation", extra={"compressed_segmentation_block_size": [8, 8, 8]})
        write_volume(root, [scale], "uint64", volume_type="segmentation")
        (root / "ready").write_text("ok")
    names = sorted(os.listdir(root / "plain" / KEY))
    latency = LATENCIES[0]
    ideal = LOOKUPS / READERS * latency
    target = f"<= {(1.3 * ideal + 3 * latency) / ideal:.2f} (1.3x + 3 round trips)"
    for label, chosen in (("first names", names[:LOOKUPS]), ("scattered", random.Random(7).sample(names, LOOKUPS))):
        name = f"{READERS} procs look up {LOOKUPS} names, seg+gzip, {label} (20 ms)"
        with profiling.figure(name), served(root / "sharded", 0, ctx.work) as server:
            with mounted("unshardfs", server.url, ctx.work) as m:
                server.delay = latency
                load = os.getloadavg()[0]
                lists = [[str(m / KEY / n) for n in chosen[i::READERS]] for i in range(READERS)]
                got = through(m, LOOKUPS, lambda: stat_lists(lists), store=server)
                server.delay = 0
            ctx.report.row(name, got.seconds, "s", f"{LOOKUPS}/{READERS} round trips", ideal, target,
                           detail={"ours": got.detail()})
            ctx.report.fact(f"lookups, seg+gzip, {label} (20 ms)",
                            {"requests": got.requests, "round_trips": got.round_trips,
                             "load_average": round(load, 1)})


def readers_rows(ctx: Context, ds: Dataset, server: NginxStore, latency: float) -> None:
    """The 8 readers over HTTP against TensorStore and against the same readers on local shards:
    `find . -type f | xargs -P 8 -n 16 cat` in the chunk directory of a fresh mount."""
    tag = f"{ds.name}, {latency * 1000:.0f} ms"
    n = len(ds.files)
    name = f"{READERS} readers over HTTP ({tag})"
    ts = tensorstore_read(ds, server)

    def work(m: Path) -> Callable[[], object]:
        return lambda: xargs_read(m / ds.chunk_dir, READERS)

    local, remote = alternating(ctx, f"{READERS} readers ({tag})", lambda: local_run(ctx, ds.root, n, work),
                                lambda: counted(ctx, server, n, work))
    ctx.report.row(name, remote.rate, "files/s", "TensorStore http kvstore", ts.rate, ">= 1.5",
                   detail={"ours": remote.detail(), "baseline": ts.detail()})
    ctx.report.row(name, remote.rate, "files/s", f"{READERS} readers, local shards", local.rate, ">= 0.6",
                   detail={"ours": remote.detail(), "baseline": local.detail()})


def measure(ctx: Context, ds: Dataset, server: NginxStore, latency: float) -> None:
    row, tag = ctx.report.row, f"{ds.name}, {latency * 1000:.0f} ms"
    n = len(ds.files)
    ts = tensorstore_read(ds, server)
    name = f"cp -r over HTTP ({tag})"
    local, remote = alternating(ctx, f"cp -r ({tag})",
                                lambda: local_run(ctx, ds.root, n, lambda m: cp_work(ctx, m, ds.chunk_dir)),
                                lambda: counted(ctx, server, n, lambda m: cp_work(ctx, m, ds.chunk_dir)))
    shutil.rmtree(ctx.work / "cp-target", ignore_errors=True)
    row(name, remote.rate, "files/s", "TensorStore http kvstore", ts.rate,
        detail={"ours": remote.detail(), "baseline": ts.detail()})
    row(name, remote.rate, "files/s", "cp -r, local shards", local.rate, ">= 0.6 (or >= TS)",
        detail={"ours": remote.detail(), "baseline": local.detail()})
    readers_rows(ctx, ds, server, latency)
    with profiling.figure(f"ls -lR ({tag})"), mounted("unshardfs", server.url, ctx.work) as m:
        got = through(m, n, lambda: subprocess.run(["ls", "-lR", str(m / ds.chunk_dir)], capture_output=True,
                                                   check=True), store=server)
    # Round trips as the store saw them: the longest chain of requests each sent after the
    # previous one was answered (overlapping requests cost one trip together).
    ctx.report.fact(f"ls -lR ({tag})", {**got.detail(), "target": "<= 15 round trips"})
    viewer(ctx, ds, server, latency, tag)


def alternating(ctx: Context, label: str, local: Callable[[], Measured],
                remote: Callable[[], Measured]) -> tuple[Measured, Measured]:
    """`local` and `remote` run in turn ROUNDS times each (which goes first alternates), each side's
    figures typical of its rounds (`measure.typical`): one pair measured at one moment swings with
    the machine's load (remote/local 0.6-0.95 between rounds of one run); the ratio of each round,
    its median and range go into the facts. With --profile, the daemons of each side are sampled
    as a figure of their own (`label`, and `label` on local shards)."""

    def run_local() -> Measured:
        with profiling.figure(f"{label}, local shards"):
            return local()

    def run_remote() -> Measured:
        with profiling.figure(f"{label} over HTTP"):
            return remote()

    pairs = []
    load = os.getloadavg()[0]
    for i in range(ROUNDS):
        if i % 2:
            r = run_remote()
            pairs.append((run_local(), r))
        else:
            loc = run_local()
            pairs.append((loc, run_remote()))
    ratios = sorted(r.rate / loc.rate for loc, r in pairs)
    ctx.report.fact(f"{label}, remote/local per round", {"median": round(statistics.median(ratios), 2),
                                                         "range": [round(ratios[0], 2), round(ratios[-1], 2)],
                                                         "rounds": ROUNDS, "load_average": [round(load, 1), round(
                                                             os.getloadavg()[0], 1)],
                                                         "round_trips": [r.round_trips for _, r in pairs]})
    return typical([loc for loc, _ in pairs]), typical([r for _, r in pairs])


def counted(ctx: Context, server: NginxStore, files: int, work: Callable[[Path], Callable[[], object]]) -> Measured:
    """`work(mountpoint)()` through a fresh mount of the store, with what does not depend on load
    beside its time: the store's requests and round trips, the CPU of the daemon, the store and
    the readers, and the prefetch (where the time goes when a figure falls short of its target)."""
    with mounted("unshardfs", server.url, ctx.work) as m:
        return through(m, files, work(m), store=server)


def local_run(ctx: Context, source: Any, files: int, work: Callable[[Path], Callable[[], object]]) -> Measured:
    """`work(mountpoint)()` through a fresh mount of the local shards."""
    with mounted("unshardfs", source, ctx.work) as m:
        return through(m, files, work(m))


def viewer(ctx: Context, ds: Dataset, server: NginxStore, latency: float, tag: str) -> None:
    """8 readers, 500 scattered chunks, no listing first: read-ahead must not pay."""
    chosen = random.Random(7).sample(ds.files, min(VIEWER_CHUNKS, len(ds.files)))
    name = f"viewer, {READERS} readers, scattered ({tag})"
    with profiling.figure(name), mounted("unshardfs", server.url, ctx.work) as m:
        paths = [str(m / f) for f in chosen]
        got = through(m, len(chosen), lambda: parallel_read(paths, READERS), store=server)
    ideal = READERS / latency  # every reader one file per round trip
    ctx.report.row(name, got.rate, "files/s", f"{READERS} files per round trip", ideal, ">= 0.5",
                   detail={"ours": got.detail()})
    ctx.report.fact(f"viewer prefetch ({tag})", {"requests": got.requests,
                                                 "prefetched_bytes": got.prefetched_bytes,
                                                 "wasted_bytes": got.wasted_bytes,
                                                 "target": "wasted <= 25% of fetched"})


def meshes(ctx: Context, root: Path, server: NginxStore, latency: float) -> None:
    """Multi-LOD meshes read as viewers do: READERS processes, each taking every READERS-th mesh and
    reading its manifest, then its fragments."""
    with mounted("unshardfs", root, ctx.work) as m:
        segs = sorted(n[:-6] for n in os.listdir(m / "mesh") if n.endswith(".index"))

    def read(mnt: Path) -> Callable[[], object]:
        lists = [[str(mnt / p) for s in segs[i::READERS] for p in (f"mesh/{s}.index", f"mesh/{s}")]
                 for i in range(READERS)]
        return lambda: read_lists(lists)

    tag = f"{latency * 1000:.0f} ms"
    name = f"meshes manifest+fragments, {READERS} readers ({tag})"
    with profiling.figure(f"{name}, local shards"):
        local = local_run(ctx, root, len(segs), read)
    with profiling.figure(name):
        remote = counted(ctx, server, len(segs), read)
    ctx.report.row(name, remote.rate, "meshes/s", "same, local shards", local.rate,
                   detail={"ours": remote.detail(), "baseline": local.detail()})


def cp_dir(ctx: Context, source: Any, chunk_dir: str) -> float:
    """Seconds of `cp -r` of the chunk directory through a fresh mount of `source`."""
    with mounted("unshardfs", source, ctx.work) as m:
        seconds = timed(cp_work(ctx, m, chunk_dir))
    shutil.rmtree(ctx.work / "cp-target", ignore_errors=True)
    return seconds


def cp_work(ctx: Context, mnt: Path, chunk_dir: str) -> Callable[[], object]:
    """`cp -r` of the chunk directory into the run's directory (emptied first, outside the timing)."""
    target = ctx.work / "cp-target"
    shutil.rmtree(target, ignore_errors=True)
    return lambda: subprocess.run(["cp", "-r", str(mnt / chunk_dir), str(target)], check=True)


def tensorstore_read(ds: Dataset, server: NginxStore) -> Measured:
    """TensorStore reading the whole volume through its http kvstore (no cache), in this process:
    its CPU is this process's (`readers_cpu`), and the store's requests and round trips."""
    import tensorstore as ts

    spec = {**ds.ts_spec, "kvstore": f"{server.url}/", "context": {"cache_pool": {"total_bytes_limit": 0}}}
    store = ts.open(spec, read=True).result()
    before, store_before = own_seconds(), server.cpu_seconds()
    server.reset_log()
    seconds = timed(lambda: store.read().result())
    counts = server.counts()
    return Measured(seconds, len(ds.files), readers_cpu=own_seconds() - before,
                    store_cpu=server.cpu_seconds() - store_before, requests=counts["requests"],
                    round_trips=counts["round_trips"])
