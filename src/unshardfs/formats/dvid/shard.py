"""One exported shard file: its chunk index, in any of DVID's variants, and its records.

DVID has written the chunk index three ways: a JSON footer after the Arrow
data (`...[JSON]["<u64 length>"]["CHUNKIDX"]`, keys "x_y_z" -> record
number), a `<origin>.json` sidecar (the same mapping), and a `<origin>.csv`
sidecar (`x,y,z,offset,size,batch_idx` after a `# schema_size=N` comment)
that gives each record batch's byte range directly. The Arrow data is an IPC
file or an IPC stream, whatever the documentation of the day said; record
numbers are turned into byte ranges from the file footer or by walking the
stream's message headers once.

Index keys have been written both as block coordinates and as voxel
coordinates. Which one a file uses is decided from the data: a key is only
accepted if, read as a chunk cell, it belongs to this very shard under the
volume's sharding spec; the records' own chunk_x/y/z are checked again
when a block is read.
"""

from __future__ import annotations

import csv
import io
import logging
import struct
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

import numpy as np
import pyarrow as pa

from unshardfs.core.blob import Blob
from unshardfs.core.table import MAX_BAD_REASONS, ChunkTable
from unshardfs.formats.dvid.ipc import (
    FILE_MAGIC,
    RECORD_BATCH,
    IpcError,
    footer_batches,
    message_header,
    message_prefix,
)
from unshardfs.sources.base import ByteSource
from unshardfs.util.errors import DataError
from unshardfs.util.fields import DEFAULT_LIMITS, MetadataError, load_json, off_loop
from unshardfs.util.limits import DataLimits
from unshardfs.util.logonce import log_once

log = logging.getLogger(__name__)

FOOTER_MAGIC = b"CHUNKIDX"
SCAN_WINDOW = 1 << 16
Cell = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class RecordRef:
    offset: int  # of the record batch message in the file
    length: int
    row: int  # within the batch


@dataclass(frozen=True, slots=True)
class Record:
    coords: Cell
    labels: np.ndarray
    supervoxels: np.ndarray
    block: bytes
    uncompressed_size: int | None
    zstd: bool


@dataclass
class ShardIndex:
    """One shard file's records as a table keyed by cell Morton code (`extra`: row in its batch)."""

    table: ChunkTable
    schema: pa.Schema
    units: str  # how the file's keys were written: "block" or "voxel"

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + 4096


COORD_LIMIT = 1 << 40  # beyond any volume; keeps every later product inside int64


def _cell(values: Iterable[int | str], where: str) -> Cell:
    x, y, z = (int(v) for v in values)
    if not all(-COORD_LIMIT < v < COORD_LIMIT for v in (x, y, z)):
        raise DataError(where, f"chunk index key {(x, y, z)} is out of range")
    return (x, y, z)


def _parse_key(key: object, where: str) -> Cell:
    parts = str(key).split("_")
    try:
        if len(parts) != 3 or any(len(p) > 16 for p in parts):
            raise ValueError
        return _cell(parts, where)
    except ValueError:
        raise DataError(where, f"chunk index key {str(key)[:40]!r} is not x_y_z") from None


def parse_csv_index(text: str, where: str) -> dict[Cell, RecordRef]:
    lines = text.splitlines()
    if lines and lines[0].startswith("#"):
        lines = lines[1:]
    out: dict[Cell, RecordRef] = {}
    try:
        for row in csv.DictReader(io.StringIO("\n".join(lines))):
            cell = _cell((row["x"], row["y"], row["z"]), where)
            ref = RecordRef(int(row["offset"]), int(row["size"]), int(row["batch_idx"]))
            if not (0 <= ref.offset < 1 << 62 and 0 < ref.length < 1 << 62 and 0 <= ref.row < 1 << 31):
                raise ValueError(f"record range {ref} out of range")
            out.setdefault(cell, ref)
    except (KeyError, TypeError, ValueError, csv.Error) as e:
        raise DataError(where, f"malformed CSV chunk index: {str(e)[:200]}") from None
    return out


def parse_json_index(raw: bytes, where: str, limits: DataLimits = DEFAULT_LIMITS) -> dict[Cell, int]:
    try:
        mapping = load_json(raw, where, limits)
    except MetadataError as e:
        raise DataError(where, f"chunk index {e.reason}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31
                                                for v in mapping.values()):
        raise DataError(where, "JSON chunk index must map 'x_y_z' keys to record numbers")
    out: dict[Cell, int] = {}
    for key, value in mapping.items():
        out.setdefault(_parse_key(key, where), value)
    return out


