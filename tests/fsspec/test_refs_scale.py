"""`refs` on an array of a million chunks: shard indexes only, in bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import crc32c
import numpy as np
import pyarrow.parquet as pq
import pytest

from unshardfs.testing.http_servers import DatasetServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SIDE, SHARD = 1000, 100  # a 1000 x 1000 array of 1 x 1 chunks: 10^6 chunks in 100 shards of 10^4
INDEX = SHARD * SHARD * 16 + 4  # a shard's index: (offset, length) per chunk, then its crc32c


def write_array(root: Path, side: int = SIDE) -> None:
    """A Zarr v3 array of side^2 one-byte chunks (10^6 by default) in shards of 100 x 100, written here
    (the index at the end)."""
    meta = {"zarr_format": 3, "node_type": "array", "shape": [side, side], "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [SHARD, SHARD]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
            "fill_value": 0, "attributes": {},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [1, 1], "codecs": [{"name": "bytes"}],
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                "index_location": "end"}}]}
    array = root / "big"
    array.mkdir(parents=True)
    (root / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {},
        "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": {"big": meta}}}))
    (array / "zarr.json").write_text(json.dumps(meta))
    count = SHARD * SHARD
    index = np.empty((count, 2), dtype="<u8")
    index[:, 0] = np.arange(count)
    index[:, 1] = 1
    raw = index.tobytes()
    tail = raw + crc32c.crc32c(raw).to_bytes(4, "little")
    for i in range(side // SHARD):
        for j in range(side // SHARD):
            data = ((np.arange(count) + i * 7 + j) % 251 + 1).astype(np.uint8).tobytes()
            (array / f"c.{i}.{j}").write_bytes(data + tail)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(10^6 chunks, 90,000 chunks), written once."""
    root = tmp_path_factory.mktemp("scale")
    write_array(root / "big")
    write_array(root / "small", 300)
    return root / "big", root / "small"


def run_refs(source: str, out: Path, *options: str) -> tuple[int, str]:
    """(max RSS in KiB, stdout) of `unshardfs refs --view zarr2 --inline-threshold 0` in a process of its own."""
    child = subprocess.Popen([sys.executable, "-m", "unshardfs", "refs", "-q", "--view", "zarr2", "--inline-threshold",
                              "0", *options, source, "-o", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    stdout, stderr = child.communicate()
    assert os.waitstatus_to_exitcode(status) == 0, stderr[-2000:]
    return usage.ru_maxrss, stdout


def test_a_million_chunks_from_indexes_alone(arrays: tuple[Path, Path], tmp_path: Path) -> None:
    big, _ = arrays
    out = tmp_path / "refs.parq"
    with DatasetServer(big) as server:
        _, stdout = run_refs(server.url, out, "--format", "parquet", "--record-size", "100000")
        gets = server.requests("GET")
        # The metadata, then each shard's index (its last bytes, with its size): no chunk is read.
        shards = [r for r in gets if "/big/c." in r.path]
        assert len(shards) == 100 and len({r.path for r in shards}) == 100
        assert all(r.range and r.range.startswith("bytes=-") and r.sent == INDEX for r in shards), shards[:3]
        # Besides them, zarr.json and the array's; format detection's probes of names that are absent (404).
        found = [r.path for r in gets if r not in shards and r.status < 400]
        assert sorted(found) == ["/big/zarr.json", "/zarr.json"], found
        assert all(r.status == 404 for r in gets if r not in shards and r.status >= 400)
        assert not [r for r in server.requests("HEAD") if r.path.startswith("/big/c.")]
    assert "1,000,000 references" in stdout
    meta = json.loads((out / ".zmetadata").read_text())
    assert meta["record_size"] == 100_000 and sorted(os.listdir(out / "big")) == [f"refs.{i}.parq" for i in range(10)]
    table = pq.read_table(out / "big" / "refs.3.parq")
    row = 12_345  # chunk 312345 = (312, 345): shard (3, 3), chunk (12, 45) of it
    assert table.column("path")[row].as_py() == f"{server.url}/big/c.3.3"
    assert table.column("offset")[row].as_py() == 12 * SHARD + 45 and table.column("size")[row].as_py() == 1


@pytest.mark.parametrize("layout,per_chunk", [("json", 8), ("parquet", 40)])
def test_memory_does_not_grow_with_the_chunks(arrays: tuple[Path, Path], tmp_path: Path, layout: str,
                                              per_chunk: int) -> None:
    """11 times the chunks, in bounded memory: JSON is streamed (the growth is noise); parquet's references
    are spilled to a file-backed map of 36 bytes a chunk, counted as its pages are touched. Held as
    Python objects, a reference would take over 200 bytes. The shard-index cache is kept small, so
    that its own bound is not what is measured."""
    big, small = arrays
    cache = ("--shard-index-cache", "2", "--format", layout)
    small_rss, _ = run_refs(str(small), tmp_path / "small", *cache)
    big_rss, stdout = run_refs(str(big), tmp_path / "big", *cache)
    assert "1,000,000 references" in stdout
    grown = (big_rss - small_rss) * 1024 / (SIDE * SIDE - 300 * 300)
    assert grown < per_chunk, f"max RSS {small_rss >> 10} MiB for 90,000 chunks, {big_rss >> 10} MiB for 10^6"
