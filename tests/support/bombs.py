"""Hostile payloads and indexes, and the check every bomb test makes of a mount.

The payloads are built directly (not by compressing gigabytes): a gzip bomb
repeats one full-flush deflate unit, a zstd bomb repeats one frame. Shards
are written by hand, so a test can put any bytes where the format expects
an index or a payload. `assert_contained` is the contract each hostile file
must keep: EIO (or absent) within seconds, bounded daemon memory, every
other file of the mount exact in parallel, and a clean unmount on SIGTERM.
"""

from __future__ import annotations

import errno
import gzip
import os
import signal
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np
import zstandard

from tests.support.memory import MiB, daemon_peak_rss
from unshardfs.testing.mounts import Mount, daemon_pids
UNIT = 16 * MiB  # zeros per repeated deflate unit / zstd frame


def gzip_zeros(size: int) -> bytes:
    """A one-member gzip of `size` zeros (a multiple of 16 MiB), about size / 1000 bytes.

    Its CRC32 is left 0 (computing it would take seconds): a reader learns
    that only after inflating all of it, which is what the bomb is about.
    """
    assert size % UNIT == 0
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    # After a full flush the compressor starts afresh: every unit is the same bytes.
    unit = deflate.compress(bytes(UNIT)) + deflate.flush(zlib.Z_FULL_FLUSH)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    final = b"\x03\x00"  # an empty final block
    return header + unit * (size // UNIT) + final + struct.pack("<II", 0, size & 0xFFFFFFFF)


def gzip_chain(content: bytes, members: int, truncate_last: bool = False) -> bytes:
    """`members` empty gzip members, then one holding `content` (cut short if asked)."""
    last = gzip.compress(content, mtime=0)
    return gzip.compress(b"", mtime=0) * members + (last[:-5] if truncate_last else last)


def zstd_zeros(size: int) -> bytes:
    """Concatenated zstd frames of zeros (each declaring its honest 16 MiB), `size` in all."""
    assert size % UNIT == 0
    return zstandard.ZstdCompressor(level=3).compress(bytes(UNIT)) * (size // UNIT)


def zstd_declaring(content: bytes, declared: int) -> bytes:
    """One zstd frame of `content` whose header declares `declared` bytes of content."""
    frame = zstandard.ZstdCompressor(level=3, write_content_size=False).compressobj()
    data = frame.compress(content) + frame.flush()
    descriptor = data[4]
    assert descriptor & 0xE3 == 0, "expected a frame without content size, single segment or dictionary"
    # Frame_Content_Size_flag 3: an 8-byte size after the window descriptor.
    return data[:4] + bytes([descriptor | 0xC0]) + data[5:6] + struct.pack("<Q", declared) + data[6:]


# -- precomputed shards written by hand ------------------------------------------------


@dataclass
class Minishard:
    chunks: dict[int, bytes] = field(default_factory=dict)  # chunk id -> payload
    index: bytes | None = None  # hostile minishard index bytes instead of the encoded table
    span: tuple[int, int] | None = None  # hostile shard-index entry instead of the real one
    encode: Callable[[bytes], bytes] | None = None  # how the table is encoded (default: the spec's)


def write_shard(path: Path, minishards: list[Minishard], gzip_index: bool = False, size: int | None = None) -> None:
    """A `neuroglancer_uint64_sharded_v1` shard: payloads, then minishard indexes, after the
    shard index; `size` extends the file (sparsely) for indexes that point far into it."""
    data = bytearray()
    spans = []
    for mini in minishards:
        ids = sorted(mini.chunks)
        starts = []
        for cid in ids:
            starts.append(len(data))
            data += mini.chunks[cid]
        index = mini.index
        if index is None:
            table = np.zeros((3, len(ids)), dtype="<u8")
            ends = [s + len(mini.chunks[c]) for s, c in zip(starts, ids)]
            table[0] = np.diff(ids, prepend=0)
            table[1] = np.array(starts) - np.array([0] + ends[:-1]) if ids else []
            table[2] = [len(mini.chunks[c]) for c in ids]
            encode = mini.encode or ((lambda raw: gzip.compress(raw, mtime=0)) if gzip_index else bytes)
            index = encode(table.tobytes())
        spans.append(mini.span or (len(data), len(data) + len(index)))
        data += index
    shard_index = np.array(spans, dtype="<u8").tobytes()
    path.write_bytes(shard_index + bytes(data))
    if size is not None:
        os.truncate(path, size)


def zarr_shard(count: int, chunks: dict[int, bytes]) -> bytes:
    """A Zarr v3 shard of `count` inner chunks, those of `chunks` present (by position), then the
    index at the end, crc32c-protected."""
    import crc32c

    index = np.full((count, 2), (1 << 64) - 1, dtype="<u8")
    at = 0
    for i, chunk in sorted(chunks.items()):
        index[i] = (at, len(chunk))
        at += len(chunk)
    raw = index.tobytes()
    return b"".join(chunks[i] for i in sorted(chunks)) + raw + struct.pack("<I", crc32c.crc32c(raw))


def zarr_array(shape: list[int], shard: list[int], inner: list[int], codecs: list[dict]) -> dict:
    """The zarr.json of a uint8 array sharded `shard` / `inner`, inner chunks encoded by `codecs`."""
    index_codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    sharding = {"name": "sharding_indexed", "configuration": {"chunk_shape": inner, "codecs": codecs,
                                                              "index_codecs": index_codecs}}
    return {"zarr_format": 3, "node_type": "array", "shape": shape, "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shard}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0, "codecs": [sharding], "attributes": {}}


# -- Arrow records ------------------------------------------------------------------------


def record_buffers(message: bytes, schema) -> dict[tuple[str, int], int]:
    """Where each buffer of a one-batch Arrow IPC message lies in it: (column, i) -> offset, for
    `column.buffers()[i]` (body buffers follow one another, each padded to 8 bytes)."""
    import pyarrow as pa

    parsed = pa.ipc.read_message(pa.py_buffer(message))
    batch = pa.ipc.read_record_batch(parsed, schema)
    pos = len(message) - parsed.body.size
    out = {}
    for name, column in zip(batch.schema.names, batch.columns):
        for i, buf in enumerate(column.buffers()):
            size = 0 if buf is None else buf.size
            assert message[pos:pos + size] == (b"" if buf is None else buf.to_pybytes()), (name, i)
            out[(name, i)] = pos
            pos += -(-size // 8) * 8
    return out


# -- the contract ------------------------------------------------------------------------


@dataclass
class Bad:
    """A hostile file: `stat` gives `size` (None: the lookup itself fails with EIO), a read fails
    with EIO; listed in its directory exactly when it can be stat'ed."""

    size: int | None = None


@dataclass
class Figures:
    baseline_mib: float  # daemon VmHWM after mounting, before any read
    peak_mib: float  # daemon VmHWM after every hostile file was hit
    slowest_bad_s: float  # the slowest stat/read/listing of a hostile file or its directory
    slowest_good_s: float  # the slowest read of a good file while that went on
    good_reads: int


def peak_rss_mib(mountpoint: Path) -> float:
    """The largest resident set (VmHWM) the daemon serving `mountpoint` has had, in MiB."""
    return daemon_peak_rss(mountpoint) / MiB


def _eio(action) -> None:
    try:
        action()
    except OSError as e:
        assert e.errno == errno.EIO, e
        return
    raise AssertionError("expected EIO")


def assert_contained(m: Mount, bad: dict[str, Bad], good: dict[str, bytes], growth_mib: float,
                     seconds: float = 5.0, baseline_mib: float | None = None) -> Figures:
    """Hit every hostile file (stat, read, its directory's listing) while other threads read `good`
    files; then check times, memory growth (over `baseline_mib`, by default the peak so far), the
    log, and that SIGTERM unmounts. Paths are relative to the mount."""
    baseline = peak_rss_mib(m.path) if baseline_mib is None else baseline_mib
    stop = threading.Event()
    errors: list[str] = []
    latencies: list[float] = []

    def read_good() -> None:
        while not stop.is_set():
            for rel, want in good.items():
                started = time.monotonic()
                try:
                    got = (m.path / rel).read_bytes()
                except OSError as e:
                    errors.append(f"{rel}: {e}")
                    return
                latencies.append(time.monotonic() - started)
                if got != want:
                    errors.append(f"{rel}: wrong bytes")
                    return

    readers = [threading.Thread(target=read_good) for _ in range(2)]
    for t in readers:
        t.start()
    slowest = 0.0
    try:
        for rel, expect in bad.items():
            path = m.path / rel
            for _ in range(2):  # the second time from whatever the daemon kept
                started = time.monotonic()
                if expect.size is None:
                    _eio(path.stat)
                else:
                    assert path.stat().st_size == expect.size, rel
                _eio(path.read_bytes)
                slowest = max(slowest, time.monotonic() - started)
        for parent in sorted({str(Path(rel).parent) for rel in bad}):
            started = time.monotonic()
            listed = set(os.listdir(m.path / parent))
            slowest = max(slowest, time.monotonic() - started)
            for rel, expect in bad.items():
                if str(Path(rel).parent) == parent:
                    assert (Path(rel).name in listed) == (expect.size is not None), rel
            for rel in good:
                if str(Path(rel).parent) == parent:
                    assert Path(rel).name in listed, rel
    finally:
        time.sleep(0.2)  # let the readers overlap the last hostile reads
        stop.set()
        for t in readers:
            t.join(timeout=60)
    assert not errors, errors
    assert latencies, "no good file was read"
    figures = Figures(baseline, peak_rss_mib(m.path), slowest, max(latencies), len(latencies))
    print(f"\n{m.path.name}: {figures}")
    assert figures.slowest_bad_s < seconds, figures
    assert figures.slowest_good_s < seconds, figures
    assert figures.peak_mib - figures.baseline_mib < growth_mib, figures
    log = m.log_text()
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
    assert_sigterm_unmounts(m)
    return figures


def assert_sigterm_unmounts(m: Mount, seconds: float = 10.0) -> None:
    pids = daemon_pids(m.path)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGTERM)
    deadline = time.monotonic() + seconds
    while (os.path.ismount(m.path) or daemon_pids(m.path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.ismount(m.path) and not daemon_pids(m.path), "SIGTERM did not unmount"


def traced(main: Callable[[], Awaitable[object]]) -> tuple[object, int]:
    """(what `trio.run(main)` returned or raised, the peak bytes Python allocated while it ran)."""
    import tracemalloc

    import trio

    tracemalloc.start()
    try:
        try:
            result: object = trio.run(main)
        except Exception as e:  # the caller checks which
            result = e
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, peak
