"""Kerchunk references to a virtual tree: every file as a byte range of the stored object it is, so
that fsspec's `reference` filesystem (and zarr, xarray through it) reads the unsharded view straight
from the original shards, with no unshardfs at read time.

A writer over the node API, knowing no format: a file whose bytes are one range of one stored object
(`StoredBytes`) whose store has a URL (`StoredAt`) becomes `[url, offset, length]`; in-memory metadata
(`BytesFile`) and files smaller than the inline threshold are written in; any other file is refused
with one line naming its directory and the reason, and nothing is written.

Two layouts, as fsspec reads them:
- JSON, reference spec version 1: `{"version": 1, "refs": {key: "text" | "base64:..." | [url, offset,
  length]}}`, streamed (a million references never in memory);
- kerchunk's parquet layout (Zarr v2 only, `.`-separated chunk keys): a directory with `.zmetadata`
  (`{"metadata": {...}, "record_size": N}`, which is also zarr's consolidated metadata) and, per
  array, `ARRAY/refs.K.parq` holding chunks K*N .. (K+1)*N-1 in C order, columns path, offset, size,
  raw (a missing chunk: path and raw null).

Both record, under the key `unshardfs` (which fsspec ignores), every referenced object's version
(ETag or generation and size remote; device, inode, size, mtime and ctime local), for
`unshardfs check --refs` to tell which references a changed object invalidated.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import secrets
import shutil
import tempfile
from contextlib import aclosing
from dataclasses import dataclass
from typing import IO, Any, AsyncGenerator, Awaitable, Callable, Literal

import numpy as np

from unshardfs.sources.base import ByteSource, UrlLocation, Version, stored_at
from unshardfs.sources.base import name_problem
from unshardfs.tree.nodes import BytesFile, Closable, DirNode, FileNode, StoredBytes, StoredRange
from unshardfs.util.concurrency import gather
from unshardfs.util.errors import ConfigError, DataError
from unshardfs.util.logonce import collect_problems, log_once

Layout = Literal["json", "parquet"]
RECORD = "unshardfs"  # the key of our own record in a reference file (fsspec ignores it)
INLINE_BATCH = 64  # small files read at once (the read path coalesces them)
TEMP_MARK = ".unshardfs-tmp-"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefsOptions:
    """How `write_refs` writes references."""

    layout: Layout = "json"
    # Files smaller than this many bytes are written into the references rather than referenced,
    # as kerchunk's `inline_threshold` (0: only metadata is written in).
    inline_threshold: int = 500
    # Parquet: references per file (kerchunk's `record_size`).
    record_size: int = 10_000
    # What to record about the SOURCE (shown by `check --refs`; never used to read).
    source: str = ""


class Refused(ConfigError):
    """A file that cannot be a reference: one line naming its directory and the reason."""


@dataclass
class RefsSummary:
    files: int = 0
    references: int = 0
    inlined: int = 0
    inlined_bytes: int = 0
    objects: int = 0


def version_json(version: Version) -> list[Any]:
    """A version as JSON values (what `check --refs` compares): ints and strings kept, anything else as text."""
    return [v if isinstance(v, (int, str)) and not isinstance(v, bool) else str(v) for v in version]


def inline_text(data: bytes) -> str:
    """How fsspec's reference filesystem takes bytes in a JSON reference: UTF-8 text as it is (it
    encodes a string as UTF-8), anything else (or text that starts as an encoded value would) as
    `base64:...`."""
    if not data.startswith(b"base64:"):
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            pass
    return "base64:" + base64.b64encode(data).decode("ascii")


class Objects:
    """The stored objects referenced so far, by URL, with where they are and their version."""

    def __init__(self) -> None:
        self.by_url: dict[str, UrlLocation] = {}
        self.inlined: dict[str, int] = {}  # by URL: files written in from that object (stale with it)
        self._located: dict[tuple[int, str, Version], UrlLocation | None] = {}
        self._sources: dict[int, ByteSource] = {}  # kept alive while their ids are keys

    async def locate(self, stored: StoredRange) -> UrlLocation | None:
        key = (id(stored.source), stored.path, stored.version)
        if key not in self._located:
            self._sources[id(stored.source)] = stored.source
            found = await stored_at(stored.source, stored.path, stored.version)
            self._located[key] = found
            if found is not None:
                self.by_url.setdefault(found.url, found)
        return self._located[key]

    def record(self, options: RefsOptions) -> dict[str, Any]:
        return {"refs": 1, "source": options.source,
                "objects": {url: {"root": loc.root, "path": loc.path, "version": version_json(loc.version),
                                  "inlined": self.inlined.get(url, 0)}
                            for url, loc in sorted(self.by_url.items())}}


async def references(root: DirNode, options: RefsOptions, objects: Objects,
                     progress: Callable[[int], None] | None = None
                     ) -> AsyncGenerator[tuple[str, str, bytes | list[Any]], None]:
    """(key, kind, value) for every file of the tree in listing order: kind "inline" with the bytes, or
    "ref" with [url, offset, length]. `Refused` at the first file that can be neither."""
    pending: list[tuple[str, FileNode]] = []

    async def inline_all() -> list[tuple[str, str, bytes | list[Any]]]:
        def reader(key: str, node: FileNode) -> Callable[[], Awaitable[tuple[str, str, bytes | list[Any]]]]:
            async def read() -> tuple[str, str, bytes | list[Any]]:
                return key, "inline", await whole(node, key)
            return read

        out = await gather([reader(key, node) for key, node in pending], INLINE_BATCH)
        pending.clear()
        return out

    async with aclosing(files(root)) as entries:
        async for key, node in entries:
            if progress is not None:
                progress(1)
            if isinstance(node, BytesFile):
                yield key, "inline", node.data
                continue
            if not isinstance(node, StoredBytes):
                raise Refused(f"{parent(key)}: {key.rsplit('/', 1)[-1]}'s bytes are computed by unshardfs, not "
                              "stored as one byte range")
            stored = node.stored_range()
            if isinstance(stored, str):
                raise Refused(f"{parent(key)}: {stored}")
            location = await objects.locate(stored)
            if location is None:
                raise Refused(f"{parent(key)}: its files are stored where no reader can fetch them by URL "
                              f"({stored.source.description}: a compressed zip member or a versioned store's value)")
            if node.size < options.inline_threshold:
                objects.inlined[location.url] = objects.inlined.get(location.url, 0) + 1
                pending.append((key, node))
                if len(pending) >= INLINE_BATCH:
                    for item in await inline_all():
                        yield item
                continue
            yield key, "ref", [location.url, location.offset + stored.offset, stored.length]
    for item in await inline_all():
        yield item


async def files(root: DirNode) -> AsyncGenerator[tuple[str, FileNode], None]:
    """(path, node) of every file below `root`, depth first in listing order; one listing open at a
    time (closed when the walk is abandoned), names that could not be a path left out and logged."""
    stack: list[tuple[str, DirNode]] = [("", root)]
    while stack:
        prefix, directory = stack.pop()
        below: list[tuple[str, DirNode]] = []
        listing = directory.entries()
        try:
            async for batch in listing:
                for name, node in batch:
                    problem = name_problem(name)
                    if problem is not None:  # no tree should show one; references must not trust that
                        log_once(log, f"refs:{prefix}:{problem}", "%s: skipping %s", prefix or ".", problem)
                    elif isinstance(node, DirNode):
                        below.append((f"{prefix}{name}/", node))
                    elif isinstance(node, FileNode):
                        try:
                            yield f"{prefix}{name}", node
                        except GeneratorExit:
                            # Abandoned (a refusal): the listing is run to its end rather than left half
                            # done, so the generators a format nests in it finish instead of being collected.
                            async for _ in listing:
                                pass
                            raise
        finally:
            if isinstance(listing, Closable):
                await listing.aclose()
        stack.extend(reversed(below))


def parent(key: str) -> str:
    return key.rsplit("/", 1)[0] if "/" in key else "."


async def whole(node: FileNode, where: str) -> bytes:
    out = bytearray()
    while len(out) < node.size:
        data = await node.read(len(out), node.size - len(out))
        if not data:
            raise DataError(where, f"short read at {len(out)} of {node.size}")
        out += data
    return bytes(out)


# -- output -------------------------------------------------------------------------------------

def temp_beside(path: str) -> str:
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}{TEMP_MARK}{secrets.token_hex(6)}")


def replace_atomically(temp: str, path: str) -> None:
    """`temp` (a file or a directory, complete) under the name `path`, replacing what was there."""
    if os.path.isdir(temp) and os.path.isdir(path) and not os.path.islink(path):
        old = temp_beside(path)
        os.rename(path, old)
        os.rename(temp, path)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.replace(temp, path)


async def write_refs(root: DirNode, out: str, options: RefsOptions,
                     progress: Callable[[int], None] | None = None) -> RefsSummary:
    """References to every file of the tree written to `out` (a file for JSON, a directory for
    parquet), complete under that name or not at all. `Refused` (nothing written) when a file
    cannot be referenced; DataError when the tree cannot be read."""
    objects = Objects()
    summary = RefsSummary()
    temp = temp_beside(out)
    try:
        with collect_problems() as problems:  # a shard skipped by a listing: its files would be missing
            await _write(root, temp, options, objects, summary, progress)
        if problems:
            more = f" (and {len(problems) - 1:,} more)" if len(problems) > 1 else ""
            raise Refused(f"the tree could not be read whole, so references would leave files out: "
                          f"{problems[0]}{more}")
        if not summary.files:
            raise Refused("the tree shows no file to reference (a plain HTTP server cannot list: a Zarr group "
                          "without consolidated metadata shows nothing there; name an array, or read a listable store)")
        replace_atomically(temp, out)
    except BaseException:
        if os.path.isdir(temp):
            shutil.rmtree(temp, ignore_errors=True)
        elif os.path.exists(temp):
            os.unlink(temp)
        raise
    summary.objects = len(objects.by_url)
    return summary


async def _write(root: DirNode, temp: str, options: RefsOptions, objects: Objects, summary: RefsSummary,
                 progress: Callable[[int], None] | None) -> None:
    if options.layout == "json":
        with open(temp, "w", encoding="utf-8") as f:
            await _write_json(root, f, options, objects, summary, progress)
            f.flush()
            os.fsync(f.fileno())
    else:
        os.mkdir(temp)
        await _write_parquet(root, temp, options, objects, summary, progress)


async def _write_json(root: DirNode, f: IO[str], options: RefsOptions, objects: Objects, summary: RefsSummary,
                      progress: Callable[[int], None] | None) -> None:
    f.write('{"version": 1, "refs": {')
    first = True
    async with aclosing(references(root, options, objects, progress)) as refs:
        async for key, kind, value in refs:
            summary.files += 1
            if kind == "inline":
                assert isinstance(value, bytes)
                summary.inlined += 1
                summary.inlined_bytes += len(value)
                text = json.dumps(inline_text(value), ensure_ascii=False)
            else:
                summary.references += 1
                text = json.dumps(value, ensure_ascii=False)
            f.write(("\n" if first else ",\n") + json.dumps(key, ensure_ascii=False) + ": " + text)
            first = False
    f.write("\n},\n" + json.dumps(RECORD) + ": " + json.dumps(objects.record(options), ensure_ascii=False) + "}\n")


# -- parquet --------------------------------------------------------------------------------------

@dataclass
class _Field:
    """One array's chunks, spilled to disk in chunk order until its records are written."""

    shape: list[int]
    chunks: list[int]
    count: int
    folder: str
    url: np.memmap  # index into `urls`, -1: none
    offset: np.memmap
    size: np.memmap
    raw_at: np.memmap  # offset into the raw spill file, -1: none
    raw_len: np.memmap
    raw: IO[bytes]  # the bytes of inlined chunks, one after another
    grid: list[int]


