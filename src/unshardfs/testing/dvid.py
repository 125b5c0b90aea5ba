"""A reference writer of DVID `export-shards` output, for the tests.

`encode_block` implements DVID's label block compression from its published
description (sub-block by sub-block; it shares no code with the vectorised
decoder under test). `write_export` lays blocks out as DVID does:
`s<scale>/<ox>_<oy>_<oz>.arrow` per Neuroglancer shard, with each of the
chunk-index variants DVID has written over time. Shard membership comes
from CloudVolume's sharding code, not ours.
"""

from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import zstandard

SUB = 8
BLOCK = 64


def encode_block(block: np.ndarray) -> bytes:
    """DVID-compress a (nz, ny, nx) uint64 block of supervoxel ids."""
    nz, ny, nx = block.shape
    gz, gy, gx = nz // SUB, ny // SUB, nx // SUB
    flat = block.ravel()
    uniq, first = np.unique(flat, return_index=True)
    labels = uniq[np.argsort(first)]  # first-seen order (any order is valid)
    head = struct.pack("<4I", gx, gy, gz, len(labels)) + labels.astype("<u8").tobytes()
    if len(labels) <= 1:
        return head
    position = {int(v): i for i, v in enumerate(labels.tolist())}
    counts: list[int] = []
    indices: list[int] = []
    values: list[bytes] = []
    for sz in range(gz):
        for sy in range(gy):
            for sx in range(gx):
                sub = block[sz * SUB:(sz + 1) * SUB, sy * SUB:(sy + 1) * SUB, sx * SUB:(sx + 1) * SUB].ravel()
                sub_uniq, sub_first = np.unique(sub, return_index=True)
                local = sub_uniq[np.argsort(sub_first)]
                counts.append(len(local))
                indices.extend(position[int(v)] for v in local.tolist())
                if len(local) >= 2:
                    width = math.ceil(math.log2(len(local)))
                    code = np.searchsorted(np.sort(local), sub)
                    code = np.argsort(np.argsort(sub_first))[code]  # rank in first-seen order
                    bits = ((code[:, None] >> np.arange(width - 1, -1, -1)) & 1).astype(np.uint8)
                    values.append(np.packbits(bits.ravel()).tobytes())
    return (head + struct.pack(f"<{len(counts)}H", *counts) + struct.pack(f"<{len(indices)}I", *indices)
            + b"".join(values))


def zero_subblock_block(label: int, other: int) -> bytes:
    """A block whose first sub-block has no labels at all (count 0: reads as zeros)."""
    block = np.full((BLOCK, BLOCK, BLOCK), label, dtype=np.uint64)
    block[0, 0, 1] = other
    data = bytearray(encode_block(block))
    n = struct.unpack_from("<I", data, 12)[0]
    pos = 16 + 8 * n
    counts = list(struct.unpack_from("<512H", data, pos))
    index_pos = pos + 2 * 512
    first = counts[0]
    width = math.ceil(math.log2(first)) if first >= 2 else 0
    values_pos = index_pos + 4 * sum(counts)
    del data[values_pos: values_pos + 64 * width]
    del data[index_pos: index_pos + 4 * first]
    counts[0] = 0
    struct.pack_into("<512H", data, pos, *counts)
    return bytes(data)


