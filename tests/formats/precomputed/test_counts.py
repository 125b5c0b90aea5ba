"""Deterministic costs, pinned: backing reads per chunk and per listing, and
the daemon's per-inode memory (which must not grow with listed chunks)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.support.precomputed import chunk_locations
from unshardfs.testing.mounts import stats
from unshardfs.testing.precomputed import Scale, sharding, write_volume

KEY = "1_1_1"
SIZE, CHUNK = (96, 64, 48), (8, 8, 8)  # 12*8*6 = 576 chunks of 1 KiB (uint16)


@pytest.fixture(scope="module", params=["raw", "gzip"])
def volume(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"counts-{request.param}")
    spec = sharding(preshift=1, minishard=3, shard=2, index_enc="gzip", data_enc=request.param)
    paths = write_volume(root, [Scale(SIZE, CHUNK, spec)], "uint16")
    return paths, spec


def source_reads(mnt: Path) -> int:
    return stats(mnt)["source"]["reads"]


def test_one_backing_read_per_further_chunk(volume, mount):
    paths, spec = volume
    m = mount(paths["sharded"])
    group = max(chunk_locations(spec, SIZE, CHUNK).values(), key=len)
    assert len(group) >= 4
    first, *rest = group
    assert (m.path / KEY / first).read_bytes() == (paths["plain"] / KEY / first).read_bytes()
    for name in rest:
        before = m.stats()
        assert (m.path / KEY / name).read_bytes() == (paths["plain"] / KEY / name).read_bytes()
        after = m.stats()
        assert after["source"]["reads"] - before["source"]["reads"] == 1, name
        # ...and the minishard index came from the cache: one hit, no miss.
        hits = after["caches"]["minishard_index"]["hits"] - before["caches"]["minishard_index"]["hits"]
        misses = after["caches"]["minishard_index"]["misses"] - before["caches"]["minishard_index"]["misses"]
        assert (hits, misses) == (1, 0), name


def test_copying_a_scale_reads_each_index_once(volume, mount, tmp_path):
    paths, spec = volume
    m = mount(paths["sharded"])
    before = source_reads(m.path)
    subprocess.run(["cp", "-r", str(m.path / KEY), str(tmp_path / "copy")], check=True, timeout=120)
    reads = source_reads(m.path) - before
    shards = sorted((paths["sharded"] / KEY).glob("*.shard"))
    minishards = index_reads = 0
    for shard in shards:
        index = np.frombuffer(shard.read_bytes()[: 16 << spec["minishard_bits"]], dtype="<u8").reshape(-1, 2)
        ranges = sorted((int(s), int(e)) for s, e in index if e > s)
        minishards += len(ranges)
        # Minishard indexes lying back to back (CloudVolume writes them so)
        # are read in one request; TensorStore puts each after its data.
        index_reads += 1 + sum(1 for (_, e0), (s1, _) in zip(ranges, ranges[1:]) if s1 - e0 > 4096)
    chunks = len(os.listdir(paths["plain"] / KEY))
    # Per chunk: its payload, nothing else: the raw encoding fixes every
    # chunk's size, so even gzip payloads need no size trailer read.
    assert reads == len(shards) + index_reads + chunks
    s = m.stats()
    assert s["caches"]["shard_index"]["entries"] == len(shards)
    assert s["caches"]["minishard_index"]["entries"] == minishards


def test_listing_does_not_grow_the_inode_table(volume, mount):
    paths, _ = volume
    m = mount(paths["sharded"])
    names = os.listdir(m.path / KEY)
    assert len(names) == len(os.listdir(paths["plain"] / KEY))
    for entry in os.scandir(m.path / KEY):
        entry.stat()
    fuse = m.stats()["fuse"]
    # root, the scale directory, info: nothing per chunk.
    assert fuse["inodes_tabled"] <= 4, fuse
    assert fuse["nodes_recent"] <= 1 << 16
    # Computed inode numbers are stable and distinct.
    inos = {entry.name: entry.inode() for entry in os.scandir(m.path / KEY)}
    assert len(set(inos.values())) == len(inos)
    assert all(os.stat(m.path / KEY / n).st_ino == i for n, i in list(inos.items())[:50])
