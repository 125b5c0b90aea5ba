"""The ByteSource contract as one suite every source runs (ours, or a third party's: this ships in
the package).

A subclass says what its source claims (`listable`, `remote`, `versioned`)
and provides a `make` fixture: a function building the source over the
`tree` fixture's files (served, uploaded or layered as that source needs).
Where the objects live elsewhere (an S3 emulator), it also overrides
`change`, which replaces or removes an object behind the source's back.
Each test drives one fresh source in one `trio.run` and closes it.

`ChangedUnderneath` is the one case every byte source runs, also those that
cannot hold the suite's tree (an Icechunk repository holds Zarr keys): the
file a source reads an object's bytes from by range (the object's own file, a
zip archive, an OCDBT data file, an Icechunk chunk object) is changed while a
reader is half way through the object -- renamed over, overwritten as `cp`
does, or rewritten in place with its size and mtime put back -- and the rest
of the object must read as the old bytes or fail with `StaleError`, never as
the new bytes; looked up again, the object reads as the new bytes whole.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import Awaitable, Callable, ClassVar, TypeVar

import numpy as np
import pytest
import trio

from unshardfs.sources.base import ByteSource, stat_and_head, stat_and_tail
from unshardfs.util.errors import StaleError

T = TypeVar("T")
MakeSource = Callable[[], ByteSource]
# Replace the object at a path with new bytes, or remove it (None).
Change = Callable[[str, "bytes | None"], None]

_rng = np.random.default_rng(7)
TREE: dict[str, bytes] = {
    "a.bin": _rng.bytes(1000),
    "empty.bin": b"",
    "dir/b.bin": _rng.bytes(300),
    "dir/sub/c.bin": _rng.bytes(10),
    "dir/odd name%20+.bin": _rng.bytes(5),  # must be quoted in URLs, and not unquoted twice
}


def children(directory: str) -> dict[str, int | None]:
    """Direct children of `directory` in TREE: name -> size (None for directories)."""
    out: dict[str, int | None] = {}
    prefix = f"{directory}/" if directory else ""
    for path, data in TREE.items():
        if path.startswith(prefix):
            name, sep, _ = path[len(prefix):].partition("/")
            out[name] = None if sep else len(data)
    return out


def write_tree(root: Path) -> Path:
    for path, data in TREE.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return root


def renamed_over(file: Path, content: bytes) -> None:
    """A new file written beside `file`, then renamed over it (what `rsync` and careful writers do)."""
    fresh = file.with_name(file.name + ".new")
    fresh.write_bytes(content)
    os.replace(fresh, file)


def overwritten(file: Path, content: bytes) -> None:
    """`file` truncated and written again, the same inode (what `cp` does to a file that exists)."""
    with open(file, "wb") as f:
        f.write(content)


def restored(file: Path, content: bytes) -> None:
    """`file` rewritten in place and its mtime put back (`cp -p`, `rsync -t --inplace`): of its attributes only
    the ctime tells. `content` has `file`'s size."""
    before = file.stat()
    with open(file, "r+b") as f:
        f.write(content)
        f.truncate(len(content))
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))


# The ways a file changes under a mount, by name: `ChangedUnderneath` tries each.
CHANGES: dict[str, Callable[[Path, bytes], None]] = {
    "renamed over": renamed_over, "overwritten": overwritten, "rewritten with size and mtime restored": restored}
RESTORED = "rewritten with size and mtime restored"
# Make a change of the given kind to the file an object's bytes lie in; what the object reads afterwards.
Rewrite = Callable[[str], bytes]


def flipped(data: bytes) -> bytes:
    """Bytes of the same length, each one different."""
    return bytes(b ^ 0xFF for b in data)


def rewrite_stored(root: Path, value: bytes, at: int | None = None) -> Rewrite:
    """A `rewrite` for a source over a store under `root` that keeps an object's bytes, `value`, as they are
    inside one of its files (an OCDBT data file, an Icechunk chunk object): that file is changed, `value`'s
    bytes in it flipped. `at`: where in the file they lie, if the file holds them more than once."""
    def rewrite(how: str) -> bytes:
        holders = [f for f in sorted(root.rglob("*")) if f.is_file() and value in f.read_bytes()]
        assert len(holders) == 1, f"{len(holders)} files under {root} hold the value"
        data = holders[0].read_bytes()
        assert at is not None or data.count(value) == 1, "the value lies in its file more than once: say where"
        at_ = data.index(value) if at is None else at
        assert data[at_:at_ + len(value)] == value
        new = flipped(value)
        CHANGES[how](holders[0], data[:at_] + new + data[at_ + len(value):])
        return new

    return rewrite


