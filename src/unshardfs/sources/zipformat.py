"""The ZIP format, parsed from bytes: end records, central directory entries, local headers, member data.

Pure functions and a push parser: nothing here reads a file, awaits or
logs. The byte source (`unshardfs.sources.zip`) fetches the bytes and hands
them in; every decision about what an archive's bytes mean is made here, so
it is tested on bytes alone.

Why not `zipfile.ZipFile`: it wants a seekable file (a remote archive would
need a file-like wrapper turning every seek+read into a request), builds one
`ZipInfo` object per entry (hundreds of bytes each: 10^7 entries would cost
gigabytes) and trusts the entry count the end record claims. We use its
struct formats and signatures (`zipfile.structCentralDir`, ...) but parse
the records ourselves into the compact columns of `unshardfs.sources.zipindex`.

Hostile archives: names that are absolute, contain `\\`, NUL or a `.`/`..`
segment, or are not decodable never become paths (reported to the caller's
`skip`, not kept); entries that are encrypted, use an unknown method, or
whose data would run into the central directory are skipped the same way. A
local header that disagrees with the central directory (signature, name,
method, sizes) is a `DataError` for that member. Memory grows with the
entries actually present, never with a count an end record claims.
"""

from __future__ import annotations

import bz2
import struct
import zipfile
import zlib
from array import array
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from unshardfs.sources.base import name_problem
from unshardfs.util.decompress import STEP, unzstd
from unshardfs.util.errors import ConfigError, DataError

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
ZSTD = 93  # APPNOTE 4.4.5: Zstandard (zipfile knows no constant for it)
STORED = zipfile.ZIP_STORED
METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate", zipfile.ZIP_BZIP2: "bzip2",
           ZSTD: "zstd"}
UTF8_FLAG = 0x800
ENCRYPTED_FLAG = 0x1
DESCRIPTOR_FLAG = 0x8
U32, U16 = 0xFFFFFFFF, 0xFFFF
# The per-entry columns a central directory yields (`Entries.columns`).
COLUMNS = ("header", "csize", "usize", "method", "crc", "extra")

# Told about every entry that never becomes a path: (its name as found, why).
Skip = Callable[[object, str], None]


# -- the end of central directory record ---------------------------------------------------

@dataclass(frozen=True)
class EndRecord:
    """Where the central directory is, from the end record (and the ZIP64 one when present).

    `zip64_at` is the offset of a ZIP64 end record that did not come with the
    tail: read `EOCD64.size` bytes there and pass them to `with_zip64`.
    """

    entries: int  # as claimed: never used to allocate
    cd_size: int
    cd_offset: int
    record_at: int  # where the central directory must end (the first end record's offset)
    comment: bytes
    zip64: bool
    disk: int
    cd_disk: int
    zip64_at: int | None = None

    def with_zip64(self, raw: bytes, where: str) -> "EndRecord":
        """This record completed by the ZIP64 end record `raw` (read at `zip64_at`)."""
        assert self.zip64_at is not None
        if len(raw) != EOCD64.size or raw[:4] != SIG_EOCD64:
            raise ConfigError(f"{where}: ZIP64 end of central directory record is damaged")
        (_sig, _size, _made_by, _needed, disk, cd_disk, _disk_entries, entries, cd_size,
         cd_offset) = EOCD64.unpack(raw)
        return replace(self, disk=disk, cd_disk=cd_disk, entries=entries, cd_size=cd_size, cd_offset=cd_offset,
                       record_at=self.zip64_at, zip64=True, zip64_at=None)

    def check(self, where: str, index_bytes: int) -> None:
        """ConfigError unless the central directory is on this disk, before the end record and within
        `index_bytes` (the index lives in memory: bound what a hostile end record can make us read)."""
        if self.disk != 0 or self.cd_disk != 0:
            raise ConfigError(f"{where}: multi-disk (split) archives are not supported")
        if self.cd_offset + self.cd_size > self.record_at:
            raise ConfigError(f"{where}: central directory ({self.cd_size:,} bytes at {self.cd_offset:,}) lies "
                              f"beyond the end record at {self.record_at:,} (truncated or damaged archive)")
        if self.cd_size > index_bytes:
            raise ConfigError(f"{where}: central directory of {self.cd_size:,} bytes exceeds the "
                              f"{index_bytes >> 20} MiB limit (--max-index-size)")


