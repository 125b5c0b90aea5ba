"""The local source against hostile directory contents: odd names, links out, files rewritten in place."""

from __future__ import annotations

import os

import pytest
import trio

from unshardfs.sources.base import name_problem
from unshardfs.sources.local import LocalSource
from unshardfs.util.errors import SourceError, StaleError


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\0b", "bad\udcff"])
def test_names_that_are_never_keys(name):
    assert name_problem(name) is not None


@pytest.mark.parametrize("name", ["info", "1_1_1", "0-64_0-64_0-64", "c", "é", ".zattrs", "..x"])
def test_ordinary_names(name):
    assert name_problem(name) is None


def _listing(source: LocalSource, path: str) -> list[str]:
    async def run() -> list[str]:
        return [name async for name, _ in source.list(path)]
    return sorted(trio.run(run))


def test_listing_skips_undecodable_names_and_refuses_links_out(tmp_path):
    """A name that is not UTF-8 cannot be a path: skipped. A link out is there but refused: listed as a
    file that says why, nothing of the outside stat'ed or read (its size is the link's own)."""
    root = tmp_path / "src"
    root.mkdir()
    (root / "info").write_text("{}")
    with open(os.path.join(os.fsencode(root), b"bad\xff"), "wb") as f:  # not UTF-8
        f.write(b"x")
    outside = tmp_path / "secret"
    outside.write_text("a secret of a size of its own")
    os.symlink(outside, root / "link-out")
    os.symlink("info", root / "link-in")
    source = LocalSource(str(root))
    assert _listing(source, "") == ["info", "link-in", "link-out"]

    async def main() -> None:
        listed = {name: st async for name, st in source.list("")}
        st = listed["link-out"]
        assert st == await source.stat("link-out")
        assert (st.refused, st.is_dir, st.version, st.size) == (
            "a symbolic link on its way leads outside the source", False, (), len(str(outside)))
        assert listed["link-in"].refused is None
        with pytest.raises(SourceError, match="outside the source"):
            await source.read("link-out", 0, 10)

    trio.run(main)


def test_file_rewritten_in_place_is_stale(tmp_path):
    """Same inode, same size, mtime put back (as `cp -p` or rsync -t would): still detected (ctime)."""
    path = tmp_path / "0.shard"
    path.write_bytes(b"a" * 4096)
    source = LocalSource(str(tmp_path))

    async def run() -> None:
        st = await source.stat("0.shard")
        assert await source.read("0.shard", 0, 4, st.version) == b"aaaa"  # the fd is now cached
        before = os.stat(path)
        with open(path, "r+b") as f:
            f.write(b"b" * 4096)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(path).st_ino == before.st_ino and os.stat(path).st_size == before.st_size
        with pytest.raises(StaleError):
            await source.read("0.shard", 0, 4, st.version)
        fresh = await source.stat("0.shard")
        assert await source.read("0.shard", 0, 4, fresh.version) == b"bbbb"

    trio.run(run)
