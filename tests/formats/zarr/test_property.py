"""Property-based: a Zarr shard whose index is protected by crc32c, damaged at
random (byte flips anywhere in the index, truncation anywhere): every inner
chunk read through the format layer is the exact stored chunk, absent, or a
DataError, never other bytes and never another exception."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.profiles import examples
from unshardfs.app.opened import OpenedSource
from unshardfs.testing.zarr import BYTES_LE, CRC, ZCase, codec, sharding, write_case
from unshardfs.util.errors import DataError

SHARD = "arr/c/0/0"
INNER = [(i, j) for i in range(4) for j in range(4)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("zprop")
    case = ZCase((16, 16), "uint16", (16, 16), [sharding((4, 4), [BYTES_LE, codec("gzip", level=1)], (BYTES_LE, CRC))],
                 (4, 4), [BYTES_LE, codec("gzip", level=1)], holes=False)
    write_case(root, "arr", case)
    return root


def read_all(store: Path) -> dict[tuple, object]:
    """Each inner chunk's bytes, None when absent, or the DataError."""

    async def main() -> dict:
        tree = (await OpenedSource.open(str(store))).tree
        out: dict[tuple, object] = {}
        for index in INNER:
            try:
                node = await tree.lookup("c")
                for part in map(str, index):
                    node = None if node is None else await node.lookup(part)  # type: ignore[attr-defined]
                out[index] = None if node is None else await node.read(0, node.size)  # type: ignore[attr-defined]
            except DataError as e:
                out[index] = e
        return out

    return trio.run(main)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_index_never_yields_other_bytes(pristine, tmp_path, data):
    assert all(isinstance(v, bytes) for v in read_all(pristine / "sharded" / "arr").values())
    store = Path(tempfile.mkdtemp(dir=tmp_path)) / "arr"
    shutil.copytree(pristine / "sharded" / "arr", store)
    shard = store / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    index_size = 16 * len(INNER) + 4
    if data.draw(st.booleans()):
        at = data.draw(st.integers(len(raw) - index_size, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
    else:
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    shard.write_bytes(bytes(raw))
    for index, got in read_all(store).items():
        want = (pristine / "plain" / "arr" / "c" / str(index[0]) / str(index[1])).read_bytes()
        assert got is None or isinstance(got, DataError) or got == want, index
