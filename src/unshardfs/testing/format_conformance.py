"""What every format must do on a real FUSE mount, as one suite each format inherits.

A format's test module (ours or a third party's: this ships in the package)
subclasses `FormatConformance` and provides a module-scoped `case` fixture
(datasets are written once) from its own dataset writer: the sharded source, its unsharded twin, a way to damage
one shard, and the chunk files of one index table. The suite then checks
that

- the mount equals the unsharded twin, byte for byte;
- after damage the affected files fail with EIO (or are absent), every
  other file is still exact, the damage is logged, and the daemon serves on;
- every file can be found by name in a fresh mount before any listing;
- once a table is cached, each further chunk of it costs one backing read;

each on every engine and transport the machine offers (the kernel engine
over /dev/fuse and over io_uring, with passthrough, and pyfuse3).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest
import trio

from unshardfs.testing.inprocess import opened, read_file, resolve, walk
from unshardfs.testing.mounts import MountFn
from unshardfs.testing.setups import SETUPS, mounting_with
from unshardfs.testing.trees import assert_same_file, assert_same_tree, walk_files
from unshardfs.tree.edge import classify
from unshardfs.tree.nodes import FileNode


@dataclass(frozen=True)
class Damaged:
    shard: Path  # the damaged shard file (its name must appear in the log)
    files: frozenset[str]  # twin-relative paths of the files whose bytes lived there


@dataclass
class FormatCase:
    sharded: Path  # the source to mount (never modified: damage goes to a copy)
    twin: Path  # the same data as an unsharded writer lays it out
    # Damages one shard of a copy of `sharded` (given its root).
    damage: Callable[[Path], Damaged]
    # Twin-relative paths of chunk files stored in one index table (a minishard, a shard).
    same_table: list[str]
    args: tuple[str, ...] = ()  # mount options the format needs
    json_files: tuple[str, ...] = ()  # metadata files compared as parsed JSON
    absent: list[str] = field(default_factory=list)  # names of the computed form with no chunk


class FormatConformance:
    """Inherit, and provide a `case` fixture returning a `FormatCase`; the tests mount through FUSE
    (the `unshardfs` of this interpreter, with its entry points)."""

    @pytest.fixture(params=SETUPS, ids=lambda setup: setup.name)
    def mount(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MountFn]:
        """Mounts served by each engine and transport in turn (`unshardfs.testing.setups`); a setup
        this machine cannot offer is skipped, one it offers must be granted."""
        yield from mounting_with(request.param, tmp_path)

    def test_mount_equals_unsharded_twin(self, case: FormatCase, mount: MountFn) -> None:
        m = mount(case.sharded, *case.args)
        assert assert_same_tree(m.path, case.twin, case.json_files) >= len(case.same_table)

    def test_lookup_without_listing(self, case: FormatCase, mount: MountFn) -> None:
        """Every file (and directory on the way) found by name alone in a fresh mount."""
        m = mount(case.sharded, *case.args)
        for rel, path in walk_files(case.twin).items():
            assert_same_file(m.path / rel, path, rel, case.json_files)
        for rel in case.absent:
            assert not (m.path / rel).exists(), rel

    def test_damage_fails_only_the_damaged_shard(self, case: FormatCase, mount: MountFn, tmp_path: Path) -> None:
        source = tmp_path / "damaged"
        shutil.copytree(case.sharded, source)
        damaged = case.damage(source)
        assert damaged.files, "the damage must hit some files"
        m = mount(source, *case.args)
        want = walk_files(case.twin)
        listed = set(walk_files(m.path))
        assert set(want) - damaged.files <= listed <= set(want)
        failed = 0
        for rel, path in want.items():
            if rel not in damaged.files:
                assert_same_file(m.path / rel, path, rel, case.json_files)
                continue
            try:
                (m.path / rel).read_bytes()
            except FileNotFoundError:
                assert rel not in listed, rel
                continue
            except OSError as e:
                assert e.errno == errno.EIO, (rel, e)
                failed += 1
                continue
            raise AssertionError(f"{rel} lives in the damaged shard, yet it was read")
        assert failed, "damage must surface as EIO, not vanish silently"
        assert damaged.shard.name in m.log_text()
        assert os.path.ismount(m.path)
        rel = next(rel for rel in want if rel not in damaged.files)
        assert_same_file(m.path / rel, want[rel], rel, case.json_files)  # still serving

    def test_one_backing_read_per_further_chunk(self, case: FormatCase, mount: MountFn) -> None:
        """The first chunk of a table reads its shard's indexes; every further chunk just its bytes.
        (No read-ahead: it would fetch the later chunks of a recognised scan early.)"""
        m = mount(case.sharded, *case.args, "--no-read-ahead")
        first, *rest = case.same_table
        assert len(rest) >= 2, "a table of at least three chunks"
        assert_same_file(m.path / first, case.twin / first, first)
        for rel in rest:
            before = m.stats()["source"]["reads"]
            assert_same_file(m.path / rel, case.twin / rel, rel)
            assert m.stats()["source"]["reads"] - before == 1, rel


def _same_bytes(got: bytes, want: Path, rel: str, json_files: tuple[str, ...]) -> None:
    if rel in json_files or rel.endswith("/info") or rel == "info":
        assert json.loads(got) == json.loads(want.read_bytes()), rel
    else:
        assert got == want.read_bytes(), rel


class InProcessConformance:
    """The same checks over the node API, in this process (no mount): inherit beside
    `FormatConformance` with the same `case` fixture. What each test opens is what `mount` with
    `case.args` would serve; the kernel's part (page cache, request sizes) is the mounted suite's."""

    in_process = True  # no mount, whatever else the test module imports

    def test_tree_equals_unsharded_twin(self, case: FormatCase) -> None:
        async def main() -> None:
            async with opened(str(case.sharded), *case.args) as source:
                got = await walk(source.tree)
                want = walk_files(case.twin)
                assert sorted(got) == sorted(want), (
                    f"missing: {sorted(set(want) - set(got))[:10]} extra: {sorted(set(got) - set(want))[:10]}")
                for rel, node in got.items():
                    assert node.size == len(await read_file(node)), rel
                    _same_bytes(await read_file(node), want[rel], rel, case.json_files)
                assert len(want) >= len(case.same_table)

        trio.run(main)

    def test_lookup_without_listing(self, case: FormatCase) -> None:
        async def main() -> None:
            async with opened(str(case.sharded), *case.args) as source:
                for rel, path in walk_files(case.twin).items():
                    node = await resolve(source.tree, rel)
                    assert isinstance(node, FileNode), rel
                    _same_bytes(await read_file(node), path, rel, case.json_files)
                for rel in case.absent:
                    assert await resolve(source.tree, rel) is None, rel

        trio.run(main)

    def test_damage_fails_only_the_damaged_shard(self, case: FormatCase, tmp_path: Path) -> None:
        source_dir = tmp_path / "damaged"
        shutil.copytree(case.sharded, source_dir)
        damaged = case.damage(source_dir)
        assert damaged.files, "the damage must hit some files"

        async def main() -> int:
            failed = 0
            async with opened(str(source_dir), *case.args) as source:
                for rel, path in walk_files(case.twin).items():
                    try:
                        node = await resolve(source.tree, rel)
                        if node is None:
                            assert rel in damaged.files, f"{rel} is absent, yet its shard is whole"
                            continue
                        assert isinstance(node, FileNode), rel
                        data = await read_file(node)
                    except Exception as e:  # what a front end would answer: EIO for a known cause
                        failure = classify(e)
                        assert rel in damaged.files and not failure.bug, (rel, failure.message)
                        failed += 1
                        continue
                    assert rel not in damaged.files, f"{rel} lives in the damaged shard, yet it was read"
                    _same_bytes(data, path, rel, case.json_files)
            return failed

        assert trio.run(main), "damage must surface as an error, not vanish silently"

    def test_one_backing_read_per_further_chunk(self, case: FormatCase) -> None:
        async def main() -> None:
            async with opened(str(case.sharded), *case.args, "--no-read-ahead") as source:
                first, *rest = case.same_table
                assert len(rest) >= 2, "a table of at least three chunks"
                node = await resolve(source.tree, first)
                assert isinstance(node, FileNode)
                _same_bytes(await read_file(node), case.twin / first, first, ())
                for rel in rest:
                    before = source.source.counters.reads
                    node = await resolve(source.tree, rel)
                    assert isinstance(node, FileNode), rel
                    _same_bytes(await read_file(node), case.twin / rel, rel, ())
                    assert source.source.counters.reads - before == 1, rel

        trio.run(main)
