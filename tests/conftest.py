"""Shared fixtures: real FUSE mounts that are always unmounted, even when a test fails."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.mounts import Mount, force_unmount, run_cli


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
