"""The `neuroglancer_uint64_sharded_v1` sharding specification and its hashes."""

from __future__ import annotations

from dataclasses import dataclass

import mmh3
import numpy as np

from ...errors import ConfigError

U64 = (1 << 64) - 1
ENCODINGS = ("raw", "gzip")
HASHES = ("identity", "murmurhash3_x86_128")


def murmurhash3_x86_128_low64(value: int) -> int:
    """Low 64 bits of MurmurHash3_x86_128 (seed 0) of `value` as 8 LE bytes."""
    return mmh3.hash128(value.to_bytes(8, "little"), 0, False) & U64


def _int_member(obj: dict, name: str, lo: int, hi: int) -> int:
    value = obj.get(name)
    # bool is an int subclass in Python; a JSON true is not a bit count.
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ConfigError(f"sharding {name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _encoding_member(obj: dict, name: str) -> str:
    value = obj.get(name, "raw")
    if value not in ENCODINGS:
        raise ConfigError(f"sharding {name} must be one of {ENCODINGS}, got {value!r}")
    return value


@dataclass(frozen=True)
class ShardingSpec:
    preshift_bits: int
    hash: str
    minishard_bits: int
    shard_bits: int
    minishard_index_encoding: str = "raw"
    data_encoding: str = "raw"

    @classmethod
    def from_json(cls, obj: object) -> "ShardingSpec":
        if not isinstance(obj, dict):
            raise ConfigError(f"sharding must be a JSON object, got {type(obj).__name__}")
        if obj.get("@type") != "neuroglancer_uint64_sharded_v1":
            raise ConfigError(f"sharding @type must be 'neuroglancer_uint64_sharded_v1', got {obj.get('@type')!r}")
        if obj.get("hash") not in HASHES:
            raise ConfigError(f"sharding hash must be one of {HASHES}, got {obj.get('hash')!r}")
        spec = cls(
            preshift_bits=_int_member(obj, "preshift_bits", 0, 64),
            hash=obj["hash"],
            minishard_bits=_int_member(obj, "minishard_bits", 0, 32),
            shard_bits=_int_member(obj, "shard_bits", 0, 64),
            minishard_index_encoding=_encoding_member(obj, "minishard_index_encoding"),
            data_encoding=_encoding_member(obj, "data_encoding"),
        )
        if spec.minishard_bits + spec.shard_bits > 64:
            raise ConfigError("sharding minishard_bits + shard_bits must not exceed 64")
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
        h = self.hashed(chunk_id)
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
