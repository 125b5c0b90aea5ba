"""Hostile Icechunk repositories, made from a real one: truncated and garbled snapshots and manifests, a
wrong magic, an unknown spec version, huge declared sizes and counts, a zstd bomb, refs naming missing
snapshots, node paths with `..` and NUL, virtual references leaving their allowed places. Each ends in a
one-line error (opening) or a DataError (serving: EIO), with bounded memory and nothing fetched outside
its place; through a real mount the damage stays with the files it touches and the daemon stays up."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
import trio

from tests.support.bombs import Bad, assert_contained, traced, zstd_zeros
from tests.support.icechunk_repos import HEADER, Written, body_of, needs_icechunk, reframe, write_repo
from unshardfs.sources import CountingSource, LocalSource
from unshardfs.sources.base import ByteSource
from unshardfs.sources.icechunk import IcechunkOptions, IcechunkSource, open_icechunk
from unshardfs.sources.icechunk.format import ChunkManifest, decode_id, decode_snapshot, encode_id
from unshardfs.util.errors import ConfigError, DataError, SourceError
from unshardfs.util.limits import DataLimits

MiB = 1 << 20
pytestmark = needs_icechunk


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Written:
    return write_repo(tmp_path_factory.mktemp("icechunk"))


@pytest.fixture
def repo(written, tmp_path) -> Path:
    """A copy of the written repository to damage (its virtual references still name the original's
    places: the outside one is `written.external`)."""
    root = tmp_path / "repo"
    shutil.copytree(written.root, root)
    return root


def _snapshot(root: Path, ref: str = "branch.main") -> Path:
    return root / "snapshots" / json.loads((root / "refs" / ref / "ref.json").read_text())["snapshot"]


def _manifest_of(root: Path, array: str, ref: str = "branch.main") -> Path:
    """The manifest holding `array`'s chunk references in `ref`'s snapshot."""
    snap = _snapshot(root, ref)
    found = decode_snapshot(body_of(snap.read_bytes()), "test")
    refs = found.nodes[array].array.manifests  # type: ignore[union-attr]
    assert len(refs) == 1
    return root / "manifests" / encode_id(refs[0].id)


def _open(root: Path, source: ByteSource | None = None, limits: DataLimits | None = None,
          version: str | None = None, **kw: object) -> IcechunkSource:
    return trio.run(lambda: open_icechunk(source or LocalSource(str(root)), "", "", version, limits,
                                          url=f"file://{root}", **kw))  # type: ignore[arg-type]


def _fails_at_open(root: Path, match: str, version: str | None = None) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        _open(root, version=version)
    text = str(info.value)
    assert "\n" not in text and len(text) < 1000
    return text


def _read(source: IcechunkSource, path: str, size: int = 1 << 20) -> bytes:
    return trio.run(source.read, path, 0, size)


def _huge_vector(body: bytes) -> bytes:
    """The snapshot body with its node vector claiming 2^32 - 1 nodes."""
    root = struct.unpack_from("<I", body, 0)[0]
    vtable = root - struct.unpack_from("<i", body, root)[0]
    field = struct.unpack_from("<H", body, vtable + 4 + 2 * 2)[0]  # slot 2: nodes
    at = root + field
    target = at + struct.unpack_from("<I", body, at)[0]
    return body[:target] + struct.pack("<I", 0xFFFFFFFF) + body[target + 4:]


DAMAGE: list[tuple[str, Callable[[bytes], bytes], str]] = [
    ("truncated", lambda d: d[:len(d) // 2], "truncated|zstd"),
    ("header only", lambda d: d[:HEADER - 5], "shorter than an Icechunk object header"),
    ("wrong magic", lambda d: reframe(d, magic=b"ICE?CHUNK".ljust(12, b"!")), "no Icechunk magic"),
    ("spec version 3", lambda d: reframe(d, version=3), "spec version 3 .* is not supported; unshardfs reads spec "
                                                         "versions 1, 2"),
    ("spec version 0", lambda d: reframe(d, version=0), "spec version 0"),
    ("a manifest", lambda d: reframe(d, file_type=2), "is a manifest, a snapshot was expected"),
    ("unknown compression", lambda d: reframe(d, compression=7), "compression 7 is not known"),
    ("garbled zstd", lambda d: d[:HEADER + 8] + bytes(b ^ 0x5A for b in d[HEADER + 8:HEADER + 40]) + d[HEADER + 40:],
     "zstd|outside|offset|vtable|UTF-8|required|elements"),
    ("root offset out of range", lambda d: reframe(d, struct.pack("<I", 1 << 30) + body_of(d)[4:]), "outside"),
    ("root offset zero", lambda d: reframe(d, bytes(4) + body_of(d)[4:]), "offset of 0"),
    ("huge node count", lambda d: reframe(d, _huge_vector(body_of(d))), "elements, more than"),
    ("uncompressed", lambda d: reframe(d, compression=0), None),  # type: ignore[list-item]
    ("another snapshot's id", lambda d: d, "its name says"),
]


@pytest.mark.parametrize("name, damage, match", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_snapshots_are_one_line(repo, written, name, damage, match):
    path = _snapshot(repo)
    if name == "another snapshot's id":
        other = _snapshot(repo, "tag.v1")
        path.write_bytes(other.read_bytes())
    else:
        path.write_bytes(damage(path.read_bytes()))
    if match is None:  # a valid variant: an uncompressed body reads the same
        source = _open(repo)
        assert _read(source, "zarr.json") == written.keys("branch.main")["zarr.json"]
        assert len(source.snapshot.nodes) >= 5
        trio.run(source.aclose)
        return
    _fails_at_open(repo, match)


@pytest.mark.parametrize("which", ["snapshot", "manifest"])
def test_every_single_byte_garbling_is_refused_or_decodes(repo, which):
    """Every byte of a real body flipped in turn: the decoders answer with a value or a DataError, never
    another exception, and never read outside the body."""
    if which == "snapshot":
        body = body_of(_snapshot(repo).read_bytes())

        def decode(data: bytes) -> None:
            decode_snapshot(data, "garbled")
    else:
        body = body_of(_manifest_of(repo, "img").read_bytes())

        def decode(data: bytes) -> None:
            manifest = ChunkManifest(data, "garbled")
            for node_id in manifest.arrays:
                list(manifest.refs_from(node_id, ()))
                manifest.find(node_id, (0, 0))
    decoded = refused = 0
    for i in range(len(body)):
        for flip in (0xFF, 0x80):
            data = body[:i] + bytes([body[i] ^ flip]) + body[i + 1:]
            try:
                decode(data)
                decoded += 1
            except DataError:
                refused += 1
    assert refused > 0 and decoded > 0


def test_huge_objects_are_refused_before_any_read(repo):
    """An object larger than --max-index-size is refused from its size alone (nothing of it read)."""
    path = _snapshot(repo)
    with path.open("r+b") as f:
        f.truncate(3 * MiB)  # sparse: costs no disk
    counted = CountingSource(LocalSource(str(repo)))
    with pytest.raises(ConfigError, match="exceeds the 2 MiB limit"):
        _open(repo, counted, DataLimits(index_bytes=2 * MiB))
    assert counted.counters.read_bytes < 4096  # the ref, not the snapshot


def test_zstd_bomb_manifest_stops_at_the_cap(repo):
    path = _manifest_of(repo, "img")
    header = path.read_bytes()[:HEADER]
    path.write_bytes(header + zstd_zeros(512 * MiB))  # 512 MiB of zeros in about 16 KiB

    async def main() -> object:
        source = await open_icechunk(LocalSource(str(repo)), "", "", None, DataLimits(index_bytes=8 * MiB))
        try:
            assert (await source.read("img/zarr.json", 0, 100)).startswith(b"{")  # the snapshot is intact
            return await source.read("img/c/0/0", 0, 100)
        finally:
            await source.aclose()
    result, peak = traced(main)
    assert isinstance(result, DataError) and "decodes to more than" in str(result)
    assert peak < 40 * MiB


def test_refs_naming_missing_snapshots(repo, caplog):
    missing = "A0000000000000000000"
    assert decode_id(missing) is not None
    main = repo / "refs" / "branch.main" / "ref.json"
    good = main.read_text()
    main.write_text(json.dumps({"snapshot": missing}))
    _fails_at_open(repo, "missing")
    main.write_text(good)
    (repo / "refs" / "tag.v1" / "ref.json").write_text(json.dumps({"snapshot": missing}))
    (repo / "refs" / "tag.bad").mkdir()
    (repo / "refs" / "tag.bad" / "ref.json").write_text('{"snapshot": "../../etc/passwd"}')
    (repo / "refs" / "branch.huge").mkdir()
    (repo / "refs" / "branch.huge" / "ref.json").write_bytes(b" " * (1 << 20))
    source = _open(repo)
    names = [v.name for v in trio.run(source.versions)]
    assert "branch.main" in names and "branch.dev" in names
    assert not {"tag.v1", "tag.bad", "branch.huge"} & set(names)
    assert trio.run(source.open_version, "tag.v1") is None
    logged = [r.getMessage() for r in caplog.records if "is not shown" in r.getMessage()]
    assert len(logged) == 3 and all("\n" not in line for line in logged)
    _fails_at_open(repo, "missing", "tag.v1")
    _fails_at_open(repo, "not .*snapshot id", "tag.bad")
    trio.run(source.aclose)


def test_node_paths_that_cannot_be_shown_are_left_out(repo, caplog):
    """`/coords` renamed `/../etc` and `/img` renamed `/i<NUL>g` in the snapshot: those two nodes are not
    shown (logged once each), every other node is."""
    path = _snapshot(repo)
    body = body_of(path.read_bytes())
    assert body.count(b"/coords") == 1 and body.count(b"/img") == 1
    path.write_bytes(reframe(path.read_bytes(), body.replace(b"/coords", b"/../etc").replace(b"/img", b"/i\0g")))
    source = _open(repo)

    async def names(p: str) -> list[str]:
        return [n async for n, _ in source.list(p)]
    top = trio.run(names, "")
    assert "coords" not in top and "img" not in top and ".." not in top and {"seg", "deep", "virt"} <= set(top)
    for probe in ("../etc/zarr.json", "i\0g/zarr.json", "coords/zarr.json", "img/c/0/0"):
        assert trio.run(source.stat, probe) is None
    assert _read(source, "deep/er/arr/zarr.json").startswith(b"{")
    logged = [r.getMessage() for r in caplog.records if "(not shown)" in r.getMessage()]
    assert len(logged) == 2 and all("\n" not in line for line in logged)
    trio.run(source.aclose)


def test_virtual_references_stay_in_their_places(repo, written):
    """Locations leaving the repository or an allowed prefix through `..`, and locations nowhere allowed,
    are refused without opening anything; an allowed prefix is opened once and read in range."""
    opened: list[str] = []

    def open_url(url: str) -> ByteSource:
        opened.append(url)
        return LocalSource(url[len("file://"):])

    options = IcechunkOptions((f"file://{written.external}/",))
    path = _manifest_of(repo, "virt")
    original = path.read_bytes()
    body = body_of(original)
    # the repository's own URL is the copy's: its inside reference (to the original's root) is outside it
    source = _open(repo, options=options, open_url=open_url)
    assert _read(source, "virt/c/0/0") == bytes(range(16, 24))
    assert _read(source, "virt/c/1/0") == bytes(range(44, 52))
    with pytest.raises(DataError, match="outside the repository and every allowed location"):
        _read(source, "virt/c/2/0")
    assert opened == [f"file://{written.external}/"]
    trio.run(source.aclose)
    # `..` out of the allowed prefix and out of the repository
    assert body.count(b"data.bin") == 2 and body.count(b"inside.bin") == 1
    path.write_bytes(reframe(original, body.replace(b"data.bin", b"../r.bin").replace(b"inside.bin", b"../x/a.bin")))
    opened.clear()
    source = _open(written.root, options=options, open_url=open_url)  # the original's URL: inside refs allowed
    source.store.inner = LocalSource(str(repo))
    for key in ("virt/c/0/0", "virt/c/1/0", "virt/c/2/0"):
        with pytest.raises(DataError, match="outside the repository"):
            _read(source, key)
    assert opened == [] and source.stats()["icechunk"]["virtual_refused"] == 3
    trio.run(source.aclose)


def test_damaged_manifests_fail_their_arrays_only(repo):
    _manifest_of(repo, "img").write_bytes(_manifest_of(repo, "img").read_bytes()[:60])
    (repo / "manifests" / _manifest_of(repo, "deep/er/arr").name).unlink()
    source = _open(repo)
    assert _read(source, "img/zarr.json").startswith(b"{")
    for key in ("img/c/0/0", "deep/er/arr/c/0/0"):
        with pytest.raises(DataError):
            _read(source, key)
    assert len(_read(source, "seg/c/0/0/0")) > 100
    trio.run(source.aclose)


def test_chunk_objects_missing_or_short_fail_their_chunks_only(repo, written):
    source = _open(repo)
    node = source.snapshot.nodes["img"]
    manifest = trio.run(source.store.manifest, node.array.manifests[0].id)  # type: ignore[union-attr]
    missing, short = manifest.find(node.id, (0, 0)), manifest.find(node.id, (1, 1))
    assert missing is not None and short is not None and missing.chunk_id and short.chunk_id
    (repo / "chunks" / encode_id(missing.chunk_id)).unlink()
    cut = repo / "chunks" / encode_id(short.chunk_id)
    cut.write_bytes(cut.read_bytes()[:10])
    with pytest.raises(SourceError, match="chunks/"):
        _read(source, "img/c/0/0")
    with pytest.raises(DataError, match="truncated"):
        _read(source, "img/c/1/1")
    assert _read(source, "img/c/2/2") == written.keys("branch.main")["img/c/2/2"]
    trio.run(source.aclose)


def test_damage_through_a_mount_stays_with_what_it_touches(repo, written, mount):
    """A garbled manifest, a missing chunk object and refused virtual references: those files fail with
    EIO, quickly and within bounded memory, while the rest of the mount (and every version directory)
    reads exactly; SIGTERM unmounts."""
    keys = written.keys("branch.main")
    _manifest_of(repo, "coords").write_bytes(b"ICE garbage")
    source = _open(repo)
    node = source.snapshot.nodes["img"]
    manifest = trio.run(source.store.manifest, node.array.manifests[0].id)  # type: ignore[union-attr]
    (repo / "chunks" / encode_id(manifest.find(node.id, (2, 1)).chunk_id)).unlink()  # type: ignore[union-attr]
    trio.run(source.aclose)
    m = mount(repo)
    bad = {"coords/c/0": Bad(None), "img/c/2/1": Bad(len(keys["img/c/2/1"])),
           "virt/c/0/0": Bad(8), "virt/c/1/0": Bad(8)}
    good = {k: v for k, v in keys.items() if k.startswith(("img/", "deep/")) and k != "img/c/2/1"}
    good["@tag.v1/deep/er/arr/c/0/0"] = written.keys("tag.v1")["deep/er/arr/c/0/0"]
    assert_contained(m, bad, good, growth_mib=64)


def test_a_chunk_reference_claiming_a_huge_length(repo, written):
    """A native reference whose length says 2^62 bytes: the size is shown as claimed, a read asks for no
    more than the reader wants and fails at the object's real end (truncated); other chunks read."""
    path = _manifest_of(repo, "img")
    body = body_of(path.read_bytes())
    source = _open(repo)
    node = source.snapshot.nodes["img"]
    found = ChunkManifest(body, "img").find(node.id, (0, 0))
    assert found is not None and found.chunk_id is not None
    trio.run(source.aclose)
    claimed = struct.pack("<Q", found.length)
    assert body.count(claimed) == 1
    path.write_bytes(reframe(path.read_bytes(), body.replace(claimed, struct.pack("<Q", 1 << 62))))
    source = _open(repo)
    assert trio.run(source.stat, "img/c/0/0").size == 1 << 62

    async def main() -> bytes:
        return await source.read("img/c/0/0", (1 << 62) - 100, 100)
    result, peak = traced(main)
    assert isinstance(result, DataError) and "truncated" in str(result) and peak < 8 * MiB
    assert _read(source, "img/c/2/2") == written.keys("branch.main")["img/c/2/2"]
    trio.run(source.aclose)


