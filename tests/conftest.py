"""Shared fixtures: real FUSE mounts that are always unmounted, even when a test fails."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

import tests.support.profiles  # noqa: F401  (the hypothesis profile, loaded before any test module)

from unshardfs.testing.mounts import MountFn, mounting


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[MountFn]:
    """`mount(source, *options)` mounts in the background and returns a `Mount`."""
    yield from mounting(tmp_path)
