"""Writes a toy dataset sharded and as its unsharded twin (see the package docstring)."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np

from .plugin import ENTRY, HEADER, MARKER, SUFFIX


def encode_shard(payloads: dict[int, bytes]) -> bytes:
    ids = sorted(payloads)
    lengths = [len(payloads[k]) for k in ids]
    offsets = HEADER + ENTRY * len(ids) + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    index = np.array([ids, offsets, lengths], dtype="<u8").T.tobytes()
    return struct.pack("<Q", len(ids)) + index + b"".join(payloads[k] for k in ids)


def write_toy(root: Path, chunks: dict[int, bytes], shards: int, encoding: str = "gzip") -> dict[str, Path]:
    """`root/sharded` and `root/plain`, each with a README that passes through; shards with no chunk
    are not written. Every chunk must have the same size."""
    (chunk_size,) = {len(data) for data in chunks.values()}
    sharded, plain = root / "sharded", root / "plain"
    for base in (sharded, plain):
        base.mkdir(parents=True)
        (base / "README").write_text("a toy dataset\n")
    (sharded / MARKER).write_text(json.dumps({"chunk_size": chunk_size, "shards": shards, "encoding": encoding}))
    (plain / MARKER).write_text(json.dumps({"chunk_size": chunk_size}))
    for n in range(shards):
        mine = {k: gzip.compress(v, mtime=0) if encoding == "gzip" else v for k, v in chunks.items() if k % shards == n}
        if mine:
            (sharded / f"{n}{SUFFIX}").write_bytes(encode_shard(mine))
    for chunk_id, data in chunks.items():
        (plain / str(chunk_id)).write_bytes(data)
    return {"sharded": sharded, "plain": plain}
