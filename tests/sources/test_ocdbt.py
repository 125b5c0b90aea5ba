"""OCDBT databases written by TensorStore, read back through `OcdbtSource` byte for byte against
TensorStore's own reads of every version, over a local and an HTTP base; the pipeline syntax as
Neuroglancer writes it; the request counts of a first read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio

from tests.support.ocdbt import DEEP, ts_keys, ts_versions, write_precomputed, write_zarr, written
from unshardfs.app.pipeline import OcdbtPart, open_spec, parse_source
from unshardfs.sources import CountingSource, LocalSource, RemoteOptions, open_source
from unshardfs.sources.base import ByteSource, VersionedSource, iso_time
from unshardfs.sources.ocdbt import OcdbtSource, OcdbtStore, VersionSpec, open_ocdbt
from unshardfs.sources.ocdbt.format import decode_manifest, numbered_manifest_name
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.source_conformance import TREE, MakeSource, Rewrite, SourceConformance, rewrite_stored
from unshardfs.util.errors import ConfigError

pytest.importorskip("tensorstore")


@pytest.fixture(scope="module")
def zarr_db(tmp_path_factory) -> Path:
    return written(tmp_path_factory, "zarr.ocdbt", write_zarr)


@pytest.fixture(scope="module")
def deep_db(tmp_path_factory) -> Path:
    return written(tmp_path_factory, "deep.ocdbt", write_zarr, DEEP)


@pytest.fixture(scope="module")
def numbered_db(tmp_path_factory) -> Path:
    return written(tmp_path_factory, "numbered.ocdbt", write_zarr, {"manifest_kind": "numbered"})


@pytest.fixture(scope="module")
def precomputed_db(tmp_path_factory) -> Path:
    return written(tmp_path_factory, "pre.ocdbt", write_precomputed)


async def _contents(source: ByteSource, path: str = "") -> dict[str, bytes]:
    """Every file under `path` by listing, each read whole (in two pieces, to exercise ranged reads)."""
    out: dict[str, bytes] = {}
    async for name, st in source.list(path):
        child = f"{path}/{name}" if path else name
        if st.is_dir:
            out.update(await _contents(source, child))
        else:
            half = st.size // 2
            data = await source.read(child, 0, half) + await source.read(child, half, st.size - half + 100)
            assert len(data) == st.size, child
            assert await source.stat(child) == st
            out[child] = data
    return out


def _read_all(base: ByteSource, version: str | None = None, path: str = "") -> dict[str, bytes]:
    async def main() -> dict[str, bytes]:
        source = await open_ocdbt(base, "", path, version, None)
        try:
            return await _contents(source)
        finally:
            await source.aclose()
    return trio.run(main)


@pytest.mark.parametrize("which", ["zarr_db", "deep_db", "numbered_db", "precomputed_db"])
def test_every_version_matches_tensorstore(which, request):
    root: Path = request.getfixturevalue(which)
    versions = ts_versions(root)
    assert len(versions) >= 4
    for n in versions:
        expected = ts_keys(f"file://{root}/", n)
        assert _read_all(LocalSource(str(root)), f"v{n}") == expected, f"v{n}"
    assert _read_all(LocalSource(str(root))) == ts_keys(f"file://{root}/")


def test_versions_listed_with_times_and_sizes(zarr_db):
    async def main():
        source = await open_ocdbt(LocalSource(str(zarr_db)), "", "", None, None)
        assert isinstance(source, VersionedSource) and not source.pinned
        found = await source.versions()
        # TensorStore writes an empty first version
        older = await source.open_version("v1")
        assert older is not None and [x async for x in older.list("")] == []
        assert await source.open_version("v0") is None and await source.open_version("v99999") is None
        await source.aclose()
        return found
    found = trio.run(main)
    assert [v.name for v in found] == [f"v{n}" for n in ts_versions(zarr_db)]
    assert [v.latest for v in found] == [False] * (len(found) - 1) + [True]
    times = [v.time_ns for v in found]
    assert times == sorted(times) and times[0] > 1_600_000_000 * 10**9
    assert found[0].entries == 0 and found[-1].entries == len(ts_keys(f"file://{zarr_db}/"))


@pytest.mark.parametrize("which", ["zarr_db", "deep_db"])
def test_commit_time_selects_the_version_tensorstore_selects(which, request):
    """Exact commit times, times between two commits, after the last and before the first."""
    root: Path = request.getfixturevalue(which)

    async def times():
        source = await open_ocdbt(LocalSource(str(root)), "", "", None, None)
        found = await source.versions()
        await source.aclose()
        return found
    found = trio.run(times)
    stamps = [v.time_text for v in found]
    assert VersionSpec.parse(stamps[3]).time_ns == found[3].time_ns
    between = [iso_time((a.time_ns + b.time_ns) // 2) for a, b in zip(found, found[1:])]
    for stamp in [*stamps, *between, "2200-01-01T00:00:00Z"]:
        assert _read_all(LocalSource(str(root)), stamp) == ts_keys(f"file://{root}/", stamp), stamp
    with pytest.raises(ConfigError, match="no version"):
        _read_all(LocalSource(str(root)), "2001-01-01T00:00:00Z")


def test_key_prefix_shows_only_the_keys_under_it(zarr_db):
    got = _read_all(LocalSource(str(zarr_db)), path="notes/")
    assert got == {k[len("notes/"):]: v for k, v in ts_keys(f"file://{zarr_db}/").items() if k.startswith("notes/")}
    assert {"readme.txt", "blob.bin", "many/0000-"} <= set(got) and len(got) == 122


def test_over_http_matches_tensorstore(zarr_db):
    expected = ts_keys(f"file://{zarr_db}/")
    with DatasetServer(zarr_db.parent) as srv:
        url = f"{srv.url}/{zarr_db.name}"

        async def main(version: str | None) -> dict[str, bytes]:
            spec = parse_source(f"{url}/|ocdbt:" + (f"@{version}/" if version else "") + "|zarr3:")
            source = await open_spec(spec, lambda base: open_source(base, RemoteOptions()))
            assert isinstance(source, OcdbtSource)
            try:
                return await _contents(source)
            finally:
                await source.aclose()

        assert trio.run(main, None) == expected
        assert trio.run(main, "v3") == ts_keys(f"file://{zarr_db}/", 3)


def test_deep_trees_are_deep(deep_db):
    async def main():
        source = await open_ocdbt(LocalSource(str(deep_db)), "", "", None, None)
        assert source.store.manifest is not None and source.store.manifest.nodes  # versions in version nodes
        heights = source.version.root_height, max(r.height for r in source.store.manifest.nodes)
        await source.aclose()
        return heights
    btree, version_tree = trio.run(main)
    assert btree >= 2 and version_tree >= 2

    async def opening(version: str) -> int:
        counted = CountingSource(LocalSource(str(deep_db)))
        source = await open_ocdbt(counted, "", "", version, None)
        await source.aclose()
        return counted.counters.reads
    # one path down the version tree: the manifest, then one node per level (heights version_tree .. 0)
    assert trio.run(opening, "v3") == 1 + version_tree + 1


@pytest.mark.parametrize("which", ["zarr_db", "deep_db"])
def test_first_read_costs_one_read_per_tree_level(which, request):
    """Cold: the manifest (a stat and a read), then one read per B+tree level; a key's value is one more.
    Warm: a value read costs its one read, nothing else."""
    root: Path = request.getfixturevalue(which)

    async def main():
        counted = CountingSource(LocalSource(str(root)))
        source = await open_ocdbt(counted, "", "", None, None)
        assert (counted.counters.stats, counted.counters.reads) == (1, 1)
        levels = source.version.root_height + 1
        st = await source.stat("notes/blob.bin")
        assert st is not None and st.size == 10240
        assert counted.counters.reads == 1 + levels
        await source.read("notes/blob.bin", 0, st.size)
        assert counted.counters.reads == 1 + levels + 1
        await source.read("notes/blob.bin", 100, 50)  # nodes cached: the value's range only
        await source.stat("notes/blob.bin")
        assert counted.counters.reads == 1 + levels + 2
        await source.stat("notes/readme.txt")  # another leaf at most: the root is cached
        assert counted.counters.reads <= 1 + levels + 2 + levels - 1
        await source.aclose()
    trio.run(main)


@pytest.mark.parametrize("url, base, zip_path, part, fmt", [
    ("gs://b/repo.zarr.ocdbt/|ocdbt:path/to/array/|zarr3:", "gs://b/repo.zarr.ocdbt/", None,
     OcdbtPart(None, "path/to/array/"), "zarr"),
    ("gs://b/r/|ocdbt:@v10/path/|zarr3:", "gs://b/r/", None, OcdbtPart("v10", "path/"), "zarr"),
    ("gs://b/r/|ocdbt:@2024-12-31T10:23:45.123456789Z/a/", "gs://b/r/", None,
     OcdbtPart("2024-12-31T10:23:45.123456789Z", "a/"), None),
    ("s3://b/r/|ocdbt:@v3", "s3://b/r/", None, OcdbtPart("v3", ""), None),
    ("x.zip|zip:db/|ocdbt:|neuroglancer-precomputed:", "x.zip", "db/", OcdbtPart(None, ""), "precomputed"),
    ("gs://b/r/|ocdbt:a%40b/", "gs://b/r/", None, OcdbtPart(None, "a@b/"), None),
])
def test_pipeline_syntax(url, base, zip_path, part, fmt):
    spec = parse_source(url)
    assert (spec.base, spec.zip_path, spec.ocdbt, spec.format) == (base, zip_path, part, fmt)


@pytest.mark.parametrize("url, error", [
    ("gs://b/r/|ocdbt:|ocdbt:", "inside another"),
    ("gs://b/r/|ocdbt:|zip:", "zip inside an OCDBT"),
    ("gs://b/r/|ocdbt:@/x", "names no version"),
])
def test_pipeline_refusals(url, error):
    with pytest.raises(ConfigError, match=error):
        parse_source(url)


@pytest.mark.parametrize("version", ["10", "v0", "v-1", "2024-12-31", "2024-13-01T00:00:00Z", "HEAD"])
def test_bad_version_names_are_one_line(version):
    with pytest.raises(ConfigError, match="OCDBT version"):
        VersionSpec.parse(version)


def test_directory_holding_a_manifest_is_detected(zarr_db):
    async def main(url: str) -> ByteSource:
        return await open_spec(parse_source(url), lambda base: open_source(base, RemoteOptions()))
    detected = trio.run(main, str(zarr_db))
    assert isinstance(detected, OcdbtSource) and not detected.pinned
    trio.run(detected.aclose)
    named = trio.run(main, f"{zarr_db}|ocdbt:@v2/")
    assert isinstance(named, OcdbtSource) and named.pinned and named.version.generation == 2
    trio.run(named.aclose)
    plain = trio.run(main, str(zarr_db / "d"))
    assert not isinstance(plain, OcdbtSource)
    with pytest.raises(ConfigError, match="no manifest.ocdbt"):
        trio.run(main, f"{zarr_db / 'd'}|ocdbt:")
    with pytest.raises(ConfigError, match="no version v999"):
        trio.run(main, f"{zarr_db}|ocdbt:@v999/")


def test_first_chunk_read_costs_at_most_one_more_round_trip_than_sharded(zarr_db, tmp_path):
    """Over HTTP, opening and reading a first chunk: the database's B+tree (one level at TensorStore's
    default node size) costs at most one request more than the same sharded Zarr store as plain objects;
    a second chunk costs the same one request."""
    import tensorstore as ts

    from unshardfs.testing.inprocess import opened, read_file, resolve

    plain = ts.KvStore.open(f"file://{tmp_path}/plain/").result()
    for key, value in ts_keys(f"file://{zarr_db}/").items():
        plain.write(key, value).result()
    shutil.copytree(zarr_db, tmp_path / "db")

    async def requests(url: str, srv: DatasetServer) -> tuple[int, int, int]:
        srv.reset_log()
        async with opened(url, "--no-read-ahead") as session:
            at_open = len(srv.requests())
            first = await resolve(session.tree, "arr/c/0/0/0")
            await read_file(first)
            after_first = len(srv.requests())
            await read_file(await resolve(session.tree, "arr/c/1/0/0"))
            return at_open, after_first - at_open, len(srv.requests()) - after_first

    with DatasetServer(tmp_path) as srv:
        sharded = trio.run(requests, f"{srv.url}/plain/|zarr3:", srv)
        through = trio.run(requests, f"{srv.url}/db/|ocdbt:|zarr3:", srv)
    # the manifest (one GET: a suffix range states its size with its bytes) and the root node at open; then
    # the array's metadata, the shard's index and the chunk (the shard's stat comes from the leaf); then the
    # next chunk alone
    assert through == (2, 3, 1)
    assert through[0] + through[1] <= sharded[0] + sharded[1] + 1 and through[2] <= sharded[2]


def test_numbered_manifests_over_plain_http_are_one_line(numbered_db):
    with DatasetServer(numbered_db.parent) as srv:
        async def main() -> None:
            spec = parse_source(f"{srv.url}/{numbered_db.name}/|ocdbt:|zarr3:")
            await open_spec(spec, lambda base: open_source(base, RemoteOptions()))
        with pytest.raises(ConfigError, match="numbered manifests needs a base that can list"):
            trio.run(main)


def test_inside_a_zip_archive(zarr_db, tmp_path):
    """`x.zip|zip:db/|ocdbt:`: the database read through the archive's members, every key exact."""
    from unshardfs.testing.zips import zip_tree

    archive = zip_tree(zarr_db, tmp_path / "x.zip", comment=b"", under="db/")
    expected = ts_keys(f"file://{zarr_db}/")

    async def main() -> dict[str, bytes]:
        spec = parse_source(f"{archive}|zip:db/|ocdbt:|zarr3:")
        source = await open_spec(spec, lambda base: open_source(base, RemoteOptions()))
        try:
            assert isinstance(source, OcdbtSource) and "|zip:db/|ocdbt:" in source.description
            return await _contents(source)
        finally:
            await source.aclose()
    assert trio.run(main) == expected


