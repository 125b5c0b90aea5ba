"""Hand-built zip archives for the hostile tests: every field of every record under the test's control
(zipfile refuses to write most of these: NUL names, lying sizes, shared local headers)."""

from __future__ import annotations

import struct
import zipfile
import zlib
from dataclasses import dataclass

CENTRAL = struct.Struct(zipfile.structCentralDir)
LOCAL = struct.Struct(zipfile.structFileHeader)
EOCD = struct.Struct(zipfile.structEndArchive)
EOCD64 = struct.Struct(zipfile.structEndArchive64)
LOCATOR64 = struct.Struct(zipfile.structEndArchive64Locator)


@dataclass
class Member:
    name: bytes
    content: bytes  # what the member holds (compressed here when method is DEFLATE)
    method: int = zipfile.ZIP_STORED
    usize: int | None = None  # the central directory's size (default: the true one)
    local_name: bytes | None = None  # the local header's name (default: the same)
    local_usize: int | None = None  # the local header's size (default: the central one)
    same_header_as: int | None = None  # point the central entry at another member's local header
    zip64: bool = False  # sizes and offset in a ZIP64 extra field
    local_extra: bytes = b""  # an extra field in the local header only


def deflate(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


def build(members: list[Member], comment: bytes = b"", claimed_entries: int | None = None,
          zip64_end: bool = False) -> bytes:
    out = bytearray()
    centrals = []
    offsets: list[int] = []
    for m in members:
        stored = deflate(m.content) if m.method == zipfile.ZIP_DEFLATED else m.content
        crc = zlib.crc32(m.content)
        usize = len(m.content) if m.usize is None else m.usize
        offset = len(out)
        offsets.append(offset)
        local_name = m.name if m.local_name is None else m.local_name
        local_usize = (0xFFFFFFFF if m.zip64 else usize) if m.local_usize is None else m.local_usize
        out += LOCAL.pack(zipfile.stringFileHeader, 20, 0, 0x800, m.method, 0, 0x21, crc, len(stored),
                          local_usize & 0xFFFFFFFF, len(local_name), len(m.local_extra)) + local_name + m.local_extra \
            + stored
        header = offsets[m.same_header_as] if m.same_header_as is not None else offset
        centrals.append((m, crc, len(stored), usize, header))
    cd_start = len(out)
    for m, crc, csize, usize, header in centrals:
        extra = b""
        if m.zip64:
            extra = struct.pack("<HH3Q", 1, 24, usize, csize, header)
            usize = csize = header = 0xFFFFFFFF
        out += CENTRAL.pack(zipfile.stringCentralDir, 45, 3, 20, 0, 0x800, m.method, 0, 0x21, crc, csize, usize,
                            len(m.name), len(extra), 0, 0, 0, 0, header) + m.name + extra
    cd_size = len(out) - cd_start
    entries = len(members) if claimed_entries is None else claimed_entries
    if zip64_end or entries > 0xFFFF:
        at = len(out)
        out += EOCD64.pack(zipfile.stringEndArchive64, 44, 45, 45, 0, 0, entries, entries, cd_size, cd_start)
        out += LOCATOR64.pack(zipfile.stringEndArchive64Locator, 0, at, 1)
        out += EOCD.pack(zipfile.stringEndArchive, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, len(comment))
    else:
        out += EOCD.pack(zipfile.stringEndArchive, 0, 0, entries, entries, cd_size, cd_start, len(comment))
    return bytes(out + comment)
