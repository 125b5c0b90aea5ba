"""A local shard revalidated on every lookup, counted in system calls: a file resolved before and
unchanged costs one fstatat (no openat2, fstat, close); anything else is resolved beneath the root
again, so a replaced, rewritten or removed file, a link (in or out) and a FIFO are seen as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from unshardfs.core.blob import RecentBlobs
from unshardfs.sources.local import LocalSource
from unshardfs.util import fdpath


class Calls:
    """Resolutions beneath the root (Beneath.open: openat2 or the walk) and plain stats."""

    def __init__(self, monkeypatch) -> None:
        self.opens = 0
        self.stats = 0
        real_open, real_stat = fdpath.Beneath.open, os.stat

        def counted_open(beneath, rel, flags, mode=0):
            self.opens += 1
            return real_open(beneath, rel, flags, mode)

        def counted_stat(path, *args, **kwargs):
            self.stats += 1
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(fdpath.Beneath, "open", counted_open)
        monkeypatch.setattr(os, "stat", counted_stat)


@pytest.fixture
def tree(tmp_path) -> Path:
    root = tmp_path / "src"
    (root / "s").mkdir(parents=True)
    (root / "s" / "0.shard").write_bytes(b"a" * 100)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "0.shard").write_bytes(b"o" * 100)
    return root


def stat(source: LocalSource, path: str):
    return trio.run(source.stat, path)


def test_an_unchanged_shard_costs_one_fstatat_and_keeps_its_blob(tree, monkeypatch):
    source = LocalSource(str(tree))
    first = stat(source, "s/0.shard")
    calls = Calls(monkeypatch)
    for _ in range(100):
        again = stat(source, "s/0.shard")
        assert again is first  # the same answer: formats keep their Blob and cached indexes
    assert (calls.opens, calls.stats) == (0, 100)
    blobs = RecentBlobs()
    assert blobs.of("s/0.shard", again) is blobs.of("s/0.shard", first)
    source.close()


@pytest.mark.parametrize("change", ["replaced", "rewritten", "removed", "link out", "link in", "fifo"])
def test_any_change_is_resolved_beneath_the_root_again(tree, monkeypatch, change):
    source = LocalSource(str(tree))
    shard = tree / "s" / "0.shard"
    first = stat(source, "s/0.shard")
    if change == "replaced":
        new = tree / "s" / "new"
        new.write_bytes(b"b" * 100)
        os.replace(new, shard)
    elif change == "rewritten":  # in place, size and mtime restored: only ctime tells
        st = shard.stat()
        shard.write_bytes(b"c" * 100)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "removed":
        shard.unlink()
    elif change == "link out":
        shard.unlink()
        shard.symlink_to(tree.parent / "outside" / "0.shard")
    elif change == "link in":
        (tree / "s" / "1.shard").write_bytes(b"d" * 50)
        shard.unlink()
        shard.symlink_to("1.shard")
    else:
        shard.unlink()
        os.mkfifo(shard)
    calls = Calls(monkeypatch)
    got = stat(source, "s/0.shard")
    assert calls.opens >= 1  # resolved beneath the root, not taken from the fstatat
    if change == "removed":
        assert got is None
    elif change in ("link out", "fifo"):  # there, but refused: nothing of it is read
        assert got is not None and got.refused is not None and got.version == ()
    else:
        assert got is not None and got.version != first.version
        if change == "link in":
            assert got.size == 50
    source.close()
