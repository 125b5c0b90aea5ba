"""Icechunk repositories written by the `icechunk` package, read back through `IcechunkSource` byte for byte
against icechunk's own reads of every version (branches, tags, snapshots), over a local, an HTTP and a zip
base; native, inline and virtual chunks; the pipeline syntax as Neuroglancer writes it; one fetch per
object, shared by concurrent readers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import trio

from tests.support.icechunk_repos import Written, needs_icechunk, write_repo
from tests.support.s3 import s3_endpoint  # noqa: F401 - a fixture
from unshardfs.app.pipeline import IcechunkPart, open_spec, parse_source
from unshardfs.sources import CountingSource, LocalSource, RemoteOptions, open_source
from unshardfs.sources.base import ByteSource, VersionedSource
from unshardfs.sources.icechunk import IcechunkOptions, IcechunkSource, IcechunkStore, RefSpec, open_icechunk
from unshardfs.sources.icechunk.format import decode_id, encode_id
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.source_conformance import ChangedUnderneath, MakeSource, Rewrite, rewrite_stored
from unshardfs.util.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Written:
    return write_repo(tmp_path_factory.mktemp("icechunk"))


OUTSIDE = ("virt/c/0/0", "virt/c/1/0")  # virtual references into the directory beside the repository
INSIDE = "virt/c/2/0"  # a virtual reference to an object inside the repository


def _without(keys: dict[str, bytes], *refused: str) -> dict[str, bytes]:
    return {k: v for k, v in keys.items() if k not in refused}


async def _contents(source: ByteSource, path: str = "", refused: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under `path` by listing, each read whole (in two pieces, to exercise ranged reads); the
    `refused` ones (listed, but failing their reads) left out."""
    out: dict[str, bytes] = {}
    async for name, st in source.list(path):
        child = f"{path}/{name}" if path else name
        assert await source.stat(child) == st, child
        if st.is_dir:
            out.update(await _contents(source, child, refused))
        elif child in refused:
            with pytest.raises(DataError, match="outside the repository and every allowed location"):
                await source.read(child, 0, st.size)
        else:
            half = st.size // 2
            data = await source.read(child, 0, half) + await source.read(child, half, st.size - half + 100)
            assert len(data) == st.size, child
            out[child] = data
    return out


def _allowed(repo: Written) -> IcechunkOptions:
    return IcechunkOptions((f"file://{repo.external}/",))


def _open(url: str, options: IcechunkOptions | None = None) -> ByteSource:
    async def main() -> ByteSource:
        return await open_spec(parse_source(url), lambda base: open_source(base, RemoteOptions()), None, options)
    return trio.run(main)


def _read_all(url: str, options: IcechunkOptions | None = None, refused: tuple[str, ...] = ()) -> dict[str, bytes]:
    async def main() -> dict[str, bytes]:
        source = await open_spec(parse_source(url), lambda base: open_source(base, RemoteOptions()), None, options)
        try:
            assert isinstance(source, IcechunkSource)
            return await _contents(source, "", refused)
        finally:
            await source.aclose()
    return trio.run(main)


def test_id_names_round_trip():
    raw = bytes(range(12))
    assert decode_id(encode_id(raw)) == raw and len(encode_id(raw)) == 20
    assert decode_id("1CECHNKREP0F1RSTCMT0") is not None  # the id of every repository's first snapshot
    for bad in ("1CECHNKREP0F1RSTCMT", "1CECHNKREP0F1RSTCMTU", "1cechnkrep0f1rstcmt0", "ZZZZZZZZZZZZZZZZZZZZ"):
        assert decode_id(bad) is None, bad


@needs_icechunk
def test_every_version_matches_icechunk(repo):
    versions = repo.versions
    assert {"branch.main", "branch.dev", "tag.v1"} <= set(versions) and len(versions) >= 8
    for name in versions:
        expected = repo.keys(name)
        shown = _read_all(f"{repo.root}|icechunk:@{name}/|zarr3:", _allowed(repo))
        assert shown == expected, name
    assert _read_all(str(repo.root), _allowed(repo)) == repo.keys("branch.main")
    # what the comparison covered: native chunks, inline ones (no chunk object), an array whose references
    # spread over several manifests
    source = _open(str(repo.root))
    assert isinstance(source, IcechunkSource)
    split = source.snapshot.nodes["split"].array
    assert split is not None and len(split.manifests) >= 3
    coords = source.snapshot.nodes["coords"].array
    assert coords is not None
    manifest = trio.run(source.store.manifest, coords.manifests[0].id)
    assert manifest.find(source.snapshot.nodes["coords"].id, (0,)).data is not None  # type: ignore[union-attr]
    assert len(list((repo.root / "chunks").iterdir())) >= 10
    trio.run(source.aclose)


