"""The `sharding_indexed` codec: what an unsharded view of a sharded array is.

`unshard` walks an array's codec chain once, at mount time, and returns the
inner chunk grid, the codec chain an unsharded writer would have used, and
one `ShardLevel` per (possibly nested) sharding codec. Reading a chunk is
then pure index arithmetic plus one index lookup per level.

Array -> array codecs before a sharding codec are applied to the whole shard;
for elementwise codecs and `transpose` that equals applying them to every
inner chunk, so they move into the unsharded chain unchanged (a transpose
also permutes the coordinates the inner chunk shape is given in).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from unshardfs.formats.zarr.metadata import ArrayMeta, codec_config, codec_name
from unshardfs.util.errors import ConfigError, DataError
from unshardfs.util.fields import as_ints, grid_shape

EMPTY = (1 << 64) - 1

# Array -> array codecs that act on each element alone: applying them to a
# shard or to each of its inner chunks gives the same bytes.
ELEMENTWISE = frozenset({"numcodecs.fixedscaleoffset", "numcodecs.quantize", "numcodecs.bitround",
                         "numcodecs.astype"})


MAX_LEVELS = 8


class Unsupported(ConfigError):
    """This array cannot be shown unsharded (the reason says why)."""


def transpose_order(codec: object, ndim: int) -> tuple[int, ...]:
    order = codec_config(codec).get("order")
    if order == "C":
        return tuple(range(ndim))
    if order == "F":
        return tuple(reversed(range(ndim)))
    # Integers checked first: sorted() cannot compare mixed types.
    if (not isinstance(order, list) or not all(isinstance(o, int) and not isinstance(o, bool) for o in order)
            or sorted(order) != list(range(ndim))):
        raise ConfigError(f"transpose order {str(order)[:80]} is not a permutation of {ndim} dimensions")
    return tuple(order)


@dataclass(frozen=True)
class ShardLevel:
    """One sharding codec: the grid of inner chunks inside each shard at this level."""

    chunk_shape: tuple[int, ...]  # inner chunk shape, in this level's (transposed) dimension order
    perm: tuple[int, ...]  # this level's dimension i is array dimension perm[i]
    counts: tuple[int, ...]  # inner chunks per shard along each of this level's dimensions
    endian: str  # "<" or ">"
    checksum: bool
    at_start: bool

    @property
    def entries(self) -> int:
        return math.prod(self.counts)

    @property
    def index_size(self) -> int:
        return 16 * self.entries + (4 if self.checksum else 0)

    def decode_index(self, raw: bytes, where: str) -> np.ndarray:
        """The (entries, 2) uint64 array of (offset, nbytes), checksum verified."""
        body = raw
        if self.checksum:
            body, stored = raw[:-4], int.from_bytes(raw[-4:], "little")
            if crc32c.crc32c(body) != stored:
                raise DataError(where, "shard index crc32c checksum mismatch")
        return np.frombuffer(body, dtype=self.endian + "u8").astype(np.uint64).reshape(-1, 2)


@dataclass(frozen=True)
class Unsharded:
    chunk_shape: tuple[int, ...]  # inner chunk shape in array order
    codecs: list[Any]  # the codec chain of the unsharded array
    levels: tuple[ShardLevel, ...]  # empty: the array is not sharded


def _index_codecs(config: dict[str, Any], where: str) -> tuple[str, bool]:
    chain = config.get("index_codecs")
    if not isinstance(chain, list):
        raise Unsupported(f"{where}: sharding_indexed needs an index_codecs list")
    names = [codec_name(c) for c in chain]
    if names not in (["bytes"], ["bytes", "crc32c"]):
        raise Unsupported(f"{where}: index_codecs {names} are not supported (bytes, optionally followed by crc32c)")
    endian = codec_config(chain[0]).get("endian", "little")
    if endian not in ("little", "big"):
        raise Unsupported(f"{where}: index endian {endian!r}")
    return ("<" if endian == "little" else ">"), len(names) == 2


def unshard(meta: ArrayMeta, where: str) -> Unsharded:
    """The unsharded form of `meta`, or `Unsupported` with the reason."""
    ndim = meta.ndim
    shape = meta.chunk_shape
    perm = tuple(range(ndim))
    carried: list[Any] = []
    levels: list[ShardLevel] = []
    codecs = meta.codecs
    while True:
        names = [codec_name(c) for c in codecs]
        if "sharding_indexed" not in names:
            break
        at = names.index("sharding_indexed")
        if at + 1 < len(names):
            raise Unsupported(f"{where}: codecs {names[at + 1:]} after sharding_indexed encode whole shards; "
                              "inner chunks cannot be read on their own")
        for codec, name in zip(codecs[:at], names[:at]):
            if name == "transpose":
                order = transpose_order(codec, ndim)
                shape = tuple(shape[o] for o in order)
                perm = tuple(perm[o] for o in order)
            elif name not in ELEMENTWISE:
                raise Unsupported(f"{where}: array->array codec {name!r} before sharding_indexed is not supported")
            carried.append(codec)
        config = codec_config(codecs[at])
        if len(levels) >= MAX_LEVELS:
            raise Unsupported(f"{where}: more than {MAX_LEVELS} nested sharding_indexed codecs")
        inner = as_ints(config.get("chunk_shape"), f"{where}: sharding chunk_shape", lo=1, max_length=ndim + 1)
        if len(inner) != ndim or any(s % c for s, c in zip(shape, inner)):
            raise Unsupported(f"{where}: sharding chunk_shape {list(inner)} does not evenly divide the shard "
                              f"shape {list(shape)}")
        location = config.get("index_location", "end")
        if location not in ("start", "end"):
            raise Unsupported(f"{where}: index_location {location!r}")
        endian, checksum = _index_codecs(config, where)
        levels.append(ShardLevel(inner, perm, tuple(s // c for s, c in zip(shape, inner)), endian, checksum,
                                 location == "start"))
        shape = inner
        inner_codecs = config.get("codecs")
        if not isinstance(inner_codecs, list) or not inner_codecs:
            raise Unsupported(f"{where}: sharding_indexed needs a non-empty codecs list")
        codecs = inner_codecs
    if not levels:
        return Unsharded(meta.chunk_shape, meta.codecs, ())
    array_shape = [0] * ndim
    for i, p in enumerate(perm):
        array_shape[p] = shape[i]
    grid_shape(meta.shape, tuple(array_shape), where)  # inner chunk keys must fit in 63 bits
    return Unsharded(tuple(array_shape), carried + list(codecs), tuple(levels))
