"""Each codec's size rules and caps, in-process, with the exact reason of every refusal."""

from __future__ import annotations

import gzip
import struct

import crc32c
import numpy as np
import pytest

from unshardfs.core.codecs import CODECS, Codec, Crc32cSuffix, Gzip, Stored, codec, register_codec
from unshardfs.util.errors import DataError


class Ref:
    """The payload reference a codec sees."""

    def __init__(self, size: int, length: int, where: str = "s.shard chunk 3") -> None:
        self.size, self.length, self.where, self.chunk_id, self.extra = size, length, where, 3, 0


def reason(call) -> str:
    with pytest.raises(DataError) as e:
        call()
    return e.value.reason


def test_codecs_by_name():
    assert isinstance(codec("gzip"), Gzip) and isinstance(codec("raw"), Stored)
    with pytest.raises(KeyError, match="no codec named 'nope' .known: .*gzip"):
        codec("nope")


def test_a_registered_codec_is_found_by_name():
    @register_codec
    class Reverse(Codec):
        name = "test-reverse"

        def decode(self, payload, f, prepared=None):
            return payload[::-1]

    try:
        assert codec("test-reverse").decode(b"abc", Ref(3, 3)) == b"cba"
    finally:
        del CODECS["test-reverse"]


def test_raw_size_must_match_the_geometry():
    raw = Stored()
    assert raw.size(10, None, 5, "w") == 10  # no geometry: the stored length, whatever the cap
    assert raw.size(10, 10, 100, "w") == 10
    assert reason(lambda: raw.size(10, 12, 100, "w")) == "raw chunk has 10 bytes; its geometry says 12"
    sizes, ok = raw.sizes(np.array([10, 12], np.uint64), np.array([10, 10]), np.array([99, 99]))
    assert sizes.tolist() == [10, 12] and ok.tolist() == [True, False]


def test_gzip_sizes_and_caps():
    gz = Gzip()
    assert gz.size(100, 4096, 8192, "w") == 4096  # the geometry fixes it: no trailer needed
    assert reason(lambda: gz.size(100, 9000, 8192, "w")) == \
        "a decoded chunk of 9,000 bytes exceeds the 8,192-byte limit (--max-payload-size)"
    assert gz.size(100, None, 8192, "w") is None  # the trailer tells
    assert reason(lambda: gz.size(17, None, 8192, "w")) == "gzip payload of 17 bytes is too short"
    assert reason(lambda: gz.size(100_000, None, 1000, "w")) == \
        "gzip payload of 100,000 bytes is larger than any encoding of at most 1,000 bytes"
    assert gz.size_from_trailer(struct.pack("<I", 500), 1000, "w") == 500
    assert reason(lambda: gz.size_from_trailer(struct.pack("<I", 1001), 1000, "w")) == \
        "gzip trailer claims 1,001 bytes, more than this file can hold (1,000)"
    sizes, ok = gz.sizes(np.array([10, 100, 10**6], np.uint64), None, np.array([1000, 1000, 1000]))
    assert sizes is None and ok.tolist() == [False, True, False]


def test_gzip_decode_checks_the_size():
    gz = Gzip()
    data = bytes(range(200))
    assert gz.decode(gzip.compress(data), Ref(200, 0)) == data
    assert reason(lambda: gz.decode(gzip.compress(data[:150]), Ref(200, 0))) == \
        "gzip payload decodes to 150 bytes, expected 200"


def test_crc32c_suffix():
    crc = Crc32cSuffix()
    data = b"hello chunk"
    payload = data + crc32c.crc32c(data).to_bytes(4, "little")
    assert crc.size(len(payload), None, 100, "w") == len(data)
    assert crc.decode(payload, Ref(len(data), len(payload))) == data
    assert reason(lambda: crc.size(3, None, 100, "w")) == "3-byte chunk is too short to end in a crc32c checksum"
    assert reason(lambda: crc.size(200, None, 100, "w")) == \
        "200-byte chunk is larger than any encoding of this chunk (100)"
    assert reason(lambda: crc.decode(payload[:-1] + b"\0", Ref(len(data), len(payload)))) == \
        "chunk crc32c checksum mismatch"