def run(make: MakeSource, work: Callable[[ByteSource], Awaitable[T]]) -> T:
    """`work` on a fresh source, in one trio run; the source is closed however `work` ends."""
    async def main() -> T:
        source = make()
        try:
            return await work(source)
        finally:
            await source.aclose()

    return trio.run(main)


class ChangedUnderneath:
    """The one case every byte source runs (see the module docstring). A subclass provides `make` (a
    function building the source) and `rewrite` (the change, made underneath the source to the file that
    holds `underneath`'s bytes; it returns what `underneath` reads afterwards, of the same size), and says
    whether its objects' versions see a rewrite that puts the mtime back (`sees_restored`: a server whose
    validators are derived from size and mtime, as nginx's and Apache's are, cannot)."""

    underneath: ClassVar[str] = "a.bin"
    sees_restored: ClassVar[bool] = True

    @pytest.mark.parametrize("how", list(CHANGES))
    def test_changed_underneath_is_old_new_or_stale(self, make: MakeSource, rewrite: Rewrite, how: str) -> None:
        if how == RESTORED and not self.sees_restored:
            pytest.skip("this source's versions cannot see a rewrite that puts the mtime back")
        path = self.underneath

        async def work(source: ByteSource) -> None:
            st = await source.stat(path)
            assert st is not None and not st.is_dir and st.size >= 2
            old = await source.read(path, 0, st.size, st.version)
            half = st.size // 2
            assert await source.read(path, 0, half, st.version) == old[:half]
            new = rewrite(how)
            assert len(new) == st.size and new != old
            for read in (source.read, source.read_index):
                try:
                    rest = await read(path, half, st.size - half, st.version)
                except StaleError:
                    continue
                assert rest == old[half:], "the new bytes after the old ones" if rest == new[half:] else rest[:50]
            # Looked up again (once more if the first stat was one kept from before): the new bytes, whole.
            for again in (False, True):
                fresh = await source.stat(path)
                assert fresh is not None and fresh.size == len(new)
                try:
                    got = await source.read(path, 0, fresh.size, fresh.version)
                    break
                except StaleError:
                    if again:
                        raise
            assert got == new

        run(make, work)


