"""TensorStore's OCDBT on-disk structures, decoded from bytes (no I/O here).

An OCDBT database is a prefix of a key-value store holding `manifest.ocdbt`
and data files (`d/<32 hex digits>`, but any relative path a data file table
names). The manifest holds the configuration and the newest versions (each a
generation number, a commit time and the location of its B+tree root); older
versions are reached through version tree nodes. B+tree interior nodes lead
to leaf nodes, whose entries hold each key's value inline or as a reference
(data file, offset, length). Every encoded node and manifest is framed the
same way: magic (uint32 big-endian), total length (uint64 little-endian),
format version and compression (varints; zstd or none), the body, and a
CRC-32C of everything before it (uint32 little-endian).

Everything a structure declares is checked before it is used: lengths
against what is present, counts against the bytes left (so a count can never
allocate more than the input could hold), the rebuilt keys' total against a
bound (prefix compression lets a few bytes claim gigabytes of keys), the
decoded body against a cap (a zstd bomb stops there), and data file paths
against escaping the database (`..`, absolute, NUL, not UTF-8). Any failure
is a `DataError` naming the object and what is wrong.
"""

from __future__ import annotations

import bisect
import struct
from array import array
from dataclasses import dataclass
from typing import Sequence

import crc32c
import numpy as np

from unshardfs.sources.base import name_problem
from unshardfs.util.decompress import unzstd
from unshardfs.util.errors import DataError

MANIFEST_MAGIC = 0x0CDB3A2A
VERSION_NODE_MAGIC = 0x0CDB1234
BTREE_NODE_MAGIC = 0x0CDB20DE
FRAME_HEAD = struct.Struct("<Q")  # the length, after the big-endian magic
MIN_FRAME = 4 + 8 + 4  # magic, length, checksum
MAX_ARITY_LOG2 = 16  # version tree arity bound the format sets
MAX_KEY = 65535  # bytes in one key
MAX_PATH = 65535  # bytes in one data file path
MAX_BTREE_ARITY = 1 << 20
MANIFEST_SINGLE, MANIFEST_NUMBERED = 0, 1
MISSING = (1 << 64) - 1  # offset and length of the reference to an empty version's root
U64 = (1 << 64) - 1
VECTOR_MIN = 64  # varint columns at least this long are decoded with numpy
SAMPLE = 32  # keys per sampled key of a node (`Keys`)


class Cursor:
    """Reads fields of one decoded body in order; running out is damage (DataError)."""

    __slots__ = ("data", "pos", "where")

    def __init__(self, data: bytes, where: str, pos: int = 0) -> None:
        self.data = data
        self.pos = pos
        self.where = where

    def fail(self, reason: str) -> DataError:
        return DataError(self.where, reason)

    def left(self) -> int:
        return len(self.data) - self.pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise self.fail("ends early (truncated)")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def take(self, n: int) -> bytes:
        if n < 0 or n > len(self.data) - self.pos:
            raise self.fail(f"declares {n:,} bytes where {len(self.data) - self.pos:,} remain")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def varint(self, limit: int = U64) -> int:
        """A LEB128 varint of at most 10 bytes, at most `limit`."""
        value = shift = 0
        for _ in range(10):
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                if value > limit:
                    raise self.fail(f"value {value:,} exceeds {limit:,}")
                return value
            shift += 7
        raise self.fail("varint longer than 10 bytes")

    def varints(self, n: int, limit: int = U64) -> list[int]:
        """`n` varints in a row (a column of a node: hundreds of thousands of them, decoded at once)."""
        if n < VECTOR_MIN:
            return [self.varint(limit) for _ in range(n)]
        window = np.frombuffer(self.data, dtype=np.uint8, count=min(len(self.data) - self.pos, 10 * n),
                               offset=self.pos)
        ends = np.flatnonzero(window < 0x80)[:n]
        if len(ends) < n:
            raise self.fail("ends early (truncated)")
        starts = np.empty(n, dtype=np.int64)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lengths = ends - starts + 1
        if int(lengths.max()) > 10:
            raise self.fail("varint longer than 10 bytes")
        used = int(ends[-1]) + 1
        groups = np.repeat(starts, lengths)
        shifts = (7 * (np.arange(used) - groups)).astype(np.uint64)
        values = np.bitwise_or.reduceat((window[:used] & 0x7F).astype(np.uint64) << shifts, starts)
        tenth = lengths == 10
        if tenth.any() and int(window[ends[tenth]].max()) > 1:
            raise self.fail(f"value exceeds {U64:,}")
        out: list[int] = values.tolist()
        if limit < U64 and int(values.max()) > limit:
            raise self.fail(f"value {int(values.max()):,} exceeds {limit:,}")
        self.pos += used
        return out

    def count(self, per_item: int, limit: int) -> int:
        """A count of items each taking at least `per_item` bytes: never more than the bytes left allow."""
        n = self.varint()
        if n > limit or n * per_item > self.left():
            raise self.fail(f"declares {n:,} entries, more than {min(limit, self.left() // max(per_item, 1)):,} "
                            f"fit")
        return n

    def u64le(self) -> int:
        out: int = FRAME_HEAD.unpack(self.take(8))[0]
        return out

    def i32le(self) -> int:
        out: int = struct.unpack("<i", self.take(4))[0]
        return out


