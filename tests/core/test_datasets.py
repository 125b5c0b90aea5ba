"""A tree of datasets, in process over the node API: a directory (or bucket prefix) that is no dataset
shows its directories, each dataset in place in its unsharded layout and every other file as stored;
detection is lazy, per directory, bounded in depth, memory and round trips; hostile trees are bounded.

The datasets are the samples our own writer makes (a sharded precomputed image, a sharded Zarr v3
array), each with its unsharded twin: what the tree must show in its place, byte for byte."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tracemalloc
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import pytest
import trio
import trio.testing

from unshardfs.app.opened import OpenedSource, OpenOptions
from unshardfs.core.datasets import TREE_DEPTH, DatasetsDir, PendingDir
from unshardfs.sources import LocalSource
from unshardfs.sources.base import ObjectStat, SourceLayer, end_listing
from unshardfs.sources.subdir import SubdirSource
from unshardfs.testing.inprocess import opened, read_file, resolve, walk
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.testing.samples import write_samples
from unshardfs.tools.walk import check
from unshardfs.tree.nodes import DirNode, FileNode
from unshardfs.util.errors import ConfigError
from unshardfs.util.logonce import collect_problems

T = TypeVar("T")
LATENCY = 0.02


def run(main: Callable[[], Awaitable[T]]) -> T:
    """`main` on trio's MockClock: every wait for the source costs no real time."""
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def files_below(root: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A release: em/ (sharded precomputed), cells.zarr/ (sharded Zarr v3), raw/deeper/seg/ (precomputed
    two directories down), README.txt, an empty directory and one of plain files; and the files a tree of
    it must show (the unsharded twins in the datasets' places)."""
    samples = tmp_path_factory.mktemp("samples")
    write_samples(samples)
    root = tmp_path_factory.mktemp("release") / "release"
    root.mkdir()
    shutil.copytree(samples / "precomputed" / "sharded", root / "em")
    shutil.copytree(samples / "zarr" / "sharded", root / "cells.zarr")
    shutil.copytree(samples / "precomputed" / "sharded", root / "raw" / "deeper" / "seg")
    (root / "README.txt").write_text("a release of three datasets\n")
    (root / "empty").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "a.txt").write_text("plain\n")
    want = {"README.txt": b"a release of three datasets\n", "notes/a.txt": b"plain\n",
            **files_below(samples / "precomputed" / "plain", "em/"),
            **files_below(samples / "zarr" / "plain", "cells.zarr/"),
            **files_below(samples / "precomputed" / "plain", "raw/deeper/seg/")}
    return root, want


async def contents(root: DirNode) -> dict[str, bytes]:
    return {path: await read_file(node) for path, node in (await walk(root)).items()}


def test_the_tree_shows_each_dataset_unsharded_in_place(release):
    root, want = release

    async def main() -> None:
        async with opened(str(root)) as session:
            assert session.dataset.format is None  # no one format: a tree of datasets
            assert await contents(session.tree) == want
            empty = await session.tree.lookup("empty")
            assert isinstance(empty, DirNode) and [b async for b in empty.entries()] == []
            # By name alone, no listing: each dataset found on the way.
            node = await resolve(session.tree, "raw/deeper/seg/info")
            assert isinstance(node, FileNode) and await read_file(node) == want["raw/deeper/seg/info"]
            for absent in ("nope", "raw/nope", "em/nope", "..", "raw/..", "em/../README.txt"):
                assert await resolve(session.tree, absent) is None, absent

    trio.run(main)


def test_the_same_tree_from_memory_and_over_a_remote_bucket(release):
    """A source made elsewhere (`OpenedSource.over`), and the object-store stand-in listed in pages."""
    root, want = release

    async def main() -> None:
        for source in (MemorySource.from_directory(root),
                       LatencySource(MemorySource.from_directory(root), LATENCY, listable=True, page_size=3)):
            async with opened(source) as session:
                assert await contents(session.tree) == want

    run(main)


def test_the_same_tree_from_a_gcs_bucket(release):
    """Over the GCS JSON API stand-in, whose object stat knows no prefix: each dataset's root is its
    directory all the same (a Zarr store's hierarchy stats it)."""
    from unshardfs.testing.http_servers import DatasetServer

    root, want = release

    async def main(url: str) -> None:
        async with opened(f"gs://bkt/{root.name}", "--gcs-endpoint", url) as session:
            assert await contents(session.tree) == want

    with DatasetServer(root.parent, gcs_bucket="bkt", page_size=50) as server:
        trio.run(main, server.url)


@pytest.mark.parametrize("directories", [True, False], ids=["with-directory-members", "without"])
def test_a_zip_of_a_release_is_the_same_tree(release, tmp_path, directories):
    """A release zipped (with or without directory members), named as a path or as `ARCHIVE|zip:`: the
    same tree as the release's directory."""
    from unshardfs.testing.zips import zip_tree

    root, want = release
    archive = zip_tree(root, tmp_path / "release.zip", directories=directories)

    async def main() -> None:
        for source in (str(archive), f"{archive}|zip:"):
            async with opened(source) as session:
                assert session.dataset.format is None, source
                assert await contents(session.tree) == want, source
                node = await resolve(session.tree, "raw/deeper/seg/info")
                assert isinstance(node, FileNode) and await read_file(node) == want["raw/deeper/seg/info"]

    trio.run(main)


def test_a_source_that_cannot_hold_a_tree_is_refused_in_one_line(tmp_path):
    """No directory at all (an empty one, a directory of files), or a source that cannot list (a plain
    HTTP server): the one line detection gives, as before."""
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "a.txt").write_text("x")
    (tmp_path / "none").mkdir()

    async def main() -> None:
        for path in (tmp_path / "files", tmp_path / "none"):
            with pytest.raises(ConfigError, match="has neither an info file"):
                await OpenedSource.open(str(path))
        plain_http = LatencySource(MemorySource({"em/info": b"{}", "em/x": b"x"}), LATENCY)
        with pytest.raises(ConfigError, match="has neither"):
            await OpenedSource.over(plain_http)

    run(main)


