"""The 16-byte WKW file header (webknossos-wrap README, "File format"), parsed and bounded.

Every `.wkw` file and each mag's `header.wkw` start with it: magic `WKW`,
version 1, the block and file edges (log2 nibbles), the block encoding, the
voxel type, bytes per voxel (a multiple of the type's size for several
channels) and the offset of block 0. LZ4 files follow it with a jump table
of one u64 per block: the file offset just past that block.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

HEADER_BYTES = 16
MAGIC = b"WKW"
VERSION = 1
RAW, LZ4, LZ4HC = 1, 2, 3
BLOCK_TYPES = {RAW: "raw", LZ4: "lz4", LZ4HC: "lz4hc"}
# voxelType -> numpy dtype: the README's six, and the signed types the reference
# library (libwkw, as shipped in the `wkw` package) writes as 7 to 10.
VOXEL_TYPES = {1: "<u1", 2: "<u2", 3: "<u4", 4: "<u8", 5: "<f4", 6: "<f8", 7: "<i1", 8: "<i2", 9: "<i4",
               10: "<i8"}
# A block edge of 2**10 voxels is already 1 GiB of uint8; files of more than
# 2**8 blocks per edge would need a jump table of 128 MiB. Both are far beyond
# anything written (32 and 32); what lies between is bounded by the limits.
MAX_BLOCK_LOG2 = 10
MAX_FILE_LOG2 = 8


class HeaderError(ValueError):
    """A header no WKW writer produces (the message says which field)."""


@dataclass(frozen=True)
class WkwHeader:
    block_log2: int  # voxels per block edge = 2**block_log2
    file_log2: int  # blocks per file edge = 2**file_log2
    block_type: int
    voxel_type: int
    voxel_size: int  # bytes per voxel, all channels
    data_offset: int

    @classmethod
    def parse(cls, raw: bytes) -> "WkwHeader":
        if len(raw) < HEADER_BYTES:
            raise HeaderError(f"{len(raw)} bytes is too short for a WKW header ({HEADER_BYTES})")
        magic, version, per_dim, block_type, voxel_type, voxel_size, data_offset = struct.unpack(
            "<3sBBBBBQ", raw[:HEADER_BYTES])
        if magic != MAGIC:
            raise HeaderError(f"not a WKW file (starts with {magic!r})")
        if version != VERSION:
            raise HeaderError(f"WKW version {version} (only {VERSION} is defined)")
        block_log2, file_log2 = per_dim & 0x0F, per_dim >> 4
        if block_log2 > MAX_BLOCK_LOG2 or file_log2 > MAX_FILE_LOG2:
            raise HeaderError(f"absurd dimensions: blocks of 2**{block_log2} voxels per edge, files of "
                              f"2**{file_log2} blocks per edge")
        if block_type not in BLOCK_TYPES:
            raise HeaderError(f"unknown block type {block_type}")
        if voxel_type not in VOXEL_TYPES:
            raise HeaderError(f"unknown voxel type {voxel_type}")
        item = np.dtype(VOXEL_TYPES[voxel_type]).itemsize
        if voxel_size == 0 or voxel_size % item:
            raise HeaderError(f"voxel size {voxel_size} is not a multiple of the {VOXEL_TYPES[voxel_type][1:]} "
                              f"type's {item} bytes")
        return cls(block_log2, file_log2, block_type, voxel_type, voxel_size, data_offset)

    @property
    def block_edge(self) -> int:
        return 1 << self.block_log2

    @property
    def file_edge(self) -> int:
        """Blocks per file edge."""
        return 1 << self.file_log2

    @property
    def blocks(self) -> int:
        """Blocks in one file."""
        return 1 << (3 * self.file_log2)

    @property
    def block_bytes(self) -> int:
        """A decoded block: every voxel of the cube, all channels."""
        return (1 << (3 * self.block_log2)) * self.voxel_size

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(VOXEL_TYPES[self.voxel_type])

    @property
    def channels(self) -> int:
        return self.voxel_size // self.dtype.itemsize

    @property
    def compressed(self) -> bool:
        return self.block_type != RAW

    @property
    def jump_table_bytes(self) -> int:
        return 8 * self.blocks if self.compressed else 0

    def layout(self) -> tuple[int, int, int, int]:
        """What every file of one mag must agree on (the block type may differ per file)."""
        return self.block_log2, self.file_log2, self.voxel_type, self.voxel_size

    def describe(self) -> str:
        return (f"{BLOCK_TYPES[self.block_type]}, {self.channels} x {self.dtype.name}, blocks of "
                f"{self.block_edge}^3 voxels, {self.file_edge}^3 blocks per file")