def unframe(data: bytes, magic: int, where: str, cap: int) -> bytes:
    """The decoded body of one framed structure, after checking magic, length, version and CRC-32C.

    `cap` bounds the decoded body (a zstd body is streamed and stopped there)."""
    if len(data) < MIN_FRAME:
        raise DataError(where, f"{len(data)} bytes, shorter than any OCDBT structure (truncated)")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise DataError(where, f"magic {found:#010x}, expected {magic:#010x} (not this OCDBT structure)")
    length = FRAME_HEAD.unpack_from(data, 4)[0]
    if length != len(data):
        raise DataError(where, f"header says {length:,} bytes, {len(data):,} are present (truncated or damaged)")
    stored = int.from_bytes(data[-4:], "little")
    actual = crc32c.crc32c(data[:-4])
    if stored != actual:
        raise DataError(where, f"CRC-32C mismatch (stored {stored:#010x}, computed {actual:#010x})")
    head = Cursor(data[:-4], where, 12)
    version = head.varint()
    if version != 0:
        raise DataError(where, f"format version {version} is not supported (0 is)")
    compression = head.varint()
    rest = data[head.pos:-4]
    if compression == 0:
        if len(rest) > cap:
            raise DataError(where, f"body of {len(rest):,} bytes exceeds the {cap:,}-byte limit")
        return rest
    if compression == 1:
        return unzstd(rest, cap, where)
    raise DataError(where, f"compression format {compression} is not supported (0: none, 1: zstd)")


# -- configuration and data file tables ------------------------------------------


@dataclass(frozen=True)
class Config:
    uuid: bytes
    manifest_kind: int  # MANIFEST_SINGLE or MANIFEST_NUMBERED
    max_inline_value_bytes: int
    max_decoded_node_bytes: int
    arity_log2: int  # of the version tree
    compression: str  # "none" or "zstd"
    zstd_level: int | None


def read_config(c: Cursor) -> Config:
    uuid = c.take(16)
    kind = c.byte()
    if kind not in (MANIFEST_SINGLE, MANIFEST_NUMBERED):
        raise c.fail(f"manifest kind {kind} is not known (0: single, 1: numbered)")
    inline = c.varint(0xFFFFFFFF)
    node_bytes = c.varint(0xFFFFFFFF)
    arity = c.byte()
    if not 1 <= arity <= MAX_ARITY_LOG2:
        raise c.fail(f"version tree arity log2 {arity} outside [1, {MAX_ARITY_LOG2}]")
    method = c.varint()
    if method == 0:
        return Config(uuid, kind, inline, node_bytes, arity, "none", None)
    if method == 1:
        return Config(uuid, kind, inline, node_bytes, arity, "zstd", c.i32le())
    raise c.fail(f"compression method {method} is not known (0: none, 1: zstd)")


