"""DVID's compressed label block format, decoded with numpy.

Layout (little-endian): gx, gy, gz (u32, sub-blocks per axis), N (u32),
N u64 labels; if N >= 2: one u16 label count per sub-block, the sub-blocks'
u32 indices into the label list, then the packed per-voxel values. Sub-blocks
are 8^3 voxels in z, y, x order (x fastest), as are the voxels within each;
a sub-block with n >= 2 labels packs 512 values of ceil(log2 n) bits each,
MSB first, starting on a byte boundary (512 * bits is always a whole number
of bytes, so the boundary needs no padding). n = 0 means all voxels are 0,
n = 1 all voxels are that label; N <= 1 is a solid block.

Decoding groups sub-blocks by bit width, so the work is a handful of numpy
calls per block whatever its content; nothing loops over voxels in Python.
Every length is checked against the buffer before use: damaged blocks raise
`ValueError` with the reason, never decode to wrong labels silently.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

SUB = 8
SUB_VOXELS = SUB ** 3
HEADER = 16


def _bits(counts: np.ndarray) -> np.ndarray:
    """ceil(log2(n)) for n >= 2, else 0."""
    widths = np.zeros(counts.shape, dtype=np.int64)
    many = counts >= 2
    widths[many] = np.ceil(np.log2(counts[many].astype(np.float64))).astype(np.int64)
    return widths


def block_shape(data: bytes) -> tuple[int, int, int]:
    """(nz, ny, nx) in voxels, from the header."""
    if len(data) < HEADER:
        raise ValueError(f"block of {len(data)} bytes is shorter than its 16-byte header")
    gx, gy, gz, _ = np.frombuffer(data, dtype="<u4", count=4).tolist()
    return gz * SUB, gy * SUB, gx * SUB


def max_block_bytes(chunk_size: tuple[int, int, int]) -> int:
    """The largest valid encoding of a block of `chunk_size` voxels: every voxel its own label
    (header, labels, per-sub-block counts and indices, 9-bit values)."""
    voxels = chunk_size[0] * chunk_size[1] * chunk_size[2]
    subs = -(-voxels // SUB_VOXELS)
    return HEADER + 8 * voxels + 2 * subs + 4 * subs * SUB_VOXELS + subs * SUB_VOXELS * 9 // 8


def decode_block(data: bytes, shape: tuple[int, int, int] | None = None,
                 relabel: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """The block's labels as a C-order (nz, ny, nx) uint64 array (x fastest).

    `shape` (nz, ny, nx), when given, is the only accepted block size; it is
    checked against the header before anything is allocated. `relabel`
    maps the block's label list (a few entries) before expansion, which is
    how supervoxel ids become agglomerated labels at no per-voxel cost.
    """
    nz, ny, nx = block_shape(data)
    if shape is not None and (nz, ny, nx) != tuple(shape):
        raise ValueError(f"block is {nx}x{ny}x{nz} voxels (x, y, z), chunks are {shape[::-1]}")
    gz, gy, gx = nz // SUB, ny // SUB, nx // SUB
    if not (0 < gx <= 128 and 0 < gy <= 128 and 0 < gz <= 128):
        raise ValueError(f"implausible sub-block grid {gx}x{gy}x{gz}")
    n_labels = int(np.frombuffer(data, dtype="<u4", count=1, offset=12)[0])
    if n_labels > nz * ny * nx:
        raise ValueError(f"block declares {n_labels} labels for {nz * ny * nx} voxels")
    pos = HEADER + 8 * n_labels
    if len(data) < pos:
        raise ValueError(f"block declares {n_labels} labels but has only {len(data)} bytes")
    labels = np.frombuffer(data, dtype="<u8", count=n_labels, offset=HEADER).astype(np.uint64)
    if relabel is not None:
        labels = relabel(labels).astype(np.uint64)
    if n_labels <= 1:
        if len(data) != pos:
            raise ValueError(f"solid block has {len(data) - pos} trailing bytes")
        return np.full((nz, ny, nx), labels[0] if n_labels else 0, dtype=np.uint64)

    n_sub = gx * gy * gz
    if len(data) < pos + 2 * n_sub:
        raise ValueError("block is truncated in its sub-block label counts")
    counts = np.frombuffer(data, dtype="<u2", count=n_sub, offset=pos).astype(np.int64)
    pos += 2 * n_sub
    n_indices = int(counts.sum())
    if len(data) < pos + 4 * n_indices:
        raise ValueError("block is truncated in its sub-block label indices")
    indices = np.frombuffer(data, dtype="<u4", count=n_indices, offset=pos)
    pos += 4 * n_indices
    if n_indices and int(indices.max()) >= n_labels:
        raise ValueError(f"a sub-block index points past the {n_labels} block labels")
    if (counts > SUB_VOXELS).any():
        raise ValueError("a sub-block claims more than 512 labels")
    widths = _bits(counts)
    value_bytes = widths * (SUB_VOXELS // 8)
    if len(data) != pos + int(value_bytes.sum()):
        raise ValueError(f"block has {len(data)} bytes, its header implies {pos + int(value_bytes.sum())}")

    # Per sub-block: where its label indices start, and where its values start.
    first_index = np.cumsum(counts) - counts
    value_start = pos + np.cumsum(value_bytes) - value_bytes
    # Sub-blocks without labels read as 0: they point at an extra 0 entry.
    first_index[counts == 0] = n_indices
    lut = np.append(labels, np.uint64(0))[np.append(indices, np.uint32(n_labels))]
    raw = np.frombuffer(data, dtype=np.uint8)
    values = np.zeros((n_sub, SUB_VOXELS), dtype=np.int32)
    for width in range(1, 10):  # 512 labels need at most 9 bits
        chosen = np.nonzero(widths == width)[0]
        if not len(chosen):
            continue
        span = width * (SUB_VOXELS // 8)
        rows = raw[value_start[chosen][:, None] + np.arange(span)]  # (k, span) bytes
        bits = np.unpackbits(rows, axis=1).reshape(len(chosen), SUB_VOXELS, width)
        packed = bits[:, :, 0].astype(np.int32)
        for j in range(1, width):  # at most 9 bit planes, MSB first
            packed <<= 1
            packed |= bits[:, :, j]
        if (packed >= counts[chosen][:, None]).any():
            raise ValueError("a packed value exceeds its sub-block's label count")
        values[chosen] = packed
    values += first_index.astype(np.int32)[:, None]
    # Reorder the (4-byte) slots into voxel order, then gather the labels:
    # (gz, gy, gx, z, y, x) -> (gz, z, gy, y, gx, x).
    ordered = values.reshape(gz, gy, gx, SUB, SUB, SUB).transpose(0, 3, 1, 4, 2, 5).reshape(nz, ny, nx)
    out: np.ndarray = lut[ordered]
    return out
