"""Decompression whose cost is bounded by what the format allows, not by what the bytes claim.

A 1.5 MB gzip member can hold 1.5 GiB of zeros, and a chain of tiny
members makes `gzip.decompress` quadratic. Every decoder here is
incremental with a hard output cap (exceeding it is damage: `DataError`),
consumes input in bounded windows (no copy of the remaining input per
member), and verifies what the format can verify (gzip CRC32 and ISIZE per
member, zstd frame checks). Large inputs are decoded in a worker thread so
one bad payload never stalls the event loop that serves every other request.
"""

from __future__ import annotations

import zlib
from typing import Callable, TypeVar

import trio
import zstandard

from unshardfs.util.errors import DataError

WINDOW = 1 << 16  # most input fed to the decompressor per call
# Each gzip member starts with this much input, doubled per call up to
# WINDOW: what zlib hands back after a member ends (`unused_data`, a copy)
# is then at most twice what the member used, so a chain of thousands of
# 20-byte members costs time linear in its length, not 64 KiB per member.
FIRST_WINDOW = 1 << 8
STEP = 1 << 20  # most output taken from a decompressor per call
# Decodes of payloads at least this large run in a worker thread.
THREAD_THRESHOLD = 1 << 18

# Deflate cannot expand its input more than this (a 258-byte match coded in
# 2 bits); gzip members only add headers. So `n` gzip bytes decode to at most
# n * DEFLATE_MAX_RATIO bytes, whatever they claim.
DEFLATE_MAX_RATIO = 1032

T = TypeVar("T")


def gunzip_cost(size: int, cap: int) -> int:
    """The most decoding `size` gzip bytes with output cap `cap` can produce (what `off_loop` weighs)."""
    return min(cap, size * DEFLATE_MAX_RATIO)
_limiter: trio.CapacityLimiter | None = None


def gunzip(data: bytes | memoryview, cap: int, where: str) -> bytes:
    """The concatenated members of a gzip stream, at most `cap` bytes, fully verified."""
    view = memoryview(data)
    out: list[bytes] = []
    produced = 0
    pos = 0
    if not len(view):
        raise DataError(where, "bad gzip data: empty")
    while pos < len(view):
        d = zlib.decompressobj(31)  # gzip framing: header, CRC32 and ISIZE checked by zlib
        pending: bytes | memoryview = b""
        window = FIRST_WINDOW
        while not d.eof:
            if not pending:
                # Empty at the end of the input: zlib may still hold output.
                pending = view[pos:pos + window]
                pos += len(pending)
                window = min(2 * window, WINDOW)
            try:
                # At most STEP bytes per call: a bomb is cut off at the cap
                # plus one step, never inflated into one cap-sized buffer.
                chunk = d.decompress(pending, min(cap - produced + 1, STEP))
            except zlib.error as e:
                raise DataError(where, f"bad gzip data: {e}") from None
            if not chunk and not pending and not d.eof:
                raise DataError(where, "bad gzip data: truncated member")
            produced += len(chunk)
            if produced > cap:
                raise DataError(where, f"gzip data decodes to more than {cap:,} bytes, the most this file can hold")
            out.append(chunk)
            # What zlib did not take because of the output limit, or (at the end
            # of a member) the input after it: both at most the current window.
            pending = d.unconsumed_tail or (d.unused_data if d.eof else b"")
        pos -= len(d.unused_data)
    return b"".join(out)


def unzstd(data: bytes, cap: int, where: str, dictionary: zstandard.ZstdCompressionDict | None = None) -> bytes:
    """A zstd frame (or frames), at most `cap` bytes, streamed (a declared content size is not trusted);
    `dictionary`: the one the frames were compressed with."""
    decompressor = zstandard.ZstdDecompressor(dict_data=dictionary) if dictionary is not None else \
        zstandard.ZstdDecompressor()
    reader = decompressor.stream_reader(data, read_across_frames=True)
    out: list[bytes] = []
    produced = 0
    try:
        while True:
            chunk = reader.read(min(cap - produced + 1, STEP))
            if not chunk:
                break
            produced += len(chunk)
            if produced > cap:
                raise DataError(where, f"zstd data decodes to more than {cap:,} bytes, the most this file can hold")
            out.append(chunk)
    except zstandard.ZstdError as e:
        raise DataError(where, f"bad zstd data: {e}") from None
    return b"".join(out)


async def off_loop(work: Callable[[], T], size: int) -> T:
    """Run `work` (a decode of `size` input bytes) in a worker thread when it is large.

    At most two decodes run at once (this machine class has two cores and
    the event loop needs one); small ones run inline, where a thread hop
    would cost more than the decode.
    """
    if size < THREAD_THRESHOLD:
        return work()
    global _limiter
    if _limiter is None:
        _limiter = trio.CapacityLimiter(2)
    return await trio.to_thread.run_sync(work, limiter=_limiter)
