"""The datasets of the latency tests and what each request sent to them was for.

Shared by the tests that pin request and round-trip costs through real mounts over the test HTTP
server (tests/sources/test_latency.py) and their in-process counterparts over a `LatencySource`
under trio's MockClock (tests/core/test_latency_inprocess.py).

The precomputed volume is 256 raw chunks of 4 KiB (16^3 uint8) in 4 shards x 4 minishards
(murmurhash), in two layouts of the same chunks: TensorStore's, which writes each minishard
index right after its chunks, and CloudVolume's (Igneous), which writes all minishard indexes
together after the data. The Zarr v3 array (zarr-python) holds 128 inner chunks of 4 KiB in 8
shards.
"""

from __future__ import annotations

import os
import random
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np

from unshardfs.core.policy import POLICY
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.testing.zarr import BYTES_LE, ZCase, codec
from unshardfs.testing.zarr import sharding as zsharding
from unshardfs.testing.zarr import write_case

SPEC = sharding(minishard=2, shard=2)
SCALE = Scale((128, 128, 64), (16, 16, 16), SPEC)
KEY = "1_1_1"
# Segmentation as viewers read it: a file's size is known only from its payload (gzip trailer).
SEG_SCALE = Scale((128, 128, 64), (16, 16, 16), sharding(minishard=2, shard=2, data_enc="gzip"),
                  encoding="compressed_segmentation", extra={"compressed_segmentation_block_size": [8, 8, 8]})
# Reads of a scan before it is recognised: after a listing, its first entry (or lowest id) and one
# that follows it (a viewer, which never lists, needs a first read and two that follow it).
SCANNED_BEFORE_READ_AHEAD = 2
# A scan in listing order from the listing's first entry: that read is a request of its own and
# prefetches the next OPEN_WINDOW entries (one more request), which the read confirming the scan
# joins: one read of its own, a round trip sooner.
OPEN_WINDOW = POLICY.open_window
LISTED_OWN_READS = 1
ZCASE = ZCase((64, 64, 128), "uint8", (32, 32, 64), [zsharding((16, 16, 16), [BYTES_LE])], (16, 16, 16),
              [BYTES_LE], key_encoding=codec("default", separator="."), holes=False)
# A Zarr shard's index at its end: 16 entries of 16 bytes and a crc32c.
ZARR_INDEX = 16 * 16 + 4


