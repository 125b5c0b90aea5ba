"""A format written outside the repository, as a third party would: a package in a temporary
directory that imports only the public API (`unshardfs.abc`, and `unshardfs.testing` for its
tests), declares its format and a codec by entry points naming the objects, and runs the shipped
`FormatConformance` and `SourceConformance` suites from its own test module, in a pytest of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from unshardfs.testing.setups import SETUPS

PLUGIN = '''
"""A shard is `<n>.pack`: payloads, then (id, offset, length) u64 triples, then the u64 entry
count; chunk k lives in shard k % S and shows as `<k>.chunk`, its bytes stored XOR 0x5a."""

import struct

import numpy as np

from unshardfs.abc import (Blob, ChunkContext, ChunkInventory, ChunkTable, Codec, ConfigError, DataError, Dataset,
                           DecimalNaming, Fields, FixedSize, FormatPlugin, ShardedDir, ShardedStore, codec)

MARKER = "pack.json"


class XorCodec(Codec):
    name = "xor5a"

    def decode(self, payload, f, prepared=None):
        return (np.frombuffer(payload, np.uint8) ^ 0x5A).tobytes()


class PackStore(ShardedStore[int, ChunkTable]):
    def __init__(self, runtime, shards):
        super().__init__(runtime, "")
        self.count = shards

    def shard_of(self, id):
        return id % self.count

    def is_shard_file(self, name):
        return name.endswith(".pack")

    async def shards(self, within=None):
        names = [name async for name, st in self.source.list("") if name.endswith(".pack") and not st.is_dir]
        for n in sorted(int(name[:-5]) for name in names if name[:-5].isdigit()):
            yield n

    async def open_shard(self, shard):
        st = await self.source.stat(f"{shard}.pack")
        return None if st is None or st.is_dir else self.blob(f"{shard}.pack", st)

    async def read_index(self, shard, blob):
        if blob.size < 8:
            raise DataError(blob.label, "too short for an entry count")
        (n,) = struct.unpack("<Q", await self.read_index_bytes(blob, blob.size - 8, 8))
        if 24 * n > blob.size - 8:
            raise DataError(blob.label, f"{n} entries do not fit in the file")
        raw = await self.read_index_bytes(blob, blob.size - 8 - 24 * n, 24 * n)
        e = np.frombuffer(raw, "<u8").reshape(-1, 3).T
        return ChunkTable.build(blob, e[0], e[1], e[2], 0, blob.size - 8 - 24 * n)


class PackFormat(FormatPlugin):
    name = "pack"
    description = "third-party pack"
    marker = "a pack.json"

    async def detect(self, source, options):
        st = await source.stat(MARKER)
        return st is not None and not st.is_dir

    async def open(self, runtime, options):
        import json

        st = await runtime.source.stat(MARKER)
        root = await runtime.source.stat("")
        meta = Fields(json.loads(await runtime.source.read(MARKER, 0, st.size)), MARKER)
        shards, size = meta.int("shards", lo=1, hi=64), meta.int("chunk_size", lo=1, hi=1 << 20)
        ctx = ChunkContext(PackStore(runtime, shards), DecimalNaming(".chunk"), codec("xor5a"), FixedSize(size))
        part = ChunkInventory("pack chunks", "", ctx, f"id % {shards}", shards)

        async def inventory():
            yield part

        return Dataset(ShardedDir(runtime.source, "", root, ctx), inventory)
'''

WRITER = '''
import json
import struct

import numpy as np


def write(root, chunks, shards):
    """`root/sharded` and its unsharded twin `root/plain`; returns them."""
    sharded, plain = root / "sharded", root / "plain"
    for d in (sharded, plain):
        d.mkdir(parents=True)
    size = len(next(iter(chunks.values())))
    for d in (sharded, plain):  # the marker passes through unchanged
        (d / "pack.json").write_text(json.dumps({"shards": shards, "chunk_size": size}))
    for n in range(shards):
        mine = sorted(k for k in chunks if k % shards == n)
        if not mine:
            continue
        body, index = b"", []
        for k in mine:
            index.append((k, len(body), size))
            body += (np.frombuffer(chunks[k], np.uint8) ^ 0x5A).tobytes()
        (sharded / f"{n}.pack").write_bytes(body + np.array(index, "<u8").tobytes() + struct.pack("<Q", len(mine)))
    for k, data in chunks.items():
        (plain / f"{k}.chunk").write_bytes(data)
    return sharded, plain
'''

TESTS = '''
import struct

import numpy as np
import pytest

from unshardfs.testing.format_conformance import Damaged, FormatCase, FormatConformance
from unshardfs.testing.memory import MemorySource
from unshardfs.testing.source_conformance import TREE, SourceConformance

from extpack.writer import write

KEYS = [0, 1, 2, 3, 5, 7, 9, 11, 13, 40, 2**40 + 1]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    rng = np.random.default_rng(5)
    chunks = {k: rng.bytes(300) for k in KEYS}
    sharded, plain = write(tmp_path_factory.mktemp("pack"), chunks, 2)
    odd = [f"{k}.chunk" for k in KEYS if k % 2]

    def damage(root):
        shard = root / "1.pack"
        data = shard.read_bytes()
        shard.write_bytes(data[:-8] + struct.pack("<Q", 10**9))
        return Damaged(shard, frozenset(odd))

    return FormatCase(sharded, plain, damage, odd, absent=["4.chunk", "6.chunk"])


class TestPackFormat(FormatConformance):
    pass


class TestMemorySource(SourceConformance):
    listable, remote = True, False

    @pytest.fixture
    def source(self):
        return MemorySource(TREE)

    @pytest.fixture
    def make(self, source):
        return lambda: source

    @pytest.fixture
    def change(self, source):
        return lambda id, data: source.remove(id) if data is None else source.put(id, data)
'''


@pytest.mark.slow
def test_third_party_format_passes_the_shipped_suites(tmp_path: Path) -> None:
    site = tmp_path / "site"
    pkg = site / "extpack"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "plugin.py").write_text(textwrap.dedent(PLUGIN))
    (pkg / "writer.py").write_text(textwrap.dedent(WRITER))
    info = site / "extpack-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: extpack\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[unshardfs.formats]\npack = extpack.plugin:PackFormat\n\n"
                                           "[unshardfs.codecs]\nxor5a = extpack.plugin:XorCodec\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_pack.py").write_text(textwrap.dedent(TESTS))
    # Only the public API: the plug-in imports nothing of unshardfs but `unshardfs.abc`.
    imported = {line.split()[1] for line in PLUGIN.splitlines() if line.startswith(("from unshardfs", "import unshardfs"))}
    assert imported == {"unshardfs.abc"}, imported
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *inherited])}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tests),
                             str(tests / "test_pack.py")], capture_output=True, text=True, timeout=240, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    # Every test of both suites ran and passed: 4 of the format suite on each engine and transport,
    # 18 of the source suite.
    assert result.stdout.splitlines()[-1].startswith(f"{4 * len(SETUPS) + 18} passed in"), result.stdout[-2000:]
