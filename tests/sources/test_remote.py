"""Remote sources through real HTTP servers on 127.0.0.1: a plain server with
Range support, fault-injecting ones, a GCS JSON API stand-in and an S3
emulator (moto). Every mount must equal the local mount of the same data,
byte for byte; request logs prove reads are ranged and few."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.support.s3 import CREDENTIALS, moto_s3, upload
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.precomputed import Scale, sharding, write_objects, write_volume
from unshardfs.testing.trees import assert_same_tree, walk_files

SCALES = [Scale((96, 64, 48), (16, 16, 16), sharding(preshift=1, minishard=2, shard=2, data_enc="gzip",
                                                      index_enc="gzip")),
          Scale((48, 32, 24), (16, 16, 8), sharding(hash="identity", minishard=1, shard=1), resolution=(2, 2, 2))]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A served directory with a sharded volume and sharded meshes (each with its unsharded twin)."""
    root = tmp_path_factory.mktemp("site")
    volume = write_volume(root / "volume", SCALES, "uint16")
    meshes = write_objects(root / "meshes", "mesh", sharding(preshift=1, minishard=1, shard=1, data_enc="gzip"))
    return root, volume, meshes


@pytest.fixture
def server(site):
    with DatasetServer(site[0]) as srv:
        yield srv


def remote_tree_equals_local(mount, url: str, local: Path, *options: str) -> int:
    remote = mount(url, *options)
    here = mount(local)
    return assert_same_tree(remote.path, here.path)


def test_plain_http_equals_local_mount(site, server, mount):
    root, volume, meshes = site
    assert remote_tree_equals_local(mount, f"{server.url}/volume/sharded", volume["sharded"]) > 40
    assert remote_tree_equals_local(mount, f"precomputed://{server.url}/meshes/sharded", meshes["sharded"]) > 20
    assert all(r.range for r in server.requests("GET")), "every GET is a range request"
    assert all(r.status in (200, 206, 404) for r in server.requests())


def test_reads_are_ranged_and_few(site, server, mount):
    """First chunk of a shard: its shard index with its stat (a range from 0, no HEAD), then its minishard
    index and the chunk; each further chunk
    of that minishard: one GET of exactly its bytes. Never a whole shard. (Without read-ahead: with it,
    reading a minishard's chunks in order is a scan and later chunks arrive prefetched.)"""
    from tests.support.precomputed import chunk_locations  # chunk -> (shard, minishard), computed with CloudVolume

    root, volume, _ = site
    m = mount(f"{server.url}/volume/sharded", "--no-read-ahead")
    spec = SCALES[0].sharding
    group = max(chunk_locations(spec, SCALES[0].size, SCALES[0].chunk).values(), key=len)
    path = "1_1_1"
    server.reset_log()
    first, *rest = group
    assert (m.path / path / first).read_bytes() == (volume["plain"] / path / first).read_bytes()
    log = server.requests()
    assert [(r.method, r.range) for r in log][:1] == [("GET", f"bytes=0-{16 * 2 ** spec['minishard_bits'] - 1}")], log
    assert [r.method for r in log] == ["GET", "GET", "GET"], log
    shard_size = max(p.stat().st_size for p in (volume["sharded"] / path).glob("*.shard"))
    assert all(r.status == 206 and r.sent < shard_size for r in log if r.method == "GET")
    for name in rest:
        server.reset_log()
        assert (m.path / path / name).read_bytes() == (volume["plain"] / path / name).read_bytes()
        assert len(server.requests()) == 1 and server.requests()[0].status == 206, name


@pytest.mark.parametrize("fault", ["errors", "429", "drops", "slow"])
def test_transient_faults_are_retried(site, server, mount, fault):
    root, volume, _ = site
    f = server.faults
    if fault == "errors":
        f.error_every = 3
    elif fault == "429":
        f.error_every, f.error_status = 4, 429
    elif fault == "drops":
        f.drop_every = 3
    else:
        f.delay = 0.02
    m = mount(f"{server.url}/volume/sharded", "--retries", "8", "--timeout", "10", "--backoff", "0.005")
    assert_same_tree(m.path, volume["plain"], ("info",))
    if fault in ("errors", "429"):
        assert any(r.status in (500, 429) for r in server.requests())
    stats = json.loads(os.getxattr(m.path, "user.unshardfs.stats"))
    if fault != "slow":
        assert stats["http"]["retries"] > 0 and stats["http"]["failures"] == 0


