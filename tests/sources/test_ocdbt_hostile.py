"""Hostile OCDBT databases: truncated, garbled and CRC-damaged manifests and nodes, B+tree cycles and
absurd depths, huge declared sizes and counts, decompression and key-prefix bombs, versions naming
missing objects, keys and data file paths that would leave the database. Each ends in a one-line
error (opening) or a DataError/SourceError (serving: EIO), with bounded memory and nothing fetched
outside the database; through a real mount the damage stays with the files it touches."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import crc32c
import pytest
import trio

from tests.support.bombs import Bad, assert_contained, traced
from tests.support.ocdbt import (
    DEEP,
    Crafted,
    Ref,
    frame,
    interior,
    leaf,
    leaf_holding,
    manifest,
    simple,
    ts_keys,
    varint,
    write_zarr,
)
from unshardfs.sources import CountingSource, LocalSource
from unshardfs.sources.ocdbt import OcdbtSource, open_ocdbt
from unshardfs.sources.ocdbt.format import BTREE_NODE_MAGIC, decode_btree_node
from unshardfs.util.errors import ConfigError, DataError, SourceError
from unshardfs.util.limits import DataLimits

MiB = 1 << 20
GOOD = [(b"a/one", b"1" * 10), (b"a/two", b"2" * 20), (b"b", b"bee")]


def _open(root: Path, source=None, limits: DataLimits | None = None) -> OcdbtSource:
    return trio.run(open_ocdbt, source or LocalSource(str(root)), "", "", None, limits)


def _fails_at_open(root: Path, match: str) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        _open(root)
    text = str(info.value)
    assert "\n" not in text and len(text) < 1000
    return text


def test_a_good_crafted_database_reads(tmp_path):
    """The crafting encoder is right: what the hostile variants below break works unbroken."""
    db = Crafted(tmp_path)
    value = db.put("d/data", b"V" * 1000)
    ref = db.put("d/data", leaf(["d/data"], [*GOOD, (b"c", value)]))
    db.save(ref)

    async def main():
        source = await open_ocdbt(LocalSource(str(tmp_path)), "", "", None, None)
        names = [n async for n, _ in source.list("")]
        return names, await source.read("c", 0, 2000), await source.read("a/two", 5, 5)
    assert trio.run(main) == (["a", "b", "c"], b"V" * 1000, b"22222")


@pytest.mark.parametrize("damage, match", [
    (lambda m: m[:len(m) // 2], "header says|truncated"),
    (lambda m: m[:10], "shorter than any"),
    (lambda m: b"\x00" * len(m), "magic"),
    (lambda m: m[:-1] + bytes([m[-1] ^ 1]), "CRC-32C"),
    (lambda m: m[:20] + bytes([m[20] ^ 0x40]) + m[21:], "CRC-32C"),
    (lambda m: b"", "shorter than any"),
])
def test_damaged_manifests_are_one_line(tmp_path, damage, match):
    simple(tmp_path, GOOD)
    path = tmp_path / "manifest.ocdbt"
    path.write_bytes(damage(path.read_bytes()))
    _fails_at_open(tmp_path, match)


def test_garbled_leaf_and_crc_mismatch_fail_reads_only(tmp_path):
    db = Crafted(tmp_path)
    ref = db.put("d/data", leaf(["d/data"], GOOD))
    db.save(ref)
    blob = bytearray((tmp_path / "d/data").read_bytes())
    blob[30] ^= 0x55
    (tmp_path / "d/data").write_bytes(bytes(blob))
    source = _open(tmp_path)  # the root is read on first use
    with pytest.raises(DataError, match="CRC-32C"):
        trio.run(source.stat, "a/one")
    crc = Crafted(tmp_path / "crc")
    crc.save(crc.put("d/data", frame(BTREE_NODE_MAGIC, leaf(["d/data"], GOOD)[16:-4], bad_crc=True)))
    with pytest.raises(DataError, match="CRC-32C"):
        trio.run(_open(tmp_path / "crc").stat, "b")


def test_every_single_byte_garbling_is_refused_or_decodes(tmp_path):
    """Each byte of a leaf's body flipped, the checksum made right again: a DataError or a node, nothing else."""
    body = leaf(["d/data"], [*GOOD, (b"c", Ref(0, 0, 5))])[12:-4]
    decoded = refused = 0
    for i in range(len(body)):
        for flip in (0x01, 0x80, 0xFF):
            garbled = bytearray(body)
            garbled[i] ^= flip
            data = bytes.fromhex("0cdb20de") + struct.pack("<Q", 12 + len(garbled) + 4) + bytes(garbled)
            data += struct.pack("<I", crc32c.crc32c(data))
            try:
                decode_btree_node(data, "n", 1 * MiB, "", 1 * MiB)
                decoded += 1
            except DataError:
                refused += 1
    assert refused > 50 and decoded > 50  # keys and values garbled still decode; structure garbled does not


