"""A small tmpfs for tests that need a file system that fills up (root only)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of `size` mounted on `where` (made if missing), unmounted even when the test fails;
    the test is skipped where mounting is not allowed."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def remount(where: Path, options: str) -> None:
    """Change a mounted tmpfs's limits (`size=16m`, `nr_inodes=8`): room freed or taken away."""
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)
