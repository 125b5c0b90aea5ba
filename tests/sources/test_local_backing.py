"""`LocalSource.open_backing`: the descriptor handed to the kernel for passthrough is the very file
a node was resolved from, beneath the root, or nothing."""

from __future__ import annotations

import os

import pytest
import trio

from unshardfs.sources.base import BackingFiles
from unshardfs.sources.counting import CountingSource
from unshardfs.sources.local import LocalSource


def version_of(source: LocalSource, path: str) -> tuple:
    st = trio.run(source.stat, path)
    assert st is not None
    return st.version


def test_the_file_as_resolved_is_opened(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc")
    source = LocalSource(str(tmp_path))
    try:
        assert isinstance(source, BackingFiles) and isinstance(CountingSource(source), BackingFiles)
        fd = CountingSource(source).open_backing("a.bin", version_of(source, "a.bin"))
        assert fd is not None
        try:
            assert os.pread(fd, 10, 0) == b"abc"
        finally:
            os.close(fd)
    finally:
        source.close()


@pytest.mark.parametrize("change", ["rewritten", "replaced", "removed", "fifo", "outside"])
def test_anything_but_that_file_is_refused(tmp_path, change):
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.bin").write_bytes(b"abc")
    (tmp_path / "secret").write_bytes(b"xyz")
    source = LocalSource(str(root))
    try:
        version = version_of(source, "a.bin")
        if change == "rewritten":
            (root / "a.bin").write_bytes(b"abcd")
        elif change == "replaced":
            (root / "b.bin").write_bytes(b"abc")
            os.replace(root / "b.bin", root / "a.bin")
        elif change == "removed":
            (root / "a.bin").unlink()
        elif change == "fifo":
            (root / "a.bin").unlink()
            os.mkfifo(root / "a.bin")
        else:
            (root / "a.bin").unlink()
            os.symlink(tmp_path / "secret", root / "a.bin")
        before = len(os.listdir("/proc/self/fd"))
        assert source.open_backing("a.bin", version) is None
        assert len(os.listdir("/proc/self/fd")) == before  # nothing left open
    finally:
        source.close()
