"""Payload codecs: how a chunk's stored bytes become the bytes of its file.

One small class per encoding, registered by name (as zarr-python registers
its codecs), so a format picks its codec from its metadata by name and the
xattrs can say which one a file uses. A codec knows the file's size before
any payload is read when it can, and decodes with a hard cap on its output.
Each call gets the chunk's `exact` decoded size (when the format's geometry
fixes it; anything else is damage) and its `cap` (the most it may decode to).
"""

from __future__ import annotations

import struct
from typing import ClassVar, Protocol

import crc32c
import numpy as np
from numpy.typing import NDArray

from unshardfs.core.blob import Blob
from unshardfs.util.decompress import gunzip
from unshardfs.util.errors import DataError


class PayloadRef(Protocol):
    """What a codec knows of the chunk whose payload it decodes (a `ChunkFile` is one)."""

    @property
    def blob(self) -> Blob: ...

    @property
    def chunk_id(self) -> int: ...

    @property
    def extra(self) -> int:
        """The format's per-entry column (`ChunkTable.extra`): a row in an Arrow record batch."""

    @property
    def length(self) -> int:
        """Stored payload bytes."""

    @property
    def size(self) -> int:
        """The file's size: what `decode` must return exactly."""

    @property
    def where(self) -> str:
        """How errors name the chunk."""

CODECS: dict[str, type["Codec"]] = {}


def register_codec(cls: type["Codec"]) -> type["Codec"]:
    CODECS[cls.name] = cls
    return cls


def codec(name: str, **params: object) -> "Codec":
    """The codec registered as `name`, configured with `params`."""
    try:
        return CODECS[name](**params)
    except KeyError:
        raise KeyError(f"no codec named {name!r} (known: {', '.join(sorted(CODECS))})") from None


class Codec:
    """How a chunk's stored payload becomes its file's bytes (one small class per encoding).

    Contract: `size`/`sizes` tell the file's size from the stored length
    (and the geometry's `exact` size and `cap`) without reading the payload
    when they can, None when the `trailer` bytes are needed
    (`size_from_trailer`); `decode` returns exactly `f.size` bytes. Every
    impossible length, size beyond `cap` or undecodable payload is a
    `DataError(where, reason)`, never an exception of another type, and
    decoding never allocates beyond `cap`. Register with `register_codec` or
    an `unshardfs.codecs` entry point naming the class.
    """

    name: ClassVar[str]
    # File bytes are the stored bytes themselves: reads can be served in ranges.
    transparent: ClassVar[bool] = False
    # Bytes at the end of a payload that tell its decoded size (gzip's ISIZE)
    # when the geometry does not; 0 when none are ever needed.
    trailer: ClassVar[int] = 0

    @property
    def label(self) -> str:
        """What the `user.unshardfs.encoding` xattr says."""
        return self.name

    def size(self, length: int, exact: int | None, cap: int, where: str) -> int | None:
        """The file's size from the stored length, or None when the trailer is needed.
        DataError for a stored length this codec cannot have produced."""
        return length

    def sizes(self, lengths: np.ndarray, exact: np.ndarray | None, cap: np.ndarray
              ) -> tuple[np.ndarray | None, np.ndarray]:
        """`size` for a listing batch: (sizes, or None when trailers are needed; mask of valid entries)."""
        return lengths.astype(np.int64), np.ones(len(lengths), dtype=bool)

    def size_from_trailer(self, trailer: bytes, cap: int, where: str) -> int:
        raise NotImplementedError

    def stored_slice(self, length: int) -> tuple[int, int] | None:
        """The file's bytes as a slice of a payload of `length` bytes, (skip, keep), when they are
        one, unchanged (nothing to decode); None when they must be decoded. The default: the whole
        payload for a transparent codec."""
        return (0, length) if self.transparent else None

    async def prepare(self, f: PayloadRef) -> object:
        """Whatever `decode` needs besides the payload that takes I/O to get (a schema); None by default."""
        return None

    def decode(self, payload: bytes, f: PayloadRef, prepared: object = None) -> bytes:
        """The file's bytes (exactly `f.size` of them, already bounded) from the payload, or DataError.
        Runs in a worker thread for large payloads: no awaiting, no shared mutable state."""
        raise NotImplementedError


