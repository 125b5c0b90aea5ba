"""Shared fixtures: real FUSE mounts that are always unmounted, even when a test fails."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

UNSHARDFS = [sys.executable, "-m", "unshardfs"]


@dataclass
class Mount:
    path: Path
    log: Path

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*UNSHARDFS, *args], capture_output=True, text=True, timeout=timeout)


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


@pytest.fixture
def mount(tmp_path: Path) -> Iterator:
    """`mount(source, *options)` mounts in the background and returns a `Mount`."""
    mounted: list[Path] = []
    counter = iter(range(1000))

    def _mount(source: Path | str, *options: str) -> Mount:
        n = next(counter)
        mnt = tmp_path / f"mnt{n}"
        mnt.mkdir()
        log = tmp_path / f"unshardfs{n}.log"
        mounted.append(mnt)
        result = run_cli("mount", str(source), str(mnt), "--log-file", str(log), *options)
        assert result.returncode == 0, f"mount failed: {result.stderr}\n{log.read_text() if log.exists() else ''}"
        assert os.path.ismount(mnt)
        return Mount(mnt, log)

    yield _mount
    for mnt in mounted:
        force_unmount(mnt)


def walk_files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def unstamped(data: bytes) -> bytes:
    """`data` with a gzip member's MTIME zeroed: writers stamp the current time
    there, so two writes of the same chunk a second apart differ only in it."""
    if data[:3] == b"\x1f\x8b\x08" and len(data) >= 18:
        return data[:4] + bytes(4) + data[8:]
    return data


def assert_same_tree(mounted: Path, reference: Path, json_files: tuple[str, ...] = (),
                     ignore_gzip_mtime: bool = False) -> int:
    """Same file names and same bytes; `json_files` are compared as parsed JSON.

    Returns the number of files compared, so callers can check they compared
    something at all.
    """
    got, want = walk_files(mounted), walk_files(reference)
    assert sorted(got) == sorted(want), (
        f"missing: {sorted(set(want) - set(got))[:10]} extra: {sorted(set(got) - set(want))[:10]}")
    for rel, path in want.items():
        if rel in json_files or rel.endswith("/info") or rel == "info":
            assert json.loads(got[rel].read_bytes()) == json.loads(path.read_bytes()), rel
        elif ignore_gzip_mtime:
            assert unstamped(got[rel].read_bytes()) == unstamped(path.read_bytes()), rel
        else:
            assert got[rel].read_bytes() == path.read_bytes(), rel
    return len(want)
