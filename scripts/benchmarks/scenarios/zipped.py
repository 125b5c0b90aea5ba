"""Datasets inside zip archives: `cp -r` of the chunk directory through a mount of the zip (members
STORED, as RFC-9 `.ozx` and zarr-python's ZipStore write them) against the same command through a mount
of the unzipped sharded directory, locally and through the store stand-in answering after 20 ms. The
datasets are the remote scenario's (1,024 chunks of 32 KiB, precomputed and Zarr v3). Each pair is
measured alternately, best of `ROUNDS` (3), so load on the shared machine hits both sides alike; the
requests and round trips each `cp -r` costs the server are reported too (they do not depend on load).
"""

from __future__ import annotations

from pathlib import Path

from ..context import Context
from ..store import NginxStore
from .remote import build, cp_dir

ROUNDS = 3
LATENCY = 0.02


def _archive(ds_root: Path) -> Path:
    from unshardfs.testing.zips import zip_tree

    archive = ds_root.with_name(ds_root.name + ".zip")
    if not archive.exists():
        zip_tree(ds_root, archive, comment=b"")
    return archive


def _best(ctx: Context, sources: tuple[str, str], chunk_dir: str) -> tuple[float, float]:
    """Fewest seconds for each source over ROUNDS alternating runs."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(ROUNDS):
        for i, source in enumerate(sources):
            times[i].append(cp_dir(ctx, source, chunk_dir))
    return min(times[0]), min(times[1])


def run(ctx: Context) -> None:
    datasets, _ = build(ctx)
    for ds in datasets:
        archive = _archive(ds.root)
        n = len(ds.files)
        zipped, plain = _best(ctx, (str(archive), str(ds.root)), ds.chunk_dir)
        ctx.report.row(f"cp -r through a zip mount ({ds.name}, local)", n / zipped, "files/s",
                       "same, unzipped sharded dir", n / plain, ">= 0.9")
        with NginxStore(ds.root.parent, LATENCY, ctx.work) as server:
            sources = (f"{server.url}/{archive.name}|zip:", f"{server.url}/{ds.root.name}")
            zipped, plain = _best(ctx, sources, ds.chunk_dir)
            # Load-independent: what each cp -r asked of the server.
            for label, source in zip(("zip", "unzipped"), sources):
                server.reset_log()
                cp_dir(ctx, source, ds.chunk_dir)
                ctx.report.fact(f"cp -r at {LATENCY * 1000:.0f} ms ({ds.name}, {label})",
                                {"requests": len(server.requests()), "round_trips": server.round_trips()})
        ctx.report.row(f"cp -r through a zip mount ({ds.name}, {LATENCY * 1000:.0f} ms)", n / zipped, "files/s",
                       "same, unzipped sharded dir", n / plain, ">= 0.9")
