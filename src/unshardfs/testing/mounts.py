"""Real FUSE mounts for tests: start the CLI, read a mount's stats, find its daemon, always clean up."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

UNSHARDFS = [sys.executable, "-m", "unshardfs"]


@dataclass
class Mount:
    path: Path
    log: Path

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def stats(self) -> dict[str, Any]:
        """The daemon's live counters (what `unshardfs stats` prints)."""
        return stats(self.path)


def stats(mountpoint: Path) -> dict[str, Any]:
    """The live counters of the daemon serving `mountpoint` (its stats xattr)."""
    stats: dict[str, Any] = json.loads(os.getxattr(mountpoint, "user.unshardfs.stats"))
    return stats


MountFn = Callable[..., Mount]


def mounting(tmp_path: Path) -> Iterator[MountFn]:
    """The body of a `mount` fixture: `mount(source, *options)` mounts in the background (under
    `tmp_path`) and returns a `Mount`; every mount is unmounted when the generator ends."""
    mounted: list[Path] = []
    daemons: list[subprocess.Popen[bytes]] = []
    counter = iter(range(1000))

    def mount(source: Path | str, *options: str) -> Mount:
        n = next(counter)
        mnt = tmp_path / f"mnt{n}"
        mnt.mkdir()
        log = tmp_path / f"unshardfs{n}.log"
        mounted.append(mnt)
        daemons.append(start_daemon(str(source), mnt, log, *options))
        return Mount(mnt, log)

    try:
        yield mount
    finally:
        for mnt in mounted:
            force_unmount(mnt)
        for daemon in daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=10)


def start_daemon(source: str, mountpoint: Path, log: Path, *options: str,
                 timeout: float = 60) -> subprocess.Popen[bytes]:
    """Mount as `unshardfs mount` does, minus its detaching parent: the daemon itself is started here
    (one interpreter per mount, not two) with the readiness pipe the CLI would read; returns once it
    is mounted (with the daemon's process, for the caller to reap after unmounting), or fails the
    test with what it said."""
    read_fd, write_fd = os.pipe()
    try:
        with open(log, "ab") as out:
            daemon = subprocess.Popen([*UNSHARDFS, "mount", source, str(mountpoint), "--log-file", str(log), *options,
                                       "--foreground", "--ready-fd", str(write_fd)],
                                      pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                      start_new_session=True)
    finally:
        os.close(write_fd)
    message = f"not mounted within {timeout} s"
    try:
        with os.fdopen(read_fd, "rb") as pipe:
            waiting = select.poll()  # not select(): a test process may hold descriptors past FD_SETSIZE
            waiting.register(pipe, select.POLLIN | select.POLLHUP)
            if waiting.poll(timeout * 1000):
                message = pipe.read().decode(errors="replace").strip()
    finally:
        if message != "OK":  # whatever stopped the wait, no daemon or mount is left behind
            if daemon.poll() is None:
                daemon.kill()
            daemon.wait(timeout=30)
            force_unmount(mountpoint)
    if message != "OK":
        raise AssertionError(f"mount failed: {message}\n{log.read_text() if log.exists() else ''}")
    assert os.path.ismount(mountpoint)
    return daemon


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
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


FUSECTL = Path("/sys/fs/fuse/connections")


def connection(mountpoint: Path) -> int | None:
    """The FUSE connection number of the mount on `mountpoint` (its device's minor), from the
    mount table: the mount itself is never touched."""
    from unshardfs.util.mountinfo import mounted_at, mountpoint_path

    entry = mounted_at(mountpoint_path(str(mountpoint)))
    return None if entry is None else int(entry.device.split(":")[1])


def abort(mountpoint: Path) -> bool:
    """Abort the FUSE connection of the mount on `mountpoint` through fusectl (mounted first if it
    is not; root only): every request waiting on it fails at once. True if aborted."""
    number = connection(mountpoint)
    if number is None:
        return False
    if not (FUSECTL / str(number)).exists():
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSECTL)], capture_output=True, timeout=30)
    try:
        (FUSECTL / str(number) / "abort").write_text("1")
    except OSError:
        return False
    return True


def blocked(pid: int) -> bool:
    """Whether a thread of process `pid` sleeps uninterruptibly (state D): waiting on a file system
    that does not answer."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, IndexError):
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "D":
                return True
    return False


@dataclass
class Bounded:
    """A command run within a bound over a mount: its exit code (None if it had to be stopped),
    its output, and whether it was seen stuck in state D."""

    returncode: int | None
    stdout: str
    stuck: bool


def run_bounded(cmd: list[str], mountpoint: Path, seconds: float = 30) -> Bounded:
    """Run `cmd` (a reader of `mountpoint`) for at most `seconds`; if it has not finished by then,
    note whether it sat in state D, abort the mount's connection (which frees it) and kill it,
    so a hang fails the test instead of leaving the machine stuck."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + seconds
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        returncode, stuck = proc.poll(), False
        if returncode is None:
            stuck = blocked(proc.pid)
            abort(mountpoint)
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        out.seek(0)
        return Bounded(returncode, out.read().decode(errors="replace"), stuck)


def wait_for(predicate: Callable[[], bool], seconds: float = 20) -> bool:
    """Poll `predicate` until it holds (True) or `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