def find_end(tail: bytes) -> int | None:
    """Offset of the end of central directory record in `tail`: the last signature whose
    comment length reaches exactly the end (a comment may itself contain the signature)."""
    pos = len(tail)
    while True:
        pos = tail.rfind(SIG_EOCD, 0, pos)
        if pos < 0 or len(tail) - pos < EOCD.size:
            if pos < 0:
                return None
            continue
        *_, comment_length = EOCD.unpack_from(tail, pos)
        if pos + EOCD.size + comment_length == len(tail):
            return pos


def read_end(tail: bytes, tail_at: int, where: str) -> EndRecord:
    """The end record of an archive whose last bytes, from offset `tail_at` on, are `tail`."""
    end = find_end(tail)
    if end is None:
        raise ConfigError(f"{where}: not a zip archive (no end of central directory record; truncated?)")
    _sig, disk, cd_disk, _disk_entries, entries, cd_size, cd_offset, comment_length = EOCD.unpack_from(tail, end)
    record = EndRecord(entries=entries, cd_size=cd_size, cd_offset=cd_offset, record_at=tail_at + end,
                       comment=bytes(tail[end + EOCD.size:end + EOCD.size + comment_length]), zip64=False,
                       disk=disk, cd_disk=cd_disk)
    loc = end - LOCATOR64.size
    if loc < 0 or tail[loc:loc + 4] != SIG_LOCATOR64:
        return record
    _sig, _disk, eocd64_at, _disks = LOCATOR64.unpack_from(tail, loc)
    if eocd64_at + EOCD64.size > tail_at + loc:
        raise ConfigError(f"{where}: ZIP64 end record lies after its locator")
    record = replace(record, zip64_at=eocd64_at)
    if eocd64_at >= tail_at:
        return record.with_zip64(tail[eocd64_at - tail_at:eocd64_at - tail_at + EOCD64.size], where)
    return record


# -- names ---------------------------------------------------------------------------------

def entry_name_problem(name: str) -> str | None:
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


def root_prefix(path: str) -> str:
    """The pipeline's `zip:PATH` as a member-name prefix ('' or 'a/b/')."""
    path = path.strip("/")
    if not path:
        return ""
    problem = entry_name_problem(path)
    if problem is not None:
        raise ConfigError(f"zip:{path}: {problem}")
    return path + "/"


# -- the central directory ---------------------------------------------------------------

def zip64_extra(extra: bytes, usize: bool, csize: bool, header: bool, disk: bool) -> tuple[int, int, int] | None:
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


# The fixed part of a central directory record as numpy reads it (APPNOTE 4.3.12; zipfile's
# structCentralDir, field by field), and the part of it that walks from one record to the next.
_RECORD = np.dtype({"names": ["sig", "flags", "method", "crc", "csize", "usize", "n", "m", "k", "disk", "header"],
                    "formats": ["<u4", "<u2", "<u2", "<u4", "<u4", "<u4", "<u2", "<u2", "<u2", "<u2", "<u4"],
                    "offsets": [0, 8, 10, 16, 20, 24, 28, 30, 32, 34, 42], "itemsize": CENTRAL.size})
_STEP = struct.Struct("<I24x3H")  # signature, then the name, extra and comment lengths
_SIG_CENTRAL = int.from_bytes(SIG_CENTRAL, "little")
_SLASH, _DOT = ord("/"), ord(".")
_KNOWN_METHODS = np.array(sorted(METHODS), dtype=np.uint16)


@dataclass
class Entries:
    """The kept entries of a central directory, in its order: names (UTF-8, the pipeline's root
    removed) as one byte array with `starts` (n + 1 offsets), and one numpy column per field.
    `unshardfs.sources.zipindex.build_index` consumes it (releasing each array when done)."""

    names: np.ndarray  # uint8
    starts: np.ndarray  # int64, n + 1
    columns: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def name(self, i: int) -> bytes:
        return self.names[self.starts[i]:self.starts[i + 1]].tobytes()


