"""DVID label block decoding, per 64^3 block, against gunzip of the same labels stored as a raw chunk."""

from __future__ import annotations

import sys
import zlib
from typing import Callable

from ..context import Context
from ..workloads import timed


def run(ctx: Context) -> None:
    from unshardfs.formats.dvid.block import decode_block
    from unshardfs.testing.dvid import encode_volume, sample_volume

    row = ctx.report.row
    blocks = [data for data, _ in encode_volume(sample_volume((256, 256, 128), 5)).values()]
    raw = [zlib.compress(decode_block(b).tobytes(), 6) for b in blocks]
    rounds = 5

    def per_second(fn: Callable[[bytes], object], items: list[bytes]) -> float:
        best = min(timed(lambda: [fn(item) for item in items]) for _ in range(rounds))
        return len(items) / best

    ours = per_second(decode_block, blocks)
    gunzip = per_second(zlib.decompress, raw)
    row("DVID block decode, 64^3 (realistic mix)", ours, "blocks/s", "zlib gunzip of the raw chunk", gunzip)
    print(f"decoded {len(blocks)} blocks ({sum(map(len, blocks)) / len(blocks) / 1024:.1f} KiB compressed on "
          f"average): {1e3 / ours:.2f} ms per block, {ours * 2:.0f} MiB/s of uint64 labels", file=sys.stderr)
    wkw_blocks(ctx, per_second)


def wkw_blocks(ctx: Context, per_second: Callable[[Callable[[bytes], object], list[bytes]], float]) -> None:
    """WKW LZ4 blocks (32^3 uint8, one channel and three) to precomputed chunk files, against LZ4 alone."""
    import lz4.block
    import numpy as np

    from unshardfs.core.blob import Blob
    from unshardfs.core.chunks import ChunkFile
    from unshardfs.formats.wkw.header import LZ4, WkwHeader
    from unshardfs.formats.wkw.store import MagView, WkwBlockCodec
    from unshardfs.volume.grid import ChunkGrid

    rng = np.random.default_rng(0)
    blob = Blob((("x", 0, ()),), 0, 0)
    for channels in (1, 3):
        header = WkwHeader(5, 5, LZ4, 1, channels, 0)
        codec = WkwBlockCodec(MagView("color/1", header, ChunkGrid((1024,) * 3, (32,) * 3, (0, 0, 0))))
        # Smooth image-like content (runs of 4 equal bytes), not noise.
        blocks = [lz4.block.compress(np.repeat(rng.integers(0, 256, header.block_bytes // 4, dtype=np.uint8), 4)
                                     .tobytes(), store_size=False) for _ in range(64)]
        files = {b: ChunkFile(None, blob, 0, len(b), 0, header.block_bytes, None, LZ4)  # type: ignore[arg-type]
                 for b in blocks}
        ours = per_second(lambda b: codec.decode(b, files[b]), blocks)
        alone = per_second(lambda b: lz4.block.decompress(b, uncompressed_size=header.block_bytes), blocks)
        ctx.report.row(f"WKW LZ4 block -> chunk file, 32^3 x {channels} uint8", ours, "blocks/s",
                       "lz4.block.decompress alone", alone)