@needs_icechunk
def test_a_branch_kept_as_numbered_ref_files(repo, tmp_path):
    """Without `ref.json`, a branch's numbered ref files are read where the base can list: the first in
    name order is the newest."""
    copy = tmp_path / "copy"
    shutil.copytree(repo.root, copy)
    folder = copy / "refs" / "branch.main"
    (folder / "ref.json").unlink()
    (folder / "ZZZZZZZY.json").write_text(json.dumps({"snapshot": repo.versions["tag.v1"]}))
    (folder / "ZZZZZZZZ.json").write_text(json.dumps({"snapshot": repo.versions["branch.dev"]}))
    (folder / "notes.json").write_text("{}")
    source = _open(f"{copy}|icechunk:")  # detection looks for ref.json only
    assert isinstance(source, IcechunkSource) and encode_id(source.snapshot.id) == repo.versions["tag.v1"]
    trio.run(source.aclose)


@needs_icechunk
def test_virtual_references_outside_the_repository_are_refused_by_default(repo, caplog):
    async def main() -> None:
        source = await open_icechunk(LocalSource(str(repo.root)), "", "", None, None, url=f"file://{repo.root}")
        try:
            # inside the repository: read through the base
            assert await source.read(INSIDE, 0, 100) == b"3456789a"
            for key in OUTSIDE:
                assert (await source.stat(key)).size == 8
                with pytest.raises(DataError, match="outside the repository"):
                    await source.read(key, 0, 8)
            assert source.stats()["icechunk"]["virtual_refused"] == 2
        finally:
            await source.aclose()
    trio.run(main)


@needs_icechunk
def test_versions_listed_with_times(repo):
    async def main() -> None:
        source = await open_icechunk(LocalSource(str(repo.root)), "", "", None, None, url=f"file://{repo.root}")
        assert isinstance(source, VersionedSource) and not source.pinned
        listed = await source.versions()
        names = [v.name for v in listed]
        assert set(names) == set(repo.versions)
        assert names[:3] == ["branch.dev", "branch.main", "tag.v1"]
        by_name = {v.name: v for v in listed}
        newest = max(v.time_ns for v in listed)
        assert {v.name for v in listed if v.latest} == {"branch.dev", repo.versions["branch.dev"]}
        assert by_name["branch.dev"].time_ns == newest and source.current == "branch.main"
        for name, snapshot in repo.versions.items():
            assert by_name[name].time_ns == by_name[snapshot].time_ns
        snapshots = [v for v in listed if "." not in v.name]
        assert snapshots[0].name == "1CECHNKREP0F1RSTCMT0" and snapshots[0].entries == 0
        assert [v.time_ns for v in snapshots] == sorted(v.time_ns for v in snapshots)
        tagged = await source.open_version("tag.v1")
        assert isinstance(tagged, IcechunkSource) and tagged.pinned
        assert await _contents(tagged, "", OUTSIDE) == _without(repo.keys("tag.v1"), *OUTSIDE)
        assert await source.open_version("branch.nope") is None and await source.open_version("..") is None
        assert await source.open_version("tag.nope") is None
        await source.aclose()
    trio.run(main)


@needs_icechunk
def test_a_path_shows_the_nodes_under_it(repo):
    expected = {k[len("deep/"):]: v for k, v in repo.keys("branch.main").items() if k.startswith("deep/")}
    assert _read_all(f"{repo.root}|icechunk:deep/|zarr3:") == expected
    # as Neuroglancer writes it: the array's path after the format
    assert _read_all(f"{repo.root}/|icechunk:|zarr3:deep/") == expected
    assert _read_all(f"{repo.root}/|icechunk:@tag.v1/|zarr3:deep/er/") == {
        k[len("deep/er/"):]: v for k, v in repo.keys("tag.v1").items() if k.startswith("deep/er/")}