def test_numbered_manifests_over_gcs(numbered_db):
    """gs://: the numbered manifests are found by listing (the JSON API, in pages), every key exact."""
    expected = ts_keys(f"file://{numbered_db}/")
    with DatasetServer(numbered_db.parent, gcs_bucket="bkt", page_size=2) as gcs:
        async def main() -> dict[str, bytes]:
            spec = parse_source(f"gs://bkt/{numbered_db.name}/|ocdbt:|zarr3:")
            source = await open_spec(spec, lambda base: open_source(base, RemoteOptions(gcs_endpoint=gcs.url)))
            try:
                assert isinstance(source, OcdbtSource)
                return await _contents(source)
            finally:
                await source.aclose()
        assert trio.run(main) == expected
        assert any("pageToken" in r.path for r in gcs.requests())
    assert len([p for p in numbered_db.iterdir() if numbered_manifest_name(p.name)]) > 1


def test_nodes_kept_in_cache_dir_across_opens(deep_db, tmp_path):
    """With `--cache-dir`, a second open reads the manifest and the values, no node."""
    from unshardfs.sources.diskcache import DiskCachedSource

    async def once() -> tuple[int, dict[str, bytes]]:
        counted = CountingSource(LocalSource(str(deep_db)))
        source = await open_ocdbt(DiskCachedSource(counted, str(tmp_path / "cache")), "", "", None, None)
        try:
            found = await _contents(source, "notes/many")
            nodes = source.stats()["ocdbt"]
            assert isinstance(nodes, dict)
            return nodes["node_reads"], found
        finally:
            await source.aclose()
    first, found = trio.run(once)
    again, found_again = trio.run(once)
    assert first >= 3 and again == 0 and found_again == found and len(found) == 120