class _Parquet:
    def __init__(self, out: str, options: RefsOptions) -> None:
        self.out = out
        self.options = options
        self.metadata: dict[str, Any] = {}
        self.fields: dict[str, _Field] = {}
        self.urls: dict[str, int] = {}
        self.spill = tempfile.TemporaryDirectory(prefix="unshardfs-refs-")

    def close(self) -> None:
        for f in self.fields.values():
            for array in (f.url, f.offset, f.size, f.raw_at, f.raw_len):
                array._mmap.close()  # type: ignore[attr-defined]  # released now, not at garbage collection
            f.raw.close()
        self.spill.cleanup()

    def field_of(self, name: str, zarray: dict[str, Any]) -> _Field:
        found = self.fields.get(name)
        if found is not None:
            return found
        shape, chunks = zarray.get("shape"), zarray.get("chunks")
        if (not isinstance(shape, list) or not isinstance(chunks, list) or len(shape) != len(chunks)
                or not all(isinstance(v, int) and v >= 0 for v in shape)
                or not all(isinstance(v, int) and v > 0 for v in chunks)):
            raise Refused(f"{name}: its .zarray has no usable shape and chunks")
        grid = [math.ceil(s / c) for s, c in zip(shape, chunks)] or [1]
        count = math.prod(grid)
        folder = os.path.join(self.spill.name, str(len(self.fields)))
        os.mkdir(folder)

        def spill(kind: str, dtype: str, fill: int) -> np.memmap:
            array = np.memmap(os.path.join(folder, kind), dtype=dtype, mode="w+", shape=(max(1, count),))
            if fill:
                array[:] = fill
            return array

        made = _Field(shape, chunks, count, folder, spill("url", "int32", -1), spill("offset", "int64", 0),
                      spill("size", "int64", 0), spill("raw_at", "int64", -1), spill("raw_len", "int64", 0),
                      open(os.path.join(folder, "raw"), "w+b"), grid)
        self.fields[name] = made
        return made

    def chunk_number(self, f: _Field, name: str, key: str) -> int:
        if not f.shape:
            index = [0] if name == "0" else None
        else:
            try:
                index = [int(part) for part in name.split(".")] if all(
                    part.isdigit() for part in name.split(".")) else None
            except ValueError:
                index = None
        if index is None or len(index) != len(f.grid) or any(not 0 <= i < n for i, n in zip(index, f.grid)):
            raise Refused(f"{parent(key)}: {name!r} is not a '.'-separated chunk key of the array, which is all "
                          "kerchunk's parquet layout can hold (write JSON for other files)")
        number = 0
        for i, n in zip(index, f.grid):
            number = number * n + i
        return number

    def url_id(self, url: str) -> int:
        found = self.urls.get(url)
        if found is None:
            found = self.urls[url] = len(self.urls)
        return found

    def write_records(self, name: str, f: _Field) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        urls = np.array(list(self.urls), dtype=object)
        os.makedirs(os.path.join(self.out, name), exist_ok=True)
        size = self.options.record_size
        f.raw.flush()
        for record in range(math.ceil(f.count / size) if f.count else 0):
            lo, hi = record * size, min(f.count, (record + 1) * size)
            ids = np.asarray(f.url[lo:hi])
            has_url = ids >= 0
            paths = pa.array(np.where(has_url, urls[np.maximum(ids, 0)] if len(urls) else None, None), type=pa.string())
            raw_at, raw_len = np.asarray(f.raw_at[lo:hi]), np.asarray(f.raw_len[lo:hi])
            raws: list[bytes | None] = []
            for at, length in zip(raw_at.tolist(), raw_len.tolist()):
                if at < 0:
                    raws.append(None)
                    continue
                f.raw.seek(at)
                raws.append(f.raw.read(length))
            # offset and size required (never null): a reader of optional int64 columns (fastparquet,
            # fsspec's default engine) gets floats, which no file can seek to.
            schema = pa.schema([pa.field("path", pa.string()), pa.field("offset", pa.int64(), nullable=False),
                                pa.field("size", pa.int64(), nullable=False), pa.field("raw", pa.binary())])
            table = pa.table([paths, pa.array(np.asarray(f.offset[lo:hi]), type=pa.int64()),
                              pa.array(np.asarray(f.size[lo:hi]), type=pa.int64()), pa.array(raws, type=pa.binary())],
                             schema=schema)
            # With statistics: without them fastparquet takes even a required int64 column for a nullable one.
            pq.write_table(table, os.path.join(self.out, name, f"refs.{record}.parq"), compression="zstd",
                           data_page_version="1.0")