@needs_icechunk
def test_over_http_without_listing(repo):
    """A plain HTTP server cannot list: branch main (its ref is a known name) and every snapshot in its
    history show; branches and tags other than main are named only when asked for."""
    with DatasetServer(repo.root.parent) as srv:
        url = f"{srv.url}/{repo.root.name}/"
        options = IcechunkOptions((f"{srv.url}/{repo.external.name}/",))
        # every virtual reference names a file:// location, neither under the repository's URL nor an allowed
        # prefix here: refused
        shown = _read_all(f"{url}|icechunk:|zarr3:", options, (*OUTSIDE, INSIDE))
        assert shown == _without(repo.keys("branch.main"), *OUTSIDE, INSIDE)
        assert _read_all(f"{url}|icechunk:@tag.v1/|zarr3:coords/") == {
            k[len("coords/"):]: v for k, v in repo.keys("tag.v1").items() if k.startswith("coords/")}

        async def versions() -> list[str]:
            source = await open_spec(parse_source(url + "|icechunk:"), lambda b: open_source(b, RemoteOptions()))
            assert isinstance(source, IcechunkSource)
            try:
                return [v.name for v in await source.versions()]
            finally:
                await source.aclose()
        names = trio.run(versions)
        assert names[0] == "branch.main" and "tag.v1" not in names and repo.versions["branch.main"] in names


@needs_icechunk
def test_inside_a_zip_archive(repo, tmp_path):
    from unshardfs.testing.zips import zip_tree

    archive = zip_tree(repo.root, tmp_path / "x.zip", comment=b"", under="repo/")
    # a zip has no URL a virtual reference could name: every one is refused
    shown = _read_all(f"{archive}|zip:repo/|icechunk:@branch.dev/|zarr3:", None, (*OUTSIDE, INSIDE))
    assert shown == _without(repo.keys("branch.dev"), *OUTSIDE, INSIDE)


@needs_icechunk
def test_one_fetch_per_object_shared_by_concurrent_readers(repo):
    """Reading every chunk of every array, many at once: each snapshot and manifest is fetched once."""
    async def main() -> None:
        counted = CountingSource(LocalSource(str(repo.root)))
        source = await open_icechunk(counted, "", "", None, None)
        keys = [k for k in repo.keys("branch.main") if "/c/" in k and not k.startswith("virt/")]
        async with trio.open_nursery() as nursery:
            for key in keys * 3:
                nursery.start_soon(source.read, key, 0, 1 << 20)
        stats = source.stats()["icechunk"]
        assert stats["snapshot_reads"] == 1
        manifests = {p.name for p in (repo.root / "manifests").iterdir()}
        assert 1 <= stats["manifest_reads"] <= len(manifests)
        used = stats["manifest_reads"]
        for key in keys:
            await source.read(key, 0, 10)
        assert source.stats()["icechunk"]["manifest_reads"] == used
        await source.aclose()
    trio.run(main)


@pytest.mark.parametrize("url, base, part, fmt", [
    ("gs://bucket/path/to/repo.zarr.icechunk/|icechunk:|zarr3:path/to/array/", "gs://bucket/path/to/repo.zarr.icechunk/",
     IcechunkPart(None, "path/to/array/"), "zarr"),
    ("gs://b/repo/|icechunk:@branch.other/|zarr3:path/to/array/", "gs://b/repo/",
     IcechunkPart("branch.other", "path/to/array/"), "zarr"),
    ("gs://b/repo/|icechunk:@tag.v5/|zarr3:", "gs://b/repo/", IcechunkPart("tag.v5", ""), "zarr"),
    ("gs://b/repo/|icechunk:@4N0217AZA4VNPYD0HR0G/|zarr3:a/", "gs://b/repo/",
     IcechunkPart("4N0217AZA4VNPYD0HR0G", "a/"), "zarr"),
    ("s3://b/repo/|icechunk:@branch.main/x/y/", "s3://b/repo/", IcechunkPart("branch.main", "x/y/"), None),
    ("s3://b/repo/|icechunk:@branch.a%2Fb/a%40b/", "s3://b/repo/", IcechunkPart("branch.a/b", "a@b/"), None),
    ("s3://b/repo/|icechunk:p/|zarr3:q/", "s3://b/repo/", IcechunkPart(None, "p/q/"), "zarr"),
])
def test_pipeline_syntax(url, base, part, fmt):
    spec = parse_source(url)
    assert (spec.base, spec.zip_path, spec.icechunk, spec.format) == (base, None, part, fmt)


