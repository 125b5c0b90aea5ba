"""Many minishard indexes decoded at once give the tables (and errors) of decoding each alone."""

from __future__ import annotations

import numpy as np
import pytest

from unshardfs.core.blob import Blob
from unshardfs.formats.precomputed.shards import decode_minishard, decode_minishards
from unshardfs.util.errors import DataError

BASE = 1024


def minishard(rng: np.random.Generator, n: int, shuffle: bool = False, outside: bool = False) -> bytes:
    ids = np.sort(rng.choice(1 << 40, n, replace=False)).astype("<u8")
    if shuffle and n > 1:
        ids = ids[::-1].copy()
    sizes = rng.integers(1, 5000, n).astype("<u8")
    gaps = rng.integers(0, 100, n).astype("<u8")
    if outside:
        gaps[-1] = 1 << 40
    deltas = np.diff(ids, prepend=np.uint64(0)).astype("<u8")  # wraps where ids fall: as the format allows
    return np.stack([deltas, gaps, sizes]).astype("<u8").tobytes()


@pytest.mark.parametrize("seed", range(5))
def test_decoding_together_gives_each_alone(seed):
    rng = np.random.default_rng(seed)
    blob = Blob((("s.shard", 1 << 30, (1,)),), 1 << 30, 0)
    raws = [minishard(rng, int(rng.integers(1, 80))) for _ in range(20)]
    raws[3] = minishard(rng, 7, shuffle=True)   # out of order: sorted by the one-by-one decode
    raws[5] = minishard(rng, 9, outside=True)   # a range outside the data: reported there
    raws[8] = b""                               # empty
    raws[11] = b"x" * 25                        # not a multiple of 24 bytes
    wheres = [f"minishard {m}" for m in range(len(raws))]
    together = decode_minishards(raws, blob, BASE, wheres, list(range(len(raws))))
    for m, raw in enumerate(raws):
        try:
            alone: object = decode_minishard(raw, blob, BASE, wheres[m], m)
        except DataError as e:
            alone = e
        got = together[m]
        if isinstance(alone, DataError):
            assert isinstance(got, DataError) and str(got) == str(alone)
            continue
        assert not isinstance(got, DataError)
        assert got.part == alone.part == m and got.bad == alone.bad  # type: ignore[attr-defined]
        for field in ("ids", "starts", "lengths"):
            assert np.array_equal(getattr(got, field), getattr(alone, field)), (m, field)
            assert getattr(got, field).dtype == np.uint64