def test_inspect_lists_the_datasets_found(release):
    root, _ = release

    async def main() -> list[dict[str, object]]:
        session = await OpenedSource.open(str(root))
        try:
            return [await part.report() async for part in session.dataset.inventory()]
        finally:
            await session.aclose()

    reports = trio.run(main)
    found = [(r["key"], r["format"]) for r in reports if r["kind"] == "dataset"]
    assert found == [("cells.zarr", "zarr"), ("em", "precomputed"), ("raw/deeper/seg", "precomputed")]
    sharded = [r["key"] for r in reports if r["kind"] != "dataset"]
    assert sharded == ["cells.zarr/em", "em/8_8_40", "em/16_16_80", "raw/deeper/seg/8_8_40",
                       "raw/deeper/seg/16_16_80"]
    assert all(r["chunks"] > 0 for r in reports if r["kind"] != "dataset")


def test_depth_bounds_where_datasets_are_looked_for(release):
    """`depth` directories below SOURCE are shown; raw/deeper/seg is 3 deep."""
    root, want = release

    async def main() -> None:
        session = await OpenedSource.open(str(root), OpenOptions(depth=2))
        try:
            with collect_problems() as problems:
                shown = await contents(session.tree)
            assert shown == {k: v for k, v in want.items() if not k.startswith("raw/")}
            assert await resolve(session.tree, "raw/deeper") is not None
            assert await resolve(session.tree, "raw/deeper/seg") is None
            assert problems == ["raw/deeper/seg/: deeper than 2 directories below the source: not shown "
                                "(nor any directory as deep)"]
            parts = [await p.report() async for p in session.dataset.inventory()]
            assert [r["key"] for r in parts if r["kind"] == "dataset"] == ["cells.zarr", "em"]
        finally:
            await session.aclose()

    trio.run(main)


