"""Hostile zip archives: unsafe and ambiguous names never become paths, lying headers and overlaps fail
their members only, claimed counts and sizes cost nothing, bombs are capped, and garbled central
directories (property-tested) end in a one-line error or a tree whose every read is exact or an error,
with bounded memory (tracemalloc) -- also through a real mount, with the daemon's RSS bounded."""

from __future__ import annotations

import logging
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.bombs import Bad, assert_contained
from tests.support.profiles import examples
from tests.support.zips import Member, build, deflate
from unshardfs.app.pipeline import ome_comment
from unshardfs.sources import LocalSource
from unshardfs.sources.zip import ZipSource
from unshardfs.util.errors import ConfigError, DataError, SourceError
from unshardfs.util.limits import DataLimits

MiB = 1 << 20
GOOD = {b"ok/a.bin": b"a" * 1000, b"ok/b.json": b'{"b": 1}', b"top": b"top level"}


def _open(path: Path, limits: DataLimits | None = None) -> ZipSource:
    return ZipSource(LocalSource(str(path.parent)), path.name, limits=limits)


def _write(tmp_path: Path, blob: bytes, name: str = "x.zip") -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


async def _paths(source: ZipSource, path: str = "") -> dict[str, int | None]:
    """Every path under `path`, walking the listing: path -> size (None for directories)."""
    out: dict[str, int | None] = {}
    async for name, st in source.list(path):
        child = f"{path}/{name}" if path else name
        out[child] = None if st.is_dir else st.size
        if st.is_dir:
            out.update(await _paths(source, child))
    return out


def _traced(main) -> tuple[object, int, int]:
    """(what `main` returned, bytes still allocated after it, peak bytes allocated while it ran)."""
    tracemalloc.start()
    try:
        result = trio.run(main)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, kept, peak


def _good() -> list[Member]:
    return [Member(name, data) for name, data in GOOD.items()]


def test_unsafe_and_ambiguous_names_are_never_keys(tmp_path, caplog):
    hostile = [Member(b"../evil", b"x"), Member(b"ok/../../evil2", b"x"), Member(b"/etc/abs", b"x"),
               Member(b"win\\path", b"x"), Member(b"nul\0name", b"x"), Member(b"ok/./dot", b"x"),
               Member(b"ok//empty", b"x"), Member(b"dup", b"1"), Member(b"dup", b"2"),
               Member(b"both", b"file"), Member(b"both/inner", b"x"), Member(b"\xff\xfe", b"x"),
               Member(b"shared", b"y"), Member(b"shared-too", b"z", same_header_as=15)]
    hostile[11].name = b"\xff\xfe"  # not UTF-8 although the UTF-8 flag is set
    path = _write(tmp_path, build(_good() + hostile))

    async def main() -> None:
        source = await _open(path).open()
        members = await _paths(source)
        assert members == {"ok": None, "ok/a.bin": 1000, "ok/b.json": 8, "top": 9, "both": None, "both/inner": 1}
        for member in ("../evil", "dup", "both", "shared", "shared-too", "etc/abs", "win\\path"):
            st = await source.stat(member)
            assert st is None or st.is_dir, member
        assert source.summary is not None and source.summary.skipped == 13
        assert await source.read("ok/a.bin", 0, 5000) == GOOD[b"ok/a.bin"]
        await source.aclose()

    with caplog.at_level(logging.WARNING):
        trio.run(main)
    text = caplog.text
    for reason in ("occurs more than once", "is also a directory", "backslash", "absolute", "NUL", "not UTF-8",
                   "shared with another entry", "is not a file name"):
        assert reason in text, reason


def test_local_header_disagreeing_or_overlapping_fails_that_member(tmp_path):
    members = _good() + [
        Member(b"renamed", b"r" * 100, local_name=b"renamex"),
        Member(b"resized", b"s" * 100, local_usize=99),
        Member(b"overlaps", b"o" * 100),
    ]
    blob = bytearray(build(members))
    # Lengthen "overlaps"'s local extra field so its data would run into the central directory.
    local = [i for i in range(len(blob)) if blob.startswith(b"PK\x03\x04", i)][-1]
    blob[local + 28:local + 30] = (200).to_bytes(2, "little")
    path = _write(tmp_path, bytes(blob))

    async def main() -> None:
        source = await _open(path).open()
        for member, words in (("renamed", "names another file"), ("resized", "disagrees"), ("overlaps", "overlaps")):
            assert (await source.stat(member)).size == 100  # the central directory's word, until read
            with pytest.raises(DataError, match=words):
                await source.read(member, 0, 10)
        for name, data in GOOD.items():
            assert await source.read(name.decode(), 0, 1 << 20) == data
        await source.aclose()

    trio.run(main)