def test_btree_cycle_is_refused(tmp_path, caplog):
    """An interior node whose child is itself: a child's height must be its parent's minus one. A lookup
    fails; a listing passes over the damaged subtree (here: everything) and says so."""
    files = ["d/data"]
    probe = interior(files, 1, [(b"", Ref(0, 0, 0))])
    node = interior(files, 1, [(b"", Ref(0, 0, len(probe)))])
    assert len(node) == len(probe)
    db = Crafted(tmp_path)
    db.put("d/data", node)
    db.save(Ref(0, 0, len(node)), root_height=1)
    source = _open(tmp_path)
    with pytest.raises(DataError, match="height 1 where 0 is expected"):
        trio.run(source.stat, "x")
    assert trio.run(_listing, source) == []
    assert "are not listed" in caplog.text and "a cycle" in caplog.text


async def _listing(source: OcdbtSource) -> list[str]:
    return [n async for n, _ in source.list("")]


def test_absurd_depth_is_refused_before_any_read(tmp_path):
    db = Crafted(tmp_path)
    db.put("d/data", leaf(["d/data"], GOOD))
    db.save(Ref(0, 0, 10), root_height=200)
    counted = CountingSource(LocalSource(str(tmp_path)))
    with pytest.raises(ConfigError, match="height 200"):
        _open(tmp_path, counted)
    assert counted.counters.reads == 1  # the manifest


def test_huge_declared_sizes_cost_nothing(tmp_path):
    db = Crafted(tmp_path)
    value = Ref(0, 0, 1 << 50)  # a value far larger than the data file
    leaf_ref = db.put("d/data", leaf(["d/data"], [(b"big", value), (b"small", b"s")]))
    db.save(leaf_ref)
    source = _open(tmp_path)
    st = trio.run(source.stat, "big")
    assert st is not None and st.size == 1 << 50

    async def read_big():
        return await source.read("big", 0, 1 << 20)
    result, peak = traced(read_big)
    assert isinstance(result, DataError) and "truncated" in str(result)
    assert peak < 8 * MiB
    # a root node said to be a terabyte: refused before it is read
    huge = Crafted(tmp_path / "huge")
    huge.put("d/data", leaf(["d/data"], GOOD))
    huge.save(Ref(0, 0, 1 << 40))
    counted = CountingSource(LocalSource(str(tmp_path / "huge")))
    source = _open(tmp_path / "huge", counted)
    with pytest.raises(DataError, match="exceeds"):
        trio.run(source.stat, "b")
    assert counted.counters.reads == 1
    # a manifest file of 20 MiB
    big = Crafted(tmp_path / "bigmanifest")
    big.save(None, manifest_bytes=bytes(20 * MiB))
    _fails_at_open(tmp_path / "bigmanifest", "exceeds")


@pytest.mark.parametrize("body, match", [
    # a data file table claiming 2**40 files
    (bytes([0]) + varint(1 << 40), "declares"),
    # a node claiming a million entries in a few bytes
    (bytes([0]) + varint(0) + varint(1 << 20) + bytes(10), "declares"),
    # zero entries
    (bytes([0]) + varint(0) + varint(0), "empty B\\+tree node"),
])
def test_claimed_counts_are_checked_against_the_bytes_present(body, match):
    with pytest.raises(DataError, match=match):
        decode_btree_node(frame(BTREE_NODE_MAGIC, body), "n", 1 * MiB, "", 1 * MiB)


def test_key_prefix_bomb_is_bounded():
    """Keys sharing a long prefix claim far more bytes than the node holds: refused at the key budget."""
    n = 400
    first = b"k" * 65533 + b"\x00\x00"
    suffixes = [struct.pack(">H", i) for i in range(1, n)]
    body = bytes([0]) + varint(0) + varint(n) + b"".join(varint(65533) for _ in suffixes)
    body += varint(len(first)) + b"".join(varint(2) for _ in suffixes) + first + b"".join(suffixes)
    body += b"".join(varint(0) for _ in range(n)) + bytes(n)

    def main():
        async def run():
            decode_btree_node(frame(BTREE_NODE_MAGIC, body, zstd=True), "n", 16 * MiB, "", 16 * MiB)
        return run
    result, peak = traced(main())
    assert isinstance(result, DataError) and "keys add up" in str(result)
    assert peak < 40 * MiB


