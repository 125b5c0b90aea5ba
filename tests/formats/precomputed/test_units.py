"""Unit tests of the format code: hashes, Morton codes, spec validation, index decoding.

Where a published vector or an independent implementation (CloudVolume)
exists, results are checked against it rather than against our own idea.
"""

from __future__ import annotations

import gzip

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.profiles import examples
from unshardfs.core.blob import Blob
from unshardfs.formats.precomputed.dirs import manifest_fragment_bytes, parse_segment_id
from unshardfs.formats.precomputed.shards import decode_minishard
from unshardfs.sources.base import normalize_path
from unshardfs.util.decompress import gunzip
from unshardfs.util.errors import ConfigError, DataError
from unshardfs.volume.morton import MortonCoder
from unshardfs.volume.sharding import ShardingSpec, murmurhash3_x86_128_low64


def spec(**kw) -> ShardingSpec:
    base = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
            "minishard_bits": 2, "shard_bits": 3}
    base.update(kw)
    return ShardingSpec.from_json(base)


@pytest.mark.parametrize("key,expected", [
    (0, 0x4772B084E028AE41), (1, 0xE8BD67D616D4CE9A), (42, 0xC20B94F95119F47A)])
def test_murmurhash_published_vectors(key, expected):
    assert murmurhash3_x86_128_low64(key) == expected


@settings(max_examples=examples(200), deadline=None)
@given(chunk_id=st.integers(0, 2**64 - 1), preshift=st.integers(0, 12), minishard=st.integers(0, 8),
       shard=st.integers(0, 12), hash_=st.sampled_from(["identity", "murmurhash3_x86_128"]))
def test_shard_location_matches_cloudvolume(chunk_id, preshift, minishard, shard, hash_):
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification

    ours = spec(preshift_bits=preshift, minishard_bits=minishard, shard_bits=shard, hash=hash_)
    theirs = ShardingSpecification("neuroglancer_uint64_sharded_v1", preshift, hash_, minishard, shard, "raw", "raw")
    loc = theirs.compute_shard_location(chunk_id)
    shard_no, minishard_no = ours.location(chunk_id)
    assert ours.shard_name(shard_no) == loc.shard_number
    assert minishard_no == int(loc.minishard_number)
    s_arr, m_arr = ours.locations_array(np.array([chunk_id], dtype=np.uint64))
    assert (int(s_arr[0]), int(m_arr[0])) == (shard_no, minishard_no)


@settings(max_examples=examples(300), deadline=None)
@given(grid=st.tuples(st.integers(1, 300), st.integers(1, 300), st.integers(1, 300)), data=st.data())
def test_compressed_morton_matches_cloudvolume(grid, data):
    from cloudvolume.datasource.precomputed.common import compressed_morton_code

    cell = tuple(data.draw(st.integers(0, g - 1)) for g in grid)
    coder = MortonCoder(grid)
    code = coder.encode(cell)
    assert code == int(compressed_morton_code(cell, grid))
    cells, valid = coder.decode_array(np.array([code], dtype=np.uint64))
    assert valid[0] and tuple(cells[0]) == cell


def test_morton_hand_vectors_and_invalid_codes():
    coder = MortonCoder((1, 8, 2))  # y contributes bits 0,2,3; z bit 1; x none
    assert coder.encode((0, 5, 1)) == 0b1011
    cells, valid = coder.decode_array(np.array([0b1011, 1 << 4, 0b1000 | 0b0100], dtype=np.uint64))
    assert tuple(cells[0]) == (0, 5, 1) and valid[0]
    assert not valid[1]  # a bit beyond the grid's
    assert valid[2] and tuple(cells[2]) == (0, 6, 0)
    coder = MortonCoder((3, 1, 1))
    _, valid = coder.decode_array(np.array([3], dtype=np.uint64))  # x=3 is outside a 3-wide grid
    assert not valid[0]


@pytest.mark.parametrize("shard_bits,number,name", [(0, 0, "0"), (1, 1, "1"), (4, 10, "a"), (5, 3, "03"),
                                                     (9, 0x1AB, "1ab"), (64, 2**64 - 1, "f" * 16)])
def test_shard_names(shard_bits, number, name):
    s = spec(shard_bits=shard_bits, minishard_bits=0)
    assert s.shard_name(number) == name
    assert s.parse_shard_name(name) == number
    assert s.parse_shard_name(name.upper() if name.upper() != name else "g") is None


@pytest.mark.parametrize("bad", [
    {"@type": "neuroglancer_uint64_sharded_v2"},
    {"hash": "md5"},
    {"minishard_bits": -1},
    {"minishard_bits": 40},
    {"shard_bits": 65},
    {"shard_bits": 40, "minishard_bits": 30},
    {"preshift_bits": True},
    {"preshift_bits": 2.5},
    {"data_encoding": "zstd"},
    {"minishard_index_encoding": None},
])
def test_invalid_specs_are_rejected(bad):
    with pytest.raises(ConfigError):
        spec(**bad)


