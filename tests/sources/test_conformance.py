"""Every byte source runs the one ByteSource conformance suite (unshardfs.testing.source_conformance):
local directories, plain HTTP, the GCS JSON API stand-in, S3 through moto, the disk-cache and
counting layers, and the in-memory and latency stand-ins the in-process tests use."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.s3 import CREDENTIALS, moto_s3, upload
from unshardfs.sources import CountingSource, LocalSource
from unshardfs.sources.diskcache import DiskCachedSource
from unshardfs.sources.http import HttpOptions, HttpSource
from unshardfs.sources.objectstore import GcsSource, S3Source
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.sources.subdir import SubdirSource
from unshardfs.sources.base import ByteSource, VersionedRead
from unshardfs.testing.source_conformance import TREE, Change, MakeSource, SourceConformance, run, write_tree

# Failures are final at once: a conformance failure must not hide behind retries.
FAST = HttpOptions(retries=0, timeout=10)


class TestLocal(SourceConformance):
    listable, remote = True, False
    in_files = True

    @pytest.fixture
    def make(self, tree: Path) -> MakeSource:
        return lambda: LocalSource(str(tree))


class TestMemory(SourceConformance):
    """The in-memory source shipped for format authors' unit tests keeps the same contract."""

    listable, remote = True, False

    @pytest.fixture
    def source(self) -> MemorySource:
        return MemorySource(TREE)

    @pytest.fixture
    def make(self, source: MemorySource) -> MakeSource:
        return lambda: source

    @pytest.fixture
    def change(self, source: MemorySource) -> Change:
        return lambda path, data: source.remove(path) if data is None else source.put(path, data)


class TestLatency(SourceConformance):
    """The object-store stand-in of the in-process latency tests, as a plain HTTP server (not
    listable; a stat and its tail in one request) and as a bucket listed in pages of two."""

    listable, remote = False, True
    tails = True
    page_size: int | None = None

    @pytest.fixture
    def source(self) -> MemorySource:
        return MemorySource(TREE)

    @pytest.fixture
    def make(self, source: MemorySource) -> MakeSource:
        return lambda: LatencySource(source, 0.001, listable=self.listable, page_size=self.page_size)

    @pytest.fixture
    def change(self, source: MemorySource) -> Change:
        return lambda path, data: source.remove(path) if data is None else source.put(path, data)


class TestLatencyListed(TestLatency):
    listable = True
    page_size = 2


class TestCounting(SourceConformance):
    listable, remote = True, False
    in_files = True

    @pytest.fixture
    def make(self, tree: Path) -> MakeSource:
        return lambda: CountingSource(LocalSource(str(tree)))


class TestDiskCached(SourceConformance):
    listable, remote = True, False
    in_files = True

    @pytest.fixture
    def make(self, tree: Path, tmp_path: Path) -> MakeSource:
        return lambda: DiskCachedSource(LocalSource(str(tree)), str(tmp_path / "index-cache"))


class TestHttp(SourceConformance):
    """A file server whose entity tags are derived from inode, size and mtime (as nginx's and Apache's are):
    a rewrite that puts the mtime back keeps its tag, and no client can see it."""

    listable, remote = False, True
    tails = True
    sees_restored = False
    in_files = True

    @pytest.fixture
    def make(self, tree: Path) -> Iterator[MakeSource]:
        with DatasetServer(tree) as server:
            yield lambda: HttpSource(server.url, FAST)


class TestGcs(SourceConformance):
    """Under a prefix of the bucket, listed in pages of two (page tokens followed)."""

    listable, remote = True, True
    tails = True
    in_files = True

    @pytest.fixture
    def make(self, tree: Path) -> Iterator[MakeSource]:
        with DatasetServer(tree.parent, gcs_bucket="bkt", page_size=2) as server:
            yield lambda: GcsSource("bkt", tree.name, FAST, server.url)