def test_a_dataset_that_cannot_be_opened_is_shown_as_stored(release, tmp_path):
    """Damaged metadata of one dataset: that directory as stored, the rest of the tree as usual, the
    reason logged once and listed by `inspect`; a check of the tree reports it."""
    root, want = release
    copy = tmp_path / "release"
    shutil.copytree(root, copy)
    (copy / "em" / "info").write_text("{not json")

    async def main() -> None:
        session = await OpenedSource.open(str(copy))
        try:
            with collect_problems() as problems:
                shown = await contents(session.tree)
                summary = await check(session.tree)
            assert shown == {**{k: v for k, v in want.items() if not k.startswith("em/")},
                             **files_below(copy / "em", "em/")}
            assert len(problems) == 1 and problems[0].startswith("em/: shown as stored: ")
            assert not summary.failures
            parts = [await p.report() async for p in session.dataset.inventory()]
            assert [(r["kind"], r["key"]) for r in parts if "reason" in r] == [("shown as stored", "em")]
        finally:
            await session.aclose()

    trio.run(main)


def test_a_dataset_inside_a_dataset_is_shown_as_the_outer_one_shows_it(release, tmp_path):
    root, want = release
    copy = tmp_path / "release"
    shutil.copytree(root, copy)
    shutil.copytree(root / "cells.zarr", copy / "em" / "inner.zarr")

    async def main() -> None:
        async with opened(str(copy)) as session:
            shown = await contents(session.tree)
            assert {k: v for k, v in shown.items() if not k.startswith("em/inner.zarr/")} == want
            # precomputed shows what its info does not name as stored: the Zarr shards as they are
            assert {k for k in shown if k.startswith("em/inner.zarr/")} == set(files_below(copy / "em" / "inner.zarr",
                                                                                         "em/inner.zarr/"))

    trio.run(main)


def test_format_options_apply_to_the_datasets_of_their_format(release):
    """`--view zarr2` shows the Zarr arrays as v2 and leaves the precomputed datasets alone (a single
    precomputed SOURCE refuses it)."""
    root, want = release

    async def main() -> None:
        async with opened(str(root), "--view", "zarr2") as session:
            shown = await contents(session.tree)
            assert {k: v for k, v in shown.items() if not k.startswith("cells.zarr/")} == \
                {k: v for k, v in want.items() if not k.startswith("cells.zarr/")}
            assert json.loads(shown["cells.zarr/.zgroup"]) == {"zarr_format": 2}
            assert json.loads(shown["cells.zarr/em/.zarray"])["zarr_format"] == 2
        with pytest.raises(ConfigError, match="applies to Zarr v3 stores only"):
            await OpenedSource.open(str(root / "em"), OpenOptions(formats=(await _view_zarr2()).formats))

    trio.run(main)


async def _view_zarr2() -> OpenOptions:
    from unshardfs.app.options import open_options
    from unshardfs.testing.inprocess import options_parser

    return open_options(options_parser().parse_args(["--view", "zarr2"]))


# -- hostile trees -------------------------------------------------------------------------------


def test_symlink_loops_end(release, tmp_path):
    """A directory that links to itself or to an ancestor is not shown below itself (a local disk)."""
    root, want = release
    copy = tmp_path / "release"
    shutil.copytree(root, copy, symlinks=True)
    os.symlink(".", copy / "self")
    os.symlink("..", copy / "notes" / "up")
    os.symlink("../..", copy / "raw" / "deeper" / "top")

    async def main() -> None:
        async with opened(str(copy)) as session:
            with collect_problems() as problems:
                shown = await contents(session.tree)
            assert shown == want
            assert sorted(problems) == [f"{p}/: a directory that holds itself (a symlink loop): not shown"
                                        for p in ("notes/up", "raw/deeper/top", "self")]
            assert await resolve(session.tree, "self") is None and await resolve(session.tree, "notes/up") is None

    trio.run(main)


class Hostile(SourceLayer):
    """A listing that offers names no path may hold (a store's keys are anybody's strings), and the
    ones lookups must refuse."""

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        if not path:
            for name in ("..", ".", "a/b", "nul\0", ""):
                yield name, ObjectStat(0, 0, True)
        listing = self.inner.list(path)
        try:
            async for item in listing:
                yield item
        finally:
            await end_listing(listing)


