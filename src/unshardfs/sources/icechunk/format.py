"""Icechunk's on-disk structures, decoded from bytes (no I/O here).

An Icechunk repository is a prefix of an object store holding `refs/`
(`branch.NAME/ref.json`, `tag.NAME/ref.json`: JSON naming a snapshot),
`snapshots/ID` (the node tree of one commit: groups and arrays, each with its
Zarr metadata as the writer passed it, arrays with the manifests holding
their chunk references), `manifests/ID` (per array, chunk coordinates ->
native chunk `chunks/ID` + offset + length, inline bytes, or a virtual
reference: location + offset + length + checksum), `transactions/ID` and an
optional `config.yaml`. Object ids are 12 random bytes (node ids 8), named in
Crockford base 32.

Snapshots and manifests are FlatBuffers behind a binary header: the magic
`ICE🧊CHUNK` (12 bytes), the writer's name (24 bytes, padded), the spec
version, the file type and the compression (one byte each; zstd or none).
Spec versions 1 (Icechunk 1.x) and 2 (Icechunk 2.x) are read; any other is
refused with one line. Spec version 2 keeps refs, parents and the
configuration in one `repo` object (`repoinfo.py`) instead of `refs/` and
`config.yaml`; in snapshots an array's shape is `shape_v2` (length and
number of chunks per dimension) and the manifest files `manifest_files_v2`
(tables, not structs); in manifests a virtual reference's location may be
zstd-compressed with a dictionary the manifest holds.

The FlatBuffers reader here is our own and checks every access: a table's
vtable and every field inside the bytes, every offset pointing forward and in
range, every vector's length against the bytes it would take (so a count can
never allocate more than the input holds), every string UTF-8. The schema has
no recursive type and offsets only point forward, so no structure can loop.
Snapshots are decoded whole (their node count bounded); a manifest stays the
decoded bytes it is, each array's chunk references found by binary search
(they are sorted by coordinates), so a manifest of millions of references
costs its bytes, not millions of Python objects. Any failure is a
`DataError` naming the object and what is wrong.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from unshardfs.sources.base import name_problem
from unshardfs.util.decompress import unzstd
from unshardfs.util.errors import DataError

MAGIC = "ICE🧊CHUNK".encode()
HEADER = len(MAGIC) + 24 + 3  # magic, writer's name, spec version, file type, compression
SPEC_VERSIONS = (1, 2)  # what this module reads
FILE_SNAPSHOT, FILE_MANIFEST, FILE_ATTRIBUTES, FILE_TRANSACTION_LOG, FILE_CHUNK, FILE_REPO_INFO = 1, 2, 3, 4, 5, 6
FILE_TYPES = {FILE_SNAPSHOT: "snapshot", FILE_MANIFEST: "manifest", FILE_ATTRIBUTES: "attributes",
              FILE_TRANSACTION_LOG: "transaction log", FILE_CHUNK: "chunk", FILE_REPO_INFO: "repo info"}
COMPRESSION_NONE, COMPRESSION_ZSTD = 0, 1
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
ID_LEN, NODE_ID_LEN = 12, 8
ID_TEXT = 20  # characters of a 12-byte id in Crockford base 32
MAX_NODES = 200_000  # groups and arrays in one snapshot (the bound Icechunk sizes its 8-byte node ids for)
MAX_DIMS = 64  # dimensions of one array (Zarr writers stay far below)
MAX_PATH = 4096  # bytes of one node path
MAX_REF_JSON = 4096  # bytes of a ref file: {"snapshot":"<20 characters>"}
NODE_ARRAY, NODE_GROUP = 1, 2
U32 = struct.Struct("<I")
I32 = struct.Struct("<i")
U16 = struct.Struct("<H")
U64 = struct.Struct("<Q")


# -- ids -------------------------------------------------------------------------


def encode_id(raw: bytes) -> str:
    """An object id as its file name: Crockford base 32 of its bits, most significant first, the last
    character padded with zero bits."""
    bits = len(raw) * 8
    value = int.from_bytes(raw, "big") << (-bits % 5)
    n = (bits + 4) // 5
    return "".join(CROCKFORD[(value >> (5 * (n - 1 - i))) & 31] for i in range(n))


def decode_id(text: str, size: int = ID_LEN) -> bytes | None:
    """The id `text` names (upper-case Crockford base 32 of `size` bytes), or None when it names none."""
    n = (size * 8 + 4) // 5
    if len(text) != n or any(c not in CROCKFORD for c in text):
        return None
    value = 0
    for c in text:
        value = value << 5 | CROCKFORD.index(c)
    pad = n * 5 - size * 8
    if value & ((1 << pad) - 1):
        return None
    return (value >> pad).to_bytes(size, "big")


# -- the binary header --------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    writer: str  # the implementation that wrote the object ("ic-0.3.24")
    spec_version: int
    file_type: int
    compression: int


def decode_header(data: bytes, where: str, file_type: int) -> Header:
    """The header of a snapshot or manifest object, checked: magic, a spec version we read, the file type
    expected, a compression we decode."""
    if len(data) < HEADER:
        raise DataError(where, f"{len(data)} bytes, shorter than an Icechunk object header (truncated)")
    if data[:len(MAGIC)] != MAGIC:
        raise DataError(where, "no Icechunk magic (not an Icechunk object, or damaged)")
    writer = data[len(MAGIC):len(MAGIC) + 24].decode("utf-8", "replace").rstrip(" \0")
    version, kind, compression = data[HEADER - 3:HEADER]
    if version not in SPEC_VERSIONS:
        raise DataError(where, f"Icechunk spec version {version} (written by {writer!r}) is not supported; "
                               f"unshardfs reads spec versions {', '.join(map(str, SPEC_VERSIONS))} (Icechunk 1.x "
                               f"and 2.x)")
    if kind != file_type:
        raise DataError(where, f"is a {FILE_TYPES.get(kind, f'file of type {kind}')}, a "
                               f"{FILE_TYPES[file_type]} was expected")
    if compression not in (COMPRESSION_NONE, COMPRESSION_ZSTD):
        raise DataError(where, f"compression {compression} is not known (0: none, 1: zstd)")
    return Header(writer, version, kind, compression)


def decode_object(data: bytes, where: str, file_type: int, cap: int) -> bytes:
    """The FlatBuffers body of a snapshot, manifest or repo info object, decompressed to at most `cap` bytes."""
    header = decode_header(data, where, file_type)
    body = data[HEADER:]
    if header.compression == COMPRESSION_ZSTD:
        return unzstd(body, cap, where)
    if len(body) > cap:
        raise DataError(where, f"body of {len(body):,} bytes exceeds the {cap:,}-byte limit")
    return bytes(body)


# -- a checked FlatBuffers reader ------------------------------------------------------


class Buffer:
    """Checked access to one FlatBuffers buffer (little-endian throughout)."""

    __slots__ = ("data", "where")

    def __init__(self, data: bytes, where: str) -> None:
        self.data = data
        self.where = where

    def fail(self, reason: str) -> DataError:
        return DataError(self.where, reason)

    def need(self, pos: int, size: int, what: str) -> None:
        if pos < 0 or size < 0 or pos + size > len(self.data):
            raise self.fail(f"{what} at {pos:,} (+{size:,}) lies outside the {len(self.data):,} bytes (truncated "
                            f"or damaged)")

    def u8(self, pos: int) -> int:
        self.need(pos, 1, "a byte")
        return self.data[pos]

    def u16(self, pos: int) -> int:
        self.need(pos, 2, "a 16-bit field")
        out: int = U16.unpack_from(self.data, pos)[0]
        return out

    def u32(self, pos: int) -> int:
        self.need(pos, 4, "a 32-bit field")
        out: int = U32.unpack_from(self.data, pos)[0]
        return out

    def u64(self, pos: int) -> int:
        self.need(pos, 8, "a 64-bit field")
        out: int = U64.unpack_from(self.data, pos)[0]
        return out

    def follow(self, pos: int, what: str) -> int:
        """The target of the offset stored at `pos`: forward, and inside the buffer."""
        offset = self.u32(pos)
        if offset == 0:
            raise self.fail(f"{what}: an offset of 0 (points at itself)")
        target = pos + offset
        self.need(target, 4, what)
        return target

    def table(self, pos: int, what: str) -> "Table":
        """The table at `pos`, its vtable checked."""
        self.need(pos, 4, what)
        vtable = pos - I32.unpack_from(self.data, pos)[0]
        self.need(vtable, 4, f"{what}'s vtable")
        vsize, tsize = U16.unpack_from(self.data, vtable)[0], U16.unpack_from(self.data, vtable + 2)[0]
        if vsize < 4 or vsize % 2:
            raise self.fail(f"{what}: vtable of {vsize} bytes")
        self.need(vtable, vsize, f"{what}'s vtable")
        self.need(pos, max(tsize, 4), what)
        return Table(self, pos, vtable, vsize, tsize, what)

    def root(self, what: str) -> "Table":
        return self.table(self.follow(0, what), what)

    def vector(self, pos: int, item: int, what: str, limit: int) -> tuple[int, int]:
        """(start of the elements, count) of the vector at `pos`, each element `item` bytes."""
        n = self.u32(pos)
        if n > limit:
            raise self.fail(f"{what}: {n:,} elements, more than {limit:,}")
        self.need(pos + 4, n * item, what)
        return pos + 4, n

    def string(self, pos: int, what: str, limit: int) -> str:
        start, n = self.vector(pos, 1, what, limit)
        try:
            return self.data[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None


class Table:
    """One table: fields by slot number (the order of the schema; a union takes two slots)."""

    __slots__ = ("buf", "pos", "vtable", "vsize", "tsize", "what")

    def __init__(self, buf: Buffer, pos: int, vtable: int, vsize: int, tsize: int, what: str) -> None:
        self.buf = buf
        self.pos = pos
        self.vtable = vtable
        self.vsize = vsize
        self.tsize = tsize
        self.what = what

    def field(self, slot: int, size: int) -> int | None:
        """Where field `slot` of `size` bytes lies, or None when absent (its default applies)."""
        entry = 4 + 2 * slot
        if entry + 2 > self.vsize:
            return None
        offset = U16.unpack_from(self.buf.data, self.vtable + entry)[0]
        if offset == 0:
            return None
        if offset + size > self.tsize:
            raise self.buf.fail(f"{self.what}: field {slot} lies outside its table")
        return int(self.pos) + int(offset)

    def required(self, slot: int, size: int, name: str) -> int:
        pos = self.field(slot, size)
        if pos is None:
            raise self.buf.fail(f"{self.what}: required field {name} is missing")
        return pos

    def u8(self, slot: int, default: int = 0) -> int:
        pos = self.field(slot, 1)
        return default if pos is None else self.buf.u8(pos)

    def u32(self, slot: int, default: int = 0) -> int:
        pos = self.field(slot, 4)
        return default if pos is None else self.buf.u32(pos)

    def u64(self, slot: int, default: int = 0) -> int:
        pos = self.field(slot, 8)
        return default if pos is None else self.buf.u64(pos)

    def struct(self, slot: int, size: int, name: str, required: bool = False) -> bytes | None:
        pos = self.required(slot, size, name) if required else self.field(slot, size)
        return None if pos is None else self.buf.data[pos:pos + size]

    def ref(self, slot: int, name: str, required: bool = False) -> int | None:
        """The target of offset field `slot` (a table, vector or string), or None when absent."""
        pos = self.required(slot, 4, name) if required else self.field(slot, 4)
        return None if pos is None else self.buf.follow(pos, f"{self.what}.{name}")

    def table(self, slot: int, name: str, required: bool = False) -> "Table | None":
        pos = self.ref(slot, name, required)
        return None if pos is None else self.buf.table(pos, f"{self.what}.{name}")

    def string(self, slot: int, name: str, limit: int, required: bool = False) -> str | None:
        pos = self.ref(slot, name, required)
        return None if pos is None else self.buf.string(pos, f"{self.what}.{name}", limit)

    def blob(self, slot: int, name: str, limit: int, required: bool = False) -> bytes | None:
        pos = self.ref(slot, name, required)
        if pos is None:
            return None
        start, n = self.buf.vector(pos, 1, f"{self.what}.{name}", limit)
        return self.buf.data[start:start + n]

    def tables(self, slot: int, name: str, limit: int, required: bool = False) -> tuple[int, int]:
        """(start, count) of a vector of tables (empty when absent); element i's offset is at start + 4 i."""
        pos = self.ref(slot, name, required)
        return (0, 0) if pos is None else self.buf.vector(pos, 4, f"{self.what}.{name}", limit)

    def structs(self, slot: int, size: int, name: str, limit: int, required: bool = False) -> list[bytes]:
        pos = self.ref(slot, name, required)
        if pos is None:
            return []
        start, n = self.buf.vector(pos, size, f"{self.what}.{name}", limit)
        return [self.buf.data[start + i * size:start + (i + 1) * size] for i in range(n)]


