"""The members of a ZIP archive as a byte source, over any other byte source.

An archive is one object of an inner source (a local file, an HTTP object,
a GCS/S3 key). Everything is read with ranged reads: the end of central
directory record (ZIP64 too) from the archive's tail, the central directory
in bounded windows, and each member's 30-byte local header once, on its
first read. A STORED member is then a byte range of the archive, so a shard
inside a zip is read exactly like a shard in a directory (range reads,
coalescing, read-ahead all work on it unchanged); a DEFLATE (or bzip2, zstd)
member is decoded whole, capped by `DataLimits.payload_bytes`, verified (size,
CRC-32) and kept in a small byte-bounded cache.

What the bytes mean is decided by `unshardfs.sources.zipformat` (the records,
tested on bytes alone) and kept by `unshardfs.sources.zipindex` (the compact
per-member table); this module does the reading, the caching and the
following of an archive that changes. It interprets no archive comment:
`ZipSummary.comment` is the raw bytes, for the layers that know what a
comment may mean (an `.ozx`'s RFC-9 comment).

Hostile archives: unsafe or ambiguous entries never become paths (logged
once per archive and reason); a local header that disagrees with the
central directory, or member data that would overlap the next member or
the central directory, makes that member's reads fail. The central
directory is read only up to `DataLimits.index_bytes` (`--max-index-size`).
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import numpy as np
import trio

from unshardfs.sources.base import ByteSource, IndexCache, UrlLocation, ObjectStat, Version, stat_and_tail, stored_at
from unshardfs.sources.zipformat import (EOCD64, LOCAL, METHODS, STORED, CentralDirectory, Expected, decode,
                                         local_header_size, read_end, root_prefix)
from unshardfs.sources.zipindex import ZipIndex, build_index
from unshardfs.util.decompress import off_loop
from unshardfs.util.errors import ConfigError, DataError, SourceError, StaleError
from unshardfs.util.flight import Flights
from unshardfs.util.limits import DataLimits
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap
from unshardfs.util.memory import give_back_freed

log = logging.getLogger(__name__)
T = TypeVar("T")
U = TypeVar("U")

# The end record is within the last 22 + 65,535 bytes; with the ZIP64 locator and
# record before it, and room for a small central directory, one tail read does.
TAIL = 1 << 17
WINDOW = 1 << 20  # central directory read per request
DECODED_CACHE = 64 << 20
# Members this small (or read whole, up to WHOLE_MAX) are read with their local header in one request;
# EXTRA_SLACK covers a local extra field (timestamps, ZIP64) longer than none.
WHOLE = 64 << 10
WHOLE_MAX = 4 << 20
EXTRA_SLACK = 128
TRIM_AFTER = 100_000  # entries: an index this large is built from temporaries worth returning to the OS


@dataclass(frozen=True)
class ZipSummary:
    """What the archive a source reads through holds, for `inspect`."""

    archive: str
    entries: int  # members shown (files)
    skipped: int  # entries that never became paths
    methods: dict[str, int]  # members per compression method
    zip64: bool
    comment: bytes  # the archive comment, raw

    def lines(self) -> list[str]:
        """The archive's part of `inspect`'s report (the comment is described by the caller)."""
        methods = ", ".join(f"{n:,} {m}" for m, n in sorted(self.methods.items())) or "none"
        out = [f"  through zip   {self.archive}",
               f"  members       {self.entries:,} ({methods})" + (", ZIP64" if self.zip64 else "")]
        if self.skipped:
            out.append(f"  skipped       {self.skipped:,} entries (unsafe names, duplicates, overlaps; see the log)")
        return out


class ZipSource:
    """Members of the archive `archive` of `inner` (under `root`, the pipeline's `zip:PATH`) as paths.

    Call `open()` once before use (a bad archive is then a one-line
    ConfigError); the index is read again whenever the archive changes.
    """

    listable = True

    def __init__(self, inner: ByteSource, archive: str, root: str = "", limits: DataLimits | None = None,
                 url: str | None = None) -> None:
        self.inner = inner
        self.archive = archive
        self.root = root_prefix(root)
        self.limits = limits or DataLimits()
        self.remote = inner.remote
        self.index_cache: IndexCache | None = inner.index_cache
        self.description = (url or f"{inner.description.rstrip('/')}/{archive}") + (
            f"|zip:{self.root}" if self.root else "")
        self._index: ZipIndex | None = None
        self._stat: ObjectStat | None = None
        self._dirty = False
        self._lock = trio.Lock()
        self._flights = Flights()
        self._decoded: BoundedMap[tuple[tuple[object, ...], int], bytes] = BoundedMap(DECODED_CACHE, getsizeof=len)
        self.summary: ZipSummary | None = None
        self._skipped = 0
        self.counters = {"archive_reads": 0, "archive_bytes": 0, "local_headers": 0, "decoded_members": 0,
                         "decoded_bytes": 0}

    # -- the index -----------------------------------------------------------------

    async def open(self) -> "ZipSource":
        """Read the archive's directory; ConfigError (one line) when it is not a usable archive."""
        # Its stat and its tail in one request where the source can (an HTTP suffix range).
        st, tail = await stat_and_tail(self.inner, self.archive, TAIL)
        st = self._usable(st, required=True)
        assert st is not None  # required: a missing archive raised
        await self._load(st, tail)
        return self

    async def _archive_stat(self, required: bool = False) -> ObjectStat | None:
        return self._usable(await self.inner.stat(self.archive), required)

    def _usable(self, st: ObjectStat | None, required: bool) -> ObjectStat | None:
        if st is None or st.is_dir:
            if required:
                raise ConfigError(f"{self.description}: no such archive" if st is None else
                                  f"{self.description}: is a directory, not a zip archive")
            return None
        return st

    async def _read(self, offset: int, size: int, version: Version, index: bool = False) -> bytes:
        read = self.inner.read_index if index else self.inner.read
        data = await read(self.archive, offset, size, version)
        return self._counted(data)

    def _counted(self, data: bytes) -> bytes:
        """`data`, counted as one read of the archive."""
        self.counters["archive_reads"] += 1
        self.counters["archive_bytes"] += len(data)
        return data

    async def _load(self, st: ObjectStat, given: bytes | None = None) -> None:
        """Read the directory of the archive `st` describes; `given`: its tail, if it came with `st`."""
        where = self.description
        self._skipped = 0
        size = st.size
        tail_at = max(0, size - TAIL)
        if given is not None and len(given) == size - tail_at:
            tail = self._counted(given)  # as the read it replaces
        else:
            tail = await self._read(tail_at, size - tail_at, st.version, index=True)
        if len(tail) != size - tail_at:
            raise ConfigError(f"{where}: archive shorter than its size ({size:,} bytes)")
        end = read_end(tail, tail_at, where)
        if end.zip64_at is not None:
            end = end.with_zip64(await self._read(end.zip64_at, EOCD64.size, st.version, index=True), where)
        end.check(where, self.limits.index_bytes)
        cd_offset, cd_size = end.cd_offset, end.cd_size
        parser = CentralDirectory(where, self.root, cd_offset, self._skip)
        pos = cd_offset
        while pos < cd_offset + cd_size:
            n = min(WINDOW, cd_offset + cd_size - pos)
            if pos >= tail_at:
                window = tail[pos - tail_at:pos - tail_at + n]
            else:
                window = await self._read(pos, n, st.version, index=True)
            if len(window) != n:
                raise ConfigError(f"{where}: archive ends inside its central directory")
            await trio.lowlevel.checkpoint()
            parser.feed(window)
            pos += n
        index = build_index(parser.finish(), cd_offset, self._skip)
        if parser.seen != end.entries:
            log_once(log, f"zip:{where}:count", "%s: the end record claims %s entries, the central directory holds "
                     "%s", where, f"{end.entries:,}", f"{parser.seen:,}")
        if self.root and not len(index):
            raise ConfigError(f"{where}: no member under {self.root}")
        files = index.method[~index.isdir]
        methods = {METHODS.get(int(code), str(code)): int(count)
                   for code, count in zip(*np.unique(files, return_counts=True))}
        self.summary = ZipSummary(where, len(files), self._skipped, methods, end.zip64 or parser.zip64,
                                  end.comment)
        self._index, self._stat, self._dirty = index, st, False
        self._decoded.clear()
        if len(index) >= TRIM_AFTER:
            give_back_freed()  # the build's temporaries, not the index, are what RSS would keep

    def _skip(self, name: object, reason: str) -> None:
        """An entry that never becomes a path: counted, and logged once per archive and reason."""
        self._skipped += 1
        log_once(log, f"zip:{self.description}:{reason}", "%s: skipping entry %r: %s (further entries like it "
                 "are skipped silently)", self.description, name, reason)

    def _stale(self, st: ObjectStat) -> bool:
        return self._index is None or self._stat is None or self._dirty or st.version != self._stat.version

    async def _current(self, fresh: bool) -> tuple[ZipIndex, ObjectStat] | None:
        """The index, read again first if the archive changed (checked by a stat when `fresh`)."""
        st = self._stat
        if fresh or st is None or self._stale(st):
            st = await self._archive_stat()
            if st is None:
                return None
        if self._stale(st):
            async with self._lock:
                if self._stale(st):
                    try:
                        await self._load(st)
                    except ConfigError as e:  # replaced by something unreadable while in use: damage
                        self._index = None
                        raise SourceError(str(e)) from None
        assert self._index is not None and self._stat is not None
        return self._index, self._stat

    # -- the ByteSource contract ------------------------------------------------------

    def _member_stat(self, index: ZipIndex, st: ObjectStat, i: int) -> ObjectStat:
        return ObjectStat(int(index.usize[i]), st.mtime_ns, False, ("zip", st.version, int(index.header[i])))

    async def stat(self, path: str) -> ObjectStat | None:
        current = await self._current(fresh=True)
        if current is None:
            return None
        index, st = current
        if not path:
            return ObjectStat(0, st.mtime_ns, True, ())
        name = path.encode()
        i = index.find(name)
        if i >= 0:
            return self._member_stat(index, st, i)
        return ObjectStat(0, st.mtime_ns, True, ()) if index.is_dir(name + b"/") else None

    async def stat_dir(self, path: str) -> ObjectStat | None:
        st = await self.stat(path)
        return st if st is not None and st.is_dir else None

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        current = await self._current(fresh=True)
        if current is None:
            return
        index, st = current
        directory = ObjectStat(0, st.mtime_ns, True, ())
        for k, (child, i) in enumerate(index.children(path.encode() + b"/" if path else b"")):
            yield child.decode(), directory if i is None else self._member_stat(index, st, i)
            if k % 4096 == 4095:
                await trio.lowlevel.checkpoint()

    async def _member(self, path: str, version: Version | None) -> tuple[ZipIndex, ObjectStat, int]:
        current: tuple[ZipIndex, ObjectStat] | None
        if version is not None:
            if self._index is None or self._stat is None or version[1] != self._stat.version:
                raise StaleError(path, "the archive changed after this member was resolved")
            current = (self._index, self._stat)
        else:
            current = await self._current(fresh=False)
            if current is None:
                raise SourceError(f"{self.description}: the archive is gone")
        index, st = current
        i = index.find(path.encode())
        if i < 0 or (version is not None and version[2] != int(index.header[i])):
            if version is not None:
                raise StaleError(path, "the archive changed after this member was resolved")
            raise SourceError(f"{self.description}: no member {path!r}")
        return index, st, i

    async def _data_offset(self, index: ZipIndex, st: ObjectStat, i: int, path: str, along: int = 0
                           ) -> tuple[int, bytes]:
        """Where member i's data starts, from its local header, checked against the central directory;
        on the first call also the bytes after it that came with the header (up to `along` more)."""
        offset = int(index.data[i])
        if offset >= 0:
            return offset, b""
        header = int(index.header[i])
        full = self.root.encode() + index.name(i)
        raw = await self._read(header, LOCAL.size + len(full) + along, st.version)
        self.counters["local_headers"] += 1
        expected = Expected(full, int(index.method[i]), int(index.crc[i]), int(index.csize[i]), int(index.usize[i]))
        length = local_header_size(raw, header, expected, f"{self.description}!{path}")
        offset = header + length
        if offset + int(index.csize[i]) > int(index.limit[i]):
            raise DataError(f"{self.description}!{path}", "member data overlaps the next member or the central "
                                                          "directory")
        index.data[i] = offset
        return offset, raw[length:]

    async def _read_member(self, path: str, offset: int, size: int, version: Version | None, idx: bool) -> bytes:
        index, st, i = await self._member(path, version)
        total = int(index.usize[i])
        if size <= 0 or offset >= total:
            return b""
        size = min(size, total - offset)
        method = int(index.method[i])
        if method != STORED and total > self.limits.payload_bytes:
            # Before any read: a bomb's claimed size alone refuses it.
            raise DataError(f"{self.description}!{path}", f"{METHODS[method]} member of {total:,} bytes exceeds the "
                                                         f"{self.limits.payload_bytes >> 20} MiB limit "
                                                         f"(--max-payload-size)")
        csize = int(index.csize[i])
        # A small member (or one read whole) comes with its local header in one request: a round trip
        # saved per member of an unsharded store in a remote archive. Extra fields are usually short.
        whole = csize <= WHOLE or (offset == 0 and size == total and csize <= WHOLE_MAX)
        guessed: bytes | Exception | None = None
        guessed_at = -1
        if int(index.data[i]) < 0 and not whole and method == STORED and self.remote:
            # A part of a large member, first time: read the local header and the range at the offset the
            # central directory suggests at once (one round trip, not two); re-read if the guess was wrong.
            guessed_at = int(index.header[i]) + LOCAL.size + len(self.root.encode()) + len(index.names[i]) + int(
                index.extra[i])
            (start, came), guessed = await _together(
                lambda: self._data_offset(index, st, i, path),
                lambda: self._read(guessed_at + offset, size, st.version, idx))
        else:
            start, came = await self._data_offset(index, st, i, path, EXTRA_SLACK + csize if whole else 0)
        came = came[:csize] if len(came) >= csize else b""
        if method != STORED:
            data = await self._decoded_member(index, st, i, start, path, came or None)
            return data[offset:offset + size]
        if came:
            data = came[offset:offset + size]
        elif guessed_at == start and guessed is not None:
            if isinstance(guessed, Exception):
                raise guessed
            data = guessed
        else:
            data = await self._read(start + offset, size, st.version, idx)
        if len(data) != size:
            raise SourceError(f"{self.description}!{path}: archive ends inside the member (truncated)")
        if offset == 0 and size == total and zlib.crc32(data) != int(index.crc[i]):
            raise DataError(f"{self.description}!{path}", "CRC-32 mismatch")
        return data

    async def _decoded_member(self, index: ZipIndex, st: ObjectStat, i: int, start: int, path: str,
                              raw: bytes | None = None) -> bytes:
        identity = (st.version, int(index.header[i]))
        hit = self._decoded.get(identity)
        if hit is not None:
            # No archive read on a hit: a stat keeps a replaced archive from being served from memory.
            now = await self.inner.stat(self.archive)
            if now is None or now.version != st.version:
                raise StaleError(path, "the archive changed after this member was read")
            return hit
        where = f"{self.description}!{path}"
        size, csize, method, crc = int(index.usize[i]), int(index.csize[i]), int(index.method[i]), int(index.crc[i])

        async def work() -> bytes:
            data = raw if raw is not None else await self._read(start, csize, st.version)
            if len(data) != csize:
                raise SourceError(f"{where}: archive ends inside the member (truncated)")
            decoded_now: Callable[[], bytes] = lambda: decode(method, data, size, where)
            decoded = await off_loop(decoded_now, csize)
            if zlib.crc32(decoded) != crc:
                raise DataError(where, "CRC-32 mismatch")
            self.counters["decoded_members"] += 1
            self.counters["decoded_bytes"] += len(decoded)
            if len(decoded) <= DECODED_CACHE // 4:
                self._decoded[identity] = decoded
            return decoded

        return await self._flights.run(identity, work)

    async def _guarded_read(self, path: str, offset: int, size: int, version: Version | None, idx: bool) -> bytes:
        try:
            return await self._read_member(path, offset, size, version, idx)
        except StaleError:
            self._dirty = True  # the next stat (or unversioned read) reads the directory again
            if version is not None:
                raise
        return await self._read_member(path, offset, size, None, idx)

    async def stored_at(self, path: str, version: Version | None) -> UrlLocation | None:
        """A STORED member's bytes are a range of the archive: where the archive is, that far in
        (`StoredAt`); None for a compressed member."""
        index, st, i = await self._member(path, version)
        if int(index.method[i]) != STORED:
            return None
        offset, _ = await self._data_offset(index, st, i, path)
        archive = await stored_at(self.inner, self.archive, st.version)
        return None if archive is None else archive.at(offset)

    async def read(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return await self._guarded_read(path, offset, size, version, False)

    async def read_index(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return await self._guarded_read(path, offset, size, version, True)

    async def aclose(self) -> None:
        self._decoded.clear()
        await self.inner.aclose()

    def stats(self) -> dict[str, object]:
        return {**self.inner.stats(), "zip": dict(self.counters)}




async def _together(first: Callable[[], Awaitable[T]], second: Callable[[], Awaitable[U]]
                    ) -> tuple[T, U | Exception]:
    """Both at once: `first`'s result (its error raised as is, never wrapped in a group) and `second`'s
    result or error (the caller decides whether it matters)."""
    results: list[Any] = [None, None]

    async def run(k: int, work: Callable[[], Awaitable[object]]) -> None:
        try:
            results[k] = await work()
        except Exception as e:  # reported to the caller unwrapped; cancellation passes through
            results[k] = e

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, 0, first)
        nursery.start_soon(run, 1, second)
    if isinstance(results[0], Exception):
        raise results[0]
    return results[0], results[1]
