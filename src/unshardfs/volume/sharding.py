"""The `neuroglancer_uint64_sharded_v1` sharding specification and its hashes."""

from __future__ import annotations

from dataclasses import dataclass

import mmh3
import numpy as np

from unshardfs.core.caches import IndexLevel
from unshardfs.util.fields import Fields, MetadataError
from unshardfs.util.maps import MiB

U64 = (1 << 64) - 1
ENCODINGS = ("raw", "gzip")
HASHES = ("identity", "murmurhash3_x86_128")
# The second index level: the minishard indexes a shard index points to (decoded, cached).
MINISHARD_INDEX = IndexLevel("minishard_index", "--minishard-index-cache", 64 * MiB, "decoded minishard index cache")


def murmurhash3_x86_128_low64(value: int) -> int:
    """Low 64 bits of MurmurHash3_x86_128 (seed 0) of `value` as 8 LE bytes."""
    return mmh3.hash128(value.to_bytes(8, "little"), 0, False) & U64


@dataclass(frozen=True)
class ShardingSpec:
    preshift_bits: int
    hash: str
    minishard_bits: int
    shard_bits: int
    minishard_index_encoding: str = "raw"
    data_encoding: str = "raw"

    @classmethod
    def from_json(cls, obj: object, where: str = "sharding") -> "ShardingSpec":
        f = Fields(obj, where)
        f.str("@type", ("neuroglancer_uint64_sharded_v1",))
        spec = cls(
            preshift_bits=f.int("preshift_bits", 0, 64),
            hash=f.str("hash", HASHES),
            minishard_bits=f.int("minishard_bits", 0, 32),
            shard_bits=f.int("shard_bits", 0, 64),
            minishard_index_encoding=f.str("minishard_index_encoding", ENCODINGS, default="raw"),
            data_encoding=f.str("data_encoding", ENCODINGS, default="raw"),
        )
        if spec.minishard_bits + spec.shard_bits > 64:
            raise MetadataError(where, "minishard_bits + shard_bits must not exceed 64")
        return spec

    @property
    def shard_index_size(self) -> int:
        """Bytes of the fixed shard index at the start of every shard file."""
        return 16 << self.minishard_bits

    def hashed(self, chunk_id: int) -> int:
        shifted = chunk_id >> self.preshift_bits
        if self.hash == "identity":
            return shifted
        return murmurhash3_x86_128_low64(shifted)

    def hashed_array(self, chunk_ids: np.ndarray) -> np.ndarray:
        """Vectorised `hashed` for filtering whole minishard indexes."""
        shifted = chunk_ids >> np.uint64(self.preshift_bits) if self.preshift_bits < 64 else np.zeros_like(chunk_ids)
        if self.hash == "identity":
            return shifted
        return np.fromiter((murmurhash3_x86_128_low64(int(v)) for v in shifted), dtype=np.uint64, count=len(shifted))

    def location(self, chunk_id: int) -> tuple[int, int]:
        """(shard number, minishard number) holding `chunk_id`."""
        shifted = chunk_id >> self.preshift_bits  # `hashed`, inline: every lookup asks
        h = shifted if self.hash == "identity" else murmurhash3_x86_128_low64(shifted)
        minishard = h & ((1 << self.minishard_bits) - 1)
        shard = (h >> self.minishard_bits) & ((1 << self.shard_bits) - 1)
        return shard, minishard

    def locations_array(self, chunk_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h = self.hashed_array(chunk_ids)
        minishard = h & np.uint64((1 << self.minishard_bits) - 1)
        shard = (h >> np.uint64(self.minishard_bits)) & np.uint64((1 << self.shard_bits) - 1)
        return shard, minishard

    def shard_name(self, shard: int) -> str:
        """Base name of a shard: lowercase hex, zero padded to ceil(shard_bits/4) digits."""
        return format(shard, "x").zfill((self.shard_bits + 3) // 4)

    def parse_shard_name(self, stem: str) -> int | None:
        """Inverse of `shard_name`, or None for names that are not shard names."""
        if not stem or stem != stem.lower():
            return None
        try:
            shard = int(stem, 16)
        except ValueError:
            return None
        if shard >> self.shard_bits or self.shard_name(shard) != stem:
            return None
        return shard


def layout(spec: ShardingSpec) -> str:
    """One line that names a sharding spec's parameters, for `inspect`."""
    return (f"{spec.hash}, preshift {spec.preshift_bits}, minishard_bits {spec.minishard_bits}, shard_bits "
            f"{spec.shard_bits}; minishard index {spec.minishard_index_encoding}, data {spec.data_encoding}")
