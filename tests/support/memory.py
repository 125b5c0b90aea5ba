"""A process's resident memory, read from /proc/PID/status (Linux), for tests that bound it.

Figures are bytes. `pid` is a process id or "self"."""

from __future__ import annotations

import re
from pathlib import Path

from unshardfs.testing.mounts import daemon_pids

MiB = 1 << 20


def status_bytes(pid: int | str, field: str) -> int:
    """One "<field>: N kB" line of /proc/PID/status, in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert found, f"no {field} in /proc/{pid}/status"
    return int(found[1]) << 10


def peak_rss(pid: int | str = "self") -> int:
    """The largest resident set the process has had (VmHWM), since it started or since `reset_peak_rss`."""
    return status_bytes(pid, "VmHWM")


def rss(pid: int | str = "self") -> int:
    """The process's resident set now (VmRSS)."""
    return status_bytes(pid, "VmRSS")


def reset_peak_rss() -> bool:
    """Reset this process's peak to its resident set now (clear_refs 5); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def daemon_peak_rss(mountpoint: Path) -> int:
    """The largest resident set a daemon serving `mountpoint` has had; fails if none serves it."""
    pids = daemon_pids(mountpoint)
    assert pids, "the daemon died"
    return max(peak_rss(pid) for pid in pids)