def test_virtual_objects_modified_after_their_checksum_are_refused(repo, written):
    """`virt/c/1/0` records its object's modification time (a day after writing): an object modified later
    than that is refused (its bytes there may be other bytes); one without a checksum is read as is."""
    options = IcechunkOptions((f"file://{written.external}/",))
    data = written.external / "data.bin"
    before = data.stat()
    source = _open(repo, options=options, open_url=lambda url: LocalSource(url[len("file://"):]))
    node = source.snapshot.nodes["virt"]
    manifest = trio.run(source.store.manifest, node.array.manifests[0].id)  # type: ignore[union-attr]
    assert manifest.find(node.id, (1, 0)).last_modified > 0  # type: ignore[union-attr]
    assert manifest.find(node.id, (0, 0)).last_modified == 0  # type: ignore[union-attr]
    assert _read(source, "virt/c/1/0") == bytes(range(44, 52))
    try:
        later = before.st_mtime + 3 * 86400
        os.utime(data, (later, later))
        with pytest.raises(DataError, match="was modified after the reference was written"):
            _read(source, "virt/c/1/0")
        assert _read(source, "virt/c/0/0") == bytes(range(16, 24))
    finally:
        os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
        trio.run(source.aclose)



def test_a_snapshot_history_that_loops_ends(repo):
    """Branch main's snapshot named as its own parent: its history is itself; listing the versions ends,
    each snapshot read once."""
    path = _snapshot(repo)
    body = body_of(path.read_bytes())
    own = decode_id(path.name)
    found = decode_snapshot(body, "main")
    assert own is not None and found.parent is not None and body.count(found.parent) == 1
    path.write_bytes(reframe(path.read_bytes(), body.replace(found.parent, own)))
    source = _open(repo)
    names = [v.name for v in trio.run(source.versions)]
    assert path.name in names and "branch.main" in names
    assert source.stats()["icechunk"]["snapshot_reads"] == len({n for n in names if "." not in n})
    trio.run(source.aclose)