def test_names_that_climb_are_never_shown(release):
    root, want = release

    async def main() -> None:
        stored = MemorySource({**{f"rel/{k}": v for k, v in files_below(root).items()}, "outside": b"o"})
        async with opened(Hostile(SubdirSource(stored, "rel"))) as session:
            with collect_problems() as problems:
                assert await contents(session.tree) == {k: v for k, v in want.items()}
            assert problems == ["./: skipping name '..' is not a file name", "./: skipping name '.' is not a file name",
                                "./: skipping name 'a/b' contains '/' or NUL",
                                "./: skipping name 'nul\\x00' contains '/' or NUL", "./: skipping name '' is not a file name"]
            for name in ("..", ".", "a/b", "", "../outside", "nul\0"):
                assert await session.tree.lookup(name) is None, name

    trio.run(main)


class ManyDirectories(SourceLayer):
    """`count` empty directories beside what `inner` holds, listed lazily; what is asked of them counted."""

    def __init__(self, inner: MemorySource, count: int) -> None:
        super().__init__(inner)
        self.count = count
        self.asked: list[str] = []

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        if path:
            self.asked.append(path)
        listing = self.inner.list(path)
        try:
            async for item in listing:
                yield item
        finally:
            await end_listing(listing)
        if not path:
            empty = ObjectStat(0, 0, True)
            for i in range(self.count):
                yield f"d{i:07d}", empty

    def _empty(self, path: str) -> bool:
        return path[:1] == "d" and path[1:8].isdigit() and int(path[1:8]) < self.count

    async def stat(self, path: str) -> ObjectStat | None:
        if self._empty(path[:8]):
            self.asked.append(path)
            return ObjectStat(0, 0, True) if len(path) == 8 else None
        return await self.inner.stat(path)

    async def stat_dir(self, path: str) -> ObjectStat | None:
        st = await self.stat(path)
        return st if st is not None and st.is_dir else None


def test_a_million_empty_directories_list_in_bounded_memory(release):
    """Listing a root of 10^6 directories looks into none of them, in batches, and holds no more than
    a batch: what the last 10^5 entries allocate stays within a few MB (holding each would take tens);
    looking one up looks into that one only."""
    root, _ = release
    source = ManyDirectories(MemorySource.from_directory(root), 1_000_000)

    async def main() -> None:
        async with opened(source) as session:
            count = biggest = peak = 0
            try:
                async for batch in session.tree.entries():
                    count += len(batch)
                    biggest = max(biggest, len(batch))
                    assert all(not isinstance(node, DirNode) or isinstance(node, PendingDir) for _, node in batch)
                    if count >= 900_000 and not tracemalloc.is_tracing():
                        tracemalloc.start()
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert count == 1_000_005 and biggest <= 1024  # (a MemorySource holds no empty directory)
            assert 0 < peak < 4 << 20, peak
            assert source.asked == []  # no directory looked into while listing
            node = await session.tree.lookup("d0500000")
            assert isinstance(node, DatasetsDir) and [b async for b in node.entries()] == []
            assert source.asked and {path[:8] for path in source.asked} == {"d0500000"}

    trio.run(main)


def test_a_bucket_of_1e5_prefixes_costs_bounded_round_trips(release):
    """Over the object-store stand-in (20 ms a request, 1,000 names a listing page) a bucket of 10^5
    prefixes, one of them holding a dataset: opening it costs 3 round trips (the root's probes, one
    page for a bare WKW layer's mags, one page for a directory to show), a listing of the root one
    request per page and no other, and a lookup of the dataset two levels down two round trips per
    directory before its metadata."""
    root, want = release
    files = {f"p{i:06d}/x.bin": b"x" for i in range(100_000)}
    files.update({f"p050000/em/{k}": v for k, v in files_below(root / "em").items()})
    source = LatencySource(MemorySource(files), LATENCY, listable=True, page_size=1000)

    async def main() -> None:
        async with opened(source) as session:
            assert source.round_trips() == 3 and source.counts()["list"] == 2
            source.reset_log()
            listed = 0
            async for batch in session.tree.entries():
                listed += len(batch)
            assert listed == 100_000 and dict(source.counts()) == {"list": 100}
            source.reset_log()
            info = await resolve(session.tree, "p050000/em/info")
            assert isinstance(info, FileNode) and await read_file(info) == want["em/info"]
            # p050000: its probes with its stat, a page for mags; em: the same; then its info.
            assert source.round_trips() == 5, source.log
            source.reset_log()
            await resolve(session.tree, "p050000/em/info")
            assert source.round_trips() == 0  # the directories are known, the file's stat kept by the client

    run(main)