def chunk_keys(plain_dir: Path) -> dict[str, int]:
    """Chunk name -> chunk id (compressed Morton code of its grid cell), computed with CloudVolume."""
    from cloudvolume.datasource.precomputed.common import compressed_morton_code

    grid = [s // c for s, c in zip(SCALE.size, SCALE.chunk)]
    keys = {}
    for name in os.listdir(plain_dir):
        cell = [int(part.split("-")[0]) // c for part, c in zip(name.split("_"), SCALE.chunk)]
        keys[name] = int(compressed_morton_code(cell, grid))
    return keys


def igneous_layout(target: Path, tensorstore: Path, plain_dir: Path) -> None:
    """The chunks of `plain_dir` sharded by CloudVolume (minishard indexes together after the data)."""
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification, synthesize_shard_files

    chunks = {path: (plain_dir / name).read_bytes() for name, path in chunk_keys(plain_dir).items()}
    (target / KEY).mkdir(parents=True)
    shutil.copy(tensorstore / "info", target / "info")
    for name, data in synthesize_shard_files(ShardingSpecification.from_dict(dict(SPEC)), chunks).items():
        (target / KEY / name).write_bytes(data)


def write_site(root: Path, nested: bool = True, seg: bool = True) -> Path:
    """The datasets under `root`: tensorstore/plain (the unsharded chunks), ts and igneous (the
    two shard layouts), zarr and nested (the Zarr array with '.' and '/' chunk keys), seg."""
    volume = write_volume(root / "tensorstore", [SCALE], "uint8")
    volume["sharded"].rename(root / "ts")
    igneous_layout(root / "igneous", root / "ts", volume["plain"] / KEY)
    write_case(root / "zarr", "arr", ZCASE)
    if nested:
        write_case(root / "nested", "arr", replace(ZCASE, key_encoding=codec("default", separator="/")))
    if seg:
        write_volume(root / "seg", [SEG_SCALE], "uint64", volume_type="segmentation")
    return root


def plain(site: Path) -> Path:
    return site / "tensorstore" / "plain" / KEY


# -- what each request was for ------------------------------------------------------------

class Sent(NamedTuple):
    """A request as the shard classifier sees it: its object, whether it was a stat (a HEAD), and
    the bytes it asked for (None: a suffix or no range)."""

    path: str
    head: bool
    first: int | None
    last: int | None


def sent_over_http(server: DatasetServer, method: str | None = None) -> list[Sent]:
    """The requests the test HTTP server logged."""
    out = []
    for r in server.requests(method):
        first = last = None
        if r.range and r.range.startswith("bytes=") and not r.range.startswith("bytes=-"):
            a, _, b = r.range[len("bytes="):].partition("-")
            first, last = int(a), int(b)
        out.append(Sent(r.path, r.method == "HEAD", first, last))
    return out


def sent_to(source: LatencySource) -> list[Sent]:
    """The requests a `LatencySource` logged (a stat is a HEAD; a head, a stat with the first bytes,
    is the GET of its range; a tail has no absolute range)."""
    return [Sent(r.path, r.kind == "stat",
                 *((r.offset, r.offset + r.size - 1) if r.kind in ("read", "head") else (None, None)))
            for r in source.log]


class Shards:
    """Byte ranges of a served precomputed chunk directory, parsed here from the files."""

    def __init__(self, directory: Path) -> None:
        self.index_size = 16 << SPEC["minishard_bits"]
        self.minishards: dict[str, list[range]] = {}
        self.chunks: dict[str, list[range]] = {}
        for shard in sorted(directory.glob("*.shard")):
            raw = shard.read_bytes()
            index = np.frombuffer(raw[:self.index_size], "<u8").reshape(-1, 2)
            self.minishards[shard.name] = [range(self.index_size + int(a), self.index_size + int(b))
                                           for a, b in index if a != b]
            chunks = []
            for r in self.minishards[shard.name]:
                table = np.frombuffer(raw[r.start:r.stop], "<u8").reshape(3, -1)
                ends = self.index_size + np.cumsum(table[1] + table[2])
                chunks += [range(int(e - n), int(e)) for e, n in zip(ends, table[2])]
            self.chunks[shard.name] = sorted(chunks, key=lambda c: c.start)

    def kind(self, shard: str, sent: Sent) -> str:
        if sent.head:
            return "head"
        first, last = sent.first, sent.last
        if first is None or last is None:
            return "other"
        if (first, last) == (0, self.index_size - 1):
            return "index"
        if any(first < r.stop and r.start <= last for r in self.chunks[shard]):
            return "payload"  # (with any minishard index between its chunks)
        if any(first < r.stop and r.start <= last for r in self.minishards[shard]):
            return "minishard"
        return "other"

    def costs(self, sent: Iterable[Sent]) -> dict[str, Counter[str]]:
        """Requests per shard file and kind (head, index, minishard, payload)."""
        out: dict[str, Counter[str]] = {name: Counter() for name in self.chunks}
        for s in sent:
            name = s.path.rsplit("/", 1)[-1]
            if name in out:
                out[name][self.kind(name, s)] += 1
        return out

    def payload_ranges(self, sent: Iterable[Sent]) -> dict[str, list[range]]:
        out: dict[str, list[range]] = {name: [] for name in self.chunks}
        for s in sent:
            name = s.path.rsplit("/", 1)[-1]
            if name in out and self.kind(name, s) == "payload":
                assert s.first is not None and s.last is not None
                out[name].append(range(s.first, s.last + 1))
        return out

    def check_payloads(self, sent: Iterable[Sent], reread: int = 0) -> int:
        """Every chunk fetched, every read whole chunks (with what lies between them), at most
        `reread` chunks fetched twice; returns the bytes fetched beyond each chunk once."""
        extra = 0
        for name, reads in self.payload_ranges(sent).items():
            starts = {c.start for c in self.chunks[name]}
            stops = {c.stop for c in self.chunks[name]}
            assert all(r.start in starts and r.stop in stops for r in reads), f"{name}: {reads} cut chunks"
            times = [sum(c.start >= r.start and c.stop <= r.stop for r in reads) for c in self.chunks[name]]
            assert min(times) == 1, f"{name}: chunks never fetched"
            reread -= sum(t - 1 for t in times)
            extra += sum(len(r) for r in reads) - sum(len(c) for c in self.chunks[name])
        assert reread >= 0, "chunks fetched twice"
        return extra


# -- scattered reads: a viewer -----------------------------------------------------------------

def scattered(site: Path, n: int, seed: int) -> list[str]:
    """`n` chunk names, none next to another in key order or in its minishard's table: no two
    of them could be the start of a scan, in whatever order they are read."""
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification

    spec = ShardingSpecification.from_dict(dict(SPEC))
    path = chunk_keys(plain(site))
    table: dict[tuple[int, int], list[int]] = {}
    for k in sorted(path.values()):
        loc = spec.compute_shard_location(k)
        table.setdefault((loc.shard_number, int(loc.minishard_number)), []).append(k)
    near: dict[int, set[int]] = {k: {k - 1, k + 1} for k in path.values()}
    for keys in table.values():
        for a, b in zip(keys, keys[1:]):
            near[a].add(b)
            near[b].add(a)
    names = sorted(path)
    random.Random(seed).shuffle(names)
    picked: list[str] = []
    taken: set[int] = set()
    for name in names:
        if len(picked) < n and not near[path[name]] & taken:
            picked.append(name)
            taken.add(path[name])
    assert len(picked) == n
    return picked