@dataclass(frozen=True)
class DataFile:
    """One data file: its path from the database root, and the path its children's tables are relative to."""

    path: str
    transitive: str


def _path_problem(path: bytes) -> str | None:
    try:
        text = path.decode("utf-8")
    except UnicodeDecodeError:
        return "is not UTF-8"
    if text.startswith("/") or "\\" in text:
        return "is absolute or contains a backslash"
    for segment in text.split("/"):
        if name_problem(segment) is not None:
            return "has an empty, '.', '..' or NUL segment"
    return None


def read_data_files(c: Cursor, transitive: str) -> list[DataFile]:
    """A data file table; every path is checked to stay inside the database before anything fetches it."""
    n = c.count(2, 1 << 24)  # a suffix and a base length varint each at least
    prefix = [0, *c.varints(max(n - 1, 0), MAX_PATH)]
    suffix = c.varints(n, MAX_PATH)
    base = c.varints(n, MAX_PATH)
    inherited = transitive.encode()
    files: list[DataFile] = []
    previous = b""
    for i in range(n):
        if prefix[i] > len(previous):
            raise c.fail(f"data file {i}: common prefix {prefix[i]} longer than the previous path")
        path = previous[:prefix[i]] + c.take(suffix[i])
        if base[i] > len(path):
            raise c.fail(f"data file {i}: base path length {base[i]} exceeds the path length {len(path)}")
        full = inherited + path
        if len(full) > MAX_PATH:
            raise c.fail(f"data file {i}: path of {len(full):,} bytes exceeds {MAX_PATH:,}")
        # An empty path is what the reference to an empty version's root names; using it is refused below.
        problem = _path_problem(full) if full else None
        if problem is not None:
            raise c.fail(f"data file path {full[:200]!r} {problem}")
        files.append(DataFile(full.decode(), (inherited + path[:base[i]]).decode()))
        previous = path
    return files


@dataclass(frozen=True, slots=True)
class Location:
    """A byte range of a data file: an encoded node, or an out-of-line value."""

    file: DataFile
    offset: int
    length: int

    @property
    def identity(self) -> tuple[str, int, int]:
        return (self.file.path, self.offset, self.length)


def _locations(c: Cursor, files: Sequence[DataFile], n: int, allow_missing: bool = False
               ) -> list[Location | None]:
    ids = c.varints(n)
    offsets = c.varints(n)
    lengths = c.varints(n)
    out: list[Location | None] = []
    for i, (f, off, length) in enumerate(zip(ids, offsets, lengths)):
        if allow_missing and off == MISSING and length == MISSING:
            out.append(None)
            continue
        if f >= len(files) or not files[f].path:
            raise c.fail(f"reference {i} names data file {f:,} of {len(files):,}" if f >= len(files) else
                         f"reference {i} names a data file with an empty path")
        if off + length > U64:
            raise c.fail(f"reference {i}: offset {off:,} + length {length:,} overflows")
        out.append(Location(files[f], off, length))
    return out


# -- versions ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Version:
    """One generation: its B+tree root (None for an empty tree) and what the writer recorded about it."""

    generation: int
    commit_time_ns: int
    root: Location | None
    root_height: int
    num_keys: int
    tree_bytes: int
    indirect_bytes: int


@dataclass(frozen=True, slots=True)
class VersionNodeRef:
    """A version tree node: the newest generation under it, how many, and the oldest commit time."""

    generation: int
    location: Location
    num_generations: int
    commit_time_ns: int
    height: int


def _check_generations(c: Cursor, gens: Sequence[int]) -> None:
    for i, g in enumerate(gens):
        if g == 0:
            raise c.fail(f"generation number {i} is 0")
        if i and g <= gens[i - 1]:
            raise c.fail(f"generation numbers not increasing ({gens[i - 1]} then {g})")