async def _write_parquet(root: DirNode, out: str, options: RefsOptions, objects: Objects, summary: RefsSummary,
                         progress: Callable[[int], None] | None) -> None:
    writer = _Parquet(out, options)
    try:
        async with aclosing(references(root, options, objects, progress)) as refs:
            async for key, kind, value in refs:
                summary.files += 1
                name = key.rsplit("/", 1)[-1]
                folder = parent(key)
                if key == ".zmetadata":
                    continue  # the tree's consolidated metadata: the layout's own `.zmetadata` replaces it
                if name.startswith(".z"):
                    if not isinstance(value, bytes):
                        raise Refused(f"{folder}: {name} is not small metadata")
                    try:
                        writer.metadata[key] = json.loads(value)
                    except ValueError:
                        raise Refused(f"{folder}: {name} is not JSON") from None
                    summary.inlined += 1
                    continue
                if folder == "." or f"{folder}/.zarray" not in writer.metadata:
                    zarray = await _zarray(root, folder)
                    if zarray is None:
                        raise Refused(f"{folder}: {name} is not in a Zarr v2 array's directory, and kerchunk's parquet "
                                      "layout holds only Zarr v2 metadata and '.'-separated chunk keys (--view zarr2 of "
                                      "arrays with '.' keys; otherwise write JSON)")
                    writer.metadata[f"{folder}/.zarray"] = zarray
                f = writer.field_of(folder, writer.metadata[f"{folder}/.zarray"])
                number = writer.chunk_number(f, name, key)
                if kind == "inline":
                    assert isinstance(value, bytes)
                    f.raw.seek(0, os.SEEK_END)
                    f.raw_at[number] = f.raw.tell()
                    f.raw_len[number] = len(value)
                    f.raw.write(value)
                    summary.inlined += 1
                    summary.inlined_bytes += len(value)
                else:
                    assert isinstance(value, list)
                    f.url[number] = writer.url_id(value[0])
                    f.offset[number], f.size[number] = value[1], value[2]
                    summary.references += 1
        for name, f in writer.fields.items():
            writer.write_records(name, f)
        meta = {"metadata": writer.metadata, "record_size": options.record_size, "zarr_consolidated_format": 1,
                RECORD: objects.record(options)}
        with open(os.path.join(out, ".zmetadata"), "w", encoding="utf-8") as fh:
            json.dump(meta, fh)
    finally:
        writer.close()


async def _zarray(root: DirNode, folder: str) -> dict[str, Any] | None:
    node: DirNode | FileNode | None = root
    for name in [*folder.split("/"), ".zarray"]:
        if not isinstance(node, DirNode):
            return None
        found = await node.lookup(name)
        node = found if isinstance(found, (DirNode, FileNode)) else None
    if not isinstance(node, FileNode):
        return None
    try:
        meta = json.loads(await whole(node, f"{folder}/.zarray"))
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None