def _minishard(ids, offsets, sizes) -> bytes:
    arr = np.array([ids, offsets, sizes], dtype="<u8")
    return arr.tobytes()


def _blob(size: int) -> Blob:
    return Blob((("s", size, ()),), size, 0)


def _range(table, key):
    i = table.find(key)
    return None if i is None else table.row(i)[1:]


def test_minishard_decoding_deltas_duplicates_and_bounds():
    # ids 5, 7, 7 (dup), 100; data laid out back to back after a 32-byte shard index
    raw = _minishard([5, 2, 0, 93], [0, 0, 0, 0], [10, 20, 30, 40])
    mini = decode_minishard(raw, _blob(32 + 100), 32, "t")
    assert _range(mini, 5) == (32, 10)
    assert _range(mini, 7) == (42, 20)          # first of the duplicates wins
    assert _range(mini, 100) == (92, 40)
    assert _range(mini, 6) is None
    # The last chunk now ends past the file: flagged bad, others intact.
    mini = decode_minishard(raw, _blob(32 + 99), 32, "t")
    assert 100 in mini.bad and mini.find(100) is None
    assert _range(mini, 5) == (32, 10)


def test_minishard_wraparound_offsets_are_rejected():
    raw = _minishard([1], [2**64 - 40], [8])  # start wraps below the shard index
    mini = decode_minishard(raw, _blob(1000), 32, "t")
    assert 1 in mini.bad
    with pytest.raises(DataError):
        decode_minishard(raw + b"x", _blob(1000), 32, "t")


def test_gunzip_detects_damage():
    blob = gzip.compress(b"hello world" * 10)
    assert gunzip(blob, 110, "t") == b"hello world" * 10
    damaged = bytearray(blob)
    damaged[-6] ^= 0xFF  # CRC32
    with pytest.raises(DataError):
        gunzip(bytes(damaged), 110, "t")
    with pytest.raises(DataError):
        gunzip(blob[:-3], 110, "t")
    with pytest.raises(DataError):  # more than the file can hold
        gunzip(blob, 109, "t")


def test_manifest_parsing():
    import struct
    manifest = struct.pack("<3f3fI", 1, 1, 1, 0, 0, 0, 2) + struct.pack("<2f", 1, 2) + bytes(24)
    manifest += struct.pack("<2I", 2, 1)
    manifest += bytes(24) + struct.pack("<2I", 100, 50) + bytes(12) + struct.pack("<I", 7)
    assert manifest_fragment_bytes(manifest, "t") == 157
    with pytest.raises(DataError):
        manifest_fragment_bytes(manifest[:-1], "t")
    with pytest.raises(DataError):
        manifest_fragment_bytes(manifest + b"\0", "t")


@pytest.mark.parametrize("text,value", [("0", 0), ("12", 12), ("18446744073709551615", 2**64 - 1),
                                        ("012", None), ("18446744073709551616", None), ("-1", None),
                                        ("1e3", None), ("", None), ("١٢", None)])
def test_segment_ids(text, value):
    assert parse_segment_id(text) == value


@pytest.mark.parametrize("path,norm", [("a", "a"), ("a/./b", "a/b"), ("a/../b", "b"), ("a//b/", "a/b")])
def test_normalize_path(path, norm):
    assert normalize_path(path) == norm


@pytest.mark.parametrize("path", ["..", "../x", "a/../../x", "/etc"])
def test_paths_cannot_escape(path):
    with pytest.raises(ConfigError):
        normalize_path(path)


def _scale_dir(size, chunk, offset):
    from unshardfs.volume.grid import ChunkGrid

    return ChunkGrid(size, chunk, offset)


def test_chunk_names_offsets_and_clipping():
    d = _scale_dir((100, 70, 45), (16, 16, 16), (-5, 3, -17))
    assert d.chunk_name((0, 0, 0)) == "-5-11_3-19_-17--1"
    assert d.chunk_name((6, 4, 2)) == "91-95_67-73_15-28"  # last cells clipped to the volume
    assert d.parse_chunk_name("91-95_67-73_15-28") == (6, 4, 2)
    assert d.parse_chunk_name("-5-11_3-19_-17--1") == (0, 0, 0)
    for bad in ["91-107_67-73_15-28",     # unclipped end
                "-4-12_3-19_-17--1",      # misaligned begin
                "107-111_3-19_-17--1",    # outside the grid
                "-05-11_3-19_-17--1",     # leading zero
                "+91-95_67-73_15-28",     # explicit sign
                "91-95_67-73",            # too few axes
                "-21--5_3-19_-17--1"]:    # before the voxel offset
        assert d.parse_chunk_name(bad) is None, bad
    # names and ids round-trip through the Morton code used for inode numbers
    for cell in [(0, 0, 0), (6, 4, 2), (3, 1, 2)]:
        name = d.chunk_name(cell)
        assert d.name_of_code(d.coder.encode(cell)) == name
