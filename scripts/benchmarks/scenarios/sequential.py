"""Big sequential reads: 2 MiB raw chunks against reading the shard files natively, the null fs, and
the ceiling daemon (`ceilingfs.c`: libfuse's low-level API, the same files from memory, the options
unshardfs negotiates) on one thread and on libfuse's worker threads.

unshardfs and the ceiling daemons are measured in turn, ROUNDS fresh mounts each (which goes first
rotates), and each row carries the medians of the daemon's and the reader's CPU: where a shortfall
against the ceiling goes.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import Any

from ..ceiling import CeilingUnavailable, binary, options_like
from ..context import KEY, Context
from ..measure import Measured, stats, through, typical
from ..mounts import daemon_pid, mounted
from ..workloads import read_files, rel_files, timed, warm_page_cache

ROUNDS = 5
CEILINGS = {"ceiling": "ceiling daemon (libfuse, 1 thread)", "ceiling-mt": "ceiling daemon (libfuse, threads)"}


def ceiling_options(ctx: Context, sharded: Path) -> tuple[list[str], int | None]:
    """What an unshardfs mount of `sharded` negotiates, as ceilingfs options and read-ahead
    (CeilingUnavailable, in one line, if the ceiling daemon cannot be built here)."""
    binary(ctx.work)
    with mounted("unshardfs", sharded, ctx.work) as m:
        features = stats(m)["fuse"]["features"]
    ctx.report.fact("ceiling daemon's options (as unshardfs negotiated them)",
                    {"unshardfs": {k: features.get(k) for k in ("request_kib", "read_ahead_kib", "no_open")},
                     "ceilingfs": options_like(features)})
    return options_like(features)


def run(ctx: Context) -> None:
    large, row = ctx.datasets["large"], ctx.report.row
    warm_page_cache(large["sharded"])
    warm_page_cache(large["plain"])
    shard_paths = [str(p) for p in sorted((large["sharded"] / KEY).glob("*.shard"))]
    shard_bytes = sum(os.path.getsize(p) for p in shard_paths)
    native = max(shard_bytes / timed(lambda: read_files(shard_paths)) for _ in range(3))
    files = rel_files(large["plain"], KEY)
    size = sum((large["plain"] / f).stat().st_size for f in files)

    requests: list[int] = []  # FUSE requests each unshardfs round served

    def once(kind: str, source: Any, *options: str, readahead: int | None = None) -> Measured:
        with mounted(kind, source, ctx.work, *options, readahead_kib=readahead) as m:
            paths = [str(m / f) for f in files]
            before = stats(m)["fuse"]["requests"] if kind == "unshardfs" else 0
            got = through(m, len(files), lambda: read_files(paths), daemon=daemon_pid(m), in_process=True)
            if kind == "unshardfs":
                requests.append(stats(m)["fuse"]["requests"] - before - 1)  # less the stats' own GETXATTR
            return got

    try:
        opts, readahead = ceiling_options(ctx, large["sharded"])
        kinds = ["unshardfs", *CEILINGS]
    except CeilingUnavailable as e:
        print(e, file=sys.stderr, flush=True)
        ctx.report.fact("ceiling daemon", f"not measured: {e}")
        opts, readahead, kinds = [], None, ["unshardfs"]
    runs: dict[str, list[Measured]] = {k: [] for k in kinds}
    for r in range(ROUNDS):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            if kind == "unshardfs":
                runs[kind].append(once(kind, large["sharded"]))
            else:
                runs[kind].append(once(kind, large["plain"], *opts, readahead=readahead))
    mib = {k: statistics.median(size / m.seconds for m in v) / 2**20 for k, v in runs.items()}
    ours, ours_detail = mib["unshardfs"], typical(runs["unshardfs"]).detail()
    name = "sequential read, 2 MiB raw chunks"
    row(name, ours, "MiB/s", "native read of the shards", native / 2**20, ">= 0.5", detail={"ours": ours_detail})
    for kind, label in CEILINGS.items():
        if kind in mib:
            row(name, ours, "MiB/s", label, mib[kind], ">= 0.8",
                detail={"ours": ours_detail, "baseline": typical(runs[kind]).detail()})
            row(f"{label}, sequential", mib[kind], "MiB/s", "native read of the shards", native / 2**20)
    row(name, ours, "MiB/s", "null pyfuse3 fs", best_nullfs(ctx, large["plain"], files, size))
    ctx.report.fact("sequential, per round (MiB/s)", {k: [round(size / m.seconds / 2**20) for m in v]
                                                       for k, v in runs.items()})
    if "ceiling" in runs:
        per_request(ctx, runs, requests, lambda *o: once("ceiling", large["plain"], *opts, *o, readahead=readahead),
                    lambda: once("unshardfs", large["sharded"]), size)


def per_request(ctx: Context, runs: dict[str, list[Measured]], requests: list[int], ceiling: Any, ours: Any,
                size: int) -> None:
    """The ceiling daemon made to burn, in every request, the CPU our daemon spends per request
    beyond it (`ceilingfs --spin-us`), against ours in turn: a ratio near 1 says the daemon's
    own CPU per request is what the sequential row is short of the ceiling by."""
    extra = typical(runs["unshardfs"]).daemon_cpu or 0.0
    extra -= typical(runs["ceiling"]).daemon_cpu or 0.0
    spin = max(0, round(extra / statistics.median(requests) * 1e6))
    spun: list[Measured] = []
    again: list[Measured] = []
    for r in range(ROUNDS):
        if r % 2:
            spun.append(ceiling("--spin-us", str(spin)))
            again.append(ours())
        else:
            again.append(ours())
            spun.append(ceiling("--spin-us", str(spin)))
    ratios = sorted(b.seconds / a.seconds for a, b in zip(again, spun))
    ctx.report.row("sequential read, 2 MiB raw chunks", statistics.median(size / m.seconds for m in again) / 2**20,
                   "MiB/s", f"ceiling + ours' CPU per request ({spin} us)",
                   statistics.median(size / m.seconds for m in spun) / 2**20, "~1: bound by it",
                   detail={"ours": typical(again).detail(), "baseline": typical(spun).detail()})
    ctx.report.fact("sequential: ours against the ceiling burning ours' extra CPU per request",
                    {"spin_us": spin, "requests_per_round": statistics.median(requests),
                     "per_round_ratio": {"median": round(statistics.median(ratios), 2),
                                         "range": [round(ratios[0], 2), round(ratios[-1], 2)]}})


def best_nullfs(ctx: Context, plain: Path, files: list[str], size: int) -> float:
    out = 0.0
    for _ in range(2):
        with mounted("nullfs", plain, ctx.work) as m:
            out = max(out, size / timed(lambda: read_files([str(m / f) for f in files])))
    return out / 2**20