class SourceConformance(ChangedUnderneath):
    listable: ClassVar[bool]
    remote: ClassVar[bool]
    # The objects are the `tree` fixture's files (served or layered as they are): `rewrite` changes
    # them in each way `CHANGES` names; otherwise (an object store, memory) it replaces the object
    # through `change`.
    in_files: ClassVar[bool] = False
    # Reads made with a version from an earlier stat notice a changed object (StaleError).
    versioned: ClassVar[bool] = True
    # An object's tail comes with its stat (`stat_and_tail`, one request).
    tails: ClassVar[bool] = False

    @pytest.fixture
    def tree(self, tmp_path: Path) -> Path:
        return write_tree(tmp_path / "tree")

    @pytest.fixture
    def make(self, tree: Path) -> MakeSource:
        raise NotImplementedError("a SourceConformance subclass provides the `make` fixture")

    @pytest.fixture
    def change(self, tree: Path) -> Change:
        def change(path: str, data: bytes | None) -> None:
            if data is None:
                (tree / path).unlink()
            else:
                (tree / path).write_bytes(data)

        return change

    @pytest.fixture
    def rewrite(self, tree: Path, change: Change) -> Rewrite:
        def rewrite(how: str) -> bytes:
            new = flipped(TREE[self.underneath])
            if self.in_files:
                CHANGES[how](tree / self.underneath, new)
            else:
                change(self.underneath, new)
            return new

        return rewrite

    # -- the contract ------------------------------------------------------------------

    def test_flags(self, make: MakeSource) -> None:
        async def work(source: ByteSource) -> None:
            assert (source.listable, source.remote) == (self.listable, self.remote)
            assert isinstance(source.description, str) and source.description
            assert isinstance(source.stats(), dict)

        run(make, work)

    def test_stat(self, make: MakeSource) -> None:
        async def work(source: ByteSource) -> None:
            for path, data in TREE.items():
                st = await source.stat(path)
                assert st is not None and not st.is_dir and st.size == len(data), path
            root = await source.stat("")
            assert root is not None and root.is_dir
            for path in ("dir", "dir/sub"):  # directories: a directory stat, or unknown to `stat`
                st = await source.stat(path)
                assert st is None or st.is_dir, path
            for path in ("missing", "dir/missing.bin", "a.bin/below", "dir/su"):
                assert await source.stat(path) is None, path

        run(make, work)

    @pytest.mark.parametrize("size", [1, 100, 5000])
    @pytest.mark.parametrize("end", ["tail", "head"])
    def test_stat_with_bytes(self, make: MakeSource, end: str, size: int) -> None:
        """`stat_and_tail` (a Zarr shard's index with its stat) and `stat_and_head` (a precomputed
        shard's): the stat `stat` gives, version and all, and where the source gives them, exactly
        the object's last or first `size` bytes (all of a shorter one); nothing for absent objects
        and directories. A source gives both ends or neither."""
        stat_with = stat_and_tail if end == "tail" else stat_and_head

        def cut(data: bytes) -> bytes:
            return data[-size:] if end == "tail" else data[:size]

        async def work(source: ByteSource) -> None:
            other = make()  # its stats come from `stat` alone
            given = []
            try:
                for path, data in TREE.items():
                    st, got = await stat_with(source, path, size)
                    assert st == await other.stat(path), path
                    assert got is None or got == cut(data), (path, len(got))
                    given.append(got is not None)
                    again = await stat_with(source, path, size)
                    assert again[0] == st and again[1] in (None, cut(data)), path
                for path in ("missing", "dir/missing.bin", "dir", "dir/sub"):
                    st, got = await stat_with(source, path, size)
                    assert (st is None or st.is_dir) and got is None, path
            finally:
                await other.aclose()
            assert any(given) == self.tails

        run(make, work)

    def test_stat_dir(self, make: MakeSource) -> None:
        async def work(source: ByteSource) -> None:
            root = await source.stat_dir("")
            assert root is not None and root.is_dir
            for path in ("dir", "dir/sub"):
                st = await source.stat_dir(path)
                # A source that cannot list cannot know its directories either.
                assert (st is not None and st.is_dir) if self.listable else st is None, path
            for path in ("a.bin", "missing", "dir/su", "dir/b.bin"):
                assert await source.stat_dir(path) is None, path

        run(make, work)

    @pytest.mark.parametrize("index", [False, True], ids=["read", "read_index"])
    def test_read_ranges(self, make: MakeSource, index: bool) -> None:
        data = TREE["a.bin"]
        ranges = [(0, len(data)), (0, 1), (100, 50), (999, 1), (990, 100), (0, 5000), (1000, 10), (4000, 10),
                  (10, 0)]

        async def work(source: ByteSource) -> None:
            read = source.read_index if index else source.read
            st = await source.stat("a.bin")
            assert st is not None
            for offset, size in ranges:
                want = data[offset:offset + size]  # shorter only at the end, empty at or after it
                assert await read("a.bin", offset, size) == want, (offset, size)
                assert await read("a.bin", offset, size, st.version) == want, (offset, size)
            for path in ("empty.bin", "dir/odd name%20+.bin", "dir/sub/c.bin"):
                assert await read(path, 0, 1 << 20) == TREE[path], path

        run(make, work)

    @pytest.mark.parametrize("how", ["rewritten", "removed"])
    def test_read_after_change_is_stale(self, make: MakeSource, change: Change, how: str) -> None:
        if not self.versioned:
            pytest.skip("this source has no object versions")

        async def work(source: ByteSource) -> None:
            st = await source.stat("dir/b.bin")
            assert st is not None
            assert await source.read("dir/b.bin", 0, 10, st.version) == TREE["dir/b.bin"][:10]
            change("dir/b.bin", None if how == "removed" else b"new and shorter")
            for read in (source.read, source.read_index):
                with pytest.raises(StaleError):
                    await read("dir/b.bin", 0, 10, st.version)
            if how == "rewritten":  # without a version: whatever is there now
                assert await source.read("dir/b.bin", 0, 10) == b"new and sh"

        run(make, work)

    def test_list(self, make: MakeSource) -> None:
        async def work(source: ByteSource) -> None:
            for path in ("", "dir", "dir/sub", "missing", "a.bin"):
                listed: dict[str, int | None] = {}
                async for name, st in source.list(path):
                    assert name not in listed and "/" not in name, (path, name)
                    listed[name] = None if st.is_dir else st.size
                if not self.listable:
                    assert listed == {}, path  # an honest `listable = False`: nothing to enumerate
                elif posixpath.basename(path) in ("missing", "a.bin"):
                    assert listed == {}, path
                else:
                    assert listed == children(path), path

        run(make, work)

    def test_aclose_is_idempotent(self, make: MakeSource) -> None:
        async def work(source: ByteSource) -> None:
            assert await source.read("a.bin", 0, 4) == TREE["a.bin"][:4]
            await source.aclose()
            # ...and `run` closes it once more.

        run(make, work)
