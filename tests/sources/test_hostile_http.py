"""HTTP sources against a server that misbehaves on purpose (`HostileServer`): every hostile answer
ends in a SourceError (EIO through a mount) or an absent object, within a bounded time and memory,
never a request to another host, and the daemon goes on serving the other files."""

from __future__ import annotations

import errno
import os
import re
import time
import tracemalloc
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

import numpy as np
import pytest
import trio

from tests.support.memory import daemon_peak_rss
from unshardfs.sources import open_source
from unshardfs.sources.http import HttpOptions, HttpSource, redirect_refusal
from unshardfs.sources.objectstore import GcsSource, S3Source
from unshardfs.testing.hostile_http import HostileServer, stacked_gzip_bomb
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.util.errors import ConfigError, SourceError

pytestmark = pytest.mark.timeout(120)

SCALES = [Scale((64, 64, 32), (16, 16, 16), sharding(minishard=1, shard=1, data_enc="gzip")),
          Scale((32, 32, 16), (16, 16, 16), sharding(minishard=1, shard=1), resolution=(2, 2, 2))]
# Small budgets so that every hostile case ends quickly: one retry, a 1.5 s deadline per request.
FAST = HttpOptions(timeout=2.0, retries=1, backoff=0.0, deadline=1.5)
# For answers that must succeed, also on a loaded machine.
PATIENT = HttpOptions(timeout=10.0, retries=2, backoff=0.0)
MAX_DAEMON_RSS = 400 << 20

