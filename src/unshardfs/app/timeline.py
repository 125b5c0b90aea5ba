"""Where the time of a split export (or check) went: each task's, and the run's.

Each task measures on its worker its wall time, split by what it waited for
(`TaskTimeline`): opening SOURCE, looking up the paths its plan names, the
chunk listings of its shards (their indexes), payload bytes, DEST, its
ledger entry, and the rest (its own work: building files, checksums,
journal lines). The client adds how long each task waited for the scheduler
before it began (`idle`), times its own phases (`RunPhases`), and sums it
all up (`summary`): so a run that does not scale shows whether its tasks
wait on the store, on DEST, on the CPU or on the scheduler.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

# What a task's wall time is split into, in the order a task meets them; `work` is the rest.
WAITS = ("open", "plan", "indexes", "data", "writes", "ledger")


@dataclass
class TaskTimeline:
    """One task's time on its worker (seconds) and what it asked of the store."""

    task: int
    worker: str = ""  # the Dask worker's address, or "pid N" for a task run in a process
    started: float = 0.0  # wall clock (`time.time()`) when the task began on its worker
    wall: float = 0.0  # from its start to its end
    open: float = 0.0  # opening SOURCE: the source, the format, its metadata
    plan: float = 0.0  # looking up the directories and files its plan names
    indexes: float = 0.0  # waiting for the chunk listings of its shards (their shard and minishard indexes)
    data: float = 0.0  # waiting for payload bytes
    writes: float = 0.0  # waiting for DEST: a free write slot, streamed files, the last writes
    ledger: float = 0.0  # its journal opened, its directories flushed and its ledger entry written
    work: float = 0.0  # the rest of `wall`: its own work between waits (files built, checksums, journal lines)
    idle: float = 0.0  # before it began, its worker waited this long for it (set by the client)
    cpu: float = 0.0  # CPU seconds of its worker process meanwhile
    requests: int = 0  # requests to the store (backing reads, stats and listings where it is local)
    round_trips: int | None = None  # the longest chain of requests each sent after the one before was answered
    files: int = 0
    bytes: int = 0

    @property
    def ended(self) -> float:
        return self.started + self.wall

    def settle(self, waited: dict[str, float]) -> None:
        """Take the waits measured (seconds by kind) and make `work` the rest of `wall`."""
        for kind in WAITS:
            setattr(self, kind, max(0.0, waited.get(kind, 0.0)))
        self.work = max(0.0, self.wall - sum(getattr(self, kind) for kind in WAITS))

    def doc(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def source_requests(stats: dict[str, Any]) -> tuple[int, int | None]:
    """(requests, round trips) from an opened source's `stats()`: those of the section that counts
    both (a remote source's), else the backing reads, stats and listings (a local source's, which
    has no round trips to speak of)."""
    for section in stats.values():
        if isinstance(section, dict) and isinstance(section.get("round_trips"), int) and \
                isinstance(section.get("requests"), int):
            return section["requests"], section["round_trips"]
    counted = stats.get("source", {})
    return sum(int(counted.get(k, 0)) for k in ("reads", "stats", "lists")), None


def settle_idle(timelines: Iterable[TaskTimeline], submitted: float) -> None:
    """Each task's `idle`: how long its worker waited for it, since its previous task there ended or,
    for a worker's first task, since the tasks were submitted (`submitted`, wall clock)."""
    by_worker: dict[str, list[TaskTimeline]] = {}
    for t in timelines:
        by_worker.setdefault(t.worker, []).append(t)
    for tasks in by_worker.values():
        tasks.sort(key=lambda t: t.started)
        free = submitted
        for t in tasks:
            t.idle = max(0.0, t.started - free)
            free = max(free, t.ended)


@dataclass
class RunPhases:
    """The client's own phases (seconds), in the order a run meets them."""

    client_start: float | None = None  # the process's start to the command's (the interpreter, imports)
    connect: float = 0.0  # starting or reaching the cluster, and checking DEST from every worker
    plan: float = 0.0  # planning: walking SOURCE's tree (with --resume: reading the recorded plan)
    ledger: float = 0.0  # opening DEST, writing the plan and task list, clearing what a killed run left
    tasks: float = 0.0  # from the first task submitted to the last result
    manifest: float = 0.0  # gathering the ledger entries into the manifest
    close: float = 0.0  # closing the client (and stopping the workers of a local:N cluster)
    total: float = 0.0  # from the command's start to its end (client_start aside)
    plan_requests: int = 0
    plan_round_trips: int | None = None
    workers: int = 1  # worker processes (or 1: the tasks in this process)
    started: float = field(default_factory=time.monotonic, repr=False)

    def doc(self) -> dict[str, Any]:
        return {f.name: round(v, 4) if isinstance(v, float) else v
                for f in fields(self) if f.name != "started" for v in [getattr(self, f.name)]}


def process_age() -> float | None:
    """Seconds since this process started (Linux: from /proc), None where it cannot be told."""
    try:
        with open("/proc/self/stat", "rb") as f:
            start_ticks = int(f.read().rpartition(b")")[2].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


NUMBERS = (*WAITS, "work", "idle", "wall", "cpu", "requests", "round_trips", "files", "bytes")


def summary(run: RunPhases, timelines: list[TaskTimeline]) -> dict[str, Any]:
    """The run's statistics as JSON: its phases, the sums and medians of its tasks' timelines and
    the slowest task, then every task's timeline in task order."""
    ordered = sorted(timelines, key=lambda t: t.task)
    sums: dict[str, float | int] = {}
    medians: dict[str, float | int] = {}
    for name in NUMBERS:
        values = [v for t in ordered if (v := getattr(t, name)) is not None]
        if values:
            sums[name] = round(sum(values), 4) if isinstance(values[0], float) else sum(values)
            middle = statistics.median(values)
            medians[name] = round(middle, 4) if isinstance(middle, float) else middle
    slowest = max(ordered, key=lambda t: t.wall, default=None)
    return {"run": run.doc(),
            "tasks": {"count": len(ordered), "sum": sums, "median": medians,
                      "slowest": None if slowest is None else slowest.doc()},
            "per_task": [t.doc() for t in ordered]}


def summary_lines(stats: dict[str, Any]) -> list[str]:
    """A few lines for the terminal: the run's phases, the tasks' medians, the slowest task."""
    run, tasks = stats["run"], stats["tasks"]
    lines = [f"run: {run['total']:.2f} s: " + ", ".join(
        f"{k} {run[k]:.2f}" for k in ("client_start", "connect", "plan", "ledger", "tasks", "manifest", "close")
        if run.get(k) is not None) + f"; planning sent {run['plan_requests']:,} requests"]

    def split(doc: dict[str, Any]) -> str:
        trips = doc.get("round_trips")
        return (", ".join(f"{k} {doc.get(k, 0):.2f}" for k in (*WAITS, "work", "idle")) +
                f"; cpu {doc.get('cpu', 0):.2f}; {doc.get('requests', 0):,} requests" +
                ("" if trips is None else f", {trips:,} round trips"))
    if tasks["count"]:
        lines.append(f"tasks: {tasks['count']:,} on {run['workers']:,} worker(s); median task "
                     f"{tasks['median']['wall']:.2f} s: {split(tasks['median'])}")
        slowest = tasks["slowest"]
        lines.append(f"slowest: task {slowest['task']} on {slowest['worker']}, {slowest['wall']:.2f} s: {split(slowest)}")
    return lines
