"""Bombs in every format, through a real mount: decompression bombs (gzip chunks and minishard
indexes, member chains, zstd frames declaring or inflating to gigabytes), absurd index ranges and
declared lengths, DVID block headers and Arrow records with broken offsets, Zarr shards declaring
2^25 and 2^29 inner chunks. Each hostile file answers EIO (or is absent) within seconds with the
daemon's memory bounded, while the mount's other files read exactly in parallel, and SIGTERM
still unmounts (`assert_contained`)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.bombs import (
    UNIT,
    Bad,
    MiB,
    Minishard,
    assert_contained,
    gzip_chain,
    gzip_zeros,
    peak_rss_mib,
    record_buffers,
    write_shard,
    zarr_array,
    zarr_shard,
    zstd_declaring,
    zstd_zeros,
)
from unshardfs.testing.dvid import BLOCK, Variant, agglomerate, encode_block, info_for, write_scale
from unshardfs.util.decompress import gunzip, unzstd
from unshardfs.util.errors import DataError

pytestmark = pytest.mark.timeout(120)

GIB_1_5 = 96 * UNIT  # 1.5 GiB
# How much the daemon's peak RSS may grow over the whole test (its baseline is ~100 MiB): the
# largest legitimate decode here is a minishard index up to the 64 MiB minishard cache.
GROWTH_MIB = 160


def test_decoders_stop_at_their_cap():
    """The caps themselves, without a mount: a bomb is cut off just past the cap, quickly."""
    for bomb, decode in ((gzip_zeros(GIB_1_5), gunzip), (zstd_zeros(GIB_1_5), unzstd),
                         (zstd_declaring(bytes(UNIT), 1 << 40), unzstd)):
        started = time.monotonic()
        with pytest.raises(DataError, match="decodes to more than 64 bytes"):
            decode(bomb, 64, "bomb")
        assert time.monotonic() - started < 1
    # A chain as long as a 1 MiB chunk's payload may be: linear (gzip.decompress takes ~10 s).
    started = time.monotonic()
    assert gunzip(gzip_chain(bytes(MiB), 50_000), MiB, "chain") == bytes(MiB)
    assert time.monotonic() - started < 2


# -- Neuroglancer precomputed ---------------------------------------------------------------


def content(i: int) -> bytes:
    """The 4^3 uint8 chunk i of the good chunks."""
    return bytes((7 * i + j) % 256 for j in range(64))


def chunk_name(i: int) -> str:
    """Chunk i of a (4n, 4, 4) volume of 4^3 chunks (its compressed Morton code is i)."""
    return f"{4 * i}-{4 * i + 4}_0-4_0-4"


def scale(path: str, chunks: int, minishard_bits: int, index: str = "raw", chunk: int = 4) -> dict:
    """A scale of `chunks` chunks of `chunk`^3 voxels in a row along x."""
    spec = {"@type": "neuroglancer_uint64_sharded_v1", "hash": "identity", "preshift_bits": 0,
            "minishard_bits": minishard_bits, "shard_bits": 0, "minishard_index_encoding": index,
            "data_encoding": "gzip"}
    return {"key": path, "size": [chunk * chunks, chunk, chunk], "chunk_sizes": [[chunk] * 3], "encoding": "raw",
            "resolution": [1, 1, 1], "voxel_offset": [0, 0, 0], "sharding": spec}


def gz(i: int) -> bytes:
    return gzip.compress(content(i), mtime=0)


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory) -> tuple[Path, dict[str, Bad], dict[str, bytes]]:
    root = tmp_path_factory.mktemp("bombs") / "precomputed"
    scales = [scale("payload", 8, 0), scale("index", 16, 2, "gzip"), scale("huge", 4, 1), scale("wide", 2, 30),
              scale("giant", 1, 0, chunk=1024)]
    for s in scales:
        (root / s["key"]).mkdir(parents=True)
    (root / "info").write_text(json.dumps({"@type": "neuroglancer_multiscale_volume", "type": "image",
                                           "data_type": "uint8", "num_channels": 1, "scales": scales}))
    write_shard(root / "payload" / "0.shard", [Minishard({
        0: gzip_zeros(GIB_1_5),  # 1.5 MB: longer than any encoding of 64 bytes, refused unread
        1: gzip_zeros(3 * UNIT),  # 49 KB, a possible length: inflation stops at 65 bytes
        2: gzip_chain(content(2), 3000),  # valid: 3000 empty members, then the chunk
        3: gz(3), 4: gzip_chain(content(4), 3000, truncate_last=True), 5: gz(5)[:10], 6: gz(6), 7: gz(7)})])
    write_shard(root / "index" / "0.shard", [
        Minishard(index=gzip_zeros(GIB_1_5)),  # chunks 0, 4, 8, 12: an index inflating to 1.5 GiB
        Minishard({i: gz(i) for i in (1, 5, 9, 13)}),
        Minishard({i: gz(i) for i in (2, 6, 10, 14)}, encode=lambda raw: gzip_chain(raw, 3000)),
        Minishard(span=((1 << 64) - 16, (1 << 64) - 1))], gzip_index=True)  # 3, 7, 11, 15
    # A 200 MiB minishard index inside a (sparse) 1 GiB shard: beyond what the 64 MiB cache can hold.
    write_shard(root / "huge" / "0.shard", [Minishard(span=(MiB, 201 * MiB)), Minishard({1: gz(1), 3: gz(3)})],
                size=1 << 30)
    # 2^30 minishards: a 16 GiB shard index.
    write_shard(root / "wide" / "0.shard", [Minishard({0: gz(0)})])
    # 1 GiB chunks, beyond --max-payload-size: a 1.5 MB payload would be a possible length.
    write_shard(root / "giant" / "0.shard", [Minishard({0: gzip_zeros(GIB_1_5)})])
    bad = {f"payload/{chunk_name(i)}": Bad(64) for i in (0, 1, 4, 5)}
    bad.update({f"index/{chunk_name(i)}": Bad() for i in (0, 4, 3, 7)})
    bad.update({f"huge/{chunk_name(i)}": Bad() for i in (0, 2)})
    bad[f"wide/{chunk_name(0)}"] = Bad()
    bad["giant/0-1024_0-1024_0-1024"] = Bad()
    good = {f"payload/{chunk_name(i)}": content(i) for i in (2, 3, 6, 7)}
    good.update({f"index/{chunk_name(i)}": content(i) for i in (1, 5, 9, 13, 2, 6, 10, 14)})
    good.update({f"huge/{chunk_name(i)}": content(i) for i in (1, 3)})
    return root, bad, good


def test_precomputed_bombs(precomputed, mount):
    root, bad, good = precomputed
    m = mount(root)
    assert_contained(m, bad, good, GROWTH_MIB)


# -- DVID export -----------------------------------------------------------------------------

DVID_SHARDING = {"@type": "neuroglancer_uint64_sharded_v1", "hash": "identity", "preshift_bits": 0,
                 "minishard_bits": 0, "shard_bits": 0, "minishard_index_encoding": "raw", "data_encoding": "raw"}
DVID_GRID = (4, 2, 1)
BLOCK_BYTES = BLOCK ** 3 * 8


def header(gx: int, gy: int, gz: int, labels: int) -> bytes:
    return np.array([gx, gy, gz, labels], dtype="<u4").tobytes()


def good_block(seed: int) -> np.ndarray:
    """A (z, y, x) block of a few supervoxels in 8^3 sub-blocks."""
    coarse = np.random.default_rng(seed).integers(1, 6, size=(8, 8, 8)).astype(np.uint64)
    return np.kron(coarse, np.ones((8, 8, 8), dtype=np.uint64))


def dvid_name(cell: tuple[int, int, int]) -> str:
    return "_".join(f"{c * BLOCK}-{(c + 1) * BLOCK}" for c in cell)


@pytest.fixture(scope="module")
def dvid(tmp_path_factory) -> tuple[Path, dict[str, Bad], dict[str, bytes]]:
    root = tmp_path_factory.mktemp("bombs") / "dvid"
    one = np.array([1], dtype=np.uint64)
    hostile = {
        (0, 0, 0): zstd_zeros(GIB_1_5),  # frames inflating to 1.5 GiB
        (1, 0, 0): zstd_declaring(bytes(UNIT), 1 << 40),  # one frame declaring 1 TiB
        (2, 0, 0): header(1 << 20, 1 << 20, 1 << 20, 0),  # a 2^23-voxel-wide block
        (3, 0, 0): header(8, 8, 8, (1 << 32) - 1),  # 4 G labels
    }
    blocks = {cell: (data, one) for cell, data in hostile.items()}
    volumes = {(x, 1, 0): good_block(x) for x in range(4)}
    for cell, zyx in volumes.items():
        svs = np.unique(zyx)
        blocks[cell] = (encode_block(zyx), svs)
    write_scale(root / "s0", blocks, DVID_GRID, DVID_SHARDING, Variant("csv", "stream", False, batch_size=1))
    (root / "info").write_text(json.dumps(info_for([tuple(g * BLOCK for g in DVID_GRID)], DVID_SHARDING)))
    # Break the list offsets of two good records: labels past their values, a binary past its data.
    shard, index = root / "s0" / "0_0_0.arrow", root / "s0" / "0_0_0.csv"
    breaks = {(2, 1, 0): ("labels", 0x7FFFFFF0), (3, 1, 0): ("dvid_compressed_block", 0x40000000)}
    schema = _stream_schema(shard)
    data = bytearray(shard.read_bytes())
    for line in index.read_text().splitlines()[2:]:
        x, y, z, offset, size, _ = map(int, line.split(","))
        if (x, y, z) in breaks:
            column, value = breaks[(x, y, z)]
            at = offset + record_buffers(bytes(data[offset:offset + size]), schema)[(column, 1)]
            data[at + 4:at + 8] = np.array([value], dtype="<i4").tobytes()  # the row's end offset
    shard.write_bytes(bytes(data))
    scale_key = info_for([(1, 1, 1)], DVID_SHARDING)["scales"][0]["key"]
    bad = {f"{scale_key}/{dvid_name(cell)}": Bad(BLOCK_BYTES) for cell in [*hostile, *breaks]}
    good = {f"{scale_key}/{dvid_name(cell)}": agglomerate(zyx).astype("<u8").tobytes()
            for cell, zyx in volumes.items() if cell not in breaks}
    return root, bad, good


def _stream_schema(path: Path):
    import pyarrow as pa

    with pa.ipc.open_stream(pa.py_buffer(path.read_bytes())) as reader:
        return reader.schema


def test_dvid_bombs(dvid, mount):
    root, bad, good = dvid
    m = mount(root)
    assert_contained(m, bad, good, GROWTH_MIB)


def test_arrow_bit_flips_never_crash():
    """Every single-bit flip, and random byte damage, of a record batch: a Record or a DataError,
    in a process of its own (pyarrow would abort or segfault on unvalidated offsets)."""
    script = textwrap.dedent("""
        import numpy as np, pyarrow as pa
        from unshardfs.util.errors import DataError
        from unshardfs.formats.dvid.shard import decode_record
        from unshardfs.testing.dvid import _schema

        rng = np.random.default_rng(0)
        for zstd in (False, True):
            schema = _schema(zstd)
            row = {"chunk_x": 1, "chunk_y": 2, "chunk_z": 3, "labels": [5, 6, 7], "supervoxels": [1, 2, 3],
                   "dvid_compressed_block": bytes(range(40))}
            if zstd:
                row["uncompressed_size"] = 40
            message = pa.RecordBatch.from_pylist([row, row], schema=schema).serialize().to_pybytes()
            damaged = []
            for bit in range(8 * len(message)):
                data = bytearray(message)
                data[bit // 8] ^= 1 << (bit % 8)
                damaged.append(data)
            for _ in range(3000):
                data = bytearray(message)
                for at in rng.integers(0, len(data), size=rng.integers(1, 8)).tolist():
                    data[at] = int(rng.integers(0, 256))
                damaged.append(data)
            for data in damaged:
                for row_number in (0, 1):
                    try:
                        decode_record(bytes(data), schema, row_number, "fuzz")
                    except DataError:
                        pass
        print("survived")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0 and "survived" in result.stdout, result.stderr[-3000:]


# -- Zarr v3 (shown as Zarr v2) -----------------------------------------------------------------

BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
ZSTD = {"name": "zstd", "configuration": {"level": 3, "checksum": False}}
ZSTD_BOMBS = (zstd_zeros(GIB_1_5), zstd_declaring(bytes(UNIT), 1 << 40))


@pytest.fixture(scope="module")
def zarr(tmp_path_factory) -> tuple[Path, dict[str, Bad], dict[str, bytes]]:
    root = tmp_path_factory.mktemp("bombs") / "zarr"
    arrays = {
        "good": (zarr_array([16], [8], [4], [BYTES]), {"c/0": (2, {0: b"abcd"}), "c/1": (2, {0: b"efgh", 1: b"ijkl"})}),
        # zstd chunks are served as stored (the v2 view's compressor is zstd): never inflated here.
        "zstd": (zarr_array([8], [8], [4], [BYTES, ZSTD]), {"c/0": (2, dict(enumerate(ZSTD_BOMBS)))}),
        # A 16 MiB index of 2^20 cells, two of them present: the listing costs two entries.
        "sparse": (zarr_array([1 << 20], [1 << 20], [1], [BYTES]), {"c/0": (1 << 20, {0: b"a", (1 << 20) - 1: b"z"})}),
        # 1-byte shards whose zarr.json declares 2^25, 2^29 (2-D), 2^20 inner chunks per shard.
        "big25": (zarr_array([1 << 25], [1 << 25], [1], [BYTES]), {"c/0": b"x"}),
        "big29": (zarr_array([1 << 15, 1 << 14], [1 << 15, 1 << 14], [1, 1], [BYTES]), {"c/0/0": b"x"}),
        "big20": (zarr_array([1 << 20], [1 << 20], [1], [BYTES]), {"c/0": b"x"}),
        # a grid of 2^40 inner chunks, and one beyond what int64 can address (left out of the view).
        "vast": (zarr_array([1 << 40, 1 << 20], [1 << 20, 1 << 20], [1 << 10, 1 << 10], [BYTES]), {"c/0/0": b"x"}),
        "overflow": (zarr_array([1 << 62, 1 << 62], [1, 1], [1, 1], [BYTES]), {"c/0/0": b"x"}),
    }
    (root).mkdir(parents=True)
    (root / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    for name, (meta, shards) in arrays.items():
        (root / name).mkdir()
        (root / name / "zarr.json").write_text(json.dumps(meta))
        for key, chunks in shards.items():
            path = root / name / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(chunks if isinstance(chunks, bytes) else zarr_shard(*chunks))
    good = {"good/0": b"abcd", "good/2": b"efgh", "good/3": b"ijkl", "zstd/0": ZSTD_BOMBS[0], "zstd/1": ZSTD_BOMBS[1],
            "sparse/0": b"a", f"sparse/{(1 << 20) - 1}": b"z"}
    bad = {"big25/0": Bad(), "big29/0/0": Bad(), "big20/0": Bad(), "vast/0/0": Bad()}
    return root, bad, good


def test_zarr_bombs(zarr, mount):
    root, bad, good = zarr
    m = mount(root, "--view", "zarr2")
    baseline = peak_rss_mib(m.path)
    assert not (m.path / "overflow").exists() and (m.path / "good" / ".zarray").exists()
    assert not (m.path / "vast" / str((1 << 30) - 1) / "1023").exists()  # the last cell: its shard is absent
    assert sorted(os.listdir(m.path / "sparse")) == [".zarray", "0", str((1 << 20) - 1)]
    assert_contained(m, bad, good, GROWTH_MIB, baseline_mib=baseline)
