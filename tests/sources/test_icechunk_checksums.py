"""Virtual references with checksums (an ETag, or the object's modification time), written by the `icechunk`
package into an object an HTTP server serves and into a local file: read while the object is the one the
writer recorded (an ETag costs no request of its own: the ranged GET carries `If-Match`), EIO with one line
once it has changed, never bytes of another object."""

from __future__ import annotations

import email.utils
import errno
import os
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import trio

from tests.support.icechunk_repos import body_of, needs_icechunk, reframe, write_checksummed
from unshardfs.sources import LocalSource, RemoteOptions, open_source
from unshardfs.sources.base import ByteSource
from unshardfs.sources.icechunk import IcechunkOptions, IcechunkSource, open_icechunk
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.tree.edge import classify
from unshardfs.util.errors import DataError

pytestmark = needs_icechunk

DATA = bytes(range(256))
ETAGGED = ("v/c/0/0", "v/c/1/0", "v/c/4/0")  # quoted, unquoted and weak forms of the server's ETag
DATED, UNCHECKED, LOCAL = "v/c/2/0", "v/c/3/0", "w/c/0/0"


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[DatasetServer, Path]]:
    """A server of `data.bin`, and a repository whose virtual references the writer made against it (and
    against `local.bin` beside it), with the checksums the server and the file system gave then."""
    objects = tmp_path / "objects"
    objects.mkdir()
    (objects / "data.bin").write_bytes(DATA)
    local = tmp_path / "local" / "local.bin"
    local.parent.mkdir()
    local.write_bytes(DATA)
    with DatasetServer(objects) as server:
        head = urllib.request.urlopen(urllib.request.Request(f"{server.url}/data.bin", method="HEAD"))
        etag = head.headers["ETag"]
        modified = int(email.utils.parsedate_to_datetime(head.headers["Last-Modified"]).timestamp())
        assert etag.startswith('"')
        write_checksummed(tmp_path / "repo", f"{server.url}/data.bin", etag, modified, local)
        yield server, tmp_path


def _opener(url: str) -> ByteSource:
    if url.startswith("file://"):
        return LocalSource(url[len("file://"):])
    return open_source(url, RemoteOptions())


def _open(server: DatasetServer, base: Path) -> IcechunkSource:
    options = IcechunkOptions((f"{server.url}/", f"file://{base / 'local'}/"))

    async def main() -> IcechunkSource:
        return await open_icechunk(LocalSource(str(base / "repo")), "", "", None, None,
                                   url=f"file://{base / 'repo'}", options=options, open_url=_opener)
    return trio.run(main)


def _read(source: IcechunkSource, key: str) -> bytes:
    async def main() -> bytes:
        return await source.read(key, 0, 100)
    return trio.run(main)


def _row(row: int, data: bytes = DATA) -> bytes:
    return data[16 + 8 * row:24 + 8 * row]


def test_unchanged_objects_are_read_and_an_etag_costs_no_request_of_its_own(served):
    server, base = served
    source = _open(server, base)
    try:
        for key in ETAGGED:
            server.reset_log()
            assert _read(source, key) == _row(int(key.split("/")[2]))
            # the ranged GET alone (with If-Match), except for a weak tag: If-Match compares strongly, so
            # that one is compared with the object's stat (a HEAD) first
            assert [r.method for r in server.requests()] == (["HEAD", "GET"] if key == "v/c/4/0" else ["GET"])
        assert _read(source, DATED) == _row(2)
        assert _read(source, UNCHECKED) == _row(3)
        assert _read(source, LOCAL) == DATA[4:12]
    finally:
        trio.run(source.aclose)