@pytest.mark.parametrize("url, error", [
    ("gs://b/r/|icechunk:|icechunk:", "Icechunk repository inside another"),
    ("gs://b/r/|icechunk:|zip:", "zip inside an Icechunk repository"),
    ("gs://b/r/|icechunk:|ocdbt:", "OCDBT database inside an Icechunk repository"),
    ("gs://b/r/|ocdbt:|icechunk:", "Icechunk repository inside an OCDBT database"),
    ("gs://b/r/|icechunk:@/x", "names no ref"),
])
def test_pipeline_refusals(url, error):
    with pytest.raises(ConfigError, match=error):
        parse_source(url)


@pytest.mark.parametrize("version", ["main", "branch.", "tag.a/b", "branch..", "1cechnkrep0f1rstcmt0", "v3"])
def test_bad_ref_names_are_one_line(version):
    with pytest.raises(ConfigError, match="Icechunk"):
        RefSpec.parse(version)


@needs_icechunk
def test_a_repository_is_detected_by_branch_mains_ref(repo, tmp_path):
    detected = _open(str(repo.root))
    assert isinstance(detected, IcechunkSource) and not detected.pinned
    trio.run(detected.aclose)
    named = _open(f"{repo.root}|icechunk:@tag.v1/")
    assert isinstance(named, IcechunkSource) and named.pinned
    assert encode_id(named.snapshot.id) == repo.versions["tag.v1"]
    trio.run(named.aclose)
    plain = _open(str(repo.root / "refs"))
    assert not isinstance(plain, IcechunkSource)
    trio.run(plain.aclose)
    for url, message in ((f"{repo.root / 'refs'}|icechunk:", "no branch main"),
                         (f"{repo.root}|icechunk:@tag.nope/", "no tag.nope"),
                         (f"{repo.root}|icechunk:@branch.x%00y/", "Icechunk version")):
        with pytest.raises(ConfigError, match=message):
            _open(url)
    copy = tmp_path / "copy"
    shutil.copytree(repo.root, copy)
    (copy / "refs" / "branch.main" / "ref.json").unlink()
    with pytest.raises(ConfigError, match="no branch main"):
        _open(f"{copy}|icechunk:")


@needs_icechunk
def test_first_chunk_read_costs_at_most_one_more_round_trip_than_sharded(repo, tmp_path):
    """Over HTTP: opening costs the ref and the snapshot, one request each (a suffix range brings the size
    with the bytes), and beside the ref, in the same round trip, a look for spec version 2's `repo` object
    (the pipeline names the repository, so no marker has said which spec version it is); the first chunk
    of the sharded array costs one request more than the same Zarr store as plain objects (the manifest,
    then cached like a shard index); a second chunk costs the same."""
    from unshardfs.testing.inprocess import opened, read_file, resolve

    plain = tmp_path / "plain"
    for key, value in repo.keys("branch.main").items():
        (plain / key).parent.mkdir(parents=True, exist_ok=True)
        (plain / key).write_bytes(value)
    shutil.copytree(repo.root, tmp_path / "repo")

    async def requests(url: str, srv: DatasetServer) -> tuple[int, int, int]:
        srv.reset_log()
        async with opened(url, "--no-read-ahead") as session:
            at_open = len(srv.requests())
            await read_file(await resolve(session.tree, "seg/c/0/0/0"))
            after_first = len(srv.requests())
            await read_file(await resolve(session.tree, "seg/c/1/0/0"))
            return at_open, after_first - at_open, len(srv.requests()) - after_first

    with DatasetServer(tmp_path) as srv:
        sharded = trio.run(requests, f"{srv.url}/plain/|zarr3:", srv)
        through = trio.run(requests, f"{srv.url}/repo/|icechunk:|zarr3:", srv)
    # ref.json (with `repo`, absent) and the snapshot at open (every zarr.json is in the snapshot); then the
    # manifest, the shard's index and the chunk (the shard's size comes from the manifest); then the next chunk
    assert through == (3, 3, 1), (through, sharded)
    assert through[1] <= sharded[1] + 1 and through[2] <= sharded[2], (through, sharded)