def test_a_tree_walk_declares_each_sharded_directory(release):
    """A check of the tree over the object-store stand-in reads each dataset's chunks ahead as a check
    of that dataset alone does (`DirNode.will_read_all` reaches the datasets' directories): the same
    round trips, and the same wait (without the declaration: 15 instead of 11)."""
    root, _ = release

    def cost(source_root: Path, prefix: str) -> tuple[int, float]:
        source = LatencySource(MemorySource.from_directory(source_root), LATENCY, listable=True)

        async def main() -> tuple[int, float]:
            async with opened(source) as session:
                node = await resolve(session.tree, prefix) if prefix else session.tree
                assert isinstance(node, DirNode)
                source.reset_log()
                began = trio.current_time()
                summary = await check(node)
                assert not summary.failures and summary.files == 61
                return source.round_trips(), round((trio.current_time() - began) / LATENCY, 6)

        return run(main)

    alone = cost(root / "em", "")
    assert alone == (11, 11.0)
    assert cost(root, "em") == alone


def test_tree_datasets_never_share_cached_bytes(tmp_path):
    """Two datasets of one tree with the same shard paths and sizes, but other bytes, behind a store
    whose validators repeat (a server's weak ETags: the size alone): each shows its own chunks, however
    the caches, the read path and the index cache key what they keep."""
    from tests.support.latency import SCALE
    from unshardfs.testing.precomputed import write_volume

    a = write_volume(tmp_path / "a", [SCALE], "uint8", seed=1)
    b = write_volume(tmp_path / "b", [SCALE], "uint8", seed=2)
    shards = files_below(a["sharded"])
    assert {k: len(v) for k, v in shards.items()} == {k: len(v) for k, v in files_below(b["sharded"]).items()}
    assert shards != files_below(b["sharded"])

    class WeakValidators(MemorySource):
        async def stat(self, path: str) -> ObjectStat | None:
            st = await super().stat(path)
            return st if st is None or st.is_dir else ObjectStat(st.size, 0, False, ("weak", st.size))

        async def read(self, path: str, offset: int, size: int, version: tuple[object, ...] | None = None) -> bytes:
            return await super().read(path, offset, size, None)

    files = {**{f"a/{k}": v for k, v in shards.items()}, **{f"b/{k}": v for k, v in files_below(b["sharded"]).items()}}
    for remote in (False, True):
        store: MemorySource | LatencySource = WeakValidators(files)
        if remote:
            store = LatencySource(store, LATENCY, listable=True)

        async def main() -> None:
            async with opened(store) as session:
                for name, twin in (("a", a), ("b", b), ("a", a)):
                    node = await resolve(session.tree, name)
                    assert isinstance(node, DirNode)
                    assert await contents(node) == files_below(twin["plain"]), (name, remote)

        run(main)


def test_more_datasets_than_are_kept_open(release):
    """A tree of more datasets than stay open at once: each shows its tree whenever it is used again
    (opened again, not mixed with another)."""
    from unshardfs.core.datasets import OPEN_DATASETS

    root, want = release
    zarr = {k[len("cells.zarr/"):]: v for k, v in want.items() if k.startswith("cells.zarr/")}
    stored = files_below(root / "cells.zarr")
    count = OPEN_DATASETS + 6
    source = MemorySource({f"d{i:03d}/{k}": v for i in range(count) for k, v in stored.items()})

    async def main() -> None:
        async with opened(source) as session:
            for i in [*range(count), 0, 1, count - 1]:
                node = await resolve(session.tree, f"d{i:03d}")
                assert isinstance(node, DirNode) and await contents(node) == zarr, i

    trio.run(main)
