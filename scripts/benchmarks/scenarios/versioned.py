"""Versioned packed stores against plain shards, over a Range server answering each request after 20 ms.

One volume, 256^3 uint8 voxels in 512 chunks of 32^3 (32 KiB raw) in 8 shards of 128^3, stored six
ways under one served directory: a Zarr v3 sharded array plainly (TensorStore), the same array inside
an OCDBT database (TensorStore's `ocdbt` kvstore), the same array inside an Icechunk repository (the
`icechunk` package, in .venv-icechunk), a sharded Neuroglancer precomputed volume of the same voxels,
plainly and inside OCDBT (TensorStore), and the array unsharded inside OCDBT (every chunk a key:
TensorStore's layout in place of sharding), measured against the sharded array.

For each store: a fresh mount (the requests and round trips opening costs), then the first chunk read
(round trips and requests as the server saw them, wall time), then a second chunk of the same shard;
each beside the plain shards' figure, with the target that the first chunk costs at most one round
trip more. Then `cp -r` of the chunk directory through a fresh mount, each store against the plain
shards, alternating ROUNDS times (the requests and round trips of the last round are facts).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..context import Context
from ..mounts import mounted
from ..workloads import timed

LATENCY = 0.02
SHAPE = (256, 256, 256)
CHUNK = 32
SHARD = 128
ROUNDS = 3  # cp -r of each store and of the plain shards, alternating
SETTLE = 0.3  # seconds waited after a read, so requests still arriving are not counted with the next
ICECHUNK_PYTHON = Path(__file__).resolve().parents[3] / ".venv-icechunk" / "bin" / "python"
ICECHUNK_WRITER = Path(__file__).resolve().parents[1] / "icechunk_volume.py"


@dataclass
class Store:
    name: str  # what the rows call it
    family: str  # "zarr3" / "precomputed": which plain store it is measured against
    path: str  # served path (a directory under the data root)
    pipeline: str  # after the base URL: "|ocdbt:|zarr3:" ...
    chunk_dir: str  # the chunk directory inside the mount
    first: str  # the first chunk file, and a second one of the same shard
    second: str

    def source(self, url: str) -> str:
        return f"{url}/{self.path}/{self.pipeline}"


ZARR_FIRST, ZARR_SECOND = "c/0/0/0", "c/0/0/1"
PRE_FIRST, PRE_SECOND = "1_1_1/0-32_0-32_0-32", "1_1_1/32-64_0-32_0-32"
STORES = [
    Store("Zarr v3 sharded", "zarr3", "zarr", "|zarr3:", "c", ZARR_FIRST, ZARR_SECOND),
    Store("Zarr v3 in OCDBT", "zarr3", "zarr.ocdbt", "|ocdbt:|zarr3:", "c", ZARR_FIRST, ZARR_SECOND),
    Store("Zarr v3 in Icechunk", "zarr3", "zarr.icechunk", "|icechunk:|zarr3:", "c", ZARR_FIRST, ZARR_SECOND),
    Store("precomputed sharded", "precomputed", "pre", "|neuroglancer-precomputed:", "1_1_1", PRE_FIRST,
          PRE_SECOND),
    Store("precomputed in OCDBT", "precomputed", "pre.ocdbt", "|ocdbt:|neuroglancer-precomputed:", "1_1_1",
          PRE_FIRST, PRE_SECOND),
    # TensorStore's layout in place of sharding: every chunk a key of the database (the same array unsharded
    # as plain objects is no baseline: a plain HTTP server cannot list its chunks)
    Store("Zarr v3 unsharded in OCDBT", "zarr3", "flat.ocdbt", "|ocdbt:|zarr3:", "c", ZARR_FIRST, ZARR_SECOND),
]
BASELINES = {"zarr3": STORES[0], "precomputed": STORES[3]}


def voxels() -> np.ndarray:
    """Random bytes in runs (not all alike, so no chunk is the fill value)."""
    rng = np.random.default_rng(11)
    return np.repeat(rng.integers(1, 255, size=(*SHAPE[:2], SHAPE[2] // 8), dtype=np.uint8), 8, axis=2)


def build(data: Path) -> Path:
    """The six stores under `data`/versioned, built once."""
    import tensorstore as ts

    base = data.resolve() / "versioned"
    marker = base / "ready-2"  # (all six stores below)
    if marker.exists():
        return base
    print("building versioned benchmark datasets (once) ...", flush=True)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    vox = voxels()
    zarr_meta = {"shape": list(SHAPE), "data_type": "uint8",
                 "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [SHARD] * 3}},
                 "codecs": [{"name": "sharding_indexed", "configuration": {
                     "chunk_shape": [CHUNK] * 3, "codecs": [{"name": "bytes"}],
                     "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                      {"name": "crc32c"}]}}]}
    # Every grid bit of a shard's 64 chunks below the shard bits: 8 shards, minishards of 8 chunks.
    pre_meta = {"multiscale_metadata": {"type": "image", "data_type": "uint8", "num_channels": 1},
                "scale_metadata": {"resolution": [1, 1, 1], "encoding": "raw", "chunk_size": [CHUNK] * 3,
                                   "size": list(SHAPE), "voxel_offset": [0, 0, 0],
                                   "sharding": {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 3,
                                                "hash": "identity", "minishard_bits": 3, "shard_bits": 3,
                                                "minishard_index_encoding": "gzip", "data_encoding": "raw"}}}
    for name, ocdbt in (("zarr", False), ("zarr.ocdbt", True)):
        kv = _kvstore(base / name, ocdbt)
        ts.open({"driver": "zarr3", "kvstore": kv, "metadata": zarr_meta}, create=True).result()[...].write(
            vox).result()
    flat_meta = {**zarr_meta, "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [CHUNK] * 3}},
                 "codecs": [{"name": "bytes"}]}
    kv = _kvstore(base / "flat.ocdbt", True)
    ts.open({"driver": "zarr3", "kvstore": kv, "metadata": flat_meta}, create=True).result()[...].write(vox).result()
    for name, ocdbt in (("pre", False), ("pre.ocdbt", True)):
        kv = _kvstore(base / name, ocdbt)
        ts.open({"driver": "neuroglancer_precomputed", "kvstore": kv, **pre_meta}, create=True).result()[...].write(
            vox[..., None]).result()
    if not ICECHUNK_PYTHON.exists():
        raise SystemExit(f"the versioned scenario needs {ICECHUNK_PYTHON} (scripts/setup makes it)")
    npy = base / "voxels.npy"
    np.save(npy, vox)
    subprocess.run([str(ICECHUNK_PYTHON), "-P", str(ICECHUNK_WRITER), str(base / "zarr.icechunk"), str(npy),
                    str(SHARD), str(CHUNK)], check=True)
    npy.unlink()
    marker.write_text("ok")
    return base


def _kvstore(path: Path, ocdbt: bool) -> Any:
    path.mkdir()
    url = f"file://{path}/"
    return {"driver": "ocdbt", "base": url} if ocdbt else url


def run(ctx: Context) -> None:
    from unshardfs.testing.http_servers import DatasetServer

    root = build(Path(ctx.args.data))
    print(f"   (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)", flush=True)
    with DatasetServer(root) as server:
        server.faults.delay = LATENCY
        first = {store.name: first_reads(ctx, server, store) for store in STORES}
        for store in STORES:
            base = BASELINES[store.family]
            if store is base:
                continue
            ours, plain = first[store.name], first[base.name]
            tag = f"{store.name}, {LATENCY * 1000:.0f} ms"
            row = ctx.report.row
            # Opening and the first read together: where a store's work falls (a precomputed volume's info
            # read at open, its shard's stat at the first read) differs between stores, their sum does not.
            for what, unit in (("round_trips", "trips"), ("requests", "requests")):
                row(f"open + first chunk, {what.replace('_', ' ')} ({tag})",
                    ours["open"][what] + ours["first"][what], unit, base.name,
                    plain["open"][what] + plain["first"][what], "<= baseline + 1")
            row(f"first chunk after open, round trips ({tag})", ours["first"]["round_trips"], "trips", base.name,
                plain["first"]["round_trips"], "<= baseline + 1")
            row(f"first chunk after open, wall time ({tag})", ours["first"]["ms"], "ms", base.name,
                plain["first"]["ms"], f"<= baseline + {LATENCY * 1000:.0f} ms")
            row(f"next chunk, same shard, requests ({tag})", ours["second"]["requests"], "requests", base.name,
                plain["second"]["requests"], "<= baseline")
        for store in STORES:
            base = BASELINES[store.family]
            if store is not base:
                copy(ctx, server, store, base)
    ctx.report.fact(f"versioned: load average at the end ({os.cpu_count()} CPUs)", round(os.getloadavg()[0], 1))


def first_reads(ctx: Context, server: Any, store: Store) -> dict[str, dict[str, float]]:
    """What opening a fresh mount of `store` costs, then its first chunk, then a second of the same shard:
    requests and round trips as the server logged them (only those that arrived before the read ended;
    background read-ahead after it is not the read's), and wall time."""
    out: dict[str, dict[str, float]] = {}
    server.reset_log()
    started = time.monotonic()
    with mounted("unshardfs", store.source(server.url), ctx.work) as m:
        out["open"] = _figures(server, started, time.monotonic())
        for key, path in (("first", store.first), ("second", store.second)):
            time.sleep(SETTLE)
            server.reset_log()
            start = time.monotonic()
            (m / path).read_bytes()
            out[key] = _figures(server, start, time.monotonic())
    ctx.report.fact(f"versioned first reads, {store.name} ({LATENCY * 1000:.0f} ms)", out)
    return out


def _figures(server: Any, start: float, end: float) -> dict[str, float]:
    from unshardfs.testing.latency import round_trips

    seen = [r for r in server.requests() if r.start <= end]
    return {"requests": len(seen), "round_trips": round_trips((r.start, r.end) for r in seen),
            "ms": round((end - start) * 1000, 1)}


def copy(ctx: Context, server: Any, store: Store, base: Store) -> None:
    """`cp -r` of the chunk directory through a fresh mount of `store` and of `base`, alternating."""
    n = 0  # files copied (every round copies them all)
    ours: list[float] = []
    plain: list[float] = []
    counts: dict[str, Any] = {}
    for i in range(ROUNDS):
        order = ((store, ours), (base, plain)) if i % 2 == 0 else ((base, plain), (store, ours))
        for which, times in order:
            server.reset_log()
            seconds, n = _cp(ctx, server, which)
            times.append(seconds)
            counts[which.name] = {"requests": len(server.requests()), "round_trips": server.round_trips()}
    tag = f"{store.name}, {LATENCY * 1000:.0f} ms"
    ctx.report.row(f"cp -r over HTTP ({tag})", n / statistics.median(ours), "files/s", f"{base.name}, same",
                   n / statistics.median(plain), ">= 0.9")
    ctx.report.fact(f"versioned cp -r ({tag}), last round", counts)


def _cp(ctx: Context, server: Any, store: Store) -> tuple[float, int]:
    target = ctx.work / "cp-target"
    with mounted("unshardfs", store.source(server.url), ctx.work) as m:
        elapsed = timed(lambda: subprocess.run(["cp", "-r", str(m / store.chunk_dir), str(target)], check=True))
    files = sum(1 for p in target.rglob("*") if p.is_file())
    shutil.rmtree(target)
    return elapsed, files
