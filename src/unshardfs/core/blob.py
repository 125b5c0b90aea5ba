"""One stored object (or a concatenation of objects) as it existed when its index was read.

Formats hold a `Blob` (from one `stat`) for as long as they use offsets taken
from its index: every read carries the object's version, so an object
replaced while mounted fails with `StaleError` instead of mixing an old index
with new bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from unshardfs.sources.base import ByteSource, CachedRange, FdRange, ObjectStat, ReadNow, Version
from unshardfs.util.errors import DataError, SourceError
from unshardfs.util.maps import BoundedMap

Identity = tuple[str, tuple[Version, ...]]  # what identifies a blob's bytes (`Blob.identity`)


RECENT_BLOBS = 1 << 12


@dataclass(frozen=True, slots=True)
class Blob:
    """The logical concatenation of one or more objects (usually one)."""

    parts: tuple[tuple[str, int, Version], ...]  # (source path, size, version)
    size: int
    mtime_ns: int
    # Why the source refuses the object (`ObjectStat.refused`), if it does: every read fails, saying so.
    refused: str | None = None
    # Derived once: every lookup and read of a chunk asks for them (cache keys, messages).
    label: str = field(init=False, compare=False, repr=False)
    version: tuple[Version, ...] = field(init=False, compare=False, repr=False)
    identity: Identity = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.parts) == 1:  # the usual case, built once per lookup
            label, _, one = self.parts[0]
            version: tuple[Version, ...] = (one,)
        else:
            label = "+".join(path for path, _, _ in self.parts)
            version = tuple(version for _, _, version in self.parts)
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "version", version)
        # What identifies these bytes: cache keys are built on it.
        object.__setattr__(self, "identity", (label, version))

    @classmethod
    def of(cls, path: str, st: ObjectStat) -> "Blob":
        """The blob of one object as `st` describes it (`RecentBlobs.of` returns the same one
        again while the source answers with the same ObjectStat). An object the source refuses
        (`ObjectStat.refused`) is a blob too, every read of which fails: there, never absent."""
        return cls(((path, st.size, st.version),), st.size, st.mtime_ns, st.refused)

    @property
    def versioned(self) -> bool:
        """Whether every part has a version (without one, a copy kept across mounts could be stale)."""
        return all(version for _, _, version in self.parts)

    def cached_range(self, source: CachedRange, offset: int, size: int) -> FdRange | None:
        """Where bytes [offset, offset+size) of a one-object blob lie in an open descriptor, if
        the source can tell without I/O and they are page-cached (a local source); else None."""
        if len(self.parts) != 1 or offset < 0 or offset + size > self.size or self.refused is not None:
            return None
        path, _, version = self.parts[0]
        return source.cached_range(path, offset, size, version)

    def read_now(self, source: ReadNow, offset: int, size: int) -> bytes | bytearray | None:
        """Bytes [offset, offset+size) of a one-object blob if the source has them at once,
        without waiting (a local source, page-cached bytes); else None (`read` reads them)."""
        if len(self.parts) != 1 or offset < 0 or offset + size > self.size or self.refused is not None:
            return None
        path, _, version = self.parts[0]
        return source.read_now(path, offset, size, version)

    async def read(self, source: ByteSource, offset: int, size: int, index: bool = False) -> bytes:
        """Bytes [offset, offset+size) exactly, or DataError.

        `index` marks index structures, which a disk cache may keep across mounts.
        """
        if self.refused is not None:
            raise DataError(self.label, f"refused: {self.refused}")
        reader = source.read_index if index else source.read
        if len(self.parts) == 1 and 0 <= offset and offset + size <= self.size:
            # One object (the usual case): one call, no pieces to join.
            path, _, version = self.parts[0]
            try:
                data = await reader(path, offset, size, version)
            except SourceError as e:
                raise DataError(self.label, str(e)) from e
            if len(data) != size:
                raise DataError(self.label, f"short read at offset {offset}: file shrank while mounted?")
            return data
        out = []
        base = 0
        want_end = offset + size
        for path, part_size, version in self.parts:
            lo, hi = max(offset, base), min(want_end, base + part_size)
            if lo < hi:
                try:
                    data = await reader(path, lo - base, hi - lo, version)
                except SourceError as e:
                    raise DataError(self.label, str(e)) from e
                if len(data) != hi - lo:
                    raise DataError(self.label, f"short read at offset {lo}: file shrank while mounted?")
                out.append(data)
            base += part_size
        if offset < 0 or want_end > base:
            raise DataError(self.label, f"range [{offset}, {want_end}) lies outside the file ({base} bytes)")
        return out[0] if len(out) == 1 else b"".join(out)


class RecentBlobs:
    """The Blob last made for each path, with the ObjectStat it was made from: the same Blob
    again while the source answers with the same ObjectStat (a local source does while the
    file is unchanged). A shard is revalidated on every lookup of one of its chunks, and this
    spares building (and hashing) a new one.

    One per session (its `Caches` owns it): paths are those of one source, and sessions in one
    process (Dask workers, tests) neither see nor evict each other's. At most `size` entries,
    the one set longest ago dropped first (rebuilt by its next lookup)."""

    def __init__(self, size: int = RECENT_BLOBS) -> None:
        self.size = size
        self._recent: BoundedMap[str, tuple[ObjectStat, Blob]] = BoundedMap(size, lru=False, counted=False)

    def of(self, path: str, st: ObjectStat) -> Blob:
        recent = self._recent.get(path)
        if recent is not None and recent[0] is st:
            return recent[1]
        blob = Blob.of(path, st)
        self._recent[path] = (st, blob)
        return blob

    def __len__(self) -> int:
        return len(self._recent)
