"""OCDBT databases for the tests: written by TensorStore (the reference), or crafted byte by byte
(hostile ones) with a small encoder of the on-disk format."""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import crc32c
import numpy as np
import zstandard

ZARR_SHAPE = (64, 64, 32)


def _ts():  # imported late: collecting the tests must not need TensorStore
    import tensorstore as ts

    return ts


# Small nodes and a narrow version tree: B+trees and version trees several levels deep.
DEEP = {"max_decoded_node_bytes": 400, "max_inline_value_bytes": 64, "version_tree_arity_log2": 1}


def write_zarr(root: Path, config: dict | None = None) -> None:
    """A Zarr v3 group holding a sharded array `arr/` in an OCDBT database at `root`, written in four commits and more
    generations (each shard written is one): every version differs from the one before. `config`: the
    database's (`DEEP`, a `manifest_kind`...)."""
    ts = _ts()
    kv = {"driver": "ocdbt", "base": f"file://{root}/", **({"config": config} if config else {})}
    spec = {"driver": "zarr3", "kvstore": {**kv, "path": "arr/"},
            "metadata": {"shape": list(ZARR_SHAPE), "data_type": "uint16",
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [32, 32, 32]}},
                         "codecs": [{"name": "sharding_indexed", "configuration": {
                             "chunk_shape": [16, 16, 16],
                             "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                        {"name": "zstd", "configuration": {"level": 1}}],
                             "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                              {"name": "crc32c"}]}}]}}
    store = ts.KvStore.open(kv).result()
    store.write("zarr.json", b'{"zarr_format": 3, "node_type": "group", "attributes": {}}').result()
    array = ts.open(spec, create=True).result()
    base = np.arange(np.prod(ZARR_SHAPE), dtype=np.uint16).reshape(ZARR_SHAPE)
    for step in range(3):
        txn = ts.Transaction()
        region = np.s_[step * 16:step * 16 + 24, :40]
        array.with_transaction(txn)[region].write((base * (step + 1))[region]).result()
        txn.commit_sync()
    # a plain key beside the array, and one large enough to be stored out of line
    store.write("notes/readme.txt", b"written beside the array\n").result()
    store.write("notes/blob.bin", bytes(range(256)) * 40).result()
    txn = ts.Transaction()
    for i in range(120):
        store.with_transaction(txn).write(f"notes/many/{i:04d}-{'x' * (i % 7)}", b"n%d" % i * (i % 30)).result()
    txn.commit_sync()


def write_one_chunk(root: Path) -> bytes:
    """A Zarr v3 group in an OCDBT database at `root` whose array `arr` is one raw 1 MiB chunk (256 pages,
    one value of a data file); that chunk's bytes."""
    ts = _ts()
    kv = {"driver": "ocdbt", "base": f"file://{root}/"}
    ts.KvStore.open(kv).result().write("zarr.json", b'{"zarr_format": 3, "node_type": "group"}').result()
    array = ts.open({"driver": "zarr3", "kvstore": {**kv, "path": "arr/"},
                     "metadata": {"shape": [1024, 1024], "data_type": "uint8",
                                  "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1024, 1024]}},
                                  "codecs": [{"name": "bytes"}]}}, create=True).result()
    chunk = np.random.default_rng(3).integers(0, 256, size=(1024, 1024), dtype=np.uint8)
    array.write(chunk).result()
    return chunk.tobytes()


def write_precomputed(root: Path) -> None:
    """A sharded Neuroglancer precomputed volume in an OCDBT database at `root`, in two commits."""
    ts = _ts()
    kv = {"driver": "ocdbt", "base": f"file://{root}/"}
    spec = {"driver": "neuroglancer_precomputed", "kvstore": kv,
            "multiscale_metadata": {"type": "image", "data_type": "uint8", "num_channels": 1},
            "scale_metadata": {"resolution": [4, 4, 40], "encoding": "raw", "chunk_size": [16, 16, 8],
                               "size": [64, 48, 16], "voxel_offset": [0, 0, 0],
                               "sharding": {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 1,
                                            "hash": "identity", "minishard_bits": 1, "shard_bits": 1,
                                            "minishard_index_encoding": "gzip", "data_encoding": "raw"}}}
    volume = ts.open(spec, create=True).result()
    rng = np.random.default_rng(7)
    data = rng.integers(0, 255, size=(64, 48, 16, 1), dtype=np.uint8)
    volume[:32].write(data[:32]).result()
    volume[32:].write(data[32:]).result()
    volume[8:40, 8:24, 0:8].write(data[8:40, 8:24, 0:8] // 2).result()


def written(tmp_path_factory, name: str, write: Callable[..., None], *args: object) -> Path:
    """A database directory `name` in a fresh temporary directory, filled by `write(root, *args)`."""
    root = tmp_path_factory.mktemp("ocdbt") / name
    root.mkdir()
    write(root, *args)
    return root


def ts_versions(root: Path) -> list[int]:
    """The generation numbers TensorStore reads at `root` (consecutive from 1 to the newest)."""
    ts = _ts()
    found: list[int] = []
    while True:
        n = len(found) + 1
        try:
            ts.KvStore.open({"driver": "ocdbt", "base": f"file://{root}/", "version": n}).result().list().result()
        except Exception:  # NOT_FOUND past the newest
            return found
        found.append(n)


def ts_keys(base: str, version: int | str | None = None) -> dict[str, bytes]:
    """Every key of the database at URL `base` (a version, or the newest) and its value, as TensorStore reads
    them."""
    ts = _ts()
    spec: dict = {"driver": "ocdbt", "base": base}
    if version is not None:
        spec["version"] = version
    store = ts.KvStore.open(spec).result()
    return {key.decode(): store.read(key).result().value for key in store.list().result()}


def ts_zarr(base: str, version: int | None = None) -> np.ndarray:
    ts = _ts()
    kv: dict = {"driver": "ocdbt", "base": base, "path": "arr/"}
    if version is not None:
        kv["version"] = version
    return ts.open({"driver": "zarr3", "kvstore": kv}, read=True).result().read().result()


# -- crafting ---------------------------------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def varints(values: list[int]) -> bytes:
    return b"".join(varint(v) for v in values)


def frame(magic: int, body: bytes, zstd: bool = False, bad_crc: bool = False) -> bytes:
    payload = varint(0) + (varint(1) + zstandard.ZstdCompressor().compress(body) if zstd else varint(0) + body)
    head = magic.to_bytes(4, "big") + struct.pack("<Q", 12 + len(payload) + 4)
    crc = crc32c.crc32c(head + payload) ^ (1 if bad_crc else 0)
    return head + payload + struct.pack("<I", crc)


def config(kind: int = 0, arity_log2: int = 4, node_bytes: int = 1 << 20) -> bytes:
    return bytes(16) + bytes([kind]) + varint(100) + varint(node_bytes) + bytes([arity_log2]) + varint(0)


def file_table(paths: list[str]) -> bytes:
    """A data file table without prefix compression (every path whole, base paths empty)."""
    raw = [p.encode() for p in paths]
    return varint(len(raw)) + varints([0] * max(len(raw) - 1, 0)) + varints([len(p) for p in raw]) + \
        varints([0] * len(raw)) + b"".join(raw)


@dataclass
class Ref:
    """A reference to bytes of a data file (index into the table the structure carries)."""

    file: int
    offset: int
    length: int


def manifest(root: Ref | None, files: list[str], root_height: int = 0, generation: int = 1,
             time_ns: int = 1_700_000_000_000_000_000) -> bytes:
    if root is None:
        ref = varint(0) + varint((1 << 64) - 1) + varint((1 << 64) - 1)
    else:
        ref = varint(root.file) + varint(root.offset) + varint(root.length)
    body = (config() + file_table(files) + varint(1) + varint(generation) + bytes([root_height]) + ref +
            varints([1, 1, 0]) + struct.pack("<Q", time_ns) + varint(0))
    return frame(0x0CDB3A2A, body)


def leaf(files: list[str], entries: list[tuple[bytes, bytes | Ref]], zstd: bool = False) -> bytes:
    """A leaf node: keys stored whole (no prefix sharing), values inline (bytes) or out of line (Ref)."""
    n = len(entries)
    keys = [k for k, _ in entries]
    body = bytes([0]) + file_table(files) + varint(n) + varints([0] * (n - 1)) + varints([len(k) for k in keys])
    body += b"".join(keys)
    body += varints([len(v) if isinstance(v, bytes) else v.length for _, v in entries])
    body += bytes(0 if isinstance(v, bytes) else 1 for _, v in entries)
    refs = [v for _, v in entries if isinstance(v, Ref)]
    body += varints([r.file for r in refs]) + varints([r.offset for r in refs])
    body += b"".join(v for _, v in entries if isinstance(v, bytes))
    return frame(0x0CDB20DE, body, zstd)


def interior(files: list[str], height: int, children: list[tuple[bytes, Ref]]) -> bytes:
    n = len(children)
    keys = [k for k, _ in children]
    body = bytes([height]) + file_table(files) + varint(n) + varints([0] * (n - 1)) + \
        varints([len(k) for k in keys]) + varints([0] * n) + b"".join(keys)
    body += varints([r.file for _, r in children]) + varints([r.offset for _, r in children]) + \
        varints([r.length for _, r in children]) + varints([1] * n) + varints([1] * n) + varints([0] * n)
    return frame(0x0CDB20DE, body)


@dataclass
class Crafted:
    """A database built in a directory: data files appended to, then a manifest naming a root."""

    root: Path
    files: dict[str, bytearray] = field(default_factory=dict)

    def put(self, name: str, data: bytes) -> Ref:
        blob = self.files.setdefault(name, bytearray())
        ref = Ref(0, len(blob), len(data))
        blob += data
        return ref

    def save(self, root_ref: Ref | None, root_height: int = 0, manifest_bytes: bytes | None = None,
             data_file: str = "d/data") -> None:
        (self.root / "d").mkdir(parents=True, exist_ok=True)
        for name, blob in self.files.items():
            (self.root / name).write_bytes(bytes(blob))
        (self.root / "manifest.ocdbt").write_bytes(
            manifest_bytes if manifest_bytes is not None else manifest(root_ref, [data_file], root_height))


def simple(root: Path, entries: list[tuple[bytes, bytes | Ref]], data_file: str = "d/data") -> Crafted:
    """A database of one leaf (and whatever out-of-line values `entries` reference in `data_file`)."""
    db = Crafted(root)
    ref = db.put(data_file, leaf([data_file], entries))
    db.save(ref, data_file=data_file)
    return db


def leaf_holding(root: Path, key: bytes):
    """(data file, offset, length) of the B+tree leaf of the newest version of the database at `root`
    that holds `key`, and the key's value there (a `format.Value`), found with the format's decoders."""
    from unshardfs.sources.ocdbt.format import decode_btree_node, decode_manifest

    version = decode_manifest((root / "manifest.ocdbt").read_bytes(), "manifest", 1 << 26).latest
    location, height, prefix = version.root, version.root_height, b""
    while True:
        assert location is not None
        with open(root / location.file.path, "rb") as f:
            f.seek(location.offset)
            node = decode_btree_node(f.read(location.length), "node", 1 << 26, location.file.transitive, 1 << 26)
        if height == 0:
            i = bisect.bisect_left(node.keys, key[len(prefix):])
            assert node.keys[i] == key[len(prefix):]
            value = node.value(i)
            return (root / location.file.path, location.offset, location.length), value
        chosen = node.child(max(0, bisect.bisect_right(node.keys, key[len(prefix):]) - 1))
        location, height, prefix = chosen.location, height - 1, prefix + chosen.key[:chosen.common]