def test_zstd_bomb_node_stops_at_the_cap(tmp_path):
    db = Crafted(tmp_path)
    bomb_body = bytes([0]) + varint(0) + varint(1) + varint(0) + varint(1) + b"x" + varint(0) + bytes(1)
    bomb = frame(BTREE_NODE_MAGIC, bomb_body + bytes(200 * MiB), zstd=True)
    assert len(bomb) < 1 * MiB
    ref = db.put("d/data", bomb)
    db.save(ref)
    source = _open(tmp_path)

    async def main():
        return await source.stat("x")
    result, peak = traced(main)
    assert isinstance(result, DataError) and "more than" in str(result)
    assert peak < 48 * MiB


def test_version_naming_missing_objects_fails_its_reads(tmp_path):
    db = Crafted(tmp_path)
    db.save(Ref(0, 0, 100), data_file="d/gone")
    source = _open(tmp_path)
    with pytest.raises((DataError, SourceError)):
        trio.run(source.stat, "anything")
    # an out-of-line value in a data file that is not there
    db2 = Crafted(tmp_path / "v")
    ref = db2.put("d/data", leaf(["d/data", "d/missing"], [(b"a", Ref(1, 0, 10)), (b"b", b"ok")]))
    db2.save(ref)
    source = _open(tmp_path / "v")
    assert trio.run(source.read, "b", 0, 10) == b"ok"
    with pytest.raises((DataError, SourceError)):
        trio.run(source.read, "a", 0, 10)


def test_keys_that_cannot_be_paths_are_never_shown(tmp_path, caplog):
    keys = [b"../up", b"/abs", b"a/../b", b"a\x00b", b"dir//x", b"ok", b"trail/", b"\xff\xfe", b"./dot"]
    simple(tmp_path, [(k, b"v") for k in sorted(keys)])
    source = _open(tmp_path)

    async def main():
        top = await _listing(source)
        inner = {d: [n async for n, _ in source.list(d)] for d in top if d != "ok"}
        stats = [await source.stat(p) for p in ("a/../b", "../up", "a\x00b", "trail", "dir/x")]
        return top, inner, stats
    top, inner, stats = trio.run(main)
    assert "ok" in top and not {"..", "", ".", "/abs"} & set(top)
    assert all(names == [] for names in inner.values())
    assert stats[:3] == [None, None, None]
    assert "is not shown" in caplog.text


@pytest.mark.parametrize("path", ["../outside", "/etc/passwd", "d/../../x", "d/\x00x", "d//x"])
def test_data_file_paths_leaving_the_database_are_refused(tmp_path, path):
    (tmp_path / "outside").write_bytes(b"secret" * 100)
    root = tmp_path / "db"
    db = Crafted(root)
    ref = db.put("d/data", leaf(["d/data", path], [(b"a", Ref(1, 0, 6)), (b"b", b"ok")]))
    db.save(ref)
    counted = CountingSource(LocalSource(str(root)))
    source = _open(root, counted)
    with pytest.raises(DataError, match="data file path"):
        trio.run(source.read, "a", 0, 6)
    assert counted.counters.reads == 2  # the manifest and the leaf, nothing else
    # the manifest's own table is checked the same way
    bad = Crafted(tmp_path / "m")
    bad.save(Ref(0, 0, 10), manifest_bytes=manifest(Ref(0, 0, 10), [path]))
    _fails_at_open(tmp_path / "m", "data file path")


