"""Synthetic sharded scales with millions of chunks, written fast with numpy.

TensorStore writes the benchmark's realistic datasets; for listing and memory
figures at 10^6-10^7 chunks only the index structure matters, so this writer
lays out valid `neuroglancer_uint64_sharded_v1` shards (identity hash,
preshift 0, raw encodings) directly. Each chunk's payload is the low bytes of
its chunk id, so any read can be checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def morton_codes(grid: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Compressed Morton code of every cell, and the cells (x fastest)."""
    cells = np.indices(grid[::-1]).reshape(3, -1)[::-1].T.astype(np.uint64)  # (n, 3) as x, y, z
    codes = np.zeros(len(cells), dtype=np.uint64)
    j = 0
    for i in range(max((g - 1).bit_length() for g in grid)):
        for d in range(3):
            if (1 << i) < grid[d]:
                codes |= ((cells[:, d] >> np.uint64(i)) & np.uint64(1)) << np.uint64(j)
                j += 1
    return codes, cells


def write_scale(root: Path, grid: tuple[int, int, int], minishard_bits: int, shard_bits: int,
                payload: int = 1, key: str = "s0", noise: bool = False) -> list[str]:
    """Write `root/info` and `root/<key>/*.shard`; return the chunk file names. Payloads over 8
    bytes are zeros, or (`noise`) random bytes: a writer keeps zeros as holes, so a figure of what
    writing bytes costs needs bytes that are not."""
    root.mkdir(parents=True, exist_ok=True)
    spec = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
            "minishard_bits": minishard_bits, "shard_bits": shard_bits,
            "minishard_index_encoding": "raw", "data_encoding": "raw"}
    info = {"@type": "neuroglancer_multiscale_volume", "type": "image", "data_type": "uint8", "num_channels": 1,
            "scales": [{"key": key, "size": list(grid), "resolution": [1, 1, 1], "voxel_offset": [0, 0, 0],
                        "chunk_sizes": [[1, 1, 1]], "encoding": "raw", "sharding": spec}]}
    (root / "info").write_text(json.dumps(info))
    scale = root / key
    scale.mkdir(exist_ok=True)
    codes, cells = morton_codes(grid)
    minishard = codes & np.uint64((1 << minishard_bits) - 1)
    shard = (codes >> np.uint64(minishard_bits)) & np.uint64((1 << shard_bits) - 1)
    order = np.lexsort((codes, minishard, shard))
    codes, minishard, shard = codes[order], minishard[order], shard[order]
    payloads = codes.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :payload] if payload <= 8 else None
    width = (shard_bits + 3) // 4
    rng = np.random.default_rng(0)
    bounds = np.searchsorted(shard, np.arange((1 << shard_bits) + 1, dtype=np.uint64))
    for s in range(1 << shard_bits):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        if lo == hi:
            continue
        ids, minis = codes[lo:hi], minishard[lo:hi]
        data = (payloads[lo:hi].tobytes() if payloads is not None else
                rng.integers(0, 256, payload * (hi - lo), dtype=np.uint8).tobytes() if noise else
                bytes(payload * (hi - lo)))
        fixed = np.zeros((1 << minishard_bits, 2), dtype="<u8")
        parts = []
        cursor = len(data)
        mb = np.searchsorted(minis, np.arange((1 << minishard_bits) + 1, dtype=np.uint64))
        for m in range(1 << minishard_bits):
            a, b = int(mb[m]), int(mb[m + 1])
            if a == b:
                continue
            arr = np.zeros((3, b - a), dtype="<u8")
            arr[0] = np.diff(ids[a:b], prepend=np.uint64(0))
            arr[1, 0] = a * payload
            arr[2] = payload
            blob = arr.tobytes()
            fixed[m] = (cursor, cursor + len(blob))
            cursor += len(blob)
            parts.append(blob)
        with open(scale / f"{format(s, 'x').zfill(width)}.shard", "wb") as f:
            f.write(fixed.tobytes())
            f.write(data)
            for blob in parts:
                f.write(blob)
    x, y, z = (cells[:, d] for d in range(3))
    return [f"{a}-{a + 1}_{b}-{b + 1}_{c}-{c + 1}" for a, b, c in zip(x.tolist(), y.tolist(), z.tolist())]