def read_versions(c: Cursor, files: Sequence[DataFile], arity_log2: int) -> list[Version]:
    """Version tree leaf entries (a leaf node's, or the manifest's inline versions)."""
    n = c.count(1, 1 << arity_log2)
    if n == 0:
        raise c.fail("no versions")
    gens = c.varints(n)
    _check_generations(c, gens)
    last = gens[-1]
    if gens[0] < last - (last - 1) % (1 << arity_log2):
        raise c.fail(f"generations {gens[0]}..{last} span more than one version tree leaf")
    heights = [c.byte() for _ in range(n)]
    roots = _locations(c, files, n, allow_missing=True)
    keys, tree, indirect = c.varints(n), c.varints(n), c.varints(n)
    times = [c.u64le() for _ in range(n)]
    out: list[Version] = []
    for i in range(n):
        if roots[i] is None and heights[i] != 0:
            raise c.fail(f"empty generation {gens[i]} has root height {heights[i]}")
        out.append(Version(gens[i], times[i], roots[i], heights[i], keys[i], tree[i], indirect[i]))
    return out


def read_version_refs(c: Cursor, files: Sequence[DataFile], limit: int, height: int | None,
                      arity_log2: int) -> list[VersionNodeRef]:
    """Version tree interior entries: a node's (all of height `height`), or the manifest's (heights stored)."""
    n = c.count(1, limit)
    gens = c.varints(n)
    _check_generations(c, gens)
    locations = _locations(c, files, n)
    counts = c.varints(n)
    times = [c.u64le() for _ in range(n)]
    heights = [c.byte() for _ in range(n)] if height is None else [height] * n
    out: list[VersionNodeRef] = []
    for i in range(n):
        location = locations[i]
        assert location is not None  # not allow_missing
        if heights[i] * arity_log2 >= 64:
            raise c.fail(f"version node height {heights[i]} too large")
        if height is None and i and heights[i] >= heights[i - 1]:
            raise c.fail("manifest version node heights not decreasing")
        if counts[i] == 0 or counts[i] > gens[i]:
            raise c.fail(f"version node {i} claims {counts[i]:,} generations up to {gens[i]:,}")
        out.append(VersionNodeRef(gens[i], location, counts[i], times[i], heights[i]))
    return out


@dataclass(frozen=True)
class Manifest:
    config: Config
    versions: list[Version]  # inline, oldest first (empty for a numbered database's config-only manifest)
    nodes: list[VersionNodeRef]  # version tree nodes holding the older versions, highest first

    @property
    def latest(self) -> Version:
        return self.versions[-1]


