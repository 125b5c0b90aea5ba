"""Small-file work on local shards: warm re-read, first read, parallel readers, backing reads of cp -r."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ..context import KEY, Context
from ..ceiling import CeilingUnavailable
from ..mounts import PY, mounted
from ..workloads import parallel_read, read_files, timed, warm_page_cache, warmed_files
from .sequential import CEILINGS, ceiling_options

WARM = "warm re-read, 16 KiB chunks"
FIRST = "first read, fresh mount"


def run(ctx: Context) -> None:
    small = ctx.datasets["small"]
    files = warmed_files(small, KEY)
    warm_reread(ctx, files)
    ours = first_read(ctx, files)
    tensorstore_baseline(ctx, files, ours)
    parallel_readers(ctx, files)
    backing_reads(ctx, len(files))


def rate(root: Path, files: list[str]) -> float:
    paths = [str(root / f) for f in files]
    return len(files) / timed(lambda: read_files(paths))


def best_fresh(ctx: Context, kind: str, source: Path, files: list[str], *opts: str,
               readahead_kib: int | None = None) -> float:
    """Files/s on a fresh mount (the better of two)."""
    best = 0.0
    for _ in range(2):
        with mounted(kind, source, ctx.work, *opts, readahead_kib=readahead_kib) as m:
            best = max(best, rate(m, files))
    return best


def best_warm(ctx: Context, kind: str, source: Path, files: list[str]) -> float:
    with mounted(kind, source, ctx.work) as m:
        rate(m, files)
        return max(rate(m, files) for _ in range(3))


def warm_reread(ctx: Context, files: list[str]) -> None:
    small, row = ctx.datasets["small"], ctx.report.row
    shm = Path(tempfile.mkdtemp(prefix="bench-", dir="/dev/shm"))
    try:
        shutil.copytree(small["plain"], shm / "plain")
        disk = ctx.work / "disk"
        shutil.copytree(small["plain"], disk)
        warm_page_cache(disk)
        ours = best_warm(ctx, "unshardfs", small["sharded"], files)
        row(WARM, ours, "files/s", "null pyfuse3 fs", best_warm(ctx, "nullfs", small["plain"], files), ">= 0.8")
        row(WARM, ours, "files/s", "tmpfs", max(rate(shm / "plain", files) for _ in range(3)))
        row(WARM, ours, "files/s", "local disk (page cache)", max(rate(disk, files) for _ in range(3)))
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def first_read(ctx: Context, files: list[str]) -> float:
    small, row = ctx.datasets["small"], ctx.report.row
    ours = best_fresh(ctx, "unshardfs", small["sharded"], files)
    row(FIRST, ours, "files/s", "null pyfuse3 fs", best_fresh(ctx, "nullfs", small["plain"], files), ">= 0.6")
    tar = ctx.work / "small.tar"
    with tarfile.open(tar, "w") as t:
        t.add(small["plain"] / KEY, arcname=KEY)
    if shutil.which("ratarmount", path=str(Path(PY).parent)):
        with mounted("ratarmount", tar, ctx.work):
            pass  # builds its index once, outside the timing
        row(FIRST, ours, "files/s", "ratarmount (tar)", best_fresh(ctx, "ratarmount", tar, files), "> 1")
    try:
        opts, readahead = ceiling_options(ctx, small["sharded"])
    except CeilingUnavailable as e:
        print(e, file=sys.stderr, flush=True)
        ctx.report.fact("ceiling daemon", f"not measured: {e}")
        return ours
    for kind, label in CEILINGS.items():
        row(FIRST, ours, "files/s", label, best_fresh(ctx, kind, small["plain"], files, *opts,
                                                      readahead_kib=readahead), ">= 0.8")
    return ours


def tensorstore_baseline(ctx: Context, files: list[str], ours: float) -> None:
    """TensorStore reading the same chunks in-process from the shards, no cache."""
    ctx.report.row(FIRST, ours, "files/s", "TensorStore in-process (sharded)", tensorstore_rate(ctx, files))


def tensorstore_rate(ctx: Context, files: list[str]) -> float:
    """Files/s of TensorStore reading `files`' chunks of the small dataset in-process from its shards, no cache."""
    import tensorstore as ts

    from unshardfs.volume.morton import MortonCoder

    sharded = ctx.datasets["small"]["sharded"]
    info = json.loads((sharded / "info").read_text())["scales"][0]
    chunk = info["chunk_sizes"][0]
    coder = MortonCoder(tuple(s // c for s, c in zip(info["size"], chunk)))
    keys = []
    for name in files:
        begins = [int(part.split("-")[0]) for part in name.split("/")[-1].split("_")]
        keys.append(coder.encode(tuple(b // c for b, c in zip(begins, chunk))).to_bytes(8, "big"))

    def read_all() -> None:
        kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{sharded}/{KEY}/",
                              "metadata": info["sharding"],
                              "context": {"cache_pool": {"total_bytes_limit": 0}}}).result()
        for k in keys:
            kv.read(k).result()

    return len(files) / min(timed(read_all) for _ in range(2))


def parallel_readers(ctx: Context, files: list[str]) -> None:
    def par(readers: int) -> float:
        best = 0.0
        for _ in range(2):
            with mounted("unshardfs", ctx.datasets["small"]["sharded"], ctx.work) as m:
                best = max(best, len(files) / parallel_read([str(m / f) for f in files], readers))
        return best

    one, eight = par(1), par(8)
    ctx.report.row("8 parallel readers (first read)", eight, "files/s", "1 reader, same mount", one, ">= 1.3")


def backing_reads(ctx: Context, n: int) -> None:
    """Backing reads during `cp -r` of a scale: indexes once, then one read per chunk."""
    copy = ctx.work / "copy"
    with mounted("unshardfs", ctx.datasets["small"]["sharded"], ctx.work) as m:
        before = json.loads(os.getxattr(m, "user.unshardfs.stats"))["source"]["reads"]
        subprocess.run(["cp", "-r", str(m / KEY), str(copy)], check=True)
        s = json.loads(os.getxattr(m, "user.unshardfs.stats"))
    reads = s["source"]["reads"] - before
    idx = s["caches"]["shard_index"]["entries"] + s["caches"]["minishard_index"]["entries"]
    ctx.report.fact("backing reads per chunk (cp -r)",
                    {"reads": reads, "index_reads": idx, "chunks": n, "per_chunk": (reads - idx) / n})
    shutil.rmtree(copy)