class CentralDirectory:
    """A push parser of central directory records, fed in windows of any size.

    Keeps the entries under `root` (a '/'-terminated prefix, or ''), with the
    prefix removed; every entry rejected is reported to `skip`. Records are
    decoded a window at a time with numpy: an entry with a plain name (ASCII
    without NUL or backslash, no empty, `.` or `..` segment) and plain fields
    costs no Python object; any other (ZIP64 values, other names, anything to
    refuse) goes through `entry`, one at a time. Kept per entry: its name's
    bytes and 32 bytes of columns.
    """

    def __init__(self, where: str, root: str, cd_start: int, skip: Skip) -> None:
        self.where = where
        self.root = root.encode()
        self.cd_start = cd_start
        self.skip = skip
        self.pending = b""
        self.seen = 0
        self.zip64 = False
        self._names: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        self._columns: dict[str, list[np.ndarray]] = {k: [] for k in COLUMNS}

    def feed(self, data: bytes) -> None:
        buf = self.pending + data if self.pending else bytes(data)
        at, pos = _chain(buf)
        if at is None:  # a signature inside a name or field, or damage: walk record by record
            steps = array("q")
            pos, size, step = 0, len(buf), _STEP.unpack_from
            while size - pos >= CENTRAL.size:
                sig, n, m, k = step(buf, pos)
                if sig != _SIG_CENTRAL:
                    raise ConfigError(f"{self.where}: central directory entry {self.seen + len(steps)} is "
                                      f"damaged (bad signature)")
                end = pos + CENTRAL.size + n + m + k
                if end > size:
                    break
                steps.append(pos)
                pos = end
            at = np.frombuffer(steps, dtype=np.int64)
        self.pending = buf[pos:]
        if len(at):
            self._records(buf, at)
            self.seen += len(at)

    def finish(self) -> Entries:
        """The kept entries; ConfigError if the last window did not end on an entry's end."""
        if self.pending:
            raise ConfigError(f"{self.where}: central directory ends inside an entry (truncated or damaged)")
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.uint32)
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        names = np.concatenate(self._names) if self._names else np.zeros(0, np.uint8)
        self._names, self._lengths = [], []
        columns = {}
        for key in COLUMNS:
            parts = self._columns[key]
            columns[key] = np.concatenate(parts) if parts else np.zeros(0, _DTYPES[key])
            parts.clear()
        return Entries(names, starts, columns)

    def _records(self, buf: bytes, at: np.ndarray) -> None:
        """The records of `buf` starting at offsets `at` (each complete)."""
        raw = np.frombuffer(buf, dtype=np.uint8)
        rec = raw[at[:, None] + np.arange(CENTRAL.size)].view(_RECORD)[:, 0]
        n = rec["n"].astype(np.int64)
        flags, method, csize, usize = rec["flags"], rec["method"], rec["csize"], rec["usize"]
        header = rec["header"].astype(np.uint64)
        first = at + CENTRAL.size  # each name's offset in buf
        flat = gather(raw, first, n)  # every name's bytes, one after another
        row = np.repeat(np.arange(len(at)), n)  # the record of each byte of `flat`
        is_dir = (n > 0) & (raw[np.maximum(first + n - 1, 0)] == _SLASH)
        odd = np.zeros(len(at), dtype=bool)
        odd[row[(flat >= 0x80) | (flat == 0) | (flat == ord("\\"))]] = True
        odd[_bad_segments(flat, n, is_dir)] = True
        odd |= (csize == U32) | (usize == U32) | (rec["header"] == U32) | (rec["disk"] == U16)
        refused = ~is_dir & ((flags & ENCRYPTED_FLAG != 0) | ~np.isin(method, _KNOWN_METHODS)
                             | ((method == STORED) & (csize != usize))
                             | (header + np.uint64(LOCAL.size) + n.astype(np.uint64) + csize > self.cd_start))
        odd |= refused
        # Plain entries under the root are kept as they are, the root removed.
        r = len(self.root)
        inside = n > r
        if r:
            heads = raw[np.minimum(first[:, None] + np.arange(r), len(raw) - 1)]  # n > r where it matters
            inside &= (heads == np.frombuffer(self.root, dtype=np.uint8)).all(axis=1)
        keep = ~odd & inside
        values = {"header": header, "csize": csize.astype(np.uint64), "usize": usize.astype(np.uint64),
                  "method": method, "crc": rec["crc"], "extra": rec["m"]}
        if not odd.any():
            lengths = (n[keep] - r).astype(np.uint32)
            self._names.append(gather(raw, first[keep] + r, lengths))
        else:
            # In the directory's order, the plain entries and those `entry` keeps.
            names: list[bytes] = []
            for i in range(len(at)):
                if odd[i]:
                    name_at, extra_at = int(first[i]), int(first[i] + n[i])
                    got = self.entry(CENTRAL.unpack_from(buf, int(at[i])), buf[name_at:extra_at],
                                     buf[extra_at:extra_at + int(rec["m"][i])])
                    if got is not None:
                        keep[i] = True
                        names.append(got[0])
                        for key, value in zip(COLUMNS, got[1:]):
                            values[key][i] = value
                elif keep[i]:
                    o = int(first[i])
                    names.append(buf[o + r:o + int(n[i])])
            lengths = np.fromiter((len(x) for x in names), dtype=np.uint32, count=len(names))
            self._names.append(np.frombuffer(b"".join(names), dtype=np.uint8))
        self._lengths.append(lengths)
        for key in COLUMNS:
            self._columns[key].append(values[key][keep].astype(_DTYPES[key]))

    def entry(self, fields: tuple[int, ...], raw: bytes, extra: bytes) -> tuple[bytes, int, int, int, int, int, int] | None:
        """One entry, checked field by field: (its name under the root, its column values), or None
        when it is not kept (outside the root, or refused and told to `skip`)."""
        (_sig, _made_by, _system, _needed, _reserved, flags, method, _time, _date, crc, csize, usize, _n, _m, _k,
         disk, _internal, _external, header) = fields
        try:
            name = raw.decode("utf-8") if flags & UTF8_FLAG else raw.decode("cp437")
        except UnicodeDecodeError:
            self.skip(raw, "the name is not UTF-8")
            return None
        if U32 in (csize, usize, header) or disk == U16:
            got = zip64_extra(extra, usize == U32, csize == U32, header == U32, disk == U16)
            if got is None:
                self.skip(name, "its ZIP64 extra field is missing or too short")
                return None
            self.zip64 = True
            usize = got[0] if usize == U32 else usize
            csize = got[1] if csize == U32 else csize
            header = got[2] if header == U32 else header
        problem = entry_name_problem(name)
        if problem is not None:
            self.skip(name, problem)
            return None
        encoded = name.encode()
        if not encoded.startswith(self.root) or encoded == self.root:
            return None  # outside the path the pipeline names: not part of this source
        encoded = encoded[len(self.root):]
        if not encoded.endswith(b"/"):
            if flags & ENCRYPTED_FLAG:
                self.skip(name, "it is encrypted")
                return None
            if method not in METHODS:
                self.skip(name, f"compression method {method} is not supported")
                return None
            if method == zipfile.ZIP_STORED and csize != usize:
                self.skip(name, f"stored with {csize:,} bytes but {usize:,} uncompressed")
                return None
            if header + LOCAL.size + len(raw) + csize > self.cd_start:
                self.skip(name, "its data would run into the central directory")
                return None
        return encoded, header, csize, usize, method, crc, len(extra)


