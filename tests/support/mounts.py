"""Real FUSE mounts from the tests: start the CLI, find its daemon, always clean up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

UNSHARDFS = [sys.executable, "-m", "unshardfs"]


@dataclass
class Mount:
    path: Path
    log: Path

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, with this process's environment unless `env` is given."""
    return subprocess.run([*UNSHARDFS, *args], capture_output=True, text=True, timeout=timeout, env=env)


def daemon_pids(mountpoint: Path) -> list[int]:
    """Daemons serving `mountpoint`, found by their command line."""
    pids = []
    target = str(mountpoint)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"unshardfs" in b" ".join(argv) and target.encode() in argv:
            pids.append(int(entry.name))
    return pids


def force_unmount(mountpoint: Path) -> None:
    for cmd in (["fusermount3", "-u", str(mountpoint)], ["fusermount3", "-uz", str(mountpoint)]):
        if not os.path.ismount(mountpoint):
            break
        subprocess.run(cmd, capture_output=True, timeout=30)
    deadline = time.monotonic() + 10
    while daemon_pids(mountpoint) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in daemon_pids(mountpoint):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for(predicate: Callable[[], bool], seconds: float = 20) -> bool:
    """Poll `predicate` until it holds (True) or `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
