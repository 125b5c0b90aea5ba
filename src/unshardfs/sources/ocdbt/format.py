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

import struct
from dataclasses import dataclass
from typing import Sequence

import crc32c

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
        return [self.varint(limit) for _ in range(n)]

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
    def ident(self) -> tuple[str, int, int]:
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
    num_keys: int


@dataclass(frozen=True, slots=True)
class Value:
    """A leaf entry's value: `data` inline, or `location` in a data file."""

    size: int
    data: bytes | None
    location: Location | None


@dataclass(frozen=True)
class BtreeNode:
    height: int
    keys: list[bytes]  # relative to the prefix the path from the root gives, strictly increasing
    children: list[Child]  # height > 0
    values: list[Value]  # height 0
    nbytes: int  # what holding it costs, for byte-bounded caches


def _keys(c: Cursor, n: int, interior: bool, key_budget: int) -> tuple[list[bytes], list[int]]:
    prefix = [0, *c.varints(n - 1, MAX_KEY)]
    suffix = c.varints(n, MAX_KEY)
    common = c.varints(n, MAX_KEY) if interior else []
    keys: list[bytes] = []
    previous = b""
    total = 0
    for i in range(n):
        if prefix[i] > len(previous):
            raise c.fail(f"key {i}: prefix length {prefix[i]} exceeds the previous key's length {len(previous)}")
        length = prefix[i] + suffix[i]
        if length > MAX_KEY:
            raise c.fail(f"key {i} of {length:,} bytes exceeds {MAX_KEY:,}")
        total += length
        if total > key_budget:
            raise c.fail(f"keys add up to more than {key_budget:,} bytes")
        key = previous[:prefix[i]] + c.take(suffix[i])
        if i and key <= previous:
            raise c.fail(f"keys not strictly increasing at entry {i}")
        if interior and common[i] > length:
            raise c.fail(f"key {i}: subtree common prefix {common[i]} exceeds its length {length}")
        keys.append(key)
        previous = key
    return keys, common


def decode_btree_node(data: bytes, where: str, cap: int, transitive: str, key_budget: int) -> BtreeNode:
    """One B+tree node; `key_budget` bounds the bytes of its rebuilt keys."""
    c = Cursor(unframe(data, BTREE_NODE_MAGIC, where, cap), where)
    height = c.byte()
    files = read_data_files(c, transitive)
    n = c.count(2, MAX_BTREE_ARITY)
    if n == 0:
        raise c.fail("empty B+tree node")
    keys, common = _keys(c, n, height > 0, key_budget)
    children: list[Child] = []
    values: list[Value] = []
    if height > 0:
        locations = _locations(c, files, n)
        num_keys = c.varints(n)
        c.varints(n)  # tree bytes of each subtree
        c.varints(n)  # out-of-line value bytes of each subtree
        for i in range(n):
            location = locations[i]
            assert location is not None
            children.append(Child(keys[i], common[i], location, num_keys[i]))
    else:
        lengths = c.varints(n)
        kinds = [c.byte() for _ in range(n)]
        if any(k > 1 for k in kinds):
            raise c.fail("value kind outside [0, 1]")
        out_of_line = [i for i in range(n) if kinds[i] == 1]
        ids = c.varints(len(out_of_line))
        offsets = c.varints(len(out_of_line))
        where_of: dict[int, Location] = {}
        for i, f, off in zip(out_of_line, ids, offsets):
            if f >= len(files) or not files[f].path:
                raise c.fail(f"value {i} names data file {f:,} of {len(files):,}, or one with an empty path")
            if off + lengths[i] > U64:
                raise c.fail(f"value {i}: offset {off:,} + length {lengths[i]:,} overflows")
            where_of[i] = Location(files[f], off, lengths[i])
        for i in range(n):
            if kinds[i] == 1:
                values.append(Value(lengths[i], None, where_of[i]))
            else:
                values.append(Value(lengths[i], c.take(lengths[i]), None))
    _end(c)
    size = len(data) + sum(len(k) for k in keys) + 220 * n  # bytes objects and a Value or Child each
    return BtreeNode(height, keys, children, values, size)


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
