"""Object-store latency: a Range server that answers every request after a delay (20 ms and 100 ms, a
typical object-store first byte), serving a 1,024-chunk TensorStore-written sharded volume (32 KiB raw
chunks, 4 shards x 8 minishards), the same voxels as a sharded Zarr v3 array (zarr-python, 8 shards),
and multi-LOD meshes. Baselines in the same run: TensorStore through its http kvstore on the same
server, and the same commands through a mount of the local shards.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..context import KEY, Context
from ..mounts import mounted
from ..workloads import parallel_read, read_lists, stat_lists, timed

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
def served(root: Path, latency: float) -> Iterator[Any]:
    """A Range server of `root` answering every request after `latency` seconds."""
    from unshardfs.testing.http_servers import DatasetServer

    with DatasetServer(root) as server:
        server.faults.delay = latency
        yield server


def run(ctx: Context) -> None:
    datasets, extra = build(ctx)
    for latency in LATENCIES:
        for ds in datasets:
            with served(ds.root, latency) as server:
                measure(ctx, ds, server, latency)
        with served(extra["meshes"], latency) as server:
            meshes(ctx, extra["meshes"], server, latency)


def run_readers(ctx: Context) -> None:
    """`--only remote-readers`: the 8 readers of `measure` alone (both volumes, both latencies),
    and 8 processes looking up 200 names of one directory of a compressed_segmentation + gzip
    volume at 20 ms against the ideal (each process one lookup per round trip)."""
    datasets, _ = build(ctx)
    for latency in LATENCIES:
        for ds in datasets:
            with served(ds.root, latency) as server:
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
        with served(root / "sharded", 0) as server:
            with mounted("unshardfs", server.url, ctx.work) as m:
                server.faults.delay = latency
                server.reset_log()
                load = os.getloadavg()[0]
                elapsed = stat_lists([[str(m / KEY / n) for n in chosen[i::READERS]] for i in range(READERS)])
                server.faults.delay = 0
            ctx.report.row(f"{READERS} procs look up {LOOKUPS} names, seg+gzip, {label} (20 ms)", elapsed, "s",
                           f"{LOOKUPS}/{READERS} round trips", ideal, target)
            ctx.report.fact(f"lookups, seg+gzip, {label} (20 ms)",
                            {"requests": len(server.requests()), "round_trips": server.round_trips(),
                             "load_average": round(load, 1)})


def readers_rows(ctx: Context, ds: Dataset, server: Any, latency: float) -> None:
    """The 8 readers over HTTP against TensorStore and against the same readers on local shards."""
    tag = f"{ds.name}, {latency * 1000:.0f} ms"
    n = len(ds.files)
    ts_rate = n / tensorstore_read(ds, server.url)
    par_local, par_remote = alternating(
        ctx, f"{READERS} readers ({tag})", lambda: n / readers(ctx, ds.root, ds.files),
        lambda: n / counted(ctx, server, n, f"{READERS} readers ({tag})",
                            lambda m: parallel_read([str(m / f) for f in ds.files], READERS)))
    ctx.report.row(f"{READERS} readers over HTTP ({tag})", par_remote, "files/s", "TensorStore http kvstore", ts_rate,
                   ">= 1.5")
    ctx.report.row(f"{READERS} readers over HTTP ({tag})", par_remote, "files/s", f"{READERS} readers, local shards",
                   par_local, ">= 0.6")


def stats(mnt: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(os.getxattr(mnt, "user.unshardfs.stats"))
    return found


def measure(ctx: Context, ds: Dataset, server: Any, latency: float) -> None:
    row, tag = ctx.report.row, f"{ds.name}, {latency * 1000:.0f} ms"
    n = len(ds.files)
    ts_rate = n / tensorstore_read(ds, server.url)
    cp_local, cp_remote = alternating(ctx, f"cp -r ({tag})", lambda: n / cp_dir(ctx, ds.root, ds.chunk_dir),
                                      lambda: n / counted(ctx, server, n, f"cp -r ({tag})",
                                                          lambda m: cp_in(ctx, m, ds.chunk_dir)))
    row(f"cp -r over HTTP ({tag})", cp_remote, "files/s", "TensorStore http kvstore", ts_rate)
    row(f"cp -r over HTTP ({tag})", cp_remote, "files/s", "cp -r, local shards", cp_local, ">= 0.6 (or >= TS)")
    readers_rows(ctx, ds, server, latency)
    with mounted("unshardfs", server.url, ctx.work) as m:
        server.reset_log()
        elapsed = timed(lambda: subprocess.run(["ls", "-lR", str(m / ds.chunk_dir)], capture_output=True,
                                               check=True))
    # Round trips as the server saw them: the longest chain of requests each sent after the
    # previous one was answered (overlapping requests cost one trip together).
    ctx.report.fact(f"ls -lR ({tag})", {"round_trips": server.round_trips(), "seconds": round(elapsed, 2),
                                        "requests": len(server.requests()), "target": "<= 15 round trips"})
    viewer(ctx, ds, server, latency, tag)


def alternating(ctx: Context, label: str, local: Callable[[], float], remote: Callable[[], float]) -> tuple[float, float]:
    """Median rates of `local` and `remote`, run in turn ROUNDS times each (which goes first
    alternates): one pair measured at one moment swings with the machine's load (remote/local
    0.6-0.95 between rounds of one run); the ratio of each round, its median and range go into
    the facts (beside the last round's counts, `counted`)."""
    pairs = []
    load = os.getloadavg()[0]
    for i in range(ROUNDS):
        if i % 2:
            r = remote()
            pairs.append((local(), r))
        else:
            loc = local()
            pairs.append((loc, remote()))
    ratios = sorted(r / loc for loc, r in pairs)
    ctx.report.fact(f"{label}, remote/local per round", {"median": round(statistics.median(ratios), 2),
                                                         "range": [round(ratios[0], 2), round(ratios[-1], 2)],
                                                         "rounds": ROUNDS, "load_average": [round(load, 1), round(
                                                             os.getloadavg()[0], 1)]})
    return statistics.median(loc for loc, _ in pairs), statistics.median(r for _, r in pairs)


def counted(ctx: Context, server: Any, files: int, label: str, work: Callable[[Path], object]) -> float:
    """Seconds `work(mountpoint)` takes through a fresh mount of the server, and beside it what does not
    depend on load: the server's requests and round trips, the daemon's CPU per file and the prefetch
    (where the time goes when a figure falls short of its target)."""
    with mounted("unshardfs", server.url, ctx.work) as m:
        before = stats(m)
        server.reset_log()
        elapsed = timed(lambda: work(m))
        after = stats(m)
    cpu = after.get("process", {}).get("cpu_seconds", 0) - before.get("process", {}).get("cpu_seconds", 0)
    fetch = after.get("fetch", {})
    ctx.report.fact(label, {"requests": len(server.requests()), "round_trips": server.round_trips(),
                            "daemon_cpu_us_per_file": round(cpu / files * 1e6),
                            "prefetched_bytes": fetch.get("prefetch_bytes", 0),
                            "wasted_bytes": fetch.get("prefetch_wasted_bytes", 0)})
    return elapsed


def viewer(ctx: Context, ds: Dataset, server: Any, latency: float, tag: str) -> None:
    """8 readers, 500 scattered chunks, no listing first: read-ahead must not pay."""
    chosen = random.Random(7).sample(ds.files, min(VIEWER_CHUNKS, len(ds.files)))
    with mounted("unshardfs", server.url, ctx.work) as m:
        server.reset_log()
        elapsed = parallel_read([str(m / f) for f in chosen], READERS)
        fetch = stats(m).get("fetch", {})
    rate = len(chosen) / elapsed
    ideal = READERS / latency  # every reader one file per round trip
    ctx.report.row(f"viewer, {READERS} readers, scattered ({tag})", rate, "files/s",
                   f"{READERS} files per round trip", ideal, ">= 0.5")
    fetched = fetch.get("prefetch_bytes", 0)
    ctx.report.fact(f"viewer prefetch ({tag})", {"requests": len(server.requests()),
                                                 "prefetched_bytes": fetched,
                                                 "wasted_bytes": fetch.get("prefetch_wasted_bytes", 0),
                                                 "target": "wasted <= 25% of fetched"})


def meshes(ctx: Context, root: Path, server: Any, latency: float) -> None:
    """Multi-LOD meshes read as viewers do: READERS processes, each taking every READERS-th mesh and
    reading its manifest, then its fragments."""
    with mounted("unshardfs", root, ctx.work) as m:
        segs = sorted(n[:-6] for n in os.listdir(m / "mesh") if n.endswith(".index"))

    def read(mnt: Path) -> float:
        lists = [[str(mnt / p) for s in segs[i::READERS] for p in (f"mesh/{s}.index", f"mesh/{s}")]
                 for i in range(READERS)]
        return read_lists(lists)

    tag = f"{latency * 1000:.0f} ms"
    with mounted("unshardfs", root, ctx.work) as m:
        local = len(segs) / read(m)
    remote = len(segs) / counted(ctx, server, len(segs), f"meshes, {READERS} readers ({tag})", read)
    ctx.report.row(f"meshes manifest+fragments, {READERS} readers ({tag})", remote, "meshes/s",
                   "same, local shards", local)


def cp_dir(ctx: Context, source: Any, chunk_dir: str) -> float:
    with mounted("unshardfs", source, ctx.work) as m:
        return cp_in(ctx, m, chunk_dir)


def cp_in(ctx: Context, mnt: Path, chunk_dir: str) -> float:
    target = ctx.work / "cp-target"
    elapsed = timed(lambda: subprocess.run(["cp", "-r", str(mnt / chunk_dir), str(target)], check=True))
    shutil.rmtree(target)
    return elapsed


def readers(ctx: Context, source: Any, files: list[str]) -> float:
    with mounted("unshardfs", source, ctx.work) as m:
        return parallel_read([str(m / f) for f in files], READERS)


def tensorstore_read(ds: Dataset, url: str) -> float:
    """Seconds for TensorStore to read the whole volume through its http kvstore (no cache)."""
    import tensorstore as ts

    spec = {**ds.ts_spec, "kvstore": f"{url}/", "context": {"cache_pool": {"total_bytes_limit": 0}}}
    store = ts.open(spec, read=True).result()
    return timed(lambda: store.read().result())