@needs_icechunk
def test_over_object_stores(repo, s3_endpoint):
    """S3 (moto) and the GCS stand-in list: every branch, tag and snapshot is a version, and each reads
    exactly; virtual references there are refused unless their (file://) prefix is allowed, which only a
    local base can honour."""
    from tests.support.s3 import upload

    endpoint, client = s3_endpoint
    upload(client, "bkt", repo.root, "data/repo")
    with DatasetServer(repo.root.parent.parent, gcs_bucket="gbkt") as gcs:
        bases = {"s3": ("s3://bkt/data/repo/", RemoteOptions(s3_endpoint=endpoint)),
                 "gcs": (f"gs://gbkt/{repo.root.parent.name}/repo/", RemoteOptions(gcs_endpoint=gcs.url))}
        for label, (url, remote) in bases.items():
            async def main(version: str) -> tuple[list[str], dict[str, bytes]]:
                spec = parse_source(f"{url}|icechunk:@{version}/|zarr3:" if version else url)
                source = await open_spec(spec, lambda b: open_source(b, remote))
                try:
                    assert isinstance(source, IcechunkSource), label
                    names = [v.name for v in await source.versions()] if not version else []
                    return names, await _contents(source, "", (*OUTSIDE, INSIDE))
                finally:
                    await source.aclose()
            names, shown = trio.run(main, "")
            assert sorted(names) == sorted(repo.versions), label
            assert shown == _without(repo.keys("branch.main"), *OUTSIDE, INSIDE), label
            _, shown = trio.run(main, "tag.v1")
            assert shown == _without(repo.keys("tag.v1"), *OUTSIDE, INSIDE), label


@needs_icechunk
def test_ranges_of_one_chunk_object_read_together_are_one_request(repo):
    """Four readers of neighbouring ranges of one chunk object (a shard stored as one Icechunk chunk) at the
    same moment, over a remote base: one ranged read; one after another, four. Each gets exactly its bytes."""
    import trio.testing

    from unshardfs.testing.latency import LatencySource
    from unshardfs.testing.memory import MemorySource

    key = "seg/c/0/0/0"
    whole = repo.keys("branch.main")[key]
    ranges = [(i * 1000, 1000) for i in range(4)]

    async def main(together: bool) -> tuple[list[bytes], int]:
        remote = LatencySource(MemorySource.from_directory(repo.root), 0.02)
        source = await open_icechunk(remote, "", "", None, None)
        await source.stat(key)
        remote.reset_log()
        got: list[bytes] = [b""] * len(ranges)

        async def one(i: int) -> None:
            got[i] = await source.read(key, *ranges[i])

        if together:
            async with trio.open_nursery() as nursery:
                for i in range(len(ranges)):
                    nursery.start_soon(one, i)
        else:
            for i in range(len(ranges)):
                await one(i)
        await source.aclose()
        return got, len([r for r in remote.log if r.kind == "read"])

    for together, requests in ((True, 1), (False, 4)):
        got, sent = trio.run(main, together, clock=trio.testing.MockClock(autojump_threshold=0))
        assert got == [whole[o:o + n] for o, n in ranges] and sent == requests


class TestChangedUnderneath(ChangedUnderneath):
    """A native chunk's object, changed under a reader part way through the chunk (a copy of the repository
    and of the directory its virtual references name, so the module's repository stays as written)."""

    underneath = "split/c/0/0"
    at: int | None = None  # where the chunk's bytes lie in their file (that file repeats them)

    @pytest.fixture
    def copies(self, repo: Written, tmp_path: Path) -> tuple[Path, Path]:
        shutil.copytree(repo.root, tmp_path / "repo")
        shutil.copytree(repo.external, tmp_path / "external")
        return tmp_path / "repo", tmp_path / "external"

    @pytest.fixture
    def make(self, repo: Written, copies: tuple[Path, Path]) -> MakeSource:
        root, external = copies

        def make() -> IcechunkStore:
            # The references name the module's external directory: read from its copy instead.
            return IcechunkStore(LocalSource(str(root)), url=f"file://{root}/", options=_allowed(repo),
                                 open_url=lambda base: LocalSource(str(external)))

        snapshot = trio.run(self._snapshot, make())
        return lambda: IcechunkSource(make(), snapshot)

    @staticmethod
    async def _snapshot(store: IcechunkStore) -> object:
        raw = await store.resolve(RefSpec("branch", "main"))
        assert raw is not None
        return await store.snapshot(raw)

    @pytest.fixture
    def rewrite(self, repo: Written, copies: tuple[Path, Path]) -> Rewrite:
        key = self.underneath
        value = repo.keys("branch.main")[key]
        return rewrite_stored(copies[1] if key.startswith("virt/") else copies[0], value, self.at)


class TestChangedUnderneathVirtual(TestChangedUnderneath):
    """The file a virtual reference names, changed under a reader."""

    underneath = "virt/c/0/0"
    at = 16


class TestChangedUnderneathDated(TestChangedUnderneath):
    """The file a virtual reference with a last-modified checksum names (its mtime put back keeps it valid)."""

    underneath = "virt/c/1/0"
    at = 300