def decode_manifest(data: bytes, where: str, cap: int) -> Manifest:
    c = Cursor(unframe(data, MANIFEST_MAGIC, where, cap), where)
    config = read_config(c)
    if config.manifest_kind != MANIFEST_SINGLE:
        _end(c)
        return Manifest(config, [], [])
    files = read_data_files(c, "")
    versions = read_versions(c, files, config.arity_log2)
    nodes = read_version_refs(c, files, 64 // config.arity_log2 + 1, None, config.arity_log2)
    for ref in nodes:
        if ref.generation >= versions[0].generation:
            raise c.fail(f"version node up to generation {ref.generation} overlaps the inline versions")
    _end(c)
    return Manifest(config, versions, nodes)


@dataclass(frozen=True)
class VersionNode:
    height: int
    versions: list[Version]  # height 0
    children: list[VersionNodeRef]  # height > 0

    @property
    def nbytes(self) -> int:
        """What holding it costs, for byte-bounded caches."""
        return 200 * (len(self.versions) + len(self.children)) + 100


def decode_version_node(data: bytes, where: str, cap: int, transitive: str, arity_log2: int) -> VersionNode:
    c = Cursor(unframe(data, VERSION_NODE_MAGIC, where, cap), where)
    arity = c.byte()
    if arity != arity_log2:
        raise c.fail(f"version tree arity log2 {arity}, the manifest says {arity_log2}")
    height = c.byte()
    if height * arity_log2 >= 64:
        raise c.fail(f"version node height {height} too large")
    files = read_data_files(c, transitive)
    if height == 0:
        node = VersionNode(0, read_versions(c, files, arity_log2), [])
    else:
        children = read_version_refs(c, files, 1 << arity_log2, height - 1, arity_log2)
        if not children:
            raise c.fail("interior version node without children")
        node = VersionNode(height, [], children)
    _end(c)
    return node


# -- B+tree nodes ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Child:
    """An interior entry: the child's smallest key (relative), its subtree's common prefix, where it is."""

    key: bytes
    common: int  # bytes of `key` every key of the subtree shares
    location: Location


@dataclass(frozen=True, slots=True)
class Value:
    """A leaf entry's value: `data` inline, or `location` in a data file."""

    size: int
    data: bytes | None
    location: Location | None


class Keys:
    """A node's keys, strictly increasing, as one blob and where each starts: a sequence for `bisect`
    (a node of TensorStore's default 8 MiB holds some 300,000 keys; an object per key would cost ten times
    the node)."""

    __slots__ = ("blob", "starts", "sample")

    def __init__(self, keys: list[bytes]) -> None:
        self.blob = b"".join(keys)
        self.starts = array("Q", [0])
        at = 0
        for key in keys:
            at += len(key)
            self.starts.append(at)
        # Every SAMPLE-th key as an object: a search bisects these in C, then SAMPLE keys in the blob.
        self.sample = keys[::SAMPLE]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i: int) -> bytes:
        if i < 0:
            i += len(self)
        return self.blob[self.starts[i]:self.starts[i + 1]]

    def bisect_left(self, key: bytes) -> int:
        """Where `key` would go before equal keys (`bisect.bisect_left` of the keys)."""
        b = bisect.bisect_left(self.sample, key)
        return bisect.bisect_left(self, key, max(0, (b - 1) * SAMPLE + 1), min(len(self), b * SAMPLE))

    def bisect_right(self, key: bytes) -> int:
        """Where `key` would go after equal keys (`bisect.bisect_right` of the keys)."""
        b = bisect.bisect_right(self.sample, key)
        return bisect.bisect_right(self, key, max(0, (b - 1) * SAMPLE + 1), min(len(self), b * SAMPLE))


INLINE = 0xFFFFFFFF  # `BtreeNode.file` of an inline value: its bytes are in `BtreeNode.body`


class BtreeNode:
    """One decoded B+tree node, in columns: entry i has key `keys[i]` (relative to the prefix the path from
    the root gives) and, in a leaf, the value `value(i)`, in an interior node the child `child(i)`."""

    __slots__ = ("height", "keys", "files", "body", "file", "offset", "length", "common", "nbytes")

    def __init__(self, height: int, keys: Keys, files: list[DataFile], body: bytes, file: array[int],
                 offset: array[int], length: array[int], common: array[int], nbytes: int) -> None:
        self.height = height
        self.keys = keys
        self.files = files
        self.body = body  # the decoded node, which inline values are slices of
        self.file = file  # data file index of each value or child (INLINE: in `body`)
        self.offset = offset  # ... its offset there
        self.length = length  # ... and its length
        self.common = common  # interior: bytes of each child's key its whole subtree shares
        self.nbytes = nbytes  # what holding it costs, for byte-bounded caches

    def __len__(self) -> int:
        return len(self.keys)

    def value(self, i: int) -> Value:
        f, offset, length = self.file[i], self.offset[i], self.length[i]
        if f == INLINE:
            return Value(length, self.body[offset:offset + length], None)
        return Value(length, None, Location(self.files[f], offset, length))

    def child(self, i: int) -> Child:
        return Child(self.keys[i], self.common[i], Location(self.files[self.file[i]], self.offset[i],
                                                            self.length[i]))