def test_changed_objects_are_eio_with_one_line_never_other_bytes(served):
    """The served object and the local file are rewritten after the repository was written: every reference
    with a checksum fails with a DataError (EIO, expected damage: logged once by the front end) naming the
    reference and the checksum; the one without a checksum reads the new object's bytes, as icechunk does."""
    server, base = served
    changed = bytes(reversed(DATA))
    later = os.stat(base / "objects" / "data.bin").st_mtime + 3 * 86400
    for path in (base / "objects" / "data.bin", base / "local" / "local.bin"):
        path.write_bytes(changed)
        os.utime(path, (later, later))
    source = _open(server, base)
    try:
        for key in (*ETAGGED, DATED, LOCAL):
            with pytest.raises(DataError) as caught:
                _read(source, key)
            text = str(caught.value)
            assert "\n" not in text and key in text, text
            assert ("ETag" if key != DATED else "last modified") in text, text
            failure = classify(caught.value)
            assert (failure.errno, failure.bug) == (errno.EIO, False)
        assert _read(source, UNCHECKED) == _row(3, changed)
        # nothing of the changed object was returned for a checked reference: each failed before its bytes
        assert source.stats()["icechunk"]["chunk_reads"] == 1
    finally:
        trio.run(source.aclose)


def test_a_server_that_ignores_if_match_is_caught_by_the_etag_it_answers_with(served):
    """A server that does not honour If-Match (it answers 206 from the new object) still names that object's
    ETag: the read is refused all the same."""
    server, base = served
    path = base / "objects" / "data.bin"
    path.write_bytes(bytes(reversed(DATA)))
    os.utime(path, (path.stat().st_mtime + 86400,) * 2)
    server.faults.no_if_match = True
    source = _open(server, base)
    server.reset_log()
    try:
        with pytest.raises(DataError, match="changed after the reference was written"):
            _read(source, "v/c/0/0")
        assert [r.status for r in server.requests()] == [206]
    finally:
        trio.run(source.aclose)


def test_through_a_mount_a_changed_object_is_eio_and_one_log_line(served, mount):
    """Mounted (with the server and the local folder allowed): once the served object has changed, its
    ETag-checked chunk is EIO however often it is read, with one line in the log; the unchecked chunk and
    the local file's chunk still read, and the daemon stays up."""
    server, base = served
    m = mount(base / "repo", "--icechunk-virtual", f"{server.url}/", "--icechunk-virtual",
              f"file://{base / 'local'}/")
    assert (m.path / LOCAL).read_bytes() == DATA[4:12]
    path = base / "objects" / "data.bin"
    path.write_bytes(bytes(reversed(DATA)))
    os.utime(path, (path.stat().st_mtime + 86400,) * 2)
    for _ in range(3):
        with pytest.raises(OSError) as info:
            (m.path / "v/c/0/0").read_bytes()
        assert info.value.errno == errno.EIO
    assert (m.path / UNCHECKED).read_bytes() == _row(3, bytes(reversed(DATA)))
    assert m.stats()  # the daemon answers
    lines = [line for line in m.log_text().splitlines() if "changed after the reference was written" in line]
    assert len(lines) == 1 and "v/c/0/0" in lines[0] and len(lines[0]) < 1000, lines


def test_an_etag_checksum_that_is_no_entity_tag_is_refused_without_a_request(served):
    """A manifest whose ETag checksum holds CR LF and another header field (a hostile repository): the
    reference is refused (DataError, EIO) before any request; nothing is sent in a header."""
    server, base = served
    etag = urllib.request.urlopen(urllib.request.Request(f"{server.url}/data.bin", method="HEAD")).headers["ETag"]
    hostile = (b'"' + b"a" * 10 + b"\r\nX-Evil: 1").ljust(len(etag) - 1, b"b") + b'"'  # as long: offsets stay
    changed = 0
    for path in (base / "repo" / "manifests").iterdir():
        data = path.read_bytes()
        body = body_of(data)
        if etag.encode() in body:  # the quoted tag, and inside the weak one
            path.write_bytes(reframe(data, body.replace(etag.encode(), hostile)))
            changed += 1
    assert changed == 1
    source = _open(server, base)
    server.reset_log()
    try:
        for key in ("v/c/0/0", "v/c/4/0"):
            with pytest.raises(DataError, match="not an entity tag"):
                _read(source, key)
        assert server.requests() == []
        assert _read(source, UNCHECKED) == _row(3)
    finally:
        trio.run(source.aclose)
