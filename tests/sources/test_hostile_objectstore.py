"""Object stores holding hostile names (moto's S3 server with keys such as `ds/../x`) and hostile
bucket names: listings never yield a name that is not one file name, nothing is requested outside
the source, `export` writes nothing outside DEST, and a bad bucket name is a one-line error before
any connection."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import trio

from unshardfs.sources import RemoteOptions, open_source
from unshardfs.sources.objectstore import S3Source
from unshardfs.testing.mounts import run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.util.errors import ConfigError, SourceError

pytestmark = pytest.mark.timeout(180)

SCALES = [Scale((32, 32, 32), (16, 16, 16), sharding(minishard=1, shard=1, data_enc="gzip"))]
# Keys that a listing would turn into '..', '.', '' or NUL names, or that httpx (or the server)
# would normalise into another prefix; each object says where it would escape to.
HOSTILE_KEYS = ["ds/../x", "ds/a/../../y", "ds//z", "ds/./w", "ds/n\0ul", "ds/1_1_1/../../../up",
                "ds/1_1_1//twice"]


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    return write_volume(tmp_path_factory.mktemp("hostile-store") / "volume", SCALES, "uint8")


@pytest.fixture(scope="module")
def endpoint(volume):
    """moto's S3 on 127.0.0.1: bucket 'bkt' holds the sharded volume under ds/, and the hostile keys."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1"}.items():
            env.setenv(name, value)
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        client.create_bucket(Bucket="bkt")
        for path in volume["sharded"].rglob("*"):
            if path.is_file():
                client.put_object(Bucket="bkt", Key=f"ds/{path.relative_to(volume['sharded'])}",
                                  Body=path.read_bytes())
        for key in HOSTILE_KEYS:
            client.put_object(Bucket="bkt", Key=key, Body=f"escaped via {key!r}".encode())
        assert set(HOSTILE_KEYS) <= {o["Key"] for o in client.list_objects_v2(Bucket="bkt")["Contents"]}
        try:
            yield url
        finally:
            server.stop()


def listing(source: S3Source, path: str) -> dict[str, bool]:
    async def main() -> dict[str, bool]:
        try:
            return {name: st.is_dir async for name, st in source.list(path)}
        finally:
            await source.aclose()
    return trio.run(main)


def test_listings_yield_no_hostile_names(endpoint):
    def ls(path: str) -> dict[str, bool]:
        return listing(S3Source("bkt", "ds", endpoint=endpoint), path)

    # 'a' is a real prefix (of ds/a/../../y); '..', '.', '' and NUL never appear.
    assert ls("") == {"info": False, "1_1_1": True, "a": True}
    assert ls("a") == {}
    names = ls("1_1_1")
    assert names and all(name.endswith(".shard") and not is_dir for name, is_dir in names.items())


def test_hostile_keys_are_never_requested(endpoint):
    source = S3Source("bkt", "ds", endpoint=endpoint)

    async def main() -> None:
        try:
            for path in ("../x", "a/../../y", "/z", "./w", "1_1_1/../../../up"):
                assert await source.stat(path) is None
                with pytest.raises(SourceError, match="not requested"):
                    await source.read(path, 0, 100)
        finally:
            await source.aclose()
    trio.run(main)
    assert source.counters.requests == 0


def outside(root: Path, dest: Path) -> dict[str, bytes | None]:
    """Everything under `root` but not in `dest`: files with their bytes, directories as None."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*")) if p != dest and dest not in p.parents}


def test_export_writes_only_inside_dest(volume, endpoint, tmp_path):
    """DEST three levels down, so that every hostile key's escape would land inside tmp_path."""
    dest = tmp_path / "a" / "b" / "dest"
    dest.parent.mkdir(parents=True)
    (tmp_path / "keep").write_text("untouched")
    before = outside(tmp_path, dest)
    result = run_cli("export", "-q", "s3://bkt/ds", str(dest), "--s3-endpoint", endpoint, timeout=120)
    # Skipped names are reported (exit status 1), without a traceback.
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr
    assert outside(tmp_path, dest) == before
    plain = volume["plain"]
    for name in os.listdir(plain / "1_1_1"):
        assert (dest / "1_1_1" / name).read_bytes() == (plain / "1_1_1" / name).read_bytes()
    assert b"escaped" not in b"".join(p.read_bytes() for p in dest.rglob("*") if p.is_file())


@pytest.fixture
def listener():
    """A TCP port that records whether anything connected to it (nothing may)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        sock.setblocking(False)
        yield sock
        with pytest.raises(BlockingIOError):
            sock.accept()  # a connection attempt would be waiting here


@pytest.mark.parametrize("url", ["s3://127.0.0.1:{port}#/ds", "s3://127.0.0.1/ds", "s3://a?b/ds", "s3://Bkt/ds",
                                 "s3://bkt-/ds", "s3://a..b/ds", "s3://a_b/ds", "gs://UPPER/x", "gs://a..b/x", "s3://ab/ds", "gs://x/y",
                                 "gs://a@b/x", "gs://-ab/x", "gs://" + "a" * 64 + "/x"])
def test_bad_bucket_names_fail_before_any_connection(listener, url):
    port = listener.getsockname()[1]
    url = url.format(port=port)
    endpoint = f"http://127.0.0.1:{port}"
    options = RemoteOptions(s3_endpoint=endpoint if "{port}" not in url else None, gcs_endpoint=endpoint)
    with pytest.raises(ConfigError, match="bucket name"):
        open_source(url, options)
    # The CLI says so in one line; the endpoint given for the store is never contacted either.
    result = run_cli("inspect", url, "--s3-endpoint", endpoint, "--gcs-endpoint", endpoint)
    assert result.returncode == 1
    assert result.stderr.startswith("unshardfs: invalid") and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("url", ["s3://bkt/../other", "gs://bkt/ds/./x", "gs://bkt/a//b"])
def test_bad_prefixes_are_refused(listener, url):
    with pytest.raises(ConfigError, match="prefix"):
        open_source(url, RemoteOptions(s3_endpoint="http://127.0.0.1:1", gcs_endpoint="http://127.0.0.1:1"))


def test_good_bucket_names_pass():
    for url in ("s3://my-bucket.data/x", "gs://my_bucket-1/x", "gs://" + ".".join(["a" * 60] * 3) + "/x"):
        open_source(url)
    assert open_source("s3://my.bucket/ds").object_url("k") == "https://s3.us-east-1.amazonaws.com/my.bucket/ds/k"