def _keys(c: Cursor, n: int, interior: bool, key_budget: int) -> tuple[Keys, list[int]]:
    prefix = [0, *c.varints(n - 1, MAX_KEY)]
    suffix = c.varints(n, MAX_KEY)
    common = c.varints(n, MAX_KEY) if interior else []
    if sum(suffix) > c.left():
        raise c.fail(f"key suffixes of {sum(suffix):,} bytes where {c.left():,} remain")
    if sum(prefix) + sum(suffix) > key_budget:
        raise c.fail(f"keys add up to more than {key_budget:,} bytes")
    keys: list[bytes] = []
    previous = b""
    data, at = c.data, c.pos
    for i in range(n):
        if prefix[i] > len(previous):
            raise c.fail(f"key {i}: prefix length {prefix[i]} exceeds the previous key's length {len(previous)}")
        length = prefix[i] + suffix[i]
        if length > MAX_KEY:
            raise c.fail(f"key {i} of {length:,} bytes exceeds {MAX_KEY:,}")
        key = previous[:prefix[i]] + data[at:at + suffix[i]]
        at += suffix[i]
        if i and key <= previous:
            raise c.fail(f"keys not strictly increasing at entry {i}")
        if interior and common[i] > length:
            raise c.fail(f"key {i}: subtree common prefix {common[i]} exceeds its length {length}")
        keys.append(key)
        previous = key
    c.pos = at
    return Keys(keys), common


def decode_btree_node(data: bytes, where: str, cap: int, transitive: str, key_budget: int) -> BtreeNode:
    """One B+tree node; `key_budget` bounds the bytes of its rebuilt keys."""
    body = unframe(data, BTREE_NODE_MAGIC, where, cap)
    c = Cursor(body, where)
    height = c.byte()
    files = read_data_files(c, transitive)
    n = c.count(2, MAX_BTREE_ARITY)
    if n == 0:
        raise c.fail("empty B+tree node")
    keys, common = _keys(c, n, height > 0, key_budget)
    if height > 0:
        ids, offsets, lengths = c.varints(n), c.varints(n), c.varints(n)
        for i, (f, off, length) in enumerate(zip(ids, offsets, lengths)):
            if f >= len(files) or not files[f].path:
                raise c.fail(f"child {i} names data file {f:,} of {len(files):,}, or one with an empty path")
            if off + length > U64:
                raise c.fail(f"child {i}: offset {off:,} + length {length:,} overflows")
        c.varints(n)  # keys of each subtree
        c.varints(n)  # tree bytes of each subtree
        c.varints(n)  # out-of-line value bytes of each subtree
    else:
        lengths = c.varints(n)
        kinds = c.take(n)
        if any(k > 1 for k in kinds):
            raise c.fail("value kind outside [0, 1]")
        out_of_line = [i for i in range(n) if kinds[i] == 1]
        ids = [INLINE] * n
        offsets = [0] * n
        for i, f in zip(out_of_line, c.varints(len(out_of_line))):
            if f >= len(files) or not files[f].path:
                raise c.fail(f"value {i} names data file {f:,} of {len(files):,}, or one with an empty path")
            ids[i] = f
        for i, off in zip(out_of_line, c.varints(len(out_of_line))):
            if off + lengths[i] > U64:
                raise c.fail(f"value {i}: offset {off:,} + length {lengths[i]:,} overflows")
            offsets[i] = off
        for i in range(n):
            if kinds[i] == 0:
                offsets[i] = c.pos
                c.take(lengths[i])
    _end(c)
    columns = (array("I", ids), array("Q", offsets), array("Q", lengths), array("H", common))
    size = len(data) + len(body) + len(keys.blob) + 42 * n + 200 * len(files) + 200
    return BtreeNode(height, keys, files, body, *columns, size)


def _end(c: Cursor) -> None:
    if c.left():
        raise c.fail(f"{c.left():,} unexpected bytes after the last field")


def numbered_manifest_name(name: str) -> int | None:
    """The generation of a numbered manifest's file name (`manifest.` and 16 hex digits), else None."""
    if len(name) != 25 or not name.startswith("manifest."):
        return None
    digits = name[9:]
    if any(ch not in "0123456789abcdef" for ch in digits):
        return None
    value = int(digits, 16)
    return value or None