def agglomerate(sv: np.ndarray) -> np.ndarray:
    """The test's agglomeration: supervoxel s belongs to body s // 3 + 10**6 (0 stays 0)."""
    return np.where(sv == 0, 0, sv // 3 + 10**6).astype(np.uint64)


def sample_volume(shape: tuple[int, int, int], seed: int) -> np.ndarray:
    """An (x, y, z) supervoxel volume with solid blocks, few- and many-label sub-blocks and empty blocks."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(1, 40, size=[-(-s // 8) for s in shape]).astype(np.uint64)
    vol = np.kron(coarse, np.ones((8, 8, 8), dtype=np.uint64))[: shape[0], : shape[1], : shape[2]].copy()
    fine = rng.integers(1, 6, size=vol.shape).astype(np.uint64)
    vol[BLOCK:2 * BLOCK, :BLOCK, :] = fine[BLOCK:2 * BLOCK, :BLOCK, :] + 100  # 2-3 bit sub-blocks
    noise = rng.integers(1, 2**40, size=vol.shape).astype(np.uint64)
    vol[:16, BLOCK:BLOCK + 16, :16] = noise[:16, BLOCK:BLOCK + 16, :16]  # 512 labels per sub-block
    vol[:BLOCK, :BLOCK, :BLOCK] = 7  # a solid block
    vol[2 * BLOCK:3 * BLOCK, BLOCK:2 * BLOCK, :] = 0  # blocks DVID skips
    vol[2 * BLOCK + 8:2 * BLOCK + 16, :8, :8] = 0  # a zero sub-block inside a block
    return np.asarray(vol, dtype=np.uint64)


def info_for(sizes: list[tuple[int, int, int]], sharding: dict[str, Any]) -> dict[str, Any]:
    return {"@type": "neuroglancer_multiscale_volume", "type": "segmentation", "data_type": "uint64",
            "num_channels": 1,
            "scales": [{"key": f"{8 << i}.0x{8 << i}.0x{8 << i}.0", "size": list(size),
                        "chunk_sizes": [[BLOCK] * 3], "resolution": [8 << i] * 3, "voxel_offset": [0, 0, 0],
                        "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8],
                        "sharding": sharding} for i, size in enumerate(sizes)]}


@dataclass
class Variant:
    index: str  # "footer" (file + JSON footer), "json" (sidecar), "csv" (sidecar with byte offsets)
    framing: str  # "file" or "stream"
    zstd: bool
    key_units: str = "voxel"  # how footer/json keys are written: "voxel" or "block"
    batch_size: int = 1  # rows per record batch (csv only)


def _schema(zstd: bool) -> pa.Schema:
    block = pa.field("dvid_compressed_block", pa.binary(), nullable=False,
                     metadata={"codec": "zstd"} if zstd else None)
    fields = [pa.field("chunk_x", pa.int32(), nullable=False), pa.field("chunk_y", pa.int32(), nullable=False),
              pa.field("chunk_z", pa.int32(), nullable=False),
              pa.field("labels", pa.list_(pa.uint64()), nullable=False),
              pa.field("supervoxels", pa.list_(pa.uint64()), nullable=False), block]
    if zstd:
        fields.append(pa.field("uncompressed_size", pa.uint32(), nullable=False))
    return pa.schema(fields)


def shard_groups(grid: tuple[int, int, int], sharding: dict[str, Any]) -> dict[int, list[tuple[int, int, int]]]:
    from cloudvolume.datasource.precomputed.common import compressed_morton_code
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification

    spec = ShardingSpecification.from_dict(dict(sharding))
    groups: dict[int, list[Any]] = {}
    for x in range(grid[0]):
        for y in range(grid[1]):
            for z in range(grid[2]):
                shard = spec.compute_shard_location(int(compressed_morton_code((x, y, z), grid))).shard_number
                groups.setdefault(int(shard), []).append((x, y, z))
    return groups


def encode_volume(vol: np.ndarray) -> dict[tuple[int, int, int], tuple[bytes, np.ndarray]]:
    """Non-empty blocks of an (x, y, z) volume: cell -> (DVID block, its supervoxel ids)."""
    out = {}
    grid = [-(-s // BLOCK) for s in vol.shape]
    for x in range(grid[0]):
        for y in range(grid[1]):
            for z in range(grid[2]):
                sub = np.zeros((BLOCK, BLOCK, BLOCK), dtype=np.uint64)
                part = vol[x * BLOCK:(x + 1) * BLOCK, y * BLOCK:(y + 1) * BLOCK, z * BLOCK:(z + 1) * BLOCK]
                sub[: part.shape[0], : part.shape[1], : part.shape[2]] = part
                if not sub.any():
                    continue  # DVID skips all-zero blocks
                zyx = np.ascontiguousarray(sub.transpose(2, 1, 0))
                svs = np.unique(zyx)
                out[(x, y, z)] = (encode_block(zyx), svs[svs != 0])
    return out


def write_scale(scale_dir: Path, blocks: dict[tuple[int, int, int], Any], grid: tuple[int, int, int], sharding: dict[str, Any], variant: Variant) -> None:
    scale_dir.mkdir(parents=True, exist_ok=True)
    schema = _schema(variant.zstd)
    zstd = zstandard.ZstdCompressor(level=3)
    for shard, cells in sorted(shard_groups(grid, sharding).items()):
        present = [c for c in sorted(cells, key=lambda c: (c[2], c[1], c[0])) if c in blocks]  # ZYX order
        if not present:
            continue
        origin = [min(c[d] for c in cells) * BLOCK for d in range(3)]
        stem = scale_dir / "_".join(map(str, origin))
        rows = []
        for cell in present:
            data, svs = blocks[cell]
            row = {"chunk_x": cell[0], "chunk_y": cell[1], "chunk_z": cell[2],
                   "labels": agglomerate(svs).tolist(), "supervoxels": svs.tolist(),
                   "dvid_compressed_block": zstd.compress(data) if variant.zstd else data}
            if variant.zstd:
                row["uncompressed_size"] = len(data)
            rows.append(row)
        batch_size = variant.batch_size if variant.index == "csv" else 1
        sink = io.BytesIO()
        writer = (pa.ipc.new_file if variant.framing == "file" else pa.ipc.new_stream)(sink, schema)
        spans = []
        for at in range(0, len(rows), batch_size):
            batch = pa.RecordBatch.from_pylist(rows[at:at + batch_size], schema=schema)
            writer.write_batch(batch)
            end = sink.tell()
            size = len(batch.serialize())
            spans.extend([(end - size, size, i) for i in range(len(rows[at:at + batch_size]))])
        writer.close()
        body = sink.getvalue()
        unit = BLOCK if variant.key_units == "voxel" else 1

        def key_of(c: tuple[int, int, int]) -> str:
            return "_".join(str(v * unit) for v in c)
        mapping = {key_of(c): i for i, c in enumerate(present)}
        if variant.index == "footer":
            text = json.dumps(mapping).encode()
            body += text + struct.pack("<Q", len(text)) + b"CHUNKIDX"
        elif variant.index == "json":
            stem.with_suffix(".json").write_text(json.dumps(mapping))
        else:
            schema_size = spans[0][0]
            lines = [f"# schema_size={schema_size}", "x,y,z,offset,size,batch_idx"]
            lines += [f"{c[0]},{c[1]},{c[2]},{o},{n},{i}" for c, (o, n, i) in zip(present, spans)]
            stem.with_suffix(".csv").write_text("\n".join(lines) + "\n")
        stem.with_suffix(".arrow").write_bytes(body)
