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