# -- snapshots ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ManifestRef:
    """A manifest holding chunk references of an array, for the chunk coordinates in `extents`
    (per dimension, `from` inclusive, `to` exclusive)."""

    id: bytes
    extents: tuple[tuple[int, int], ...]

    def covers(self, coords: Sequence[int]) -> bool:
        return len(coords) == len(self.extents) and all(lo <= c < hi for c, (lo, hi) in zip(coords, self.extents))


@dataclass(frozen=True, slots=True)
class ArrayData:
    # (array length, chunk length) per dimension; in spec version 2 the chunk length is back-computed from
    # the number of chunks (the Zarr metadata is what says it)
    shape: tuple[tuple[int, int], ...]
    dimension_names: tuple[str | None, ...]
    manifests: tuple[ManifestRef, ...]


@dataclass(frozen=True, slots=True)
class SnapshotNode:
    """A group or an array of a snapshot: `path` relative to the repository root ('' for the root),
    `zarr_json` its metadata as the writer stored it."""

    id: bytes
    path: str
    zarr_json: bytes
    array: ArrayData | None

    @property
    def is_array(self) -> bool:
        return self.array is not None


@dataclass(frozen=True, slots=True)
class ManifestFile:
    id: bytes
    size: int  # bytes of the manifest object
    chunk_refs: int


