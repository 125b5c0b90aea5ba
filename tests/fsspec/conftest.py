"""Datasets read without a mount (fsspec, references), written once per session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from unshardfs.testing import precomputed as pc
from unshardfs.testing.zarr import BYTES_LE, CRC, ZCase, codec, consolidate, sharding, write_case, write_group


@dataclass
class Datasets:
    root: Path
    hier: Path  # a Zarr v3 group: em ('.' keys, zstd), seg ('/' keys, gzip + crc32c)
    em: np.ndarray
    seg: np.ndarray
    dotted: Path  # a Zarr v3 group holding em alone (kerchunk's parquet layout needs '.' keys)
    raw: Path  # sharded precomputed, raw chunks
    gzip: Path  # sharded precomputed, gzip-encoded chunks (cannot be references)


EM = ZCase(shape=(30, 40, 50), dtype="uint16", shard_shape=(10, 20, 25),
           codecs=[sharding((5, 10, 25), [BYTES_LE, codec("zstd", level=1, checksum=False)])],
           plain_chunks=(5, 10, 25), plain_codecs=[BYTES_LE, codec("zstd", level=1, checksum=False)],
           key_encoding=codec("default", separator="."), dimension_names=["z", "y", "x"])
SEG = ZCase(shape=(20, 30, 40), dtype="uint64", shard_shape=(10, 10, 20),
            codecs=[sharding((5, 5, 10), [BYTES_LE, codec("gzip", level=1), CRC])],
            plain_chunks=(5, 5, 10), plain_codecs=[BYTES_LE, codec("gzip", level=1), CRC],
            dimension_names=["t", "v", "u"])


def write_datasets(root: Path) -> Datasets:
    em = write_case(root / "zarr", "em", EM, seed=1)
    seg = write_case(root / "zarr", "seg", SEG, seed=2)
    hier = root / "zarr" / "sharded"
    write_group(hier, {"about": "fsspec and references"})
    consolidate(hier)  # a plain HTTP server cannot list: the group names its arrays
    write_case(root / "dotted", "em", EM, seed=1)
    dotted = root / "dotted" / "sharded"
    write_group(dotted)
    consolidate(dotted)
    scale = pc.Scale(size=(64, 48, 32), chunk=(16, 16, 16), sharding=pc.sharding(minishard=1, shard=1))
    raw = pc.write_volume(root / "raw", [scale], data_type="uint16")["sharded"]
    gz = pc.Scale(size=(64, 48, 32), chunk=(16, 16, 16), sharding=pc.sharding(minishard=1, shard=1, data_enc="gzip"))
    gzip = pc.write_volume(root / "gzip", [gz], data_type="uint8")["sharded"]
    return Datasets(root, hier, em, seg, dotted, raw, gzip)


@pytest.fixture(scope="session")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> Datasets:
    return write_datasets(tmp_path_factory.mktemp("unmounted"))