_DTYPES = {"header": np.uint64, "csize": np.uint64, "usize": np.uint64, "method": np.uint16, "crc": np.uint32,
           "extra": np.uint16}


def _chain(buf: bytes) -> tuple[np.ndarray | None, int]:
    """(the offsets of the complete records `buf` starts with, where the rest begins), found at once
    when every central directory signature in `buf` starts a record and each record leads to the
    next; (None, 0) otherwise (the caller walks the records one by one)."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if len(raw) < CENTRAL.size:
        return np.zeros(0, dtype=np.int64), 0
    sig = np.frombuffer(SIG_CENTRAL, dtype=np.uint8)
    at = np.flatnonzero((raw[:-3] == sig[0]) & (raw[1:-2] == sig[1]) & (raw[2:-1] == sig[2]) & (raw[3:] == sig[3]))
    at = at[at + CENTRAL.size <= len(raw)]  # the lengths of each are in `buf`
    if not len(at) or at[0] != 0:
        return None, 0
    fields = raw[at[:, None] + np.arange(28, 34)].view("<u2").astype(np.int64)
    ends = at + CENTRAL.size + fields.sum(axis=1)
    if not np.array_equal(ends[:-1], at[1:]):
        return None, 0
    complete = ends <= len(raw)
    if not complete[:-1].all() or (len(raw) - ends[-1] >= CENTRAL.size and complete[-1]):
        return None, 0  # a record after the last signature (damage), or one cut before its end
    if complete[-1]:
        return at, int(ends[-1])
    return at[:-1], int(at[-1])


def gather(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The byte ranges `data[starts[i]:starts[i] + lengths[i]]`, one after another, in one array."""
    lengths = lengths.astype(np.int64)
    out_at = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=out_at[1:])
    total = int(out_at[-1] + lengths[-1]) if len(lengths) else 0
    return data[np.repeat(starts.astype(np.int64) - out_at, lengths) + np.arange(total)]


