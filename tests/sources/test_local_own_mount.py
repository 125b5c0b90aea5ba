"""The local source keeps out of its daemon's own mount: wherever that device is mounted beneath
the root (then or later), the entry is absent from listings and lookups, while any other mount
beneath the root is crossed as before. A tmpfs stands in for the FUSE mount (its device is
named as "ours"), so what is entered can be seen without risking a hang."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import trio

from unshardfs.sources.local import LocalSource
from unshardfs.util.mountinfo import OwnMount, mounted_at

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="mounts tmpfs")


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Path]:
    """root/ with a/f, sub/ (our stand-in mount, a tmpfs holding x), other/ (someone else's tmpfs,
    holding y) and alias -> sub."""
    root = tmp_path / "root"
    for d in ("a", "sub", "other"):
        (root / d).mkdir(parents=True)
    (root / "a" / "f").write_bytes(b"f")
    (root / "alias").symlink_to("sub")
    mounted = []
    try:
        for d in ("sub", "other"):
            assert subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(root / d)], timeout=30).returncode == 0
            mounted.append(root / d)
        (root / "sub" / "x").write_bytes(b"x")
        (root / "other" / "y").write_bytes(b"y")
        yield root
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def ours(path: Path) -> OwnMount:
    entry = mounted_at(str(path))
    assert entry is not None
    return OwnMount(entry.device)


async def names(source: LocalSource, path: str) -> set[str]:
    return {name async for name, _ in source.list(path)}


@pytest.mark.parametrize("openat2", [True, False])
def test_own_mount_is_absent_and_other_mounts_are_not(tree, monkeypatch, openat2):
    if not openat2:
        monkeypatch.setattr("unshardfs.util.fdpath.openat2", None)
    source = LocalSource(str(tree))
    own = ours(tree / "sub")

    async def main() -> None:
        assert "sub" in await names(source, "")  # before: a directory like any other
        source.keep_out(own)
        assert await names(source, "") == {"a", "other"}
        for path in ("sub", "sub/x", "alias", "alias/x"):
            assert await source.stat(path) is None, path
        assert await names(source, "sub") == set()
        assert await names(source, "other") == {"y"}  # someone else's mount: crossed
        assert await source.read("other/y", 0, 1) == b"y"
        assert await source.read("a/f", 0, 1) == b"f"

    try:
        trio.run(main)
    finally:
        source.close()
        own.close()


def test_own_mount_bound_beneath_the_root_later_is_absent(tree, tmp_path):
    """A bind mount made after `keep_out` (the mount table changed) brings our device over `d`,
    where a file was already resolved (and known, so revalidated by one stat of its path): it is
    neither listed nor stat'ed through the bind."""
    root = tmp_path / "second"
    (root / "d").mkdir(parents=True)
    (root / "d" / "g").write_bytes(b"g")
    (tree / "sub" / "g").write_bytes(b"ours")  # what a path through the bind would find
    source = LocalSource(str(root))
    own = ours(tree / "sub")

    async def main() -> None:
        source.keep_out(own)
        assert (await source.stat("d/g")) is not None
        assert (await source.stat("d/g")) is not None  # known now
        assert subprocess.run(["mount", "--bind", str(tree / "sub"), str(root / "d")], timeout=30).returncode == 0
        assert await names(source, "") == set()
        assert await source.stat("d/g") is None
        assert await source.stat("d/x") is None

    try:
        trio.run(main)
    finally:
        source.close()
        own.close()
        subprocess.run(["umount", "-l", str(root / "d")], capture_output=True, timeout=30)
