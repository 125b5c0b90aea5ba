"""The zip layer as a byte source: it runs the one SourceConformance suite over every inner source
(local, HTTP, the GCS stand-in, S3 via moto), with STORED and DEFLATE members, and the archive
changed behind its back by rewriting it."""

from __future__ import annotations

import itertools
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import trio
import trio.testing

from tests.sources.test_conformance import FAST, moto  # noqa: F401  (module-scoped S3 emulator)
from tests.support.s3 import CREDENTIALS  # noqa: F401
from unshardfs.sources import CountingSource, LocalSource
from unshardfs.sources import zip as zipsource
from unshardfs.sources.diskcache import DiskCachedSource
from unshardfs.sources.http import HttpSource
from unshardfs.sources.objectstore import GcsSource, S3Source
from unshardfs.sources.zip import ZipSource
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.testing.source_conformance import (CHANGES, TREE, Change, MakeSource, Rewrite, SourceConformance,
                                                  flipped, write_tree)
from unshardfs.testing.zips import zip_tree


def _tree_zip(tmp_path: Path, method: int, under: str = "") -> Path:
    """TREE zipped (directory entries included for some directories only, as writers differ)."""
    tree = write_tree(tmp_path / "tree-src")
    archives = tmp_path / "archives"
    archives.mkdir(exist_ok=True)
    return zip_tree(tree, archives / "tree.zip", method, directories=(method == zipfile.ZIP_STORED), under=under)


def _rezip(archive: Path, method: int, path: str, data: bytes | None, under: str = "", how: str = "renamed over"
           ) -> bytes:
    """The archive with one member replaced or removed: a new file renamed over it, as writers produce (or the
    file changed in another of the ways `CHANGES` names)."""
    members = {k: v for k, v in TREE.items()}
    with zipfile.ZipFile(archive) as z:
        members = {i.filename.removeprefix(under): z.read(i) for i in z.infolist() if not i.is_dir()}
    if data is None:
        members.pop(path)
    else:
        members[path] = data
    tmp = archive.with_suffix(".new")
    with zipfile.ZipFile(tmp, "w", method) as z:
        for name, body in members.items():
            z.writestr(zipfile.ZipInfo(under + name, (2020, 1, 1, 0, 0, 0)), body, method)
    blob = tmp.read_bytes()
    tmp.unlink()
    CHANGES[how](archive, blob)
    return blob


class ZipCase(SourceConformance):
    listable, remote = True, False
    in_files = True
    method = zipfile.ZIP_STORED
    under = ""

    @pytest.fixture
    def archive(self, tmp_path: Path) -> Path:
        return _tree_zip(tmp_path, self.method, self.under)

    @pytest.fixture
    def make(self, archive: Path) -> MakeSource:
        return lambda: ZipSource(LocalSource(str(archive.parent)), archive.name, self.under)

    @pytest.fixture
    def change(self, archive: Path) -> Change:
        return lambda path, data: _rezip(archive, self.method, path, data, self.under) and None

    @pytest.fixture
    def rewrite(self, archive: Path, change: Change) -> Rewrite:
        """The archive changed, the member `underneath` in it flipped."""
        def rewrite(how: str) -> bytes:
            new = flipped(TREE[self.underneath])
            if self.in_files:
                _rezip(archive, self.method, self.underneath, new, self.under, how)
            else:
                change(self.underneath, new)
            return new

        return rewrite


class TestZipLocal(ZipCase):
    pass


class TestZipDeflated(ZipCase):
    method = zipfile.ZIP_DEFLATED


class TestZipBzip2Under(ZipCase):
    """Members compressed with bzip2, the tree under a directory the pipeline names (`|zip:data/`)."""

    method = zipfile.ZIP_BZIP2
    under = "data/"


class TestZipCounted(ZipCase):
    @pytest.fixture
    def make(self, archive: Path) -> MakeSource:
        return lambda: CountingSource(ZipSource(CountingSource(LocalSource(str(archive.parent))), archive.name))


class TestZipDiskCached(ZipCase):
    """Over the --cache-dir layer: the central directory and index reads go through it."""

    @pytest.fixture
    def make(self, archive: Path, tmp_path: Path) -> MakeSource:
        return lambda: ZipSource(DiskCachedSource(LocalSource(str(archive.parent)), str(tmp_path / "idx")),
                                 archive.name)


