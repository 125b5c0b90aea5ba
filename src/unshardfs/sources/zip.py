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

Why not `zipfile.ZipFile`: it wants a seekable file (a remote archive would
need a file-like wrapper turning every seek+read into a request), builds one
`ZipInfo` object per entry (hundreds of bytes each: 10^7 entries would cost
gigabytes) and trusts the entry count the end record claims. We use its
struct formats and signatures (`zipfile.structCentralDir`, ...) but parse
the central directory ourselves into a compact index: one bytes blob of
sorted names and numpy columns, nothing per entry.

Hostile archives: names that are absolute, contain `\\`, NUL or a `.`/`..`
segment, are not decodable, or occur twice (also a file that is also a
directory) never become paths (logged once, skipped); entries whose data
would overlap another's local header or the central directory, that share a
local header, are encrypted or use an unknown method are skipped the same
way; a local header that disagrees with the central directory (signature,
name, method, sizes, position) makes that member's reads fail. The central
directory is read only up to `DataLimits.index_bytes` (`--max-index-size`), and
memory grows with the entries actually present, never with a count an end
record claims.
"""

from __future__ import annotations

import bisect
import bz2
import json
import logging
import struct
import zipfile
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import numpy as np
import trio

from unshardfs.sources.base import ByteSource, IndexCache, ObjectStat, Version, name_problem, stat_and_tail
from unshardfs.util.decompress import STEP, off_loop, unzstd
from unshardfs.util.errors import ConfigError, DataError, SourceError, StaleError
from unshardfs.util.flight import Flights
from unshardfs.util.limits import DataLimits
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap

log = logging.getLogger(__name__)
T = TypeVar("T")
U = TypeVar("U")

# zipfile's record layouts and signatures (the struct formats fit; the reading around them does
# not, see above). They are module-level names of zipfile that typeshed's stubs do not declare.
_zipfile: Any = zipfile
EOCD = struct.Struct(_zipfile.structEndArchive)
EOCD64 = struct.Struct(_zipfile.structEndArchive64)
LOCATOR64 = struct.Struct(_zipfile.structEndArchive64Locator)
CENTRAL = struct.Struct(_zipfile.structCentralDir)
LOCAL = struct.Struct(_zipfile.structFileHeader)
SIG_EOCD: bytes = _zipfile.stringEndArchive
SIG_EOCD64: bytes = _zipfile.stringEndArchive64
SIG_LOCATOR64: bytes = _zipfile.stringEndArchive64Locator
SIG_CENTRAL: bytes = _zipfile.stringCentralDir
SIG_LOCAL: bytes = _zipfile.stringFileHeader
EXTRA = struct.Struct("<HH")
ZIP64_EXTRA = 0x0001
# The end record is within the last 22 + 65,535 bytes; with the ZIP64 locator and
# record before it, and room for a small central directory, one tail read does.
TAIL = 1 << 17
WINDOW = 1 << 20  # central directory read per request
ZSTD = 93  # APPNOTE 4.4.5: Zstandard (zipfile knows no constant for it)
METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2",
           ZSTD: "zstd"}
UTF8_FLAG = 0x800
ENCRYPTED_FLAG = 0x1
DESCRIPTOR_FLAG = 0x8
U32, U16 = 0xFFFFFFFF, 0xFFFF
DECODED_CACHE = 64 << 20
# Members this small (or read whole, up to WHOLE_MAX) are read with their local header in one request;
# EXTRA_SLACK covers a local extra field (timestamps, ZIP64) longer than none.
WHOLE = 64 << 10
WHOLE_MAX = 4 << 20
EXTRA_SLACK = 128


@dataclass(frozen=True)
class ZipSummary:
    """What `inspect` says about the archive it reads through."""

    archive: str
    entries: int  # members shown (files)
    skipped: int  # entries that never became paths
    methods: dict[str, int]  # members per compression method
    zip64: bool
    comment: str
    ome: dict[str, Any] | None  # the RFC-9 archive comment's "ome" object

    def lines(self) -> list[str]:
        methods = ", ".join(f"{n:,} {m}" for m, n in sorted(self.methods.items())) or "none"
        out = [f"  through zip   {self.archive}",
               f"  members       {self.entries:,} ({methods})" + (", ZIP64" if self.zip64 else "")]
        if self.skipped:
            out.append(f"  skipped       {self.skipped:,} entries (unsafe names, duplicates, overlaps; see the log)")
        if self.ome is not None:
            out.append(f"  RFC-9 comment {json.dumps({'ome': self.ome})}")
        elif self.comment:
            out.append(f"  comment       {self.comment[:200]!r}")
        return out


class _Names:
    """The sorted names as a sequence of bytes, for `bisect` (no object per entry kept)."""

    __slots__ = ("blob", "starts")

    def __init__(self, blob: bytes, starts: np.ndarray) -> None:
        self.blob = blob
        self.starts = array("Q")  # indexing an array gives ints faster than numpy scalars
        self.starts.frombytes(starts.astype(np.uint64).tobytes())

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i: int) -> bytes:
        return self.blob[self.starts[i]:self.starts[i + 1]]


class ZipIndex:
    """The usable entries of one central directory, sorted by name (UTF-8 bytes).

    Directory entries keep their trailing '/', so a directory's children are
    exactly the names under its prefix and listings are a walk over one
    contiguous range. Columns are numpy arrays; the local header's data offset
    is filled in on a member's first read (-1 until then).
    """

    def __init__(self, names: list[bytes], columns: dict[str, np.ndarray], cd_start: int) -> None:
        order = sorted(range(len(names)), key=names.__getitem__)
        lengths = np.fromiter((len(names[i]) for i in order), dtype=np.uint64, count=len(order))
        self.names = _Names(b"".join(names[i] for i in order), np.concatenate([[0], np.cumsum(lengths)]))
        pick = np.asarray(order, dtype=np.int64)
        self.header = np.asarray(columns["header"], dtype=np.uint64)[pick]
        self.csize = np.asarray(columns["csize"], dtype=np.uint64)[pick]
        self.usize = np.asarray(columns["usize"], dtype=np.uint64)[pick]
        self.method = np.asarray(columns["method"], dtype=np.uint16)[pick]
        self.crc = np.asarray(columns["crc"], dtype=np.uint32)[pick]
        # The central extra field's length: the local one is usually the same, so the data offset can be
        # guessed before the local header has been read.
        self.extra = np.asarray(columns["extra"], dtype=np.uint16)[pick]
        self.isdir = np.fromiter((names[i].endswith(b"/") for i in order), dtype=bool, count=len(order))
        self.data = np.full(len(order), -1, dtype=np.int64)
        # Where the next member's local header (or the central directory) starts:
        # a member's data must end there.
        self.limit = np.full(len(order), cd_start, dtype=np.uint64)
        if len(order):
            by_offset = np.argsort(self.header, kind="stable")
            self.limit[by_offset[:-1]] = self.header[by_offset[1:]]

    def __len__(self) -> int:
        return len(self.names)

    def find(self, name: bytes) -> int:
        i = bisect.bisect_left(self.names, name)
        return i if i < len(self.names) and self.names[i] == name else -1

    def is_dir(self, prefix: bytes) -> bool:
        """Whether any entry lies under `prefix` (a directory name ending in '/')."""
        i = bisect.bisect_left(self.names, prefix)
        return i < len(self.names) and self.names[i].startswith(prefix)


class CentralDirectory:
    """Parses central directory records fed in windows into a `ZipIndex`.

    Only entries under `root` (a '/'-terminated prefix, or '') are kept, with
    the prefix removed; everything rejected is counted and logged once per
    archive and reason.
    """

    def __init__(self, where: str, root: str, cd_start: int) -> None:
        self.where = where
        self.root = root.encode()
        self.cd_start = cd_start
        self.pending = b""
        self.seen = 0
        self.skipped = 0
        self.zip64 = False
        self.names: list[bytes] = []
        # Compact columns (8 bytes per value), not an object per entry.
        self.columns = {k: array("Q") for k in ("header", "csize", "usize", "method", "crc", "extra")}

    def skip(self, name: object, reason: str) -> None:
        self.skipped += 1
        log_once(log, f"zip:{self.where}:{reason}", "%s: skipping entry %r: %s (further entries like it are "
                 "skipped silently)", self.where, name, reason)

    def feed(self, data: bytes) -> None:
        buf = self.pending + data if self.pending else data
        pos = 0
        while len(buf) - pos >= CENTRAL.size:
            fields = CENTRAL.unpack_from(buf, pos)
            if fields[0] != SIG_CENTRAL:
                raise ConfigError(f"{self.where}: central directory entry {self.seen} is damaged (bad signature)")
            n, m, k = fields[12], fields[13], fields[14]
            end = pos + CENTRAL.size + n + m + k
            if end > len(buf):
                break
            name = bytes(buf[pos + CENTRAL.size:pos + CENTRAL.size + n])
            extra = buf[pos + CENTRAL.size + n:pos + CENTRAL.size + n + m]
            self.entry(fields, name, extra)
            self.seen += 1
            pos = end
        self.pending = bytes(buf[pos:])

    def finish(self) -> ZipIndex:
        if self.pending:
            raise ConfigError(f"{self.where}: central directory ends inside an entry (truncated or damaged)")
        names, header = self.names, self.columns["header"]
        counts = Counter(names)
        # Every directory some entry implies (its parents, and directory entries themselves).
        dirs: set[bytes] = set()
        for name in names:
            parent = name[:-1] if name.endswith(b"/") else name.rpartition(b"/")[0]
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = parent.rpartition(b"/")[0]
        shared = Counter(header[i] for i, name in enumerate(names) if not name.endswith(b"/"))
        keep: list[int] = []
        listed: set[bytes] = set()
        for i, name in enumerate(names):
            if name.endswith(b"/"):
                if name not in listed:  # a repeated directory entry is harmless: shown once
                    listed.add(name)
                    keep.append(i)
                continue
            # Ambiguous names are never paths: which of two members would a reader get?
            reason = ("the name occurs more than once" if counts[name] > 1 else
                      "the name is also a directory" if name in dirs else
                      "its local header is shared with another entry (overlapping members)" if shared[header[i]] > 1
                      else None)
            if reason is None:
                keep.append(i)
            else:
                self.skip(name.decode(), reason)
        pick = np.asarray(keep, dtype=np.int64)
        return ZipIndex([names[i] for i in keep],
                        {k: np.asarray(v, dtype=np.uint64)[pick] for k, v in self.columns.items()}, self.cd_start)

    def entry(self, fields: tuple[int, ...], raw: bytes, extra: bytes) -> None:
        flags, method, crc = fields[5], fields[6], fields[9]
        csize, usize, disk, header = fields[10], fields[11], fields[15], fields[18]
        try:
            name = raw.decode("utf-8") if flags & UTF8_FLAG else raw.decode("cp437")
        except UnicodeDecodeError:
            self.skip(raw, "the name is not UTF-8")
            return
        if U32 in (csize, usize, header) or disk == U16:
            got = _zip64(extra, usize == U32, csize == U32, header == U32, disk == U16)
            if got is None:
                self.skip(name, "its ZIP64 extra field is missing or too short")
                return
            self.zip64 = True
            usize = got[0] if usize == U32 else usize
            csize = got[1] if csize == U32 else csize
            header = got[2] if header == U32 else header
        problem = _name_problem(name)
        if problem is not None:
            self.skip(name, problem)
            return
        encoded = name.encode()
        if not encoded.startswith(self.root) or encoded == self.root:
            return  # outside the path the pipeline names: not part of this source
        encoded = encoded[len(self.root):]
        is_dir = encoded.endswith(b"/")
        if not is_dir:
            if flags & ENCRYPTED_FLAG:
                self.skip(name, "it is encrypted")
                return
            if method not in METHODS:
                self.skip(name, f"compression method {method} is not supported")
                return
            if method == zipfile.ZIP_STORED and csize != usize:
                self.skip(name, f"stored with {csize:,} bytes but {usize:,} uncompressed")
                return
            if header + LOCAL.size + len(raw) + csize > self.cd_start:
                self.skip(name, "its data would run into the central directory")
                return
        self.names.append(encoded)
        for key, value in (("header", header), ("csize", csize), ("usize", usize), ("method", method),
                           ("crc", crc), ("extra", len(extra))):
            self.columns[key].append(value)


def _zip64(extra: bytes, usize: bool, csize: bool, header: bool, disk: bool) -> tuple[int, int, int] | None:
    """The ZIP64 extended information of an extra field (only the values marked 0xFFFFFFFF are present)."""
    pos = 0
    while pos + EXTRA.size <= len(extra):
        kind, size = EXTRA.unpack_from(extra, pos)
        body = extra[pos + EXTRA.size:pos + EXTRA.size + size]
        pos += EXTRA.size + size
        if kind != ZIP64_EXTRA:
            continue
        want = usize + csize + header
        if len(body) < 8 * want + 4 * disk:
            return None
        values = struct.unpack_from(f"<{want}Q", body)
        it = iter(values)
        return (next(it) if usize else 0, next(it) if csize else 0, next(it) if header else 0)
    return None


def _name_problem(name: str) -> str | None:
    """Why an entry name can never be a path (a directory entry ends in '/')."""
    if "\0" in name:
        return "the name contains NUL"
    if "\\" in name:
        return "the name contains a backslash"
    if name.startswith("/"):
        return "the name is absolute"
    for segment in name.removesuffix("/").split("/"):
        problem = name_problem(segment)
        if problem is not None:
            return problem
    return None


def _root_prefix(path: str) -> str:
    """The pipeline's `zip:PATH` as a member-name prefix ('' or 'a/b/')."""
    path = path.strip("/")
    if not path:
        return ""
    problem = _name_problem(path)
    if problem is not None:
        raise ConfigError(f"zip:{path}: {problem}")
    return path + "/"