@register_codec
class Stored(Codec):
    """The stored bytes, unchanged."""

    name = "raw"
    transparent = True

    def size(self, length: int, exact: int | None, cap: int, where: str) -> int:
        if exact is not None and length != exact:
            raise DataError(where, f"raw chunk has {length:,} bytes; its geometry says {exact:,}")
        return length

    def sizes(self, lengths: np.ndarray, exact: np.ndarray | None, cap: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
        sizes = lengths.astype(np.int64)
        return sizes, np.ones(len(sizes), dtype=bool) if exact is None else sizes == exact

    def decode(self, payload: bytes, f: PayloadRef, prepared: object = None) -> bytes:
        return payload


class GeometrySized(Codec):
    """Base of codecs whose file size the format's geometry fixes (decoded raw volume chunks:
    DVID label blocks, WKW blocks): `stat` and listings need no payload, and a payload that
    decodes to any other size is damage found on read."""

    def size(self, length: int, exact: int | None, cap: int, where: str) -> int:
        assert exact is not None, "a GeometrySized codec needs a geometry with exact sizes"
        check_decoded_size(exact, cap, where)
        return exact

    def sizes(self, lengths: np.ndarray, exact: np.ndarray | None, cap: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
        assert exact is not None, "a GeometrySized codec needs a geometry with exact sizes"
        return exact, exact <= cap


GZIP_MIN = 18  # 10-byte header + empty deflate stream (2) + CRC32 + ISIZE


def _max_deflated(decoded: NDArray[np.int64] | int) -> NDArray[np.int64] | int:
    """Largest gzip encoding of `decoded` bytes: deflate's stored blocks add 5
    bytes per 16 KiB, headers and member chains a little more."""
    return decoded + decoded // 1000 + (64 << 10)


def check_decoded_size(exact: int, cap: int, where: str) -> None:
    """A size the geometry fixes is still bounded: the decoded file is held in memory whole."""
    if exact > cap:
        raise DataError(where, f"a decoded chunk of {exact:,} bytes exceeds the {cap:,}-byte limit "
                               "(--max-payload-size)")


def _check_gzip_length(length: int, decoded: int, where: str) -> None:
    if length < GZIP_MIN:
        raise DataError(where, f"gzip payload of {length} bytes is too short")
    if length > _max_deflated(decoded):
        raise DataError(where, f"gzip payload of {length:,} bytes is larger than any encoding of at most "
                               f"{decoded:,} bytes")


@register_codec
class Gzip(Codec):
    """A gzip member chain (CRC32 and ISIZE of every member verified)."""

    name = "gzip"
    trailer = 4

    def size(self, length: int, exact: int | None, cap: int, where: str) -> int | None:
        if exact is not None:
            # The geometry fixes the size (`stat` needs no payload); a payload
            # no encoding of it can have is damage found on read, like a bad CRC.
            check_decoded_size(exact, cap, where)
            return exact
        _check_gzip_length(length, cap, where)
        return None

    def sizes(self, lengths: np.ndarray, exact: np.ndarray | None, cap: np.ndarray
              ) -> tuple[np.ndarray | None, np.ndarray]:
        if exact is not None:
            return exact.astype(np.int64), exact <= cap
        lengths = lengths.astype(np.int64)
        return None, (lengths >= GZIP_MIN) & (lengths <= _max_deflated(cap))

    def size_from_trailer(self, trailer: bytes, cap: int, where: str) -> int:
        size: int = struct.unpack("<I", trailer)[0]
        if size > cap:
            raise DataError(where, f"gzip trailer claims {size:,} bytes, more than this file can hold ({cap:,})")
        return size

    async def prepare(self, f: PayloadRef) -> object:
        # Before the payload is fetched: a 64-byte chunk whose index gives it
        # 1.5 GB is never read into memory, let alone inflated.
        _check_gzip_length(f.length, f.size, f.where)
        return None

    def decode(self, payload: bytes, f: PayloadRef, prepared: object = None) -> bytes:
        data = gunzip(payload, f.size, f.where)
        if len(data) != f.size:
            raise DataError(f.where, f"gzip payload decodes to {len(data):,} bytes, expected {f.size:,}")
        return data


@register_codec
class Crc32cSuffix(Codec):
    """Stored bytes ending in a crc32c of the rest: verified, then served without it (Zarr v2 view)."""

    name = "crc32c-verified"

    def size(self, length: int, exact: int | None, cap: int, where: str) -> int:
        if length < 4:
            raise DataError(where, f"{length}-byte chunk is too short to end in a crc32c checksum")
        if length - 4 > cap:
            # Verifying means holding the whole chunk: not beyond what it can be.
            raise DataError(where, f"{length:,}-byte chunk is larger than any encoding of this chunk ({cap:,})")
        return length - 4

    def sizes(self, lengths: np.ndarray, exact: np.ndarray | None, cap: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
        sizes = lengths.astype(np.int64) - 4
        return sizes, (sizes >= 0) & (sizes <= cap)

    def stored_slice(self, length: int) -> tuple[int, int] | None:
        # All but the checksum: a reader of the slice does not verify it.
        return (0, length - 4) if length >= 4 else None

    def decode(self, payload: bytes, f: PayloadRef, prepared: object = None) -> bytes:
        data = payload[:-4]
        if crc32c.crc32c(data) != int.from_bytes(payload[-4:], "little"):
            raise DataError(f.where, "chunk crc32c checksum mismatch")
        return data