class TestZipHttp(ZipCase):
    """Over a plain HTTP server (which cannot list): the archive's directory lists anyway. Its entity tags are
    derived from inode, size and mtime: a rewrite that puts the mtime back keeps them."""

    remote = True
    sees_restored = False

    @pytest.fixture
    def make(self, archive: Path) -> Iterator[MakeSource]:
        with DatasetServer(archive.parent) as server:
            yield lambda: ZipSource(HttpSource(server.url, FAST), archive.name)


class TestZipGcs(ZipCase):
    remote = True

    @pytest.fixture
    def make(self, archive: Path) -> Iterator[MakeSource]:
        with DatasetServer(archive.parent.parent, gcs_bucket="bkt") as server:
            yield lambda: ZipSource(GcsSource("bkt", archive.parent.name, FAST, server.url), archive.name)


class TestZipS3(ZipCase):
    remote = True
    in_files = False
    buckets = itertools.count()

    @pytest.fixture
    def bucket(self, archive: Path, moto: tuple[str, Any]) -> str:  # noqa: F811
        name = f"zip-{next(self.buckets)}"
        moto[1].create_bucket(Bucket=name)
        moto[1].put_object(Bucket=name, Key="d/tree.zip", Body=archive.read_bytes())
        return name

    @pytest.fixture
    def make(self, bucket: str, moto: tuple[str, Any]) -> MakeSource:  # noqa: F811
        return lambda: ZipSource(S3Source(bucket, "d", FAST, moto[0]), "tree.zip")

    @pytest.fixture
    def change(self, archive: Path, bucket: str, moto: tuple[str, Any]) -> Change:  # noqa: F811
        def change(path: str, data: bytes | None) -> None:
            moto[1].put_object(Bucket=bucket, Key="d/tree.zip", Body=_rezip(archive, self.method, path, data))

        return change


def test_archive_reads_per_member(tmp_path: Path) -> None:
    """Deterministic archive reads: a small member (or one read whole) comes with its local header in one
    read; a large one read in part costs its local header once, then one ranged read per read."""
    big = bytes(range(256)) * 800  # 200 KiB
    archive = tmp_path / "counts.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("small", TREE["a.bin"])
        z.writestr("big", big)
        z.writestr("big-whole", big)

    async def main() -> None:
        inner = CountingSource(LocalSource(str(tmp_path)))
        source = await ZipSource(inner, archive.name).open()
        assert inner.counters.reads == 1  # tail: end record and central directory at once

        async def reads(path: str, offset: int, size: int, want: bytes) -> int:
            before = inner.counters.reads
            assert await source.read(path, offset, size) == want
            return inner.counters.reads - before

        assert await reads("small", 100, 50, TREE["a.bin"][100:150]) == 1
        assert await reads("small", 0, 5000, TREE["a.bin"]) == 1
        assert await reads("big", 1000, 10, big[1000:1010]) == 2  # local header, then the range
        for offset in (0, 500, 150_000):
            assert await reads("big", offset, 4096, big[offset:offset + 4096]) == 1
        assert await reads("big-whole", 0, len(big), big) == 1
        assert source.counters["local_headers"] == 3
        await source.aclose()

    trio.run(main)


def test_remote_first_read_of_a_large_member_is_one_round_trip(tmp_path: Path) -> None:
    """From an object store (a latency per request, on trio's MockClock), a large member's first ranged
    read sends its local header read and the range at the central directory's offset together: two
    requests, one round trip; a member whose local extra field differs from the central one is read
    again at the right offset, still exact."""
    from tests.support.zips import Member, build

    big = bytes(range(256)) * 800
    # "odd" has an extra field in its local header only: the guess from the central directory is wrong.
    archive = build([Member(b"big", big), Member(b"odd", big, local_extra=b"\x99\x99\x04\x00abcd")])
    store = LatencySource(MemorySource({"remote.zip": archive}), latency=0.25)

    async def main() -> None:
        source = await ZipSource(store, "remote.zip").open()
        # Opening it: its stat and tail (with the central directory) in one request, no stat of its own.
        assert [(r.kind, r.offset) for r in store.log] == [("tail", -zipsource.TAIL)]
        for path in ("big", "odd"):
            store.reset_log()
            start = trio.current_time()
            assert await source.read(path, 70_000, 5000) == big[70_000:75_000]
            assert (len(store.log), store.round_trips()) == ((2, 1) if path == "big" else (3, 2)), (path, store.log)
            assert trio.current_time() - start == store.round_trips() * store.latency
            store.reset_log()
            assert await source.read(path, 1000, 10) == big[1000:1010]
            assert len(store.log) == 1
        await source.aclose()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