def test_claimed_counts_and_sizes_cost_nothing(tmp_path):
    """10^8 entries claimed by a ZIP64 end record, and a central directory claimed far larger than the file."""
    claimed = _write(tmp_path, build(_good(), claimed_entries=10**8), "claimed.zip")
    blob = bytearray(build(_good(), zip64_end=True))
    end64 = blob.rindex(b"PK\x06\x06")
    blob[end64 + 40:end64 + 48] = (10**12).to_bytes(8, "little")  # central directory size
    huge = _write(tmp_path, bytes(blob), "huge.zip")

    async def main() -> None:
        source = await _open(claimed).open()
        assert set(await _paths(source)) == {"ok", "ok/a.bin", "ok/b.json", "top"}
        await source.aclose()
        with pytest.raises(ConfigError, match="lies beyond the end record"):
            await _open(huge).open()
        blob[end64 + 40:end64 + 48] = (300 * MiB).to_bytes(8, "little")
        blob[end64 + 48:end64 + 56] = (0).to_bytes(8, "little")
        huge.write_bytes(bytes(blob) + bytes(0))
        with pytest.raises(ConfigError):
            await _open(huge, DataLimits(index_bytes=256 * MiB)).open()

    peak = _traced(main)[2]
    assert peak < 4 * MiB, peak


def test_lying_zip64_sizes(tmp_path):
    """ZIP64 extra fields giving sizes beyond the archive: a STORED member is refused, a DEFLATE one
    claiming more than --max-payload-size fails its reads without decoding."""
    members = _good() + [Member(b"stored-liar", b"s" * 10, usize=1 << 62, zip64=True),
                         Member(b"deflate-liar", b"d" * 10, zipfile.ZIP_DEFLATED, usize=1 << 40, zip64=True),
                         Member(b"honest64", b"h" * 10, zip64=True)]
    path = _write(tmp_path, build(members))

    async def main() -> None:
        source = await _open(path).open()
        assert await source.stat("stored-liar") is None
        assert (await source.stat("deflate-liar")).size == 1 << 40
        with pytest.raises(DataError, match="max-payload-size"):
            await source.read("deflate-liar", 0, 10)
        assert await source.read("honest64", 0, 100) == b"h" * 10
        assert source.summary.zip64
        await source.aclose()

    trio.run(main)


def test_deflate_bombs_are_capped(tmp_path):
    """1000:1 members: one whose honest size exceeds the cap, one claiming 1 MiB and holding 64 MiB."""
    zeros = bytes(64 * MiB)
    members = _good() + [Member(b"big", zeros, zipfile.ZIP_DEFLATED),
                         Member(b"liar", zeros, zipfile.ZIP_DEFLATED, usize=MiB, local_usize=MiB)]
    path = _write(tmp_path, build(members))
    assert path.stat().st_size < 64 * MiB // 500

    async def main() -> None:
        source = await _open(path, DataLimits(payload_bytes=16 * MiB)).open()
        with pytest.raises(DataError, match="max-payload-size"):
            await source.read("big", 0, 10)
        with pytest.raises(DataError, match="more than"):
            await source.read("liar", 0, 10)
        assert await source.read("ok/a.bin", 0, 10) == b"a" * 10
        await source.aclose()

    peak = _traced(main)[2]
    assert peak < 8 * MiB, peak


