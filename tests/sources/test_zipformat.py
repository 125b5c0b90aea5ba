"""The zip format parser on bytes alone: end records (ZIP64 too), central directory entries fed in
windows of any size, local headers checked against the central directory, member data decoded to the
exact size. No source, no event loop."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.zips import Member, build, deflate
from unshardfs.sources.zipformat import (COLUMNS, EOCD64, LOCAL, CentralDirectory, Entries, Expected, decode,
                                         entry_name_problem, local_header_size, read_end, root_prefix)
from unshardfs.util.errors import ConfigError, DataError

MEMBERS = [Member(b"a/x.bin", b"x" * 300), Member(b"a/", b""), Member(b"b", b"bee" * 7, zipfile.ZIP_DEFLATED),
           Member(b"c64", b"q" * 5, zip64=True)]


def _parse(blob: bytes, window: int, root: str = "") -> tuple[Entries, list[tuple[object, str]], CentralDirectory]:
    end = read_end(blob, 0, "t.zip")
    skipped: list[tuple[object, str]] = []
    parser = CentralDirectory("t.zip", root, end.cd_offset, lambda name, why: skipped.append((name, why)))
    cd = blob[end.cd_offset:end.cd_offset + end.cd_size]
    for at in range(0, len(cd), window):
        parser.feed(cd[at:at + window])
    return parser.finish(), skipped, parser


def _names(entries: Entries) -> list[bytes]:
    return [entries.name(i) for i in range(len(entries))]


def _rows(entries: Entries) -> list[tuple[object, ...]]:
    return [(entries.name(i), *(int(entries.columns[k][i]) for k in COLUMNS)) for i in range(len(entries))]


def test_end_record_plain_and_zip64():
    plain = build(MEMBERS, comment=b"hello")
    end = read_end(plain, 0, "t.zip")
    assert (end.entries, end.comment, end.zip64, end.zip64_at) == (4, b"hello", False, None)
    assert plain[end.cd_offset:end.cd_offset + 4] == b"PK\x01\x02"
    assert end.record_at + end.cd_size >= end.cd_offset + end.cd_size
    end.check("t.zip", 1 << 20)

    wide = build(MEMBERS, zip64_end=True)
    end64 = read_end(wide, 0, "t.zip")
    assert end64.zip64 and end64.entries == 4 and end64.zip64_at is None
    assert end64.record_at == wide.rindex(b"PK\x06\x06")
    # The ZIP64 record before the tail given: its offset is asked for, then applied.
    cut = end64.record_at + 10
    partial = read_end(wide[cut:], cut, "t.zip")
    assert partial.zip64_at == end64.record_at and not partial.zip64
    assert partial.with_zip64(wide[end64.record_at:end64.record_at + EOCD64.size], "t.zip") == end64
    with pytest.raises(ConfigError, match="damaged"):
        partial.with_zip64(b"PK\x06\x07" + bytes(EOCD64.size - 4), "t.zip")


def test_end_record_refusals():
    blob = build(MEMBERS)
    with pytest.raises(ConfigError, match="not a zip archive"):
        read_end(blob[:-1], 0, "t.zip")
    end = read_end(blob, 0, "t.zip")
    with pytest.raises(ConfigError, match="max-index-size"):
        end.check("t.zip", end.cd_size - 1)
    lying = bytearray(blob)
    lying[-6:-2] = (len(blob) * 2).to_bytes(4, "little")  # central directory offset past the end record
    with pytest.raises(ConfigError, match="beyond the end record"):
        read_end(bytes(lying), 0, "t.zip").check("t.zip", 1 << 30)
    split = bytearray(blob)
    split[-18:-16] = (1).to_bytes(2, "little")  # this disk's number
    with pytest.raises(ConfigError, match="multi-disk"):
        read_end(bytes(split), 0, "t.zip").check("t.zip", 1 << 30)


def test_comment_holding_end_records():
    """A comment may hold the signature, even a whole archive: the record whose comment reaches exactly
    the end is the one."""
    comment = build([Member(b"fake", b"f")]) * 3 + b"not an end"
    end = read_end(build(MEMBERS, comment=comment), 0, "t.zip")
    assert end.comment == comment and end.entries == 4


@pytest.mark.parametrize("window", [1, 7, 46, 1 << 20])
def test_central_directory_in_any_windows(window):
    blob = build(MEMBERS)
    entries, skipped, parser = _parse(blob, window)
    assert skipped == [] and parser.seen == 4 and parser.zip64
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        want = [(i.filename.encode(), i.header_offset, i.compress_size, i.file_size, i.compress_type, i.CRC,
                 len(i.extra)) for i in z.infolist()]
    assert _rows(entries) == want


def test_central_directory_under_a_root():
    entries, _, _ = _parse(build(MEMBERS), 1 << 20, root_prefix("/a/"))
    assert _names(entries) == [b"x.bin"]
    with pytest.raises(ConfigError, match="not a file name"):
        root_prefix("a/../b")


def test_central_directory_skips_what_never_becomes_a_path():
    members = [Member(b"../up", b"1"), Member(b"/abs", b"2"), Member(b"w\\in", b"3"), Member(b"ok", b"4"),
               Member(b"lie", b"55", usize=9)]
    blob = bytearray(build(members))
    # An encrypted entry, and one of an unknown method (the central directory's flags and method).
    records = [i for i in range(len(blob)) if blob.startswith(b"PK\x01\x02", i)]
    entries, skipped, _ = _parse(bytes(blob), 1 << 20)
    assert _names(entries) == [b"ok"]
    assert [why for _, why in skipped] == ["name '..' is not a file name", "the name is absolute",
                                           "the name contains a backslash", "stored with 2 bytes but 9 uncompressed"]
    blob[records[3] + 8:records[3] + 10] = (0x801).to_bytes(2, "little")
    blob[records[0] + 10:records[0] + 12] = (99).to_bytes(2, "little")
    blob[records[0] + 46:records[0] + 48] = b"up"  # a safe name now, of method 99
    entries, skipped, _ = _parse(bytes(blob), 1 << 20)
    assert _names(entries) == []
    assert ("ok", "it is encrypted") in skipped and ("up/up", "compression method 99 is not supported") in skipped


def test_central_directory_damage():
    blob = build(MEMBERS)
    end = read_end(blob, 0, "t.zip")
    cd = blob[end.cd_offset:end.cd_offset + end.cd_size]
    parser = CentralDirectory("t.zip", "", end.cd_offset, lambda name, why: None)
    parser.feed(cd[:-3])
    with pytest.raises(ConfigError, match="ends inside an entry"):
        parser.finish()
    parser = CentralDirectory("t.zip", "", end.cd_offset, lambda name, why: None)
    with pytest.raises(ConfigError, match="entry 0 is damaged"):
        parser.feed(b"PK\x01\x03" + cd[4:])
    # ZIP64 marks without the extra field that holds the values: skipped, not guessed.
    no_extra = bytearray(build([Member(b"m", b"1")]))
    at = no_extra.index(b"PK\x01\x02")
    no_extra[at + 20:at + 24] = b"\xff\xff\xff\xff"
    assert _parse(bytes(no_extra), 1 << 20)[1] == [("m", "its ZIP64 extra field is missing or too short")]


def test_entry_names():
    for name in ("a", "a/b", "a/b/", "é/ü"):
        assert entry_name_problem(name) is None, name
    for name in ("", "/a", "a//b", "a/./b", "a/../b", "a\\b", "a\0b", ".."):
        assert entry_name_problem(name) is not None, name


def test_local_header_against_the_central_directory():
    blob = build([Member(b"m", b"data" * 10, local_extra=b"\x99\x99\x02\x00ab")])
    fields = LOCAL.unpack_from(blob)
    expected = Expected(b"m", zipfile.ZIP_STORED, fields[7], 40, 40)
    length = local_header_size(blob, 0, expected, "t.zip!m")
    assert length == LOCAL.size + 1 + 6 and blob[length:length + 40] == b"data" * 10
    for wrong, words in ((Expected(b"n", 0, fields[7], 40, 40), "names another file"),
                         (Expected(b"m", 8, fields[7], 40, 40), "method"),
                         (Expected(b"m", 0, fields[7] ^ 1, 40, 40), "CRC-32"),
                         (Expected(b"m", 0, fields[7], 40, 41), "size")):
        with pytest.raises(DataError, match=words):
            local_header_size(blob, 0, wrong, "t.zip!m")
    with pytest.raises(DataError, match="no local header at offset 5"):
        local_header_size(blob[5:], 5, expected, "t.zip!m")
    # Sizes after the data (a data descriptor): the local header's zeros are not compared.
    described = bytearray(blob)
    described[6:8] = struct.pack("<H", 0x808)
    described[14:26] = bytes(12)
    assert local_header_size(bytes(described), 0, expected, "t.zip!m") == length


def test_decode_exact_sizes():
    data = bytes(range(256)) * 100
    assert decode(zipfile.ZIP_DEFLATED, deflate(data), len(data), "w") == data
    import bz2
    assert decode(zipfile.ZIP_BZIP2, bz2.compress(data), len(data), "w") == data
    with pytest.raises(DataError, match="more than"):
        decode(zipfile.ZIP_DEFLATED, deflate(data), len(data) - 1, "w")
    with pytest.raises(DataError, match="decodes to"):
        decode(zipfile.ZIP_DEFLATED, deflate(data), len(data) + 1, "w")
    with pytest.raises(DataError, match="bad deflate data"):
        decode(zipfile.ZIP_DEFLATED, b"\xff" * 50, 10, "w")


def test_columns_are_compact():
    entries, _, _ = _parse(build(MEMBERS), 1 << 20)
    assert sum(entries.columns[k].itemsize for k in COLUMNS) == 32


def _one_by_one(blob: bytes, root: str) -> tuple[list[bytes], list[tuple[object, str]]]:
    """The reference: every record through `CentralDirectory.entry`, the field-by-field path."""
    end = read_end(blob, 0, "t.zip")
    skipped: list[tuple[object, str]] = []
    parser = CentralDirectory("t.zip", root, end.cd_offset, lambda name, why: skipped.append((name, why)))
    names, pos = [], end.cd_offset
    while pos < end.cd_offset + end.cd_size:
        fields = struct.unpack_from("<4s4B4HL2L5H2L", blob, pos)
        n, m, k = fields[12], fields[13], fields[14]
        got = parser.entry(fields, blob[pos + 46:pos + 46 + n], blob[pos + 46 + n:pos + 46 + n + m])
        if got is not None:
            names.append(got[0])
        pos += 46 + n + m + k
    return names, skipped


odd_names = st.lists(st.sampled_from([b"a", b"..", b".", b"", b"b\\c", b"n\0l", b"\xff", b"\xc3\xa9", b"d.e", b"-"]),
                     min_size=1, max_size=4).map(b"/".join)


@settings(max_examples=200, deadline=None)
@given(names=st.lists(st.tuples(odd_names, st.booleans(), st.booleans()), min_size=1, max_size=30),
       root=st.sampled_from(["", "a/"]), window=st.integers(1, 400))
def test_records_at_once_equal_one_by_one(names, root, window):
    """Plain records decoded a window at a time keep and refuse exactly what `entry` does, in order."""
    members = [Member(n + b"/" if d else n, b"", zip64=z) for n, d, z in names]
    blob = build(members)
    entries, skipped, _ = _parse(blob, window, root)
    assert (_names(entries), skipped) == _one_by_one(blob, root)