@dataclass(frozen=True)
class Snapshot:
    id: bytes
    parent: bytes | None
    flushed_at_us: int  # commit time, microseconds since the Unix epoch
    message: str
    metadata: dict[str, bytes]  # values as the writer encoded them (MessagePack)
    nodes: dict[str, SnapshotNode]  # by path
    manifest_files: tuple[ManifestFile, ...]
    skipped: tuple[str, ...]  # why nodes were left out (bad paths, duplicates), one line each
    nbytes: int  # what keeping it costs, about (for byte-bounded caches)

    @property
    def name(self) -> str:
        return encode_id(self.id)

    @property
    def time_ns(self) -> int:
        return self.flushed_at_us * 1000


def node_path_problem(path: str) -> str | None:
    """Why `path` (as stored: absolute, '/'-separated) cannot be a node of the tree we show, or None."""
    if not path.startswith("/"):
        return "is not absolute"
    if path == "/":
        return None
    for segment in path[1:].split("/"):
        problem = name_problem(segment)
        if problem is not None:
            return problem
    return None


def decode_snapshot(body: bytes, where: str, expected_id: bytes | None = None) -> Snapshot:
    """A snapshot from its decompressed FlatBuffers body. Nodes whose paths cannot be shown (`..`, NUL,
    empty segments, not absolute, duplicates, under an array) are left out and named in `skipped`."""
    buf = Buffer(body, where)
    root = buf.root("snapshot")
    raw_id = root.struct(0, ID_LEN, "id", required=True)
    assert raw_id is not None
    if expected_id is not None and raw_id != expected_id:
        raise buf.fail(f"holds snapshot {encode_id(raw_id)}, its name says {encode_id(expected_id)}")
    parent = root.struct(1, ID_LEN, "parent_id")
    flushed = root.u64(3)
    message = root.string(4, "message", len(body), required=True) or ""
    metadata: dict[str, bytes] = {}
    start, n = root.tables(5, "metadata", len(body) // 4, required=True)
    for i in range(n):
        item = buf.table(buf.follow(start + 4 * i, "metadata item"), "metadata item")
        key = item.string(0, "name", len(body), required=True) or ""
        metadata[key] = item.blob(1, "value", len(body), required=True) or b""
    files = []
    for raw in root.structs(6, 32, "manifest_files", len(body) // 32, required=True):
        files.append(ManifestFile(raw[:ID_LEN], U64.unpack_from(raw, 16)[0], U32.unpack_from(raw, 24)[0]))
    start, n = root.tables(7, "manifest_files_v2", len(body) // 4)  # spec version 2: tables
    for i in range(n):
        item = buf.table(buf.follow(start + 4 * i, "manifest file"), "manifest file")
        file_id = item.struct(0, ID_LEN, "id", required=True)
        assert file_id is not None
        files.append(ManifestFile(file_id, item.u64(1), item.u32(2)))
    nodes: dict[str, SnapshotNode] = {}
    skipped: list[str] = []
    start, n = root.tables(2, "nodes", MAX_NODES, required=True)
    for i in range(n):
        node = _node(buf, buf.follow(start + 4 * i, "node"))
        raw_path = node.path
        problem = node_path_problem(raw_path)
        path = raw_path[1:] if raw_path != "/" else ""
        if problem is None and path in nodes:
            problem = "appears twice"
        if problem is not None:
            skipped.append(f"node {raw_path[:200]!r} {problem}")
            continue
        nodes[path] = SnapshotNode(node.id, path, node.zarr_json, node.array)
    # A node below an array would collide with its chunk keys; Zarr allows none.
    for path in list(nodes):
        parent_path = path
        while parent_path:
            parent_path = parent_path.rpartition("/")[0]
            above = nodes.get(parent_path)
            if above is not None and above.is_array:
                skipped.append(f"node {'/' + path!r} lies inside array {'/' + parent_path!r}")
                del nodes[path]
                break
    size = len(body) + 600 * len(nodes)  # the decoded nodes, about
    return Snapshot(raw_id, parent, flushed, message, metadata, nodes, tuple(files), tuple(skipped), size)


def _node(buf: Buffer, pos: int) -> SnapshotNode:
    t = buf.table(pos, "node")
    node_id = t.struct(0, NODE_ID_LEN, "id", required=True)
    path = t.string(1, "path", MAX_PATH, required=True)
    user_data = t.blob(2, "user_data", len(buf.data), required=True)
    assert node_id is not None and path is not None and user_data is not None
    kind = t.u8(3)
    data = t.table(4, "node_data", required=True)
    assert data is not None
    if kind == NODE_GROUP:
        return SnapshotNode(node_id, path, user_data, None)
    if kind != NODE_ARRAY:
        raise buf.fail(f"node {path[:200]!r}: node data of type {kind} (1: array, 2: group)")
    shape = tuple((U64.unpack_from(raw, 0)[0], U64.unpack_from(raw, 8)[0])
                  for raw in data.structs(0, 16, "shape", MAX_DIMS, required=True))
    start, n = data.tables(3, "shape_v2", MAX_DIMS)  # spec version 2: length and number of chunks
    if n:
        if shape:
            raise buf.fail(f"array {path[:200]!r}: both shape and shape_v2")
        dims = []
        for i in range(n):
            item = buf.table(buf.follow(start + 4 * i, "dimension shape"), "dimension shape")
            length, chunks = item.u64(0), item.u32(1)
            dims.append((length, -(-length // chunks) if chunks else 0))  # (the chunk length, back-computed)
        shape = tuple(dims)
    names: list[str | None] = []
    start, n = data.tables(1, "dimension_names", MAX_DIMS)
    for i in range(n):
        item = buf.table(buf.follow(start + 4 * i, "dimension name"), "dimension name")
        names.append(item.string(0, "name", MAX_PATH))
    refs = []
    start, n = data.tables(2, "manifests", len(buf.data) // 4, required=True)
    for i in range(n):
        item = buf.table(buf.follow(start + 4 * i, "manifest ref"), "manifest ref")
        object_id = item.struct(0, ID_LEN, "object_id", required=True)
        assert object_id is not None
        extents = tuple((U32.unpack_from(raw, 0)[0], U32.unpack_from(raw, 4)[0])
                        for raw in item.structs(1, 8, "extents", MAX_DIMS, required=True))
        if len(extents) != len(shape):
            raise buf.fail(f"array {path[:200]!r}: a manifest ref of {len(extents)} extents for "
                           f"{len(shape)} dimensions")
        refs.append(ManifestRef(object_id, extents))
    return SnapshotNode(node_id, path, user_data, ArrayData(shape, tuple(names), tuple(refs)))


# -- manifests ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """Where one chunk's bytes are: `data` (inline), a native chunk object `chunk_id`, or a virtual
    reference to `location`; `offset` and `length` locate them inside the object."""

    index: tuple[int, ...]
    data: bytes | None = None
    chunk_id: bytes | None = None
    location: str | None = None
    offset: int = 0
    length: int = 0
    etag: str | None = None
    last_modified: int = 0  # seconds since the Unix epoch; 0: not recorded

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.length


class ChunkManifest:
    """A manifest's chunk references, read in place from its decompressed body."""

    def __init__(self, body: bytes, where: str, expected_id: bytes | None = None) -> None:
        self.buf = Buffer(body, where)
        root = self.buf.root("manifest")
        raw_id = root.struct(0, ID_LEN, "id", required=True)
        assert raw_id is not None
        if expected_id is not None and raw_id != expected_id:
            raise self.buf.fail(f"holds manifest {encode_id(raw_id)}, its name says {encode_id(expected_id)}")
        self.id = raw_id
        self.nbytes = len(body)
        # Spec version 2: virtual locations compressed with this zstd dictionary (algorithm 1), or stored
        # as they are (0).
        self._dictionary_bytes = root.blob(2, "location_dictionary", len(body))
        self._compression = root.u8(3, 1)
        self._dictionary: Any = None  # (a zstandard.ZstdCompressionDict, made on first use)
        # node id -> (start, count) of its references
        self.arrays: dict[bytes, tuple[int, int]] = {}
        start, n = root.tables(1, "arrays", len(body) // 4, required=True)
        for i in range(n):
            t = self.buf.table(self.buf.follow(start + 4 * i, "array manifest"), "array manifest")
            node_id = t.struct(0, NODE_ID_LEN, "node_id", required=True)
            assert node_id is not None
            self.arrays[node_id] = t.tables(1, "refs", len(body) // 4, required=True)

    def _index(self, start: int, i: int) -> tuple[int, ...]:
        t = self.buf.table(self.buf.follow(start + 4 * i, "chunk ref"), "chunk ref")
        pos = t.ref(0, "index", required=True)
        assert pos is not None
        first, n = self.buf.vector(pos, 4, "chunk ref index", MAX_DIMS)
        return struct.unpack_from(f"<{n}I", self.buf.data, first)

    def _ref(self, start: int, i: int) -> ChunkRef:
        buf = self.buf
        t = buf.table(buf.follow(start + 4 * i, "chunk ref"), "chunk ref")
        pos = t.ref(0, "index", required=True)
        assert pos is not None
        first, n = buf.vector(pos, 4, "chunk ref index", MAX_DIMS)
        index = struct.unpack_from(f"<{n}I", buf.data, first)
        inline = t.blob(1, "inline", len(buf.data))
        if inline is not None:
            return ChunkRef(index, data=inline)
        offset, length = t.u64(2), t.u64(3)
        chunk_id = t.struct(4, ID_LEN, "chunk_id")
        if chunk_id is not None:
            return ChunkRef(index, chunk_id=chunk_id, offset=offset, length=length)
        location = t.string(5, "location", MAX_PATH * 4)
        if location is None:
            packed = t.blob(8, "compressed_location", MAX_PATH * 4)
            if packed is not None:
                location = self._location(packed, index)
        if location is None:
            raise buf.fail(f"chunk {index}: neither inline data, a chunk id nor a location")
        return ChunkRef(index, location=location, offset=offset, length=length,
                        etag=t.string(6, "checksum_etag", MAX_PATH), last_modified=t.u32(7))

    def _location(self, packed: bytes, index: tuple[int, ...]) -> str:
        """A virtual reference's compressed location (spec version 2), decompressed with the manifest's
        dictionary, bounded like a stored one (a declared content size is not trusted)."""
        where = f"{self.buf.where}: chunk {index}: compressed location"
        if self._compression == 0:
            raw = packed
        elif self._compression == 1:
            if self._dictionary is None:
                if not self._dictionary_bytes:
                    raise DataError(where, "no location dictionary in the manifest")
                import zstandard

                self._dictionary = zstandard.ZstdCompressionDict(self._dictionary_bytes)
            raw = unzstd(packed, MAX_PATH * 4, where, self._dictionary)
        else:
            raise DataError(where, f"compression {self._compression} is not known (0: none, 1: zstd)")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(where, "not UTF-8") from None

    def _bisect(self, start: int, count: int, key: tuple[int, ...]) -> int:
        """The first position whose index is not below `key` (the references are sorted)."""
        lo, hi = 0, count
        while lo < hi:
            mid = (lo + hi) // 2
            if self._index(start, mid) < key:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def find(self, node_id: bytes, coords: tuple[int, ...]) -> ChunkRef | None:
        """The reference of chunk `coords` of array `node_id`, or None when this manifest has none."""
        start, count = self.arrays.get(node_id, (0, 0))
        i = self._bisect(start, count, coords)
        if i < count and self._index(start, i) == coords:
            return self._ref(start, i)
        return None

    def refs_from(self, node_id: bytes, key: tuple[int, ...]) -> Iterator[ChunkRef]:
        """References of array `node_id` from coordinates `key` on, in order."""
        start, count = self.arrays.get(node_id, (0, 0))
        for i in range(self._bisect(start, count, key), count):
            yield self._ref(start, i)

    def count(self, node_id: bytes) -> int:
        return self.arrays.get(node_id, (0, 0))[1]


# -- refs and the configuration --------------------------------------------------------


def decode_ref(data: bytes, where: str) -> bytes:
    """The snapshot id a branch or tag file names."""
    if len(data) > MAX_REF_JSON:
        raise DataError(where, f"ref file of {len(data):,} bytes (a ref names one snapshot)")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(where, f"not JSON: {e}") from None
    text = doc.get("snapshot") if isinstance(doc, dict) else None
    raw = decode_id(text) if isinstance(text, str) else None
    if raw is None:
        raise DataError(where, 'not {"snapshot": "<snapshot id>"}')
    return raw


@dataclass(frozen=True)
class VirtualContainer:
    """A virtual chunk container the repository's configuration declares (where its virtual
    references may point, by the writer's account)."""

    name: str
    url_prefix: str


@dataclass(frozen=True)
class RepoConfig:
    inline_chunk_threshold_bytes: int | None
    containers: tuple[VirtualContainer, ...]


def decode_config(text: str, where: str) -> RepoConfig:
    """The parts of `config.yaml` a reader uses. It is YAML written by the writer's serializer: a mapping of
    plain settings (a container's object store is tagged with its kind, `!s3`, `!local_file_system`: read
    as the plain value it tags); anything not a mapping is damage. Safe loading only: no tag constructs
    an object."""
    import yaml  # a runtime dependency of the icechunk layer only

    class Loader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no type information here
        pass

    def untagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> object:
        if isinstance(node, yaml.MappingNode):
            return loader.construct_mapping(node)
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node)
        return loader.construct_scalar(node)

    Loader.add_multi_constructor("!", untagged)
    try:
        doc = yaml.load(text, Loader=Loader) if text.strip() else {}  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        raise DataError(where, f"not YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise DataError(where, "not a mapping of settings")
    threshold = doc.get("inline_chunk_threshold_bytes")
    if threshold is not None and (not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0):
        raise DataError(where, "inline_chunk_threshold_bytes is not a count of bytes")
    containers: list[VirtualContainer] = []
    raw = doc.get("virtual_chunk_containers") or {}
    if not isinstance(raw, dict):
        raise DataError(where, "virtual_chunk_containers is not a mapping")
    for key, value in raw.items():
        prefix = value.get("url_prefix") if isinstance(value, dict) else None
        if not isinstance(prefix, str):
            raise DataError(where, f"virtual chunk container {str(key)[:100]!r} has no url_prefix")
        containers.append(VirtualContainer(str(value.get("name") or key), prefix))
    return RepoConfig(threshold, tuple(containers))