class ArrowShardReader:
    """Reads the index and records of shard files of one scale."""

    def __init__(self, source: ByteSource, read: Callable[[Blob, int, int], Awaitable[bytes]], chunk_size: Cell,
                 owned: Callable[[np.ndarray, int], np.ndarray], chunk_ids: Callable[[np.ndarray], np.ndarray],
                 limits: DataLimits = DEFAULT_LIMITS) -> None:
        self.source = source
        # The mount's metadata bounds (--max-metadata-*), which JSON chunk indexes honour too.
        self.limits = limits
        # read(blob, offset, size): index bytes, checked against the index limit first.
        self._read = read
        self.chunk_size = chunk_size
        # owned(cells, shard) -> bool mask: cell inside the grid and hashed to `shard`.
        self.owned = owned
        # keys(cells) -> uint64 chunk keys (Morton codes) of in-grid cells.
        self.chunk_ids = chunk_ids

    async def load(self, blob: Blob, stem: str, shard: int) -> ShardIndex:
        where = blob.label
        if blob.size < 16:
            raise DataError(where, f"file of {blob.size} bytes is too short for Arrow data")
        tail = await self._read(blob, blob.size - 16, 16)
        by_number: dict[Cell, int] | None = None
        by_range: dict[Cell, RecordRef] | None = None
        missing: dict[int, str] = {}  # record numbers the index names that the file does not have
        arrow_end = blob.size
        if tail[8:] == FOOTER_MAGIC:
            (length,) = struct.unpack("<Q", tail[:8])
            if length > blob.size - 16:
                raise DataError(where, f"JSON chunk index length {length} exceeds the file")
            arrow_end = blob.size - 16 - length
            raw = await self._read(blob, arrow_end, length)
            by_number = await off_loop(len(raw), parse_json_index, raw, where, self.limits)
        else:
            by_range, by_number = await self._sidecar(stem, where)
        stream_start = 8 if (await self._read(blob, 0, 8))[:6] == FILE_MAGIC else 0
        schema = await self._schema(blob, stream_start, arrow_end, where)
        if by_number is not None:
            needed = max(by_number.values(), default=-1) + 1
            batches = await self._batches(blob, stream_start, arrow_end, where, needed)
            by_range = {}
            for cell, number in by_number.items():
                if number >= len(batches):
                    missing[number] = f"the chunk index names record {number}; the file has {len(batches)}"
                    continue
                by_range[cell] = RecordRef(batches[number][0], batches[number][1], 0)
        assert by_range is not None
        # A bad entry fails its own chunk (EIO), never the shard, and never reads as absent.
        problems: dict[Cell, str] = {cell: problem for cell, number in (by_number or {}).items()
                                     if (problem := missing.get(number)) is not None}
        for cell, ref in by_range.items():
            if ref.offset < 0 or ref.length <= 0 or ref.offset + ref.length > arrow_end or ref.row < 0:
                problems[cell] = (f"record at [{ref.offset}, +{ref.length}) lies outside the Arrow data "
                                  f"[0, {arrow_end})")
        if problems:
            log_once(log, f"bad:{where}", "%s: %d chunk index entries are bad; those chunks fail with EIO", where,
                     len(problems))
        everything = {**{cell: RecordRef(0, 0, 0) for cell in problems}, **by_range}
        records, units = self._resolve_units(everything, shard, where)
        good = {cell: ref for cell, (ref, origin) in records.items() if origin not in problems}
        cells = np.array(list(good), dtype=np.int64).reshape(-1, 3)
        refs = list(good.values())
        bad_cells = [cell for cell, (_, origin) in records.items() if origin in problems][:MAX_BAD_REASONS]
        reasons = dict(zip(self.chunk_ids(np.array(bad_cells, dtype=np.int64).reshape(-1, 3)).tolist(),
                           (problems[records[cell][1]] for cell in bad_cells)))
        table = ChunkTable.build(blob, self.chunk_ids(cells), np.array([r.offset for r in refs], dtype=np.uint64),
                                 np.array([r.length for r in refs], dtype=np.uint64), 0, arrow_end,
                                 extra=np.array([r.row for r in refs], dtype=np.int64), reasons=reasons)
        return ShardIndex(table, schema, units)

    async def _sidecar(self, stem: str, where: str) -> tuple[dict[Cell, RecordRef] | None, dict[Cell, int] | None]:
        for ext in (".csv", ".json"):
            st = await self.source.stat(stem + ext)
            if st is None or st.is_dir:
                continue
            raw = await self._read(Blob.of(stem + ext, st), 0, st.size)
            if ext == ".csv":
                try:
                    return await off_loop(len(raw), parse_csv_index, raw.decode(), stem + ext), None
                except UnicodeDecodeError as e:
                    raise DataError(stem + ext, "CSV chunk index is not text") from e
            return None, await off_loop(len(raw), parse_json_index, raw, stem + ext, self.limits)
        raise DataError(where, "no chunk index: neither a CHUNKIDX footer nor a .csv/.json sidecar")

    async def _schema(self, blob: Blob, start: int, end: int, where: str) -> pa.Schema:
        try:
            head = message_prefix(await self._read(blob, start, 8))
            if head is None:
                raise IpcError("stream ends before its schema")
            raw = await self._read(blob, start, head[0] + head[1])
            return pa.ipc.read_schema(pa.py_buffer(raw))
        except (IpcError, pa.ArrowException) as e:
            raise DataError(where, f"cannot read the Arrow schema: {e}") from e

    async def _batches(self, blob: Blob, stream_start: int, end: int, where: str,
                       needed: int) -> list[tuple[int, int]]:
        """(offset, length) of the record batches in order: all of a file's, a stream's first `needed`."""
        try:
            if stream_start == 8:  # IPC file: the footer lists them
                trailer = await self._read(blob, end - 10, 10)
                if trailer[4:] != FILE_MAGIC:
                    raise IpcError("Arrow file has no footer magic")
                (length,) = struct.unpack("<i", trailer[:4])
                if length <= 0 or length > end - 10:
                    raise IpcError(f"Arrow footer length {length} is invalid")
                return footer_batches(await self._read(blob, end - 10 - length, length))
            return await self._scan(blob, stream_start, end, needed)
        except IpcError as e:
            raise DataError(where, f"cannot locate record batches: {e}") from e

    async def _scan(self, blob: Blob, pos: int, end: int, needed: int) -> list[tuple[int, int]]:
        """Walk a stream's message headers (reading in windows, not message by message) until the
        `needed` record batches the index names are found: a stream of millions of tiny messages
        costs no more than its index says it holds."""
        window_at, window = pos, b""

        async def get(at: int, n: int) -> bytes:
            nonlocal window_at, window
            if at < window_at or at + n > window_at + len(window):
                window_at, window = at, await self._read(blob, at, min(max(n, SCAN_WINDOW), end - at))
            if at + n > window_at + len(window):
                raise IpcError("stream is truncated")
            return window[at - window_at: at - window_at + n]

        batches: list[tuple[int, int]] = []
        others = 0  # the schema, dictionaries: a few, never more than the batches themselves
        while pos + 8 <= end and len(batches) < needed:
            head = message_prefix(await get(pos, 8))
            if head is None:
                break
            prefix, meta_len = head
            header_type, body = message_header(await get(pos + prefix, meta_len))
            length = prefix + meta_len + body
            if header_type == RECORD_BATCH:
                batches.append((pos, length))
            else:
                others += 1
                if others > needed + 16:
                    raise IpcError(f"more than {others - 1} messages that are not record batches")
            pos += length
        return batches

    def _resolve_units(self, by_key: dict[Cell, RecordRef], shard: int, where: str
                       ) -> tuple[dict[Cell, tuple[RecordRef, Cell]], str]:
        """The entries as chunk cells of this shard ({cell: (record, the key as written)}), and
        whether the file's keys are block or voxel coordinates."""
        if not by_key:
            return {}, "block"
        keys = np.array(list(by_key), dtype=np.int64)
        chunk = np.array(self.chunk_size, dtype=np.int64)
        as_blocks = self.owned(keys, shard)
        aligned = (keys % chunk == 0).all(axis=1)
        as_voxels = aligned & self.owned(keys // chunk, shard)
        # Both readings can fit only in degenerate cases (e.g. one shard and
        # every key a multiple of the chunk size); block coordinates win ties.
        # A wrong guess cannot serve wrong labels: each record's own chunk
        # coordinates are compared with the cell when its block is read.
        units = "block" if as_blocks.sum() >= as_voxels.sum() else "voxel"
        mask = as_blocks if units == "block" else as_voxels
        cells = keys if units == "block" else keys // chunk
        if not mask.all():
            log_once(log, f"own:{where}", "%s: %d chunk index keys lie outside this shard or the volume; not shown",
                     where, int((~mask).sum()))
        written = list(by_key.items())
        return {tuple(c): written[i][::-1] for i, c in zip(np.nonzero(mask)[0].tolist(), cells[mask].tolist())}, units

def decode_record(raw: bytes, schema: pa.Schema, row: int, where: str) -> Record:
    """One row of a record batch message, fully validated first: pyarrow trusts list offsets
    and buffer sizes it has not validated, and a bit flip there can crash the process."""
    try:
        batch = pa.ipc.read_record_batch(pa.ipc.read_message(pa.py_buffer(raw)), schema)
        batch.validate(full=True)
        if row >= batch.num_rows:
            raise DataError(where, f"record batch has {batch.num_rows} rows, index names row {row}")
        x, y, z = (int(batch.column(name)[row].as_py()) for name in ("chunk_x", "chunk_y", "chunk_z"))
        coords = (x, y, z)
        labels = batch.column("labels")[row].values.to_numpy(zero_copy_only=False).astype(np.uint64)
        supervoxels = batch.column("supervoxels")[row].values.to_numpy(zero_copy_only=False).astype(np.uint64)
        block = batch.column("dvid_compressed_block")[row].as_py()
        size = (int(batch.column("uncompressed_size")[row].as_py())
                if "uncompressed_size" in batch.schema.names else None)
        meta = schema.field("dvid_compressed_block").metadata or {}
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - anything pyarrow raises on bad data is damage of this record
        raise DataError(where, f"cannot decode the Arrow record: {type(e).__name__}: {e}") from None
    if not isinstance(block, bytes) or len(labels) != len(supervoxels):
        raise DataError(where, f"record has {len(labels)} labels for {len(supervoxels)} supervoxels")
    return Record(coords, labels, supervoxels, block, size, meta.get(b"codec") == b"zstd")