T = TypeVar("T")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A served directory: a sharded volume (with its unsharded twin) and a 64 KiB `blob`."""
    root = tmp_path_factory.mktemp("hostile-site")
    volume = write_volume(root / "volume", SCALES, "uint16")
    blob = np.random.default_rng(7).bytes(1 << 16)
    (root / "blob").write_bytes(blob)
    return root, volume, blob


@pytest.fixture
def hostile(site):
    with HostileServer(site[0]) as srv:
        srv.target = "blob"
        yield srv


@pytest.fixture
def witness(site):
    """A second server on another address, serving the same data: nothing may ever reach it."""
    with HostileServer(site[0], host="127.0.0.2") as srv:
        yield srv


def run(source: HttpSource, action: Callable[[HttpSource], Awaitable[T]]) -> T:
    async def main() -> T:
        try:
            return await action(source)
        finally:
            await source.aclose()
    return trio.run(main)


def read_blob(url: str, options: HttpOptions = FAST) -> bytes:
    return run(HttpSource(url, options), lambda s: s.read("blob", 1000, 4096))


def fails_bounded(hostile, mode: str, error: str, action: Callable[[], object]) -> None:
    """`action` against the server misbehaving in `mode` raises a SourceError saying `error`,
    within 10 s and 8 MiB (both sides traced); the server behaves again afterwards."""
    hostile.mode = mode
    stacked_gzip_bomb()  # built (and cached) before measuring: the server's memory is traced too
    started = time.monotonic()
    tracemalloc.start()
    try:
        with pytest.raises(SourceError, match=re.escape(error)):
            action()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        hostile.mode = None
    assert time.monotonic() - started < 10
    assert peak < 8 << 20, f"{peak:,} bytes allocated for 4 KiB"


@pytest.mark.parametrize("mode, error", [
    ("stacked-gzip", "refusing Content-Encoding 'gzip, gzip'"),
    ("endless", "server sent more bytes than the 4096 bytes at 1000 asked for"),
    ("other-offset", "asked for bytes 1000-5095, server sent 4096 bytes as 'bytes 1001-5096/65536'"),
    ("bad-content-range", "asked for bytes 1000-5095, server sent 4096 bytes as 'bytes 1000-5094/65536'"),
    ("drip", "no complete answer within the 1.5 s deadline"),
    ("huge-error", "HTTP 500 (after 2 attempts)"),
])
def test_hostile_answers_are_errors_in_bounded_time_and_memory(site, hostile, mode, error):
    fails_bounded(hostile, mode, error, lambda: read_blob(hostile.url))
    assert read_blob(hostile.url, PATIENT) == site[2][1000:5096]


TAIL = 4096
TAIL_AT = (1 << 16) - TAIL  # where the blob's last TAIL bytes start


@pytest.mark.parametrize("mode, error", [
    ("stacked-gzip", "refusing Content-Encoding 'gzip, gzip'"),
    ("endless", f"server sent more bytes than the {TAIL} bytes at {TAIL_AT} asked for"),
    ("other-offset", f"asked for bytes {TAIL_AT}-65535, server sent 4095 bytes as 'bytes {TAIL_AT + 1}-65535/65536'"),
    ("bad-content-range", f"asked for bytes {TAIL_AT}-65535, server sent 4096 bytes as 'bytes {TAIL_AT}-65534/65536'"),
    ("drip", "no complete answer within the 1.5 s deadline"),
    ("huge-error", "HTTP 500 (after 2 attempts)"),
])
def test_hostile_answers_to_a_stat_with_its_tail_are_errors_in_bounded_time_and_memory(site, hostile, mode, error):
    """`stat_tail` (a suffix range: a Zarr shard's stat and index in one request) checks its
    answer as a read does: the bytes must be the last ones, as many as asked, as Content-Range says."""
    fails_bounded(hostile, mode, error, lambda: run(HttpSource(hostile.url, FAST), lambda s: s.stat_tail("blob", TAIL)))
    st, tail = run(HttpSource(hostile.url, PATIENT), lambda s: s.stat_tail("blob", TAIL))
    assert st is not None and st.size == 1 << 16 and tail == site[2][TAIL_AT:]


def test_deadline_defaults_to_four_timeouts():
    assert HttpOptions(timeout=3).request_deadline() == 12
    assert HttpOptions(timeout=3, deadline=1).request_deadline() == 1


def test_keys_are_requested_exactly_or_not_at_all(hostile):
    """Keys that would be normalised into another path are absent to stat and an error to read, and
    never requested; every other key goes on the wire exactly, one quoted segment per key segment."""
    wire = {"a b/c%d": "/ds/a%20b/c%25d", "%2e%2e/x": "/ds/%252e%252e/x", "q?#": "/ds/q%3F%23",
            "...": "/ds/...", "x:y": "/ds/x%3Ay"}

    async def main(source: HttpSource) -> None:
        for path in ("../x", "a/../../y", "a//z", "./w", "a/.", "x/", "a\0b", "bad\udcff"):
            assert await source.stat(path) is None, path
            with pytest.raises(SourceError, match="not requested"):
                await source.read(path, 0, 10)
        assert hostile.arrived == []
        for path in wire:
            assert await source.stat(path) is None  # 404
    run(HttpSource(f"{hostile.url}/ds", PATIENT), main)
    assert hostile.arrived == list(wire.values())


@pytest.mark.parametrize("current, location, follow, allowed", [
    ("http://h/a/b", "/c", True, True),
    ("http://h/a/b", "c", True, True),
    ("https://h:8443/a", "https://h:8443/c", True, True),
    ("https://h/a", "http://h/a", True, False),  # never down to clear text
    ("http://h/a", "https://h/a", True, False),
    ("http://h/a", "http://h:81/a", True, False),
    ("http://h/a", "//evil/x", True, False),
    ("http://h/a", "http://h@evil/a", True, False),
    ("http://h/a", "http://[::1/a", True, False),  # not a URL at all
    ("http://h/a", "/c", False, False),  # object stores follow none
])
def test_redirect_policy(current, location, follow, allowed):
    refusal = redirect_refusal(current, location, follow)
    assert (refusal is None) == allowed
    assert refusal is None or refusal.startswith("refused redirect to")


def test_no_redirect_reaches_another_host(hostile, witness, monkeypatch):
    hostile.mode, hostile.redirect_to = "redirect", witness.url
    with pytest.raises(SourceError, match=f"refused redirect to {re.escape(witness.url)}/blob"):
        read_blob(hostile.url)
    # Object stores follow no redirect at all, even one to their own host; their SigV4 headers stay home.
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    for redirect_to in (witness.url, hostile.url):
        hostile.redirect_to = redirect_to
        s3 = S3Source("bkt", "", FAST, endpoint=hostile.url)
        with pytest.raises(SourceError, match=f"refused redirect to {re.escape(redirect_to)}/bkt/blob"):
            run(s3, lambda s: s.read("blob", 0, 10))
    assert witness.arrived == []


@pytest.mark.parametrize("url", ["http://h/ds?x=1", "http://h/ds#part", "http:///ds", "https://[::1/ds"])
def test_unusable_http_urls_are_refused(url):
    """Keys are appended to the path: a query or fragment would swallow them."""
    with pytest.raises(ConfigError, match="invalid URL"):
        open_source(url)


def test_credentials_go_to_the_endpoint_only():
    assert GcsSource("bkt", "ds").credential_origin == ("https", "storage.googleapis.com", None)
    assert GcsSource("bkt", "ds", endpoint="http://127.0.0.1:9").credential_origin == ("http", "127.0.0.1", 9)
    assert S3Source("bkt", "", endpoint="http://minio:9000").credential_origin == ("http", "minio", 9000)


# -- listings -------------------------------------------------------------------


def gcs_names(server: HostileServer, mode: str, max_pages: int | None = None) -> dict[str, bool]:
    """gs://bkt/ds's root listing from `server` misbehaving as `mode`: {name: is_dir}."""
    server.mode, server.target = mode, "/storage/v1/b/"
    source = GcsSource("bkt", "ds", FAST, endpoint=server.url)
    if max_pages:
        source.max_pages = max_pages

    async def names(s: GcsSource) -> dict[str, bool]:
        return {name: st.is_dir async for name, st in s.list("")}
    return run(source, names)


def test_listing_skips_names_that_are_no_file_names(hostile):
    assert gcs_names(hostile, "bad-names") == {"dir": True, "good": False}


@pytest.mark.parametrize("mode, error, pages", [
    ("repeat-token", "server repeated page token", 2),
    ("endless-tokens", "more than 20 pages", 20),
    ("endless", "a page of more than 8 MiB", 1),
])
def test_listings_that_never_end_are_errors(hostile, mode, error, pages):
    started = time.monotonic()
    with pytest.raises(SourceError, match=error):
        gcs_names(hostile, mode, max_pages=20)
    assert len(hostile.arrived) == pages
    assert time.monotonic() - started < 10


# -- through a real mount ---------------------------------------------------------


# Hostile answers to a shard's requests through a mount, and what the daemon's log must say.
THROUGH_A_MOUNT = [
    ("stacked-gzip", "refusing Content-Encoding"),
    ("endless", "server sent more bytes than"),
    ("other-offset", "asked for bytes"),
    ("bad-content-range", "asked for bytes"),
    ("drip", "deadline"),
    ("huge-error", "HTTP 500"),
    ("redirect", "refused redirect to http://127.0.0.2:"),
]


def fails_soon_and_alone(m, victim: Path, cause: str, healthy: dict[Path, Path], witness) -> None:
    """Reading `victim` is EIO within 30 s for `cause` (in the daemon's log); the daemon lives on
    with bounded memory, each of `healthy` (mounted path -> expected file) reads right, and
    nothing reached the witness server."""
    started = time.monotonic()
    with pytest.raises(OSError) as e:
        victim.read_bytes()
    assert e.value.errno == errno.EIO
    assert time.monotonic() - started < 30
    assert cause in m.log_text()
    for mounted, expected in healthy.items():
        assert mounted.read_bytes() == expected.read_bytes()
    assert daemon_peak_rss(m.path) < MAX_DAEMON_RSS
    assert witness.arrived == []


@pytest.mark.parametrize("mode, cause", THROUGH_A_MOUNT)
def test_hostile_shards_through_a_mount(site, hostile, witness, mount, mode, cause):
    """A chunk whose shard is served hostile is EIO, soon, for the right reason; the daemon lives on
    with bounded memory, other files read correctly, and no request reaches another host."""
    volume = site[1]
    stacked_gzip_bomb()  # built before the daemon asks for it (~2 s)
    hostile.target, hostile.redirect_to = "/2_2_2/", witness.url
    # --timeout 1: a 4 s deadline per request (a dripped answer ends there).
    m = mount(f"{hostile.url}/volume/sharded", "--timeout", "1", "--retries", "2", "--backoff", "0")
    hostile.mode = mode
    victim = min(os.listdir(volume["plain"] / "2_2_2"))
    healthy = {m.path / "1_1_1" / name: volume["plain"] / "1_1_1" / name
               for name in sorted(os.listdir(volume["plain"] / "1_1_1"))[:3]}
    fails_soon_and_alone(m, m.path / "2_2_2" / victim, cause, healthy, witness)


@pytest.fixture(scope="module")
def zarr_site(site):
    """A sharded Zarr v3 array (zarr-python, 2 x 2 shards, index at the end) under the site."""
    from unshardfs.testing.zarr import BYTES_LE, ZCase
    from unshardfs.testing.zarr import sharding as zsharding
    from unshardfs.testing.zarr import write_case

    case = ZCase((40, 30), "uint16", (20, 15), [zsharding((10, 5), [BYTES_LE])], (10, 5), [BYTES_LE], holes=False)
    write_case(site[0] / "zarr", "arr", case)
    return site[0] / "zarr"


@pytest.mark.parametrize("mode, cause", THROUGH_A_MOUNT)
def test_hostile_zarr_shards_through_a_mount(zarr_site, hostile, witness, mount, mode, cause):
    """The same for a Zarr shard, whose first request is its stat and index together (a suffix
    range): hostile answers to it are EIO for the right reason, the rest of the array reads."""
    stacked_gzip_bomb()
    hostile.target, hostile.redirect_to = "/arr/c/1/", witness.url
    m = mount(f"zarr3://{hostile.url}/zarr/sharded/arr", "--timeout", "1", "--retries", "2", "--backoff", "0")
    hostile.mode = mode
    plain = zarr_site / "plain" / "arr" / "c"
    healthy = {m.path / "c" / name: plain / name for name in ("0/0", "0/1", "1/2")}  # in shard c/0/0
    fails_soon_and_alone(m, m.path / "c" / "2" / "0", cause, healthy, witness)  # inner (2, 0): shard c/1/0
