"""One workload through a mount, with what bounds it: wall time, and the CPU of the daemon, the
store and the readers, and the store's requests and round trips on the critical path.

A figure short of its target is bound by CPU (one of the three took most
of a core for the whole run, or all together took the machine) or by round
trips (the chain of requests the store saw, times its delay, is most of
the wall time); each remote row carries these beside its rate.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from .cpu import cpu_seconds, reaped_children_seconds, thread_seconds
from .mounts import daemon_pid
from .workloads import timed


@dataclass
class Measured:
    """One run of a workload of `files` files (seconds and CPU seconds; None: not measured)."""

    seconds: float
    files: int
    daemon_cpu: float | None = None  # the daemon (or the exporting processes)
    readers_cpu: float | None = None  # the reader processes (or cp, ls)
    store_cpu: float | None = None  # nginx
    requests: int | None = None  # at the store
    round_trips: int | None = None  # at the store: the longest chain of requests, each after the last
    prefetched_bytes: int | None = None
    wasted_bytes: int | None = None

    @property
    def rate(self) -> float:
        return self.files / self.seconds

    def detail(self) -> dict[str, Any]:
        """What a report row carries (JSON; CPU per file in microseconds)."""
        out: dict[str, Any] = {"seconds": round(self.seconds, 4), "files": self.files}
        for name, value in (("daemon_cpu_s", self.daemon_cpu), ("store_cpu_s", self.store_cpu),
                            ("readers_cpu_s", self.readers_cpu)):
            if value is not None:
                out[name] = round(value, 3)
        if self.daemon_cpu is not None:
            out["daemon_cpu_us_per_file"] = round(self.daemon_cpu / self.files * 1e6)
        for name in ("requests", "round_trips", "prefetched_bytes", "wasted_bytes"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def typical(runs: list[Measured]) -> Measured:
    """Each figure's median over `runs` (not one run's: a run's wall time and its CPU move apart
    on a shared machine), but CPU seconds' mean: a process's come in 10 ms ticks, which a
    short run's median would keep."""
    values: dict[str, Any] = {}
    for f in fields(Measured):
        got = [getattr(r, f.name) for r in runs if getattr(r, f.name) is not None]
        if not got:
            values[f.name] = None
        elif f.name == "files":
            values[f.name] = got[0]
        elif f.name.endswith("_cpu"):
            values[f.name] = statistics.fmean(got)
        else:
            m = statistics.median(got)
            values[f.name] = round(m) if isinstance(got[0], int) else m
    return Measured(**values)


def stats(mnt: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(os.getxattr(mnt, "user.unshardfs.stats"))
    return found


def through(mnt: Path | None, files: int, work: Callable[[], object], store: Any = None,
            daemon: int | None = None, in_process: bool = False) -> Measured:
    """`work` timed, and the CPU of the daemon serving `mnt` (or of process `daemon`), of the
    readers (this process's children reaped meanwhile: `work` must wait for its own; or this
    thread's, `in_process`), and of `store` with its requests and round trips. `mnt` None: no
    daemon (a native baseline)."""
    readers_cpu = thread_seconds if in_process else reaped_children_seconds
    pid = daemon if daemon is not None else (daemon_pid(mnt) if mnt is not None else None)
    before = stats(mnt) if mnt is not None and daemon is None else {}
    if store is not None:
        store.reset_log()
        store_before = store.cpu_seconds()
    daemon_before = cpu_seconds(pid) if pid is not None else 0.0
    readers_before = readers_cpu()
    elapsed = timed(work)
    readers = readers_cpu() - readers_before
    daemon_cpu = cpu_seconds(pid) - daemon_before if pid is not None else None
    out = Measured(elapsed, files, daemon_cpu, readers)
    if store is not None:
        counts = store.counts()
        out.store_cpu = store.cpu_seconds() - store_before
        out.requests, out.round_trips = counts["requests"], counts["round_trips"]
        if mnt is not None and daemon is None:
            fetch_before, fetch = before.get("fetch", {}), stats(mnt).get("fetch", {})
            out.prefetched_bytes = fetch.get("prefetch_bytes", 0) - fetch_before.get("prefetch_bytes", 0)
            out.wasted_bytes = fetch.get("prefetch_wasted_bytes", 0) - fetch_before.get("prefetch_wasted_bytes", 0)
    return out
