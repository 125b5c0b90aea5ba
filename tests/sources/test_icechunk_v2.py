"""Icechunk spec version 2: the repo info object and manifests with compressed virtual locations, from
Icechunk's committed repositories and crafted field by field; hostile ones (indexes pointing nowhere, every
byte garbled, a bomb of a location, a file called `repo` that is no repo info) end in one line or a
DataError. Deleted tags and branches of both spec versions are never resolved nor listed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio
import trio.testing
import zstandard

from tests.support.flatbuild import U8, U32, U64, Bytes, I32, Struct, Table, Text, Vector, encode
from tests.support.icechunk_repos import HEADER, body_of, reframe
from unshardfs.app.opened import OpenedSource
from unshardfs.sources import LocalSource
from unshardfs.sources.icechunk import IcechunkSource, RefSpec, open_icechunk
from unshardfs.sources.icechunk.format import FILE_MANIFEST, FILE_REPO_INFO, MAGIC, ChunkManifest, encode_id
from unshardfs.sources.icechunk.repoinfo import decode_repo_info
from unshardfs.sources.icechunk.source import IcechunkStore
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.util.errors import ConfigError, DataError

DATA = Path(__file__).resolve().parents[1] / "data" / "icechunk" / "icechunk-python" / "tests" / "data"
ID = [bytes([i]) * 12 for i in range(4)]


def repo_info(snapshots: list[tuple[bytes, int]], branches: list[tuple[str, int]], tags: list[tuple[str, int]] = (),
              deleted: list[str] = (), updates: list[tuple[int, str]] = ()) -> bytes:
    """A repo info body: snapshots (id, parent index), refs (name, snapshot index), deleted tags, and log
    entries (update type, the branch or tag it names)."""
    def ref(name: str, index: int) -> Table:
        return Table({0: Text(name), 1: U32(index)})

    return encode(Table({
        0: U8(2),
        1: Vector([ref(*t) for t in tags]),
        2: Vector([ref(*b) for b in branches]),
        3: Vector([Text(name) for name in deleted]),
        4: Vector([Table({0: Struct(raw), 1: I32(parent), 2: U64(1_700_000_000_000_000 + i), 3: Text(f"commit {i}")})
                   for i, (raw, parent) in enumerate(snapshots)]),
        5: Table({}),
        7: Vector([Table({0: U8(kind), 1: Table({0: Text(name)}), 2: U64(0)}) for kind, name in updates]),
    }))


def decode(body: bytes):
    return decode_repo_info(body, "repo", 10_000, 10_000)


def test_a_crafted_repo_info_decodes():
    info = decode(repo_info([(ID[0], -1), (ID[1], 0), (ID[2], 1)], [("main", 2), ("dev", 1)], [("v1", 1), ("old", 0)],
                            deleted=["old"], updates=[(7, "gone"), (10, "main"), (8, "gone")]))
    assert info.spec_version == 2
    assert info.branches == {"main": ID[2], "dev": ID[1]}
    assert info.tags == {"v1": ID[1]}  # a deleted tag is never a tag
    assert info.deleted_tags == ("old",) and info.deleted_branches == ("gone",)
    assert [(s.parent, s.message) for s in info.snapshots.values()] == [(None, "commit 0"), (ID[0], "commit 1"),
                                                                        (ID[1], "commit 2")]


@pytest.mark.parametrize("body, reason", [
    (repo_info([(ID[0], -1)], [("main", 1)]), "snapshot index 1 outside the 1 snapshots"),
    (repo_info([(ID[0], 5)], [("main", 0)]), "parent index 5 outside the 1 snapshots"),
    (repo_info([(ID[0], -1), (ID[0], 0)], [("main", 0)]), "listed twice"),
    (repo_info([(ID[0], -1)], [("main", 0), ("main", 0)]), "branches 'main' is listed twice"),
    (encode(Table({0: U8(2)})), "required field"),
    (b"\x04\0\0\0", "outside|vtable"),
])
def test_hostile_repo_infos_are_one_line(body, reason):
    with pytest.raises(DataError, match=reason):
        decode(body)


def test_every_single_byte_garbling_of_a_committed_repo_info_is_refused_or_decodes():
    body = body_of((DATA / "test-repo-v2" / "repo").read_bytes())
    decoded = refused = 0
    for i in range(len(body)):
        for flip in (0xFF, 0x80):
            try:
                decode(body[:i] + bytes([body[i] ^ flip]) + body[i + 1:])
                decoded += 1
            except DataError:
                refused += 1
    assert decoded and refused


def _manifest(locations: list[bytes], algorithm: int, dictionary: bytes | None) -> ChunkManifest:
    refs = [Table({0: Vector([i]), 2: U64(10 * i), 3: U64(5), 8: Bytes(packed)}) for i, packed in enumerate(locations)]
    fields = {0: Struct(ID[3]), 1: Vector([Table({0: Struct(b"N" * 8), 1: Vector(refs)})]), 3: U8(algorithm)}
    if dictionary is not None:
        fields[2] = Bytes(dictionary)
    return ChunkManifest(encode(Table(fields)), "manifest")


def test_compressed_virtual_locations():
    """Spec version 2 may store a virtual reference's location zstd-compressed with a dictionary the
    manifest holds (none of the committed repositories does): each decodes to its URL."""
    urls = [f"s3://bucket/data/file-{i:04d}.nc".encode() for i in range(3)]
    dictionary = zstandard.ZstdCompressionDict(b"s3://bucket/data/file-.nc" * 4,
                                              dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    packer = zstandard.ZstdCompressor(dict_data=dictionary)
    manifest = _manifest([packer.compress(u) for u in urls], 1, dictionary.as_bytes())
    found = list(manifest.refs_from(b"N" * 8, ()))
    assert [r.location for r in found] == [u.decode() for u in urls]
    assert [(r.offset, r.length) for r in found] == [(0, 5), (10, 5), (20, 5)]
    plain = _manifest(urls, 0, None)  # compression 0: stored as they are
    assert [r.location for r in plain.refs_from(b"N" * 8, ())] == [u.decode() for u in urls]


@pytest.mark.parametrize("locations, algorithm, dictionary, reason", [
    ([zstandard.ZstdCompressor().compress(b"x" * 100_000)], 1, b"d" * 64, "more than"),  # a bomb of a URL
    ([b"\x28\xb5\x2f\xfd garbage"], 1, b"d" * 64, "bad zstd data"),
    ([b"s3://x"], 1, None, "no location dictionary"),
    ([b"s3://x"], 7, None, "compression 7 is not known"),
    ([b"\xff\xfe"], 0, None, "not UTF-8"),
])
def test_hostile_compressed_locations_fail_their_chunk(locations, algorithm, dictionary, reason):
    manifest = _manifest(locations, algorithm, dictionary)  # the manifest itself opens
    with pytest.raises(DataError, match=reason):
        list(manifest.refs_from(b"N" * 8, ()))


def test_a_file_called_repo_is_no_repository(tmp_path):
    """A dataset directory holding a file `repo` (a script, notes) stays the dataset it is; a repo object
    that is damaged, or not a repo info, is a one-line error where the pipeline names the repository."""
    from unshardfs.testing.samples import write_samples

    write_samples(tmp_path / "s")
    ds = tmp_path / "s" / "precomputed" / "sharded"
    (ds / "repo").write_text("git@example.org:lab/release.git\n")
    session = trio.run(OpenedSource.open, str(ds))
    assert session.dataset.format == "precomputed"
    trio.run(session.aclose)
    (ds / "repo").write_bytes(MAGIC + b"ic-2".ljust(24) + bytes([2, FILE_MANIFEST, 0]) + b"\0" * 40)
    session = trio.run(OpenedSource.open, str(ds))
    assert session.dataset.format == "precomputed"  # an Icechunk object, but no repo info
    trio.run(session.aclose)
    repo = tmp_path / "repo"
    shutil.copytree(DATA / "test-repo-v2", repo)
    good = (repo / "repo").read_bytes()
    for damaged, reason in ((good[:HEADER + 10], "truncated|zstd"),
                            (reframe(good, version=3), "spec version 3"),
                            (reframe(good, body=b"\x04\0\0\0"), "outside|vtable")):
        (repo / "repo").write_bytes(damaged)
        with pytest.raises(ConfigError, match=reason):
            trio.run(OpenedSource.open, f"{repo}|icechunk:")


def test_a_repo_info_bigger_than_the_index_limit_is_refused_before_it_is_read(tmp_path):
    from unshardfs.util.limits import DataLimits

    repo = tmp_path / "repo"
    shutil.copytree(DATA / "test-repo-v2", repo)
    (repo / "repo").write_bytes((repo / "repo").read_bytes() + b"\0" * (3 << 20))
    source = MemorySource.from_directory(repo)
    with pytest.raises(ConfigError, match="more than"):
        trio.run(open_icechunk, source, "", "", None, DataLimits(index_bytes=1 << 20))
    assert source.requests["read"] == 0


@pytest.mark.parametrize("spec", ["v1", "v2"])
def test_deleted_refs_are_never_resolved_nor_listed(spec):
    """Over the object-store stand-in (listed in pages), as on a local disk: the tag `deleted` of both
    spec versions resolves to nothing and is not a version; the others are."""
    root = DATA / f"test-repo-{spec}"

    async def main() -> None:
        for inner in (LocalSource(str(root)),
                      LatencySource(MemorySource.from_directory(root), 0.01, listable=True, page_size=2)):
            store = IcechunkStore(inner)
            assert await store.resolve(RefSpec("tag", "deleted")) is None
            assert await store.resolve(RefSpec("tag", "it works!")) is not None
            assert [str(r) for r in await store.refs()] == ["branch.main", "branch.my-branch", "tag.it also works!",
                                                            "tag.it works!"]
            assert await store.deleted() == (["deleted"], [])
            await inner.aclose()

    trio.run(main)


def test_a_deleted_branch_of_spec_version_1_leaves_an_empty_folder_on_a_disk(tmp_path):
    """Icechunk 1.x deletes a branch by deleting its ref.json; on a local disk the folder stays: the branch
    is not listed, and `inspect` reports it deleted."""
    repo = tmp_path / "repo"
    shutil.copytree(DATA / "test-repo-v1", repo)
    (repo / "refs" / "branch.my-branch" / "ref.json").unlink()

    async def main() -> None:
        source = await open_icechunk(LocalSource(str(repo)), "", "", None, None)
        assert isinstance(source, IcechunkSource)
        names = [v.name for v in await source.versions()]
        assert "branch.my-branch" not in names and "branch.main" in names
        assert await source.store.deleted() == (["deleted"], ["my-branch"])
        assert "  deleted       branch my-branch (not shown)" in await source.summary_lines()
        await source.aclose()

    trio.run(main)


def test_spec_version_2_snapshots_take_their_parents_from_the_repo_info():
    async def main() -> None:
        store = IcechunkStore(LocalSource(str(DATA / "test-repo-v2")))
        info = await store.info()
        assert info is not None and await store.spec_version() == 2
        tip = await store.resolve(RefSpec("branch", "my-branch"))
        assert tip is not None
        seen: dict = {}
        await store.history(tip, seen)
        assert [s.message for s in seen.values()] == ["some more structure", "delete a chunk", "set virtual chunk",
                                                      "fill data", "empty structure", "Repository initialized"]
        assert encode_id(list(seen)[-1]) == "1CECHNKREP0F1RSTCMT0"  # the spec's well-known first snapshot
        await store.inner.aclose()

    trio.run(main)


def test_the_spec_version_is_read_with_the_first_ref_in_one_round_trip():
    """A repository named by the pipeline (no marker says which spec version): `repo` and the spec
    version 1 ref are asked for together, for either version."""
    async def main() -> None:
        for spec in ("v1", "v2"):
            source = LatencySource(MemorySource.from_directory(DATA / f"test-repo-{spec}"), 0.02, listable=True)
            store = IcechunkStore(source)
            assert await store.resolve(RefSpec("branch", "main")) is not None
            assert source.round_trips() == 1, (spec, source.log)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))



