"""Icechunk's own committed repositories of both spec versions (tests/data/icechunk), read without a
mount: the same branches and tags holding the same trees in spec version 1 and 2, each what the
generating test (`test_can_read_old.py`) says it wrote; the deleted tag and the deleted branches not
shown, and `inspect` saying they were deleted.

icechunk 2.x needs Python 3.12 or later, which the tests cannot count on: these committed repositories,
and the test that wrote them, are the reference."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import trio

from unshardfs.app.opened import OpenedSource, OpenOptions
from unshardfs.sources.base import VersionedSource
from unshardfs.testing.inprocess import read_file, walk
from unshardfs.testing.mounts import run_cli
from unshardfs.util.errors import ConfigError, DataError

DATA = Path(__file__).resolve().parents[1] / "data" / "icechunk" / "icechunk-python" / "tests" / "data"
REFS = ["branch.main", "branch.my-branch", "tag.it also works!", "tag.it works!"]
SPEC = ["v1", "v2"]
# The messages of test_can_read_old.py's commits, oldest first (`write_a_test_repo`).
TEST_HISTORY = ["Repository initialized", "empty structure", "fill data", "set virtual chunk", "delete a chunk",
                "some more structure"]
SPLIT_HISTORY = ["Repository initialized", "empty structure", "write data", "write data again",
                 "write data again with more splits"]
# The one virtual chunk (`s3://testbucket/can_read_old/chunk-1`): outside the repository, never read.
VIRTUAL = "group1/big_chunks/c/0/0"

pytestmark = pytest.mark.filterwarnings("ignore:fs .* was not created with `asynchronous=True`")


def group(source: str) -> Any:
    """The Zarr hierarchy `source` shows, as zarr-python 3 reads it through the `unshard` filesystem."""
    import fsspec
    import zarr
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

    fs = fsspec.filesystem("unshard", source=source)
    return zarr.open_group(zarr.storage.FsspecStore(AsyncFileSystemWrapper(fs), read_only=True, path=""), mode="r")


def tree(source: str) -> tuple[dict[str, bytes], set[str]]:
    """Every file `source` shows with its bytes (one version: no `@NAME/` beside it), and the files that
    cannot be read."""
    async def main() -> tuple[dict[str, bytes], set[str]]:
        session = await OpenedSource.open(source, OpenOptions(versions=False))
        try:
            shown: dict[str, bytes] = {}
            failed: set[str] = set()
            for path, node in (await walk(session.tree)).items():
                try:
                    shown[path] = await read_file(node)
                except DataError:
                    failed.add(path)
            return shown, failed
        finally:
            await session.aclose()

    return trio.run(main)


def metadata(data: bytes) -> object:
    """A zarr.json as zarr-python means it: the repositories' metadata was written by two zarr-python
    releases, which spell a few defaults differently (`"consolidated_metadata": null` written or left
    out; the `bytes` codec of a one-byte type with its `endian` or without)."""
    doc = json.loads(data)
    doc = {k: v for k, v in doc.items() if v is not None}
    for codec in doc.get("codecs", []):
        if codec.get("name") == "bytes" and codec.get("configuration", {}).get("endian") == "little":
            codec.pop("configuration")
    return doc


def same_tree(a: tuple[dict[str, bytes], set[str]], b: tuple[dict[str, bytes], set[str]]) -> None:
    """The same files: chunks byte for byte, metadata as zarr-python reads it; the same ones unreadable."""
    assert sorted(a[0]) == sorted(b[0]) and a[1] == b[1]
    for path, data in a[0].items():
        if path.endswith("zarr.json"):
            assert metadata(data) == metadata(b[0][path]), path
        else:
            assert data == b[0][path], path


def versions(root: Path) -> list[str]:
    async def main() -> list[str]:
        session = await OpenedSource.open(str(root))
        try:
            store = session.versioned
            assert isinstance(store, VersionedSource)
            return [v.name for v in await store.versions()]
        finally:
            await session.aclose()

    return trio.run(main)


def test_the_same_refs_in_both_spec_versions():
    for spec in SPEC:
        names = versions(DATA / f"test-repo-{spec}")
        assert names[:4] == REFS, spec  # branches, then tags; the deleted tag is not one
        assert len(names) == 4 + len(TEST_HISTORY), spec  # then every snapshot of their histories


@pytest.mark.parametrize("ref", REFS)
def test_the_same_trees_in_both_spec_versions(ref):
    """Each branch and tag holds the same files in spec versions 1 and 2: its chunk objects and inline
    chunks byte for byte, its metadata as zarr-python reads it; the virtual chunk outside the repository is
    refused in both."""
    v1, v2 = (tree(f"{DATA / f'test-repo-{spec}'}|icechunk:@{ref}/") for spec in SPEC)
    same_tree(v1, v2)
    assert VIRTUAL in v1[1] and len(v1[0]) > 5, v1[0].keys()


@pytest.mark.parametrize("spec", SPEC)
def test_what_the_generating_test_wrote(spec):
    root = DATA / f"test-repo-{spec}"
    mine = group(f"{root}|icechunk:@branch.my-branch/")
    assert sorted(mine.group_keys()) == ["group1", "group2"]
    assert dict(mine["group1"].attrs) == {"this": "is a nice group", "icechunk": 1, "size": 42.0}
    # the last chunk was deleted on my-branch (the fill value, 8, shows); main still has it
    assert mine["group1/small_chunks"][...].tolist() == [84, 84, 84, 84, 8]
    assert group(f"{root}|icechunk:@branch.main/")["group1/small_chunks"][...].tolist() == [84] * 5
    assert group(f"{root}|icechunk:@tag.it works!/")["group1/small_chunks"][...].tolist() == [84, 84, 84, 84, 8]
    big = mine["group1/big_chunks"]
    assert big[5:, :].tolist() == [[42.0] * 10] * 5 and big[:5, 5:].tolist() == [[42.0] * 5] * 5
    inner = mine["group2/group3/group4/group5/inner"]
    assert inner.shape == (10, 10) and all(math.isnan(v) for row in inner[...].tolist() for v in row)
    assert "group2" not in group(f"{root}|icechunk:@tag.it works!/").group_keys()


@pytest.mark.parametrize("spec", SPEC)
def test_the_virtual_chunk_where_the_generating_test_puts_it(spec):
    """The generating test writes `group1/big_chunks/c/0/1`'s bytes to `s3://testbucket/can_read_old/chunk-1`
    (its virtual chunk) and reads `big_chunks` as 42.0 everywhere: with that prefix allowed and those bytes
    there, the virtual chunk is those bytes in both spec versions, on every ref holding it; only the
    allowed prefix is opened, once."""
    from unshardfs.sources import LocalSource
    from unshardfs.sources.icechunk import IcechunkOptions, open_icechunk
    from unshardfs.testing.memory import MemorySource

    root = DATA / f"test-repo-{spec}"
    chunk = tree(f"{root}|icechunk:@branch.main/")[0]["group1/big_chunks/c/0/1"]
    opened: list[str] = []

    def open_url(url: str) -> MemorySource:
        opened.append(url)
        return MemorySource({"can_read_old/chunk-1": chunk})

    async def main() -> None:
        for ref in REFS:
            source = await open_icechunk(LocalSource(str(root)), "", "", ref, None, url=f"file://{root}",
                                         options=IcechunkOptions(("s3://testbucket/",)), open_url=open_url)
            try:
                assert await source.read(VIRTUAL, 0, 1 << 20) == chunk, ref
            finally:
                await source.aclose()
                await source.store.inner.aclose()

    trio.run(main)
    assert opened == ["s3://testbucket/"] * len(REFS)


@pytest.mark.parametrize("spec", SPEC)
def test_split_manifests_in_every_version(spec):
    """The repository written with manifest splitting: every commit's values, by the commits' order."""
    root = DATA / f"split-repo-{spec}"
    snapshots = [n for n in versions(root) if "." not in n]
    assert len(snapshots) == len(SPLIT_HISTORY)
    for name, (split, small) in zip(snapshots[2:], [(120, 0), (12, 1), (14, 3)]):
        hierarchy = group(f"{root}|icechunk:@{name}/")
        assert hierarchy["group1/split"][...].tolist() == [[float(split)] * 10] * 10, (spec, name)
        assert hierarchy["group1/small_chunks"][...].tolist() == [small] * 5, (spec, name)
    empty = group(f"{root}|icechunk:@{snapshots[1]}/")
    assert all(math.isnan(v) for row in empty["group1/split"][...].tolist() for v in row)


@pytest.mark.parametrize("spec", SPEC)
def test_a_deleted_tag_is_not_shown(spec):
    root = DATA / f"test-repo-{spec}"
    with pytest.raises(ConfigError, match="no tag.deleted"):
        trio.run(OpenedSource.open, f"{root}|icechunk:@tag.deleted/")
    report = run_cli("inspect", "-q", str(root))
    assert report.returncode == 0, report.stderr
    assert "@tag.deleted" not in report.stdout
    assert "  deleted       tag deleted (not shown)" in report.stdout.splitlines(), report.stdout


@pytest.mark.parametrize("repo, deleted", [("expire-repo-v1-by-1.1.21", None),
                                           ("expire-repo-v2-by-2.0.5", "branches doomed1, doomed2")])
def test_deleted_branches_are_not_shown(repo, deleted):
    """Two rounds of expiration deleted branches doomed1 and doomed2 (generate_expired_repos.py): neither
    is shown; spec version 2 keeps their names in its log, which `inspect` reports."""
    root = DATA / repo
    names = versions(root)
    assert [n for n in names if "." in n] == ["branch.feature", "branch.main", "tag.protect-b"]
    data = group(str(root))["group1/data"]
    assert (data[0, 0], data[5, 0], data[8, 0], data[11, 0]) == (99, 5, 8, 0)
    assert set(group(str(root))["group1/small"][...].ravel().tolist()) == {0}
    report = run_cli("inspect", "-q", str(root)).stdout
    if deleted is None:
        assert "  deleted" not in report
    else:
        assert f"  deleted       {deleted} (not shown)" in report.splitlines(), report


def test_the_trees_of_a_tree_of_repositories(tmp_path):
    """A directory holding repositories of both spec versions: each shown in place (branch main)."""
    import shutil

    for spec in SPEC:
        shutil.copytree(DATA / f"split-repo-{spec}", tmp_path / "release" / spec / "repo")
    hierarchy = group(str(tmp_path / "release" / "v2" / "repo"))
    assert hierarchy["group1/small_chunks"][...].tolist() == [3] * 5
    shown, failed = tree(str(tmp_path / "release"))
    assert not failed
    for spec in SPEC:
        assert f"{spec}/repo/group1/split/zarr.json" in shown
    v1 = {k.removeprefix("v1/"): v for k, v in shown.items() if k.startswith("v1/")}
    v2 = {k.removeprefix("v2/"): v for k, v in shown.items() if k.startswith("v2/")}
    same_tree((v1, set()), (v2, set()))
    assert len(v1) > 20


def test_inspect_of_a_tree_of_repositories_names_what_they_deleted(tmp_path):
    """Each repository of a tree is listed as a dataset with what `inspect` says of it alone: its
    versions, its spec version and the tag it deleted."""
    import shutil

    for spec in SPEC:
        shutil.copytree(DATA / f"test-repo-{spec}", tmp_path / "release" / spec)
    root = tmp_path / "release"
    report = run_cli("inspect", "-q", str(root))
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert lines[0] == f"{root}: a tree of 2 datasets, 0 sharded directories"
    for spec in SPEC:
        at = lines.index(f"{spec}/  (dataset: Zarr v3)")
        store = lines[at + 1:lines.index("", at)] if "" in lines[at:] else lines[at + 1:]
        assert store[0] == f"  versions      {4 + len(TEST_HISTORY)} in {root / spec}|icechunk: (@branch.main shown)"
        assert any(f"; spec version {spec[1]}; " in line for line in store), store
        assert "  deleted       tag deleted (not shown)" in store, store
    parts = json.loads(run_cli("inspect", "--json", str(root)).stdout)
    assert [(p["key"], p["kind"], "  deleted       tag deleted (not shown)" in p["store"]) for p in parts] == \
        [("v1", "dataset", True), ("v2", "dataset", True)]


@pytest.mark.parametrize("spec", SPEC)
def test_versions_as_directories_of_a_mount(spec, mount):
    """Mounted, each spec version shows branch main at the root and every branch, tag and snapshot as a
    directory beside it, the deleted tag not among them; the same files in each as read without a mount."""
    import os

    m = mount(DATA / f"test-repo-{spec}")
    names = sorted(os.listdir(m.path))
    assert [n for n in names if not n.startswith("@")] == ["group1", "zarr.json"]
    assert [n for n in names if n.startswith("@") and "." in n] == [f"@{ref}" for ref in REFS]
    assert len([n for n in names if n.startswith("@")]) == len(REFS) + len(TEST_HISTORY)
    shown, _ = tree(f"{DATA / f'test-repo-{spec}'}|icechunk:@tag.it also works!/")
    for path, data in shown.items():
        assert (m.path / "@tag.it also works!" / path).read_bytes() == data, path
    assert not (m.path / "@tag.deleted").exists()
    with pytest.raises(OSError):
        (m.path / "@tag.it also works!" / VIRTUAL).read_bytes()  # EIO: outside the repository