def _decode(method: int, data: bytes, size: int, where: str) -> bytes:
    """A compressed member, exactly `size` bytes (never more are produced)."""
    if method == ZSTD:
        out = unzstd(data, size, where)
    else:
        decoder: Any = zlib.decompressobj(-15) if method == zipfile.ZIP_DEFLATED else bz2.BZ2Decompressor()
        parts: list[bytes] = []
        produced = 0
        pending: bytes = data
        try:
            while True:
                if method == zipfile.ZIP_DEFLATED:
                    chunk = decoder.decompress(pending, min(size - produced + 1, STEP))
                    pending = decoder.unconsumed_tail
                    done = decoder.eof or (not chunk and not pending)
                else:
                    chunk = decoder.decompress(pending, min(size - produced + 1, STEP))
                    pending = b""
                    done = decoder.eof or (not chunk and decoder.needs_input)
                produced += len(chunk)
                if produced > size:
                    raise DataError(where, f"decodes to more than the {size:,} bytes the central directory gives")
                parts.append(chunk)
                if done:
                    break
        except (zlib.error, OSError, EOFError, ValueError) as e:
            raise DataError(where, f"bad {METHODS[method]} data: {e}") from None
        out = b"".join(parts)
    if len(out) != size:
        raise DataError(where, f"decodes to {len(out):,} bytes, the central directory gives {size:,}")
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
        self.root = _root_prefix(root)
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
        size = st.size
        tail_at = max(0, size - TAIL)
        if given is not None and len(given) == size - tail_at:
            tail = self._counted(given)  # as the read it replaces
        else:
            tail = await self._read(tail_at, size - tail_at, st.version, index=True)
        if len(tail) != size - tail_at:
            raise ConfigError(f"{where}: archive shorter than its size ({size:,} bytes)")
        end = _find_end(tail)
        if end is None:
            raise ConfigError(f"{where}: not a zip archive (no end of central directory record; truncated?)")
        fields = EOCD.unpack_from(tail, end)
        disk, cd_disk, entries, cd_size, cd_offset = fields[1], fields[2], fields[4], fields[5], fields[6]
        comment = tail[end + EOCD.size:end + EOCD.size + fields[7]]
        record_at = tail_at + end  # where the central directory must end
        zip64 = False
        loc = end - LOCATOR64.size
        if loc >= 0 and tail[loc:loc + 4] == SIG_LOCATOR64:
            _, _, eocd64_at, _ = LOCATOR64.unpack_from(tail, loc)
            if eocd64_at + EOCD64.size > tail_at + loc:
                raise ConfigError(f"{where}: ZIP64 end record lies after its locator")
            if eocd64_at >= tail_at:
                raw = tail[eocd64_at - tail_at:eocd64_at - tail_at + EOCD64.size]
            else:
                raw = await self._read(eocd64_at, EOCD64.size, st.version, index=True)
            if len(raw) != EOCD64.size or raw[:4] != SIG_EOCD64:
                raise ConfigError(f"{where}: ZIP64 end of central directory record is damaged")
            f64 = EOCD64.unpack(raw)
            disk, cd_disk, entries, cd_size, cd_offset = f64[4], f64[5], f64[7], f64[8], f64[9]
            record_at, zip64 = eocd64_at, True
        if disk != 0 or cd_disk != 0:
            raise ConfigError(f"{where}: multi-disk (split) archives are not supported")
        if cd_offset + cd_size > record_at:
            raise ConfigError(f"{where}: central directory ({cd_size:,} bytes at {cd_offset:,}) lies beyond the end "
                              f"record at {record_at:,} (truncated or damaged archive)")
        # The index lives in memory: bound what a hostile end record can make us read.
        if cd_size > self.limits.index_bytes:
            raise ConfigError(f"{where}: central directory of {cd_size:,} bytes exceeds the "
                              f"{self.limits.index_bytes >> 20} MiB limit (--max-index-size)")
        parser = CentralDirectory(where, self.root, cd_offset)
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
        index = parser.finish()
        if parser.seen != entries:
            log_once(log, f"zip:{where}:count", "%s: the end record claims %s entries, the central directory holds "
                     "%s", where, f"{entries:,}", f"{parser.seen:,}")
        if self.root and not len(index):
            raise ConfigError(f"{where}: no member under {self.root}")
        files = index.method[~index.isdir]
        methods = {METHODS.get(int(code), str(code)): int(count)
                   for code, count in zip(*np.unique(files, return_counts=True))}
        text = comment.decode("utf-8", "replace")
        self.summary = ZipSummary(where, len(files), parser.skipped, methods, zip64 or parser.zip64, text,
                                  _ome_comment(text))
        self._index, self._stat, self._dirty = index, st, False
        self._decoded.clear()

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
        prefix = path.encode() + b"/" if path else b""
        names = index.names
        i = bisect.bisect_left(names, prefix)
        directory = ObjectStat(0, st.mtime_ns, True, ())
        while i < len(names):
            name = names[i]
            if not name.startswith(prefix):
                break
            rest = name[len(prefix):]
            child, slash, _ = rest.partition(b"/")
            if not rest:  # the directory's own entry
                i += 1
            elif slash:
                if child:
                    yield child.decode(), directory
                # Past every name under prefix/child/ ('0' follows '/').
                i = bisect.bisect_left(names, prefix + child + b"0", i + 1)
            else:
                yield child.decode(), self._member_stat(index, st, i)
                i += 1
            if i % 4096 == 0:
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
        name = index.names[i]
        full = self.root.encode() + name
        raw = await self._read(header, LOCAL.size + len(full) + along, st.version)
        self.counters["local_headers"] += 1
        where = f"{self.description}!{path}"
        if len(raw) < LOCAL.size or raw[:4] != SIG_LOCAL:
            raise DataError(where, f"no local header at offset {header:,}")
        fields = LOCAL.unpack_from(raw)
        flags, method, crc, csize, usize, n, m = (fields[3], fields[4], fields[7], fields[8], fields[9],
                                                  fields[10], fields[11])
        if method != int(index.method[i]):
            raise DataError(where, f"local header says method {method}, the central directory {index.method[i]}")
        if raw[LOCAL.size:LOCAL.size + n] != full:
            raise DataError(where, "local header names another file")
        if not flags & DESCRIPTOR_FLAG:
            for label, local, central in (("CRC-32", crc, index.crc[i]), ("compressed size", csize, index.csize[i]),
                                          ("size", usize, index.usize[i])):
                if local != int(central) and local != U32:
                    raise DataError(where, f"local header {label} {local:,} disagrees with the central directory "
                                           f"({int(central):,})")
        offset = header + LOCAL.size + n + m
        if offset + int(index.csize[i]) > int(index.limit[i]):
            raise DataError(where, "member data overlaps the next member or the central directory")
        index.data[i] = offset
        return offset, raw[LOCAL.size + n + m:]

    async def _read_member(self, path: str, offset: int, size: int, version: Version | None, idx: bool) -> bytes:
        index, st, i = await self._member(path, version)
        total = int(index.usize[i])
        if size <= 0 or offset >= total:
            return b""
        size = min(size, total - offset)
        method = int(index.method[i])
        if method != zipfile.ZIP_STORED and total > self.limits.payload_bytes:
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
        if int(index.data[i]) < 0 and not whole and method == zipfile.ZIP_STORED and self.remote:
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
        if method != zipfile.ZIP_STORED:
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
        ident = (st.version, int(index.header[i]))
        hit = self._decoded.get(ident)
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
            decode: Callable[[], bytes] = lambda: _decode(method, data, size, where)
            decoded = await off_loop(decode, csize)
            if zlib.crc32(decoded) != crc:
                raise DataError(where, "CRC-32 mismatch")
            self.counters["decoded_members"] += 1
            self.counters["decoded_bytes"] += len(decoded)
            if len(decoded) <= DECODED_CACHE // 4:
                self._decoded[ident] = decoded
            return decoded

        return await self._flights.run(ident, work)

    async def _guarded_read(self, path: str, offset: int, size: int, version: Version | None, idx: bool) -> bytes:
        try:
            return await self._read_member(path, offset, size, version, idx)
        except StaleError:
            self._dirty = True  # the next stat (or unversioned read) reads the directory again
            if version is not None:
                raise
        return await self._read_member(path, offset, size, None, idx)

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


def _find_end(tail: bytes) -> int | None:
    """Offset of the end of central directory record in `tail`: the last signature whose
    comment length reaches exactly the end (a comment may itself contain the signature)."""
    pos = len(tail)
    while True:
        pos = tail.rfind(SIG_EOCD, 0, pos)
        if pos < 0 or len(tail) - pos < EOCD.size:
            if pos < 0:
                return None
            continue
        if pos + EOCD.size + EOCD.unpack_from(tail, pos)[7] == len(tail):
            return pos


def _ome_comment(text: str) -> dict[str, Any] | None:
    """The RFC-9 archive comment's `ome` object, if the comment is one."""
    try:
        value = json.loads(text) if text.lstrip().startswith("{") else None
    except ValueError:
        return None
    ome = value.get("ome") if isinstance(value, dict) else None
    return ome if isinstance(ome, dict) else None