def test_damage_through_a_mount_stays_with_what_it_touches(tmp_path, mount):
    """A TensorStore-written database with a garbled leaf (a directory of many keys) and a truncated
    out-of-line value: those are EIO, the array and every other file exact, memory bounded, daemon alive."""
    root = tmp_path / "db"
    root.mkdir()
    write_zarr(root, DEEP)
    keys = ts_keys(f"file://{root}/")
    damaged = tmp_path / "damaged"
    shutil.copytree(root, damaged)
    (path, offset, length), _ = leaf_holding(damaged, b"notes/many/0060-xxxx")
    blob = bytearray(path.read_bytes())
    blob[offset + length // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    _, value = leaf_holding(root, b"notes/blob.bin")
    assert value.location is not None  # out of line: cut its data file inside it
    held = damaged / value.location.file.path
    held.write_bytes(held.read_bytes()[:value.location.offset + 5000])
    m = mount(damaged)
    good = {k: v for k, v in keys.items() if k.startswith("notes/many/00") or k == "notes/readme.txt"}
    readable = {}
    for rel, want in good.items():
        try:
            readable[rel] = (m.path / rel).read_bytes()
        except OSError:
            continue
        assert readable[rel] == want
    assert "notes/readme.txt" in readable and len(readable) >= 20
    bad = {"notes/blob.bin": Bad(10240), "notes/many/0060-xxxx": Bad(None)}
    assert_contained(m, bad, readable, growth_mib=48)


def test_damaged_version_tree_leaves_the_current_tree(tmp_path, mount):
    """A garbled version tree node: no version directories (logged), the newest version fully readable;
    naming an old version is a one-line error."""
    from unshardfs.sources.ocdbt.format import decode_manifest
    from unshardfs.testing.mounts import run_cli

    root = tmp_path / "db"
    root.mkdir()
    write_zarr(root, DEEP)
    keys = ts_keys(f"file://{root}/")
    nodes = decode_manifest((root / "manifest.ocdbt").read_bytes(), "m", 1 << 26).nodes
    assert nodes
    node = nodes[0].location
    path = root / node.file.path
    blob = bytearray(path.read_bytes())
    blob[node.offset + node.length // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    m = mount(root)
    names = sorted(p.name for p in m.path.iterdir())
    assert names == ["arr", "notes", "zarr.json"]
    assert (m.path / "notes/readme.txt").read_bytes() == keys["notes/readme.txt"]
    assert "no version directories" in m.log_text()
    result = run_cli("inspect", str(root))
    assert result.returncode == 0 and "versions      unreadable:" in result.stdout and "arr/" in result.stdout
    result = run_cli("inspect", f"{root}|ocdbt:@v2/")
    assert result.returncode != 0 and "version tree is damaged" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_version_tree_cycle_is_refused(tmp_path):
    """A version tree node listing itself as its child: heights must fall by one per level."""
    from tests.support.ocdbt import config, file_table, varints
    from unshardfs.sources.ocdbt.format import MANIFEST_MAGIC, VERSION_NODE_MAGIC

    when = struct.pack("<Q", 1_700_000_000_000_000_000)

    def node(length: int) -> bytes:
        return frame(VERSION_NODE_MAGIC, bytes([4, 1]) + file_table(["d/v"]) + varint(1) + varint(16) +
                     varints([0, 0, length]) + varint(16) + when)
    length = len(node(0))
    assert len(node(length)) == length
    (tmp_path / "d").mkdir()
    (tmp_path / "d/v").write_bytes(node(length))
    missing = varint(0) + varint((1 << 64) - 1) + varint((1 << 64) - 1)
    body = (config() + file_table(["d/v"]) + varint(1) + varint(17) + bytes([0]) + missing + varints([0, 0, 0]) +
            when + varint(1) + varint(16) + varints([0, 0, length]) + varint(16) + when + bytes([1]))
    (tmp_path / "manifest.ocdbt").write_bytes(frame(MANIFEST_MAGIC, body))
    source = _open(tmp_path)  # the newest version needs no version tree
    assert trio.run(_listing, source) == []
    with pytest.raises(DataError, match="height 1 where 0 is expected"):
        trio.run(source.versions)
    with pytest.raises(ConfigError, match="version tree is damaged"):
        trio.run(open_ocdbt, LocalSource(str(tmp_path)), "", "", "v3", None)


@pytest.mark.parametrize("split", [False, True], ids=["one leaf", "two leaves"])
def test_a_key_that_is_also_a_directory_shows_the_directory(tmp_path, split, caplog):
    entries = [(b"x", b"file"), (b"x-y", b"other"), (b"x/z", b"below")]
    db = Crafted(tmp_path)
    if split:  # the key and the keys below it in different leaves: answered with a second descent
        first = db.put("d/data", leaf(["d/data"], entries[:2]))
        second = db.put("d/data", leaf(["d/data"], entries[2:]))
        root = db.put("d/data", interior(["d/data"], 1, [(b"x", first), (b"x/z", second)]))
        db.save(root, root_height=1)
    else:
        db.save(db.put("d/data", leaf(["d/data"], entries)))
    source = _open(tmp_path)

    async def main():
        top = [(n, st.is_dir) async for n, st in source.list("")]
        below = [n async for n, _ in source.list("x")]
        return top, below, await source.stat("x"), await source.read("x/z", 0, 10)
    top, below, st, data = trio.run(main)
    assert top == [("x-y", False), ("x", True)] and below == ["z"]
    assert st is not None and st.is_dir and data == b"below"
    assert "is also a directory" in caplog.text
