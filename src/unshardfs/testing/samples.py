"""Small sample datasets written by our own writer, sharded and unsharded, from the runtime dependencies alone.

The demo (and anyone without TensorStore at hand) gets, from numpy, mmh3,
crc32c and zstandard only:

- a Neuroglancer precomputed image, two scales, in the
  `neuroglancer_uint64_sharded_v1` format (murmurhash3_x86_128 and identity
  hashes, raw and gzip minishard indexes and data),
- a Zarr v3 group holding one array with the `sharding_indexed` codec
  (zstd inner chunks, a crc32c-checked index at the end of each shard, one
  all-fill inner chunk left out as writers do),

each also written unsharded (`plain/`): the tree a mount of `sharded/` must
show, byte for byte. The writer shares no code with the readers in
`unshardfs`; the tests check it against TensorStore reading the same files.

Usage: python -m unshardfs.testing.samples DEST  ->  DEST/{precomputed,zarr}/{sharded,plain}
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import crc32c
import mmh3
import numpy as np
import zstandard

ZARR_ARRAY = "em"
GZIP_LEVEL = 6
ZSTD_LEVEL = 3
ABSENT = (1 << 64) - 1  # a Zarr shard index entry for an inner chunk that is not stored


@dataclass(frozen=True)
class ShardSpec:
    """A `neuroglancer_uint64_sharded_v1` sharding specification."""

    hash: str = "murmurhash3_x86_128"  # or "identity"
    preshift_bits: int = 0
    minishard_bits: int = 2
    shard_bits: int = 2
    minishard_index_encoding: str = "raw"  # or "gzip"
    data_encoding: str = "raw"  # or "gzip"

    def to_json(self) -> dict[str, object]:
        return {"@type": "neuroglancer_uint64_sharded_v1", "hash": self.hash,
                "preshift_bits": self.preshift_bits, "minishard_bits": self.minishard_bits,
                "shard_bits": self.shard_bits, "minishard_index_encoding": self.minishard_index_encoding,
                "data_encoding": self.data_encoding}

    def place(self, key: int) -> tuple[int, int]:
        """(shard number, minishard number) of `key`."""
        shifted = key >> self.preshift_bits
        if self.hash == "identity":
            hashed = shifted
        elif self.hash == "murmurhash3_x86_128":
            # The low 64 bits of the 128-bit hash of the key's 8 little-endian bytes, seed 0.
            hashed = mmh3.hash128(shifted.to_bytes(8, "little"), 0, False, signed=False) & ((1 << 64) - 1)
        else:
            raise ValueError(f"unknown hash {self.hash!r}")
        minishard = hashed & ((1 << self.minishard_bits) - 1)
        shard = (hashed >> self.minishard_bits) & ((1 << self.shard_bits) - 1)
        return shard, minishard

    def shard_name(self, shard: int) -> str:
        return f"{shard:0{-(-self.shard_bits // 4)}x}.shard"


def _encoded(data: bytes, encoding: str) -> bytes:
    return gzip.compress(data, GZIP_LEVEL, mtime=0) if encoding == "gzip" else data


def shard_files(spec: ShardSpec, values: dict[int, bytes]) -> dict[str, bytes]:
    """The shard files holding `values` (key -> bytes), by file name; shards with no key are not written.

    Each shard: the shard index (start, end) per minishard, then every
    minishard's chunk data in key order followed by its minishard index
    (keys, start offsets and sizes, the first two delta-coded). Offsets
    count from the end of the shard index.
    """
    placed: dict[int, dict[int, list[int]]] = {}
    for key in sorted(values):
        shard, minishard = spec.place(key)
        placed.setdefault(shard, {}).setdefault(minishard, []).append(key)
    files = {}
    for shard, minishards in placed.items():
        body = bytearray()
        ranges = np.zeros((1 << spec.minishard_bits, 2), dtype="<u8")
        for minishard in range(1 << spec.minishard_bits):
            keys = minishards.get(minishard, [])
            if not keys:
                ranges[minishard] = (len(body), len(body))
                continue
            starts, sizes = [], []
            for key in keys:
                payload = _encoded(values[key], spec.data_encoding)
                starts.append(len(body))
                sizes.append(len(payload))
                body += payload
            index = np.zeros((3, len(keys)), dtype="<u8")
            index[0] = np.diff(np.array(keys, dtype=np.uint64), prepend=np.uint64(0))
            ends = [s + n for s, n in zip(starts, sizes)]
            index[1] = [starts[0]] + [s - e for s, e in zip(starts[1:], ends[:-1])]
            index[2] = sizes
            encoded_index = _encoded(index.tobytes(), spec.minishard_index_encoding)
            ranges[minishard] = (len(body), len(body) + len(encoded_index))
            body += encoded_index
        files[spec.shard_name(shard)] = ranges.tobytes() + bytes(body)
    return files


def compressed_morton_code(cell: tuple[int, ...], grid: tuple[int, ...]) -> int:
    """Interleave the bits of `cell`, lowest first, skipping bits no cell of `grid` needs."""
    code, out_bit = 0, 0
    for bit in range(max(g - 1 for g in grid).bit_length()):
        for dim, extent in enumerate(grid):
            if (1 << bit) < extent:
                code |= ((cell[dim] >> bit) & 1) << out_bit
                out_bit += 1
    return code


# -- Neuroglancer precomputed ------------------------------------------------------------------

@dataclass(frozen=True)
class SampleScale:
    key: str
    size: tuple[int, int, int]  # x, y, z
    chunk: tuple[int, int, int]
    resolution: tuple[float, float, float]
    sharding: ShardSpec


PRECOMPUTED_SCALES = (
    SampleScale("8_8_40", (200, 160, 48), (64, 64, 16), (8.0, 8.0, 40.0),
          ShardSpec("murmurhash3_x86_128", preshift_bits=1, minishard_bits=2, shard_bits=2,
                    minishard_index_encoding="gzip", data_encoding="gzip")),
    SampleScale("16_16_80", (100, 80, 24), (32, 32, 16), (16.0, 16.0, 80.0),
          ShardSpec("identity", preshift_bits=0, minishard_bits=1, shard_bits=2)),
)


def precomputed_volumes() -> list[np.ndarray]:
    """The image at each scale, indexed [x, y, z, channel] (uint8); each scale halves the one before."""
    x, y, z = np.meshgrid(*(np.arange(n, dtype=np.float64) for n in PRECOMPUTED_SCALES[0].size), indexing="ij")
    # Smooth structure plus a little noise: compresses like EM, not like white noise.
    smooth = 96 + 60 * np.sin(x / 11.0) * np.cos(y / 7.0) + 40 * np.sin((x + 2 * y + 3 * z) / 17.0)
    noise = np.random.default_rng(35).integers(0, 24, size=smooth.shape)
    volumes = [np.clip(smooth + noise, 0, 255).astype(np.uint8)[..., np.newaxis]]
    for scale in PRECOMPUTED_SCALES[1:]:
        top = volumes[-1].astype(np.uint16)
        sx, sy, sz = scale.size
        half = top[:2 * sx, :2 * sy, :2 * sz].reshape(sx, 2, sy, 2, sz, 2, 1).mean(axis=(1, 3, 5))
        volumes.append(np.round(half).astype(np.uint8))
    return volumes


def precomputed_info(sharded: bool) -> dict[str, object]:
    scales = []
    for scale in PRECOMPUTED_SCALES:
        meta: dict[str, object] = {"key": scale.key, "size": list(scale.size), "chunk_sizes": [list(scale.chunk)],
                                   "encoding": "raw", "resolution": list(scale.resolution),
                                   "voxel_offset": [0, 0, 0]}
        if sharded:
            meta["sharding"] = scale.sharding.to_json()
        scales.append(meta)
    return {"@type": "neuroglancer_multiscale_volume", "type": "image", "data_type": "uint8",
            "num_channels": 1, "scales": scales}


def _raw_chunks(volume: np.ndarray, scale: SampleScale) -> dict[tuple[int, int, int], bytes]:
    """Each grid cell's raw chunk: clipped at the volume's end, x fastest, then y, z, channel."""
    grid = tuple(-(-s // c) for s, c in zip(scale.size, scale.chunk))
    chunks = {}
    for cell in np.ndindex(*grid):
        box = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(cell, scale.chunk, scale.size))
        chunks[cell] = volume[box].tobytes(order="F")
    return chunks


def write_precomputed(root: Path) -> list[np.ndarray]:
    """`root/sharded` and `root/plain`; returns the volumes written."""
    volumes = precomputed_volumes()
    for variant in ("sharded", "plain"):
        _fresh(root / variant)
        # Compact JSON: the form in which a mount shows the info with `sharding` removed.
        (root / variant / "info").write_text(json.dumps(precomputed_info(variant == "sharded"), separators=(",", ":")))
    for scale, volume in zip(PRECOMPUTED_SCALES, volumes):
        grid = tuple(-(-s // c) for s, c in zip(scale.size, scale.chunk))
        chunks = _raw_chunks(volume, scale)
        plain = root / "plain" / scale.key
        plain.mkdir()
        for cell, data in chunks.items():
            name = "_".join(f"{i * c}-{min((i + 1) * c, s)}" for i, c, s in zip(cell, scale.chunk, scale.size))
            (plain / name).write_bytes(data)
        sharded = root / "sharded" / scale.key
        sharded.mkdir()
        by_id = {compressed_morton_code(cell, grid): data for cell, data in chunks.items()}
        for name, data in shard_files(scale.sharding, by_id).items():
            (sharded / name).write_bytes(data)
    return volumes


# -- Zarr v3 -----------------------------------------------------------------------------------

ZARR_SHAPE = (48, 160, 200)  # z, y, x: neither the shard nor the inner chunk shape divides it
ZARR_SHARD = (32, 64, 64)
ZARR_INNER = (16, 32, 32)
INNER_CODECS: list[dict[str, object]] = [{"name": "bytes", "configuration": {"endian": "little"}},
                                         {"name": "zstd", "configuration": {"level": ZSTD_LEVEL, "checksum": False}}]


def zarr_volume() -> np.ndarray:
    """The array (uint16, z, y, x); its first inner chunk is all fill value, so it is not stored."""
    z, y, x = np.meshgrid(*(np.arange(n, dtype=np.float64) for n in ZARR_SHAPE), indexing="ij")
    smooth = 2000 + 1500 * np.sin(x / 13.0 + z / 5.0) * np.cos(y / 9.0)
    noise = np.random.default_rng(36).integers(0, 48, size=ZARR_SHAPE)
    volume = (smooth + noise).astype(np.uint16)
    volume[tuple(slice(0, n) for n in ZARR_INNER)] = 0
    return volume


def zarr_metadata(sharded: bool) -> dict[str, object]:
    codecs: list[dict[str, object]]
    if sharded:
        chunk_shape, codecs = ZARR_SHARD, [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(ZARR_INNER), "codecs": INNER_CODECS,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "end"}}]
    else:
        chunk_shape, codecs = ZARR_INNER, INNER_CODECS
    return {"zarr_format": 3, "node_type": "array", "shape": list(ZARR_SHAPE), "data_type": "uint16",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0, "codecs": codecs, "attributes": {"description": "unshardfs sample"},
            "dimension_names": ["z", "y", "x"]}


def _inner_chunks(volume: np.ndarray) -> dict[tuple[int, ...], bytes]:
    """Each stored inner chunk, encoded (padded to the full chunk shape with the fill value);
    chunks that are all fill value are left out."""
    grid = tuple(-(-s // c) for s, c in zip(ZARR_SHAPE, ZARR_INNER))
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False)
    chunks = {}
    for cell in np.ndindex(*grid):
        block = np.zeros(ZARR_INNER, dtype="<u2")
        part = volume[tuple(slice(i * c, (i + 1) * c) for i, c in zip(cell, ZARR_INNER))]
        block[tuple(slice(0, n) for n in part.shape)] = part
        if block.any():
            chunks[cell] = compressor.compress(block.tobytes())
    return chunks


def write_zarr(root: Path) -> np.ndarray:
    """`root/sharded` and `root/plain`, each a group holding the array `em`; returns the array."""
    volume = zarr_volume()
    inner = _inner_chunks(volume)
    per_shard = tuple(s // c for s, c in zip(ZARR_SHARD, ZARR_INNER))
    shard_grid = tuple(-(-s // c) for s, c in zip(ZARR_SHAPE, ZARR_SHARD))
    group = {"zarr_format": 3, "node_type": "group", "attributes": {"description": "unshardfs sample group"}}
    for variant in ("sharded", "plain"):
        _fresh(root / variant)
        (root / variant / "zarr.json").write_text(json.dumps(group, indent=2))
        (root / variant / ZARR_ARRAY).mkdir()
        # Indented as a mount shows a rewritten zarr.json.
        (root / variant / ZARR_ARRAY / "zarr.json").write_text(json.dumps(zarr_metadata(variant == "sharded"), indent=2))
    for cell, data in inner.items():
        path = root / "plain" / ZARR_ARRAY / "c" / "/".join(map(str, cell))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    for shard in np.ndindex(*shard_grid):
        body = bytearray()
        index = np.full((math.prod(per_shard), 2), ABSENT, dtype="<u8")
        for n, local in enumerate(np.ndindex(*per_shard)):
            cell = tuple(s * k + i for s, k, i in zip(shard, per_shard, local))
            if cell in inner:
                index[n] = (len(body), len(inner[cell]))
                body += inner[cell]
        if not body:
            continue
        raw_index = index.tobytes()
        path = root / "sharded" / ZARR_ARRAY / "c" / "/".join(map(str, shard))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(body) + raw_index + crc32c.crc32c(raw_index).to_bytes(4, "little"))
    return volume


def _fresh(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def write_samples(dest: Path) -> None:
    write_precomputed(dest / "precomputed")
    write_zarr(dest / "zarr")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m unshardfs.testing.samples DEST")
    write_samples(Path(sys.argv[1]))