def test_long_comment_with_fake_end_records(tmp_path):
    fake = build([Member(b"fake", b"f")])  # a whole archive inside the comment
    comment = (fake * (65535 // len(fake) + 1))[:65535]
    path = _write(tmp_path, build(_good(), comment=comment))

    async def main() -> None:
        source = await _open(path).open()
        assert set(await _paths(source)) == {"ok", "ok/a.bin", "ok/b.json", "top"}
        assert source.summary.comment and ome_comment(source.summary.comment) is None
        await source.aclose()

    trio.run(main)


def test_truncated_archive(tmp_path):
    blob = build(_good())
    path = _write(tmp_path, blob[:len(blob) // 2])

    async def main() -> None:
        with pytest.raises(ConfigError, match="not a zip archive"):
            await _open(path).open()
        # Truncated after it was opened: reads fail, nothing else.
        path.write_bytes(blob)
        source = await _open(path).open()
        st = await source.stat("top")
        path.write_bytes(blob[:40])
        with pytest.raises((DataError, SourceError)):
            await source.read("top", 0, 100, st.version)
        with pytest.raises((DataError, SourceError)):
            await source.read("top", 0, 100)
        with pytest.raises(SourceError, match="not a zip archive"):  # the directory is read again: gone
            await source.stat("top")
        await source.aclose()

    trio.run(main)


@pytest.mark.slow
def test_index_memory_per_entry(tmp_path):
    """What the index keeps per entry (names blob + columns), measured with 200,000 entries."""
    n = 200_000
    members = [Member(f"c/{i // 1000}/{i % 1000}".encode(), b"") for i in range(n)]
    path = _write(tmp_path, build(members))

    async def main() -> ZipSource:
        return await _open(path).open()

    source, kept, peak = _traced(main)
    assert source.summary.entries == n
    print(f"\nzip index: {kept / n:.0f} bytes kept per entry, parse peak {peak / n:.0f} bytes per entry")
    assert kept / n < 80, kept / n  # ~9-byte names + 57 bytes of columns; no object per entry
    assert peak / n < 200, peak / n  # no object per entry while the index is built either


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_garbled_central_directory(tmp_path, data):
    """Any garbling of the central directory and end records: a one-line ConfigError, or paths whose
    reads give exactly the central directory's size or fail with DataError/SourceError."""
    members = _good() + [Member(b"d/deflated", b"z" * 3000, zipfile.ZIP_DEFLATED), Member(b"d/64", b"q", zip64=True)]
    blob = bytearray(build(members, comment=b'{"ome": {"version": "0.5"}}', zip64_end=data.draw(st.booleans())))
    cd_start = blob.index(b"PK\x01\x02")
    for _ in range(data.draw(st.integers(1, 12))):
        at = data.draw(st.integers(cd_start, len(blob) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(cd_start, len(blob)))
        blob = blob[:cut]
    path = _write(tmp_path, bytes(blob), "garbled.zip")

    async def main() -> None:
        try:
            source = await _open(path, DataLimits(index_bytes=MiB, payload_bytes=MiB)).open()
        except ConfigError as e:
            assert "\n" not in str(e)
            return
        try:
            for member, size in (await _paths(source)).items():
                if size is None:
                    continue
                try:
                    got = await source.read(member, 0, size + 10)
                except (DataError, SourceError):
                    continue
                assert len(got) == size, member
        finally:
            await source.aclose()

    peak = _traced(main)[2]
    assert peak < 8 * MiB, peak


def test_hostile_zip_through_a_mount(tmp_path, mount):
    """A sharded precomputed volume zipped with hostile members beside it: the hostile files are absent
    or EIO, every other file exact, daemon RSS bounded, SIGTERM unmounts."""
    from unshardfs.testing.precomputed import Scale, sharding, write_volume
    from unshardfs.testing.zips import zip_tree

    paths = write_volume(tmp_path / "vol", [Scale((64, 64, 64), (16, 16, 16), sharding())])
    plain = zip_tree(paths["sharded"], tmp_path / "plain.zip", comment=b"")
    with zipfile.ZipFile(plain) as z:
        members = [Member(i.filename.encode(), z.read(i)) for i in z.infolist() if not i.is_dir()]
    zeros = bytes(512 * MiB)
    good = {"extra/good.txt": b"good" * 100}
    members += [Member(b"extra/good.txt", good["extra/good.txt"]), Member(b"../evil", b"x"),
                Member(b"extra/dup", b"1"), Member(b"extra/dup", b"2"), Member(b"extra\\win", b"x"),
                Member(b"extra/bomb", zeros, zipfile.ZIP_DEFLATED),
                Member(b"extra/liar", zeros, zipfile.ZIP_DEFLATED, usize=1000, local_usize=1000),
                Member(b"extra/renamed", b"r" * 50, local_name=b"extra/renamex")]
    archive = _write(tmp_path, build(members), "hostile.zip")
    m = mount(archive, "--max-payload-size", "64")
    assert assert_same_tree_of(m.path, paths["plain"]) > 10
    assert sorted(p.name for p in (m.path / "extra").iterdir()) == ["bomb", "good.txt", "liar", "renamed"]
    bad = {"extra/bomb": Bad(512 * MiB), "extra/liar": Bad(1000), "extra/renamed": Bad(50)}
    assert_contained(m, bad, good, growth_mib=48)


def assert_same_tree_of(mounted: Path, plain: Path) -> int:
    """The volume's files (not extra/) equal the unsharded twin's."""
    from unshardfs.testing.trees import assert_same_file, walk_files

    want = walk_files(plain)
    for rel, path in want.items():
        assert_same_file(mounted / rel, path, rel)
    return len(want)