def test_persistent_failure_is_eio_then_recovers(site, server, mount):
    root, volume, _ = site
    m = mount(f"{server.url}/volume/sharded", "--retries", "2", "--backoff", "0.01")
    names = sorted(os.listdir(m.path / "1_1_1"))
    server.faults.error_every = 1  # every request fails from now on
    with pytest.raises(OSError) as e:
        (m.path / "2_2_2" / sorted(os.listdir(volume["plain"] / "2_2_2"))[0]).read_bytes()
    assert e.value.errno == errno.EIO
    assert "after 3 attempts" in m.log_text()
    server.faults.error_every = 0
    assert (m.path / "1_1_1" / names[0]).read_bytes() == (volume["plain"] / "1_1_1" / names[0]).read_bytes()


def test_missing_shard_is_absent_data(site, server, mount):
    root, volume, _ = site
    shards = sorted((volume["sharded"] / "1_1_1").glob("*.shard"))
    server.faults.missing = {f"/volume/sharded/1_1_1/{shards[0].name}"}
    m = mount(f"{server.url}/volume/sharded")
    listed = set(os.listdir(m.path / "1_1_1"))
    assert 0 < len(listed) < len(os.listdir(volume["plain"] / "1_1_1"))
    for name in set(os.listdir(volume["plain"] / "1_1_1")) - listed:
        assert not (m.path / "1_1_1" / name).exists()  # ENOENT, not EIO
    for name in sorted(listed)[:5]:
        assert (m.path / "1_1_1" / name).read_bytes() == (volume["plain"] / "1_1_1" / name).read_bytes()


def test_server_without_range_support(site, server, mount):
    root, volume, _ = site
    server.faults.no_range = True
    m = mount(f"{server.url}/volume/sharded")
    assert_same_tree(m.path, volume["plain"], ("info",))
    assert "ignores Range requests" in m.log_text()


def test_index_disk_cache_survives_remount(site, server, mount, tmp_path):
    root, volume, _ = site
    cache = tmp_path / "index-cache"
    m = mount(f"{server.url}/volume/sharded", "--cache-dir", str(cache))
    files = sorted(walk_files(m.path))
    for rel in files:
        (m.path / rel).read_bytes()
    first = len(server.requests("GET"))
    assert any(cache.rglob("*"))
    server.reset_log()
    m2 = mount(f"{server.url}/volume/sharded", "--cache-dir", str(cache))
    for rel in files:
        assert (m2.path / rel).read_bytes() == (m.path / rel).read_bytes()
    second = len(server.requests("GET"))
    stats = json.loads(os.getxattr(m2.path, "user.unshardfs.stats"))
    assert stats["index_disk_cache"]["misses"] == 0 and stats["index_disk_cache"]["hits"] > 0
    assert second < first


def test_gcs_listing_and_reads(site, mount):
    """gs:// against a stand-in for the GCS JSON API (listing, in pages) and media endpoint."""
    root, volume, meshes = site
    with DatasetServer(root, gcs_bucket="test-bucket", page_size=2) as gcs:
        remote = mount("gs://test-bucket/meshes/sharded", "--gcs-endpoint", gcs.url)
        assert_same_tree(remote.path, meshes["plain"], ("info", "mesh/info"))
        assert any("pageToken" in r.path for r in gcs.requests()), "listing followed page tokens"
        assert (remote.path / "provenance").exists()  # listed through the API: not a declared name


def test_gcs_reads_are_checked_against_the_listed_generation(tmp_path):
    """A GCS listing's etag is not the media endpoint's ETag, so versions are generations: a
    listed object and the same object statted agree, a read with its version sends
    x-goog-if-generation-match, and an object replaced since it was listed is StaleError
    (412, or an answer naming another generation), never its new bytes."""
    import trio

    from unshardfs.sources.objectstore import GcsSource
    from unshardfs.util.errors import StaleError

    data = np.random.default_rng(6).bytes(4096)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "obj").write_bytes(data)
    with DatasetServer(tmp_path, gcs_bucket="bkt") as gcs:

        async def main() -> None:
            source = GcsSource("bkt", "d", endpoint=gcs.url)
            try:
                listed = {name: st async for name, st in source.list("")}["obj"]
                assert listed.version == (f"x-goog-generation:{(tmp_path / 'd' / 'obj').stat().st_ctime_ns}", 4096)
                assert await source.stat("obj") == listed
                gcs.reset_log()
                assert await source.read("obj", 100, 50, listed.version) == data[100:150]
                assert [r.status for r in gcs.requests()] == [206]
                replacement = tmp_path / "d" / "obj.new"
                replacement.write_bytes(data[::-1])  # same size: only the generation tells
                os.replace(replacement, tmp_path / "d" / "obj")
                with pytest.raises(StaleError):
                    await source.read("obj", 100, 50, listed.version)
                assert [r.status for r in gcs.requests()][-1] == 412
            finally:
                await source.aclose()

        trio.run(main)


