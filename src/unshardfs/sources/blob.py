"""One stored object as it exists now, read with a check that it has not changed.

Formats hold a `Blob` (from one `stat`) for as long as they use offsets taken
from its index: every read carries the object's version, so an object
replaced while mounted fails with `StaleError` instead of mixing an old index
with new bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..caches import Caches, CountedLRU
from ..errors import DataError, SourceError
from .base import ByteSource, ObjectStat

# Over the network, payloads up to this size are fetched whole in one request
# instead of in the kernel's 128 KiB pieces, each a round trip.
WHOLE_READ_MAX = 1 << 20


@dataclass(frozen=True, slots=True)
class Blob:
    """The logical concatenation of one or more objects (usually one)."""

    parts: tuple[tuple[str, int, tuple], ...]  # (source key, size, version)
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, key: str, st: ObjectStat) -> "Blob":
        return cls(((key, st.size, st.version),), st.size, st.mtime_ns)

    @property
    def version(self) -> tuple:
        return tuple(version for _, _, version in self.parts)

    @property
    def label(self) -> str:
        return "+".join(key for key, _, _ in self.parts)

    async def read(self, source: ByteSource, offset: int, size: int, index: bool = False) -> bytes:
        """Bytes [offset, offset+size) exactly, or DataError.

        `index` marks index structures, which a disk cache may keep across mounts.
        """
        out = []
        base = 0
        want_end = offset + size
        for key, part_size, version in self.parts:
            lo, hi = max(offset, base), min(want_end, base + part_size)
            if lo < hi:
                try:
                    reader = source.read_index if index else source.read
                    data = await reader(key, lo - base, hi - lo, version)
                except SourceError as e:
                    raise DataError(self.label, str(e)) from e
                if len(data) != hi - lo:
                    raise DataError(self.label, f"short read at offset {lo}: file shrank while mounted?")
                out.append(data)
            base += part_size
        if want_end > base:
            raise DataError(self.label, f"range [{offset}, {want_end}) lies beyond the end ({base} bytes)")
        return b"".join(out)

    def payload_key(self, start: int, length: int) -> tuple:
        """Cache key of the payload at [start, start+length) of this version of the blob."""
        return (self.label, self.version, start, length)

    async def read_payload(self, source: ByteSource, start: int, length: int, offset: int, size: int,
                           cache: CountedLRU) -> bytes:
        """Bytes [offset, offset+size) of the payload at [start, start+length).

        From a remote source a small payload is fetched whole once and kept
        in `cache`, so the reads that follow cost no further requests.
        """
        if source.remote and length <= WHOLE_READ_MAX:
            whole = await Caches.through(cache, self.payload_key(start, length),
                                         lambda: self.read(source, start, length))
            return whole[offset:offset + size]
        return await self.read(source, start + offset, size)