@pytest.fixture(scope="module")
def moto() -> Iterator[tuple[str, Any]]:
    """One S3 emulator for the module, with the credentials S3Source's signer reads when it is made."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in CREDENTIALS.items():
            mp.setenv(name, value)
        with moto_s3() as server:
            yield server


class TestS3(SourceConformance):
    """A bucket per test, the tree under a prefix; objects changed through the S3 API."""

    listable, remote = True, True
    tails = True
    buckets = itertools.count()

    @pytest.fixture
    def bucket(self, tree: Path, moto: tuple[str, Any]) -> str:
        name = f"conformance-{next(self.buckets)}"
        upload(moto[1], name, tree, "data")
        return name

    @pytest.fixture
    def make(self, bucket: str, moto: tuple[str, Any]) -> MakeSource:
        return lambda: S3Source(bucket, "data", FAST, moto[0])

    @pytest.fixture
    def change(self, bucket: str, moto: tuple[str, Any]) -> Change:
        client = moto[1]

        def change(path: str, data: bytes | None) -> None:
            if data is None:
                client.delete_object(Bucket=bucket, Key=f"data/{path}")
            else:
                client.put_object(Bucket=bucket, Key=f"data/{path}", Body=data)

        return change


def nested_tree(tmp_path: Path) -> Path:
    """The suite's tree at `outer/release/em`, with a decoy `a.bin` beside `em/`."""
    outer = tmp_path / "outer"
    write_tree(outer / "release" / "em")
    (outer / "release" / "a.bin").write_bytes(b"not the one below em/")
    return outer / "release" / "em"


class TestSubdir(SourceConformance):
    """A directory of another source (a dataset in a tree of datasets), with a decoy beside it."""

    listable, remote = True, False
    in_files = True

    @pytest.fixture
    def tree(self, tmp_path: Path) -> Path:
        return nested_tree(tmp_path)

    @pytest.fixture
    def make(self, tree: Path) -> MakeSource:
        return lambda: SubdirSource(LocalSource(str(tree.parent.parent)), "release/em")


class OwnedSubdir(SubdirSource):
    """A directory of a source it owns (a tree's dataset leaves the source to the tree: this one closes it)."""

    async def aclose(self) -> None:
        await self.inner.aclose()


class TestSubdirGcs(TestGcs):
    """... and over a bucket's prefix, whose reads say the version they read (`VersionedRead`)."""

    @pytest.fixture
    def tree(self, tmp_path: Path) -> Path:
        return nested_tree(tmp_path)

    @pytest.fixture
    def make(self, tree: Path) -> Iterator[MakeSource]:
        with DatasetServer(tree.parent.parent, gcs_bucket="bkt", page_size=2) as server:
            yield lambda: OwnedSubdir(GcsSource("bkt", "release", FAST, server.url), "em")

    def test_a_versioned_read_is_of_the_object_below_the_directory(self, make: MakeSource) -> None:
        async def work(source: ByteSource) -> None:
            assert isinstance(source, VersionedRead)
            st = await source.stat("a.bin")
            assert st is not None
            data, version = await source.read_versioned("a.bin", 0, st.size)
            assert data == await source.read("a.bin", 0, st.size, st.version) != b"not the one below em/"
            assert version == st.version

        run(make, work)


class TestSubdirLatency(TestLatency):
    """... and over the listed object-store stand-in (a stat with its tail)."""

    listable = True
    page_size = 2

    @pytest.fixture
    def source(self) -> MemorySource:
        return MemorySource({**{f"rel/em/{k}": v for k, v in TREE.items()}, "rel/a.bin": b"decoy"})

    @pytest.fixture
    def make(self, source: MemorySource) -> MakeSource:
        return lambda: SubdirSource(LatencySource(source, 0.001, listable=True, page_size=2), "rel/em")

    @pytest.fixture
    def change(self, source: MemorySource) -> Change:
        return lambda path, data: source.remove(f"rel/em/{path}") if data is None else source.put(f"rel/em/{path}",
                                                                                                  data)