def _bad_segments(flat: np.ndarray, n: np.ndarray, is_dir: np.ndarray) -> np.ndarray:
    """Rows whose name (row r's bytes are the next n[r] of `flat`) has an empty, `.` or `..` segment
    or is absolute: in '\0/' + name (+ '/' for a file) that is '//', '/./' or '/../'."""
    rows = len(n)
    width = n + 2 + ~is_dir
    at = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(width, out=at[1:])
    ext = np.zeros(int(at[-1]), dtype=np.uint8)
    ext[at[:-1] + 1] = _SLASH
    name_at = np.zeros(rows, dtype=np.int64)
    np.cumsum(n[:-1], out=name_at[1:])
    ext[np.repeat(at[:-1] + 2 - name_at, n) + np.arange(len(flat))] = flat
    files = np.flatnonzero(~is_dir)
    ext[at[:-1][files] + 2 + n[files]] = _SLASH
    slash, dot = ext == _SLASH, ext == _DOT
    hits = [np.flatnonzero(slash[:-1] & slash[1:]),
            np.flatnonzero(slash[:-2] & dot[1:-1] & slash[2:]),
            np.flatnonzero(slash[:-3] & dot[1:-2] & dot[2:-1] & slash[3:])]
    return np.searchsorted(at, np.concatenate(hits), side="right") - 1


# -- local headers and member data ---------------------------------------------------------

@dataclass(frozen=True)
class Expected:
    """What the central directory says of a member, for checking its local header."""

    name: bytes  # the full entry name (with the pipeline's root)
    method: int
    crc: int
    csize: int
    usize: int


def local_header_size(raw: bytes, at: int, expected: Expected, where: str) -> int:
    """The length of the local header (name and extra field included) that `raw` starts with, read at
    offset `at`; DataError when it is not one or disagrees with the central directory."""
    if len(raw) < LOCAL.size or raw[:4] != SIG_LOCAL:
        raise DataError(where, f"no local header at offset {at:,}")
    _sig, _needed, _reserved, flags, method, _time, _date, crc, csize, usize, n, m = LOCAL.unpack_from(raw)
    if method != expected.method:
        raise DataError(where, f"local header says method {method}, the central directory {expected.method}")
    if raw[LOCAL.size:LOCAL.size + n] != expected.name:
        raise DataError(where, "local header names another file")
    if not flags & DESCRIPTOR_FLAG:
        for label, local, central in (("CRC-32", crc, expected.crc), ("compressed size", csize, expected.csize),
                                      ("size", usize, expected.usize)):
            if local != central and local != U32:
                raise DataError(where, f"local header {label} {local:,} disagrees with the central directory "
                                       f"({central:,})")
    return int(LOCAL.size + n + m)


def decode(method: int, data: bytes, size: int, where: str) -> bytes:
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