def test_duplicate_nodes_and_nodes_inside_arrays_are_left_out(repo, written, caplog):
    """`/split` renamed `/img/x` (inside an array, where its keys would collide with chunk keys) and
    `/coords` renamed `/scalar` (a second node of that path): neither is shown, the first `/scalar` is."""
    path = _snapshot(repo)
    body = body_of(path.read_bytes())
    assert body.count(b"/split") == 1 and body.count(b"/coords") == 1
    path.write_bytes(reframe(path.read_bytes(), body.replace(b"/split", b"/img/x").replace(b"/coords", b"/scalar")))
    source = _open(repo)
    keys = written.keys("branch.main")

    async def listing(p: str) -> list[str]:
        return [n async for n, _ in source.list(p)]
    assert trio.run(listing, "img") == ["zarr.json", "c"]
    assert trio.run(source.stat, "img/x/zarr.json") is None and trio.run(source.stat, "split/zarr.json") is None
    shown = _read(source, "scalar/zarr.json")
    assert shown in (keys["scalar/zarr.json"], keys["coords/zarr.json"])
    logged = [r.getMessage() for r in caplog.records if "(not shown)" in r.getMessage()]
    assert any("inside array '/img'" in line for line in logged) and any("appears twice" in line for line in logged)
    trio.run(source.aclose)