class TestOcdbtConformance(SourceConformance):
    """The ByteSource contract, for the keys of a TensorStore-written database holding the suite's tree.
    A version never changes (a change is a new commit, seen by opening again): no staleness to notice."""

    listable = True
    remote = False
    versioned = False

    @pytest.fixture
    def db(self, tmp_path: Path) -> Path:
        import tensorstore as ts

        db = tmp_path / "db"
        store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{db}/"}).result()
        for path, data in TREE.items():
            store.write(path, data).result()
        return db

    @pytest.fixture
    def rewrite(self, db: Path) -> Rewrite:
        """The data file holding the value of `underneath` changed, that value's bytes flipped."""
        return rewrite_stored(db, TREE[self.underneath])

    @pytest.fixture
    def make(self, db: Path) -> MakeSource:
        manifest = decode_manifest((db / "manifest.ocdbt").read_bytes(), "manifest", 1 << 24)

        def make() -> ByteSource:
            opened = OcdbtStore(LocalSource(str(db)))
            opened.manifest = manifest  # what `open` reads, read here: `make` is not async
            return OcdbtSource(opened, manifest.latest)
        return make


def test_a_large_node_costs_about_its_bytes_and_its_estimate_covers_it():
    """100,000 entries (a third of what TensorStore's default 8 MiB node holds): held in columns, the node
    costs about twice its decoded body, and the estimate the cache budgets with is not below it."""
    import tracemalloc

    from tests.support.ocdbt import Ref, leaf
    from unshardfs.sources.ocdbt.format import decode_btree_node

    entries: list[tuple[bytes, bytes | Ref]] = [
        (b"arr/c/%03d/%03d" % divmod(i, 1000), b"v" * (i % 40) if i % 3 else Ref(0, i * 100, 100))
        for i in range(100_000)]
    encoded = leaf(["d/data"], entries, zstd=True)
    tracemalloc.start()
    try:
        node = decode_btree_node(encoded, "big", 64 << 20, "", 64 << 20)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(node) == 100_000 and node.value(5).data == b"v" * 5 and node.value(3).location.offset == 300
    assert held <= node.nbytes and held < 2.5 * len(node.body)
