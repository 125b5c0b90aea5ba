"""Mount and unmount the file systems compared (unshardfs, the null pyfuse3 fs, ratarmount)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from . import ceiling, profiling

SCRIPTS = Path(__file__).resolve().parent.parent
PY = sys.executable
UNSHARDFS = [PY, "-m", "unshardfs"]


def wait_mounted(path: Path, proc: subprocess.Popen[bytes] | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.ismount(path):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mount process exited: {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not mount")
        time.sleep(0.02)


def unmount(path: Path) -> None:
    for flags in ("-u", "-uz"):
        if not os.path.ismount(path):
            return
        subprocess.run(["fusermount3", flags, str(path)], capture_output=True)
        time.sleep(0.1)


@contextmanager
def mounted(kind: str, source: Path | str, workdir: Path, *options: str,
            env: dict[str, str] | None = None, readahead_kib: int | None = None) -> Iterator[Path]:
    """`source` mounted by `kind`; `env` runs unshardfs with another environment (another checkout's
    code on PYTHONPATH, see `compare`). Kinds: unshardfs, nullfs, ratarmount, and the ceiling
    daemon (`ceiling`) on one thread or libfuse's worker threads (`ceiling-mt`), its options
    `ceiling.options_like` and its read-ahead `readahead_kib` (as unshardfs sets its own, root only).
    With `scripts/bench --profile`, py-spy samples each unshardfs daemon while it is mounted."""
    mnt = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir))
    # The daemon's log goes to the run's work directory, not the user's cache.
    env = {**(os.environ if env is None else env), "XDG_CACHE_HOME": str(workdir)}
    proc = None
    recording = None
    try:
        if kind == "unshardfs":
            subprocess.run([*UNSHARDFS, "mount", str(source), str(mnt), *options], check=True, env=env)
            if profiling.ACTIVE is not None:
                recording = profiling.attach(daemon_pid(mnt))
        elif kind in ("ceiling", "ceiling-mt"):
            binary = ceiling.binary(workdir)
            threads = ["--mt"] if kind == "ceiling-mt" else []
            proc = subprocess.Popen([str(binary), *threads, *options, str(source), str(mnt)],
                                    stdout=subprocess.DEVNULL)
            wait_mounted(mnt, proc)
            if readahead_kib:
                from unshardfs.fuse.mount import set_readahead

                set_readahead(str(mnt), readahead_kib)
        elif kind == "nullfs":
            proc = subprocess.Popen([PY, str(SCRIPTS / "nullfs.py"), *options, str(source), str(mnt)],
                                    stdout=subprocess.DEVNULL)
            wait_mounted(mnt, proc)
        elif kind == "ratarmount":
            subprocess.run([str(Path(PY).parent / "ratarmount"), str(source), str(mnt)], check=True,
                           capture_output=True)
            wait_mounted(mnt)
        yield mnt
    finally:
        unmount(mnt)
        if proc is not None:
            proc.wait(timeout=30)
        profiling.stop(recording)
        shutil.rmtree(mnt, ignore_errors=True)


def daemon_pid(mnt: Path) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(mnt).encode() in argv and (b"--foreground" in argv or argv[0].endswith(b"/ceilingfs")):
                return int(entry.name)
    raise RuntimeError("daemon not found")


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields
