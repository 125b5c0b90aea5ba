"""CPU seconds of the processes in a run: the daemon's, the store's, the readers'.

A process's from `/proc/PID/stat`: utime + stime, and cutime + cstime of
the children it has reaped (clock ticks, 10 ms on Linux; the kernel keeps
nanoseconds and rounds on the way out). Processes of our own (the reader
processes, `cp`) from `getrusage(RUSAGE_CHILDREN)` once reaped, in
microseconds.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of `pid` (0 if it has gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + cutime + cstime) / TICK


def children(pid: int) -> list[int]:
    """The live children of `pid`, from every thread's `children` list."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and of all its live descendants (each with its reaped children)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu_seconds(p)
        todo += children(p)
    return total


def reaped_children_seconds() -> float:
    """CPU seconds of this process's children that have been waited for (resource usage)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def thread_seconds() -> float:
    """CPU seconds of the calling thread (a reader in this process), in microseconds."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


def own_seconds() -> float:
    """CPU seconds of this process, all its threads (an in-process client such as TensorStore)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