def test_zarr_over_http(tmp_path, mount):
    """A Zarr v3 store: the v3 view over HTTP equals the local one, and zarr-python reads it."""
    import zarr

    from unshardfs.testing.zarr import BYTES_LE, ZCase, codec, consolidate
    from unshardfs.testing.zarr import sharding as zsharding
    from unshardfs.testing.zarr import write_case, write_group

    case = ZCase((40, 30), "uint16", (20, 15), [zsharding((10, 5), [BYTES_LE, codec("zstd", level=1)])], (10, 5),
                 [BYTES_LE, codec("zstd", level=1)])
    write_group(tmp_path / "sharded")
    data = write_case(tmp_path, "arr", case)
    consolidate(tmp_path / "sharded")
    with DatasetServer(tmp_path) as srv:
        remote = mount(f"zarr3://{srv.url}/sharded")
        here = mount(tmp_path / "sharded")
        assert sorted(os.listdir(remote.path)) == ["arr", "zarr.json"]  # from consolidated metadata
        np.testing.assert_array_equal(zarr.open_array(str(remote.path / "arr"), mode="r")[...], data)
        assert assert_same_tree(remote.path, here.path) > 5


@pytest.fixture
def s3(site, monkeypatch):
    """moto's S3 server on 127.0.0.1, holding the site under bucket 'bkt'."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    with moto_s3() as (endpoint, client):
        upload(client, "bkt", site[0])
        yield endpoint


def test_s3_listing_and_reads(site, s3, mount):
    root, volume, meshes = site
    remote = mount("s3://bkt/volume/sharded", "--s3-endpoint", s3)
    assert_same_tree(remote.path, volume["plain"], ("info",))
    objects = mount("s3://bkt/meshes/sharded", "--s3-endpoint", s3)
    assert_same_tree(objects.path, meshes["plain"], ("info", "mesh/info"))


def test_source_urls():
    from unshardfs.core.registry import split_format
    from unshardfs.sources import RemoteOptions, open_source
    from unshardfs.sources.objectstore import GcsSource, S3Source
    from unshardfs.util.errors import ConfigError

    assert split_format("zarr3://gs://bkt/x") == ("zarr", "gs://bkt/x")
    gcs = open_source("gs://my-bucket/some/data/")
    assert isinstance(gcs, GcsSource) and gcs.object_url("info") == \
        "https://storage.googleapis.com/my-bucket/some/data/info"
    s3 = open_source("s3://bkt/p", RemoteOptions(s3_endpoint="http://minio:9000"))
    assert isinstance(s3, S3Source) and s3.object_url("a b") == "http://minio:9000/bkt/p/a%20b"
    assert open_source("s3://bkt").object_url("k").startswith("https://bkt.s3.")  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="bucket"):
        open_source("gs:///x")
    with pytest.raises(ConfigError, match="unsupported source scheme"):
        open_source("ftp://host/x")


def test_requests_run_concurrently(site, server, mount):
    """Parallel readers on a slow server: their requests are in flight together, within --concurrency."""
    from concurrent.futures import ThreadPoolExecutor

    root, volume, _ = site
    m = mount(f"{server.url}/volume/sharded", "--concurrency", "4")
    names = sorted(os.listdir(m.path / "1_1_1"))
    server.faults.delay = 0.05
    server.max_in_flight = 0
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda n: (m.path / "1_1_1" / n).read_bytes(), names[:24]))
    assert got == [(volume["plain"] / "1_1_1" / n).read_bytes() for n in names[:24]]
    assert 2 <= server.max_in_flight <= 4


def test_whole_object_fallback_has_a_limit(site, server):
    """A server ignoring Range is read up to the limit into an object, with a clear error beyond."""
    import trio

    from unshardfs.sources.http import HttpOptions, HttpSource
    from unshardfs.util.errors import SourceError

    root, volume, _ = site
    server.faults.no_range = True
    shard = sorted((volume["sharded"] / "1_1_1").glob("*.shard"))[0]
    path = f"volume/sharded/1_1_1/{shard.name}"

    async def read(limit: int) -> bytes:
        source = HttpSource(server.url, HttpOptions(whole_object_limit=limit))
        try:
            return await source.read(path, 10, 20)
        finally:
            await source.aclose()

    assert trio.run(read, 1 << 30) == shard.read_bytes()[10:30]
    assert trio.run(read, 30) == shard.read_bytes()[10:30]
    with pytest.raises(SourceError, match="ignores Range requests"):
        trio.run(read, 29)


def test_a_stat_with_its_tail_is_one_request(tmp_path):
    """`stat_tail` (how a Zarr shard's index comes with its stat): one suffix-range GET whose stat
    equals a HEAD's; a known stat costs nothing; short, empty and absent objects, and a server
    that ignores Range, are statted right (the last two with the HEAD as before, nothing read)."""
    import trio

    from unshardfs.sources.http import HttpSource
    from unshardfs.util.errors import SourceError

    data = np.random.default_rng(3).bytes(10_000)
    (tmp_path / "obj").write_bytes(data)
    (tmp_path / "small").write_bytes(data[:100])
    (tmp_path / "empty").write_bytes(b"")
    with DatasetServer(tmp_path) as srv:
        def sent() -> list[tuple[str, str | None]]:
            out = [(r.method, r.range) for r in srv.requests()]
            srv.reset_log()
            return out

        async def main() -> None:
            headed, source = HttpSource(srv.url), HttpSource(srv.url)
            try:
                assert await source.stat_tail("obj", 300) == (await headed.stat("obj"), data[-300:])
                assert sent() == [("GET", "bytes=-300"), ("HEAD", None)]
                assert await source.stat_tail("obj", 300) == (await headed.stat("obj"), None)  # known
                assert sent() == []
                st, tail = await source.stat_tail("small", 300)
                assert (st and st.size, tail) == (100, data[:100])  # the object is shorter than the tail
                assert await source.stat_tail("absent", 300) == (None, None)
                assert await source.stat("absent") is None
                assert sent() == [("GET", "bytes=-300"), ("GET", "bytes=-300")]
                st, tail = await source.stat_tail("empty", 300)  # 416: nothing to suffix
                assert (st and st.size, tail) == (0, None)
                assert sent() == [("GET", "bytes=-300"), ("HEAD", None)]
                srv.faults.no_range = True
                fresh = HttpSource(srv.url)
                try:
                    assert await fresh.stat_tail("obj", 300) == (await headed.stat("obj"), None)
                    assert fresh.counters.bytes == 0  # the 200's body was not read
                    sent()
                    assert await fresh.stat_tail("small", 300) == (await headed.stat("small"), None)
                    assert sent() == [("HEAD", None), ("HEAD", None)]  # remembered: no suffix asked again
                finally:
                    await fresh.aclose()
                srv.faults.no_range = False
                srv.faults.error_every, srv.faults.error_status = 1, 403
                refused = HttpSource(srv.url)
                try:
                    with pytest.raises(SourceError, match="HTTP 403"):
                        await refused.stat_tail("obj", 300)
                finally:
                    await refused.aclose()
                assert len(sent()) == 1  # the error, once: no HEAD to meet it again
            finally:
                await source.aclose()
                await headed.aclose()

        trio.run(main)


def test_stats_of_one_object_asked_together_are_one_head(tmp_path: Path) -> None:
    """Readers looking up chunks of one cold shard at once stat it together: one HEAD, whose answer
    (an absence too) all of them get; later stats come from the stat cache."""
    import trio

    from unshardfs.sources.http import HttpSource

    (tmp_path / "obj").write_bytes(b"x" * 1000)
    with DatasetServer(tmp_path) as srv:
        async def main() -> dict[str, list[int | None]]:
            source = HttpSource(srv.url)
            got: dict[str, list[int | None]] = {"obj": [], "absent": []}
            try:
                async def stat(path: str) -> None:
                    st = await source.stat(path)
                    got[path].append(st and st.size)

                async with trio.open_nursery() as nursery:
                    for path in ("obj", "absent") * 8:
                        nursery.start_soon(stat, path)
                await stat("obj")
            finally:
                await source.aclose()
            return got

        assert trio.run(main) == {"obj": [1000] * 9, "absent": [None] * 8}
        assert sorted((r.method, r.path) for r in srv.requests()) == [("HEAD", "/absent"), ("HEAD", "/obj")]


def test_timeouts_end_in_eio(site, server, mount):
    root, volume, _ = site
    m = mount(f"{server.url}/volume/sharded", "--timeout", "0.2", "--retries", "1", "--backoff", "0")
    name = sorted(os.listdir(volume["plain"] / "2_2_2"))[0]
    server.faults.delay = 0.5
    with pytest.raises(OSError) as e:
        (m.path / "2_2_2" / name).read_bytes()
    assert e.value.errno == errno.EIO
    assert "Timeout" in m.log_text()
    server.faults.delay = 0
    assert (m.path / "2_2_2" / name).read_bytes() == (volume["plain"] / "2_2_2" / name).read_bytes()


def test_dvid_export_over_gcs(tmp_path, mount):
    """DVID exports need listing: over gs:// they mount like local ones; plain HTTP is refused clearly."""
    from tests.formats.dvid.test_mount import SHARDING, VARIANTS, read_tensorstore
    from unshardfs.testing.dvid import BLOCK, agglomerate, encode_volume, info_for, sample_volume, write_scale
    from unshardfs.testing.mounts import run_cli

    size = (128, 128, 64)
    vol = sample_volume(size, 2)
    site = tmp_path / "site"  # served; the mounts live outside it
    write_scale(site / "export" / "s0", encode_volume(vol), tuple(-(-s // BLOCK) for s in size), SHARDING,
                VARIANTS["csv-stream-zstd"])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(info_for([size], SHARDING)))
    with DatasetServer(site, gcs_bucket="bkt") as gcs:
        m = mount("gs://bkt/export", "--gcs-endpoint", gcs.url, "--info", str(spec))
        np.testing.assert_array_equal(read_tensorstore(m.path, 0), agglomerate(vol))
        mnt = tmp_path / "mnt-http"
        mnt.mkdir()
        result = run_cli("mount", "--info", str(spec), f"{gcs.url}/b/export", str(mnt))
        assert result.returncode == 1 and "need a source that can list" in result.stderr


def test_redirects_are_followed(site, server, mount):
    root, volume, _ = site
    server.faults.moved = "/old"
    m = mount(f"{server.url}/old/volume/sharded")
    assert_same_tree(m.path, volume["plain"], ("info",))
    assert any(r.status == 301 for r in server.requests())


@pytest.mark.parametrize("tag", ["strong", "weak", "date"])
def test_versioned_reads_check_the_tag_without_refusing_a_weak_one(tmp_path, tag):
    """A read made with an object's version is one request whether its ETag is strong (sent in
    If-Match), weak (If-Match would refuse it on every read: compared with the answer's tag
    instead) or missing (Last-Modified, sent in If-Unmodified-Since); either way a replaced
    object is StaleError, never its new bytes."""
    import os

    import trio

    from unshardfs.sources.http import HttpSource
    from unshardfs.util.errors import StaleError

    data = np.random.default_rng(5).bytes(4096)
    (tmp_path / "obj").write_bytes(data)
    with DatasetServer(tmp_path) as srv:
        srv.faults.weak_etags = tag == "weak"
        srv.faults.no_etags = tag == "date"

        async def main() -> None:
            source = HttpSource(srv.url)
            try:
                st = await source.stat("obj")
                assert st is not None and st.version is not None
                assert str(st.version[0]).startswith(("W/", '"')[["weak", "strong"].index(tag)]) if tag != "date" \
                    else "GMT" in str(st.version[0])
                srv.reset_log()
                assert await source.read("obj", 100, 50, st.version) == data[100:150]
                assert [(r.method, r.status) for r in srv.requests()] == [("GET", 206)]
                replacement = tmp_path / "obj.new"
                replacement.write_bytes(data[::-1])
                later = (tmp_path / "obj").stat().st_mtime + 10  # Last-Modified counts whole seconds
                os.utime(replacement, (later, later))
                os.replace(replacement, tmp_path / "obj")
                with pytest.raises(StaleError):
                    await source.read("obj", 100, 50, st.version)
            finally:
                await source.aclose()

        trio.run(main)
