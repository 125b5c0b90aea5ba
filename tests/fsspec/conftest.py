"""Datasets read without a mount (fsspec, references), written once per session."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from unshardfs.testing import precomputed as pc
from unshardfs.testing.ome import write_ome_zarr_py
from unshardfs.testing.zips import zip_tree
from unshardfs.testing.zarr import BYTES_LE, CRC, ZCase, codec, consolidate, sharding, write_case, write_group


@dataclass
class Datasets:
    root: Path
    hier: Path  # a Zarr v3 group: em ('.' keys, zstd), seg ('/' keys, gzip + crc32c)
    em: np.ndarray
    seg: np.ndarray
    dotted: Path  # a Zarr v3 group holding em alone (kerchunk's parquet layout needs '.' keys)
    odd: Path  # a Zarr v3 group whose array's transpose has no Zarr v2 equivalent
    stored_zip: Path  # `dotted` zipped, members STORED
    deflated_zip: Path  # `dotted` zipped, members DEFLATE-compressed
    ome: Path  # OME-Zarr 0.5 by ome-zarr-py: image.ome.zarr (image and labels), plate.ome.zarr
    ome_arrays: dict[str, np.ndarray]
    raw: Path  # sharded precomputed, raw chunks
    gzip: Path  # sharded precomputed, gzip-encoded chunks (cannot be references)

    @property
    def ome_image(self) -> Path:
        return self.ome / "image.ome.zarr"


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
    odd_case = ZCase(shape=(8, 8, 8), dtype="uint8", shard_shape=(8, 8, 8),
                     codecs=[sharding((4, 4, 4), [codec("transpose", order=[2, 0, 1]), BYTES_LE])],
                     plain_chunks=(4, 4, 4), plain_codecs=[codec("transpose", order=[2, 0, 1]), BYTES_LE])
    write_case(root / "odd", "twisted", odd_case, seed=3)
    odd = root / "odd" / "sharded"
    write_group(odd)
    consolidate(odd)
    stored_zip = zip_tree(dotted, root / "dotted.zip")
    deflated_zip = zip_tree(dotted, root / "deflated.zip", zipfile.ZIP_DEFLATED)
    ome_arrays = write_ome_zarr_py(root / "ome")
    scale = pc.Scale(size=(64, 48, 32), chunk=(16, 16, 16), sharding=pc.sharding(minishard=1, shard=1))
    raw = pc.write_volume(root / "raw", [scale], data_type="uint16")["sharded"]
    gz = pc.Scale(size=(64, 48, 32), chunk=(16, 16, 16), sharding=pc.sharding(minishard=1, shard=1, data_enc="gzip"))
    gzip = pc.write_volume(root / "gzip", [gz], data_type="uint8")["sharded"]
    return Datasets(root, hier, em, seg, dotted, odd, stored_zip, deflated_zip, root / "ome", ome_arrays, raw, gzip)


@pytest.fixture(scope="session")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> Datasets:
    return write_datasets(tmp_path_factory.mktemp("unmounted"))
