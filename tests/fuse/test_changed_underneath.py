"""A file read through a mount while the file holding its bytes changes underneath: a 1 MiB chunk of an
unsharded Zarr array kept in an OCDBT database, its data file copied over in place (as `cp` does, or with
its size and mtime put back) or renamed over while a reader holds the chunk open with its first pages in
the kernel's cache; and the same for a plain file of a directory. Through the same handle the reader gets
the old bytes or EIO, never the new bytes after the old pages; opened again, the old bytes, the new bytes
or EIO, whole, and soon the new bytes. A rewrite that puts the mtime back is tried once more with the
file's attributes asked for between the change and the read (`--cache-timeout 0`): the kernel keeps its
pages then (the attributes are the same), and so must the daemon keep the node that served them."""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.support.ocdbt import write_one_chunk
from unshardfs.testing.mounts import wait_for
from unshardfs.testing.source_conformance import CHANGES, RESTORED, flipped

CHUNK = 1 << 20
KEY = "arr/c/0/0"  # the array's one chunk, stored raw: 256 pages
FAR = 700 << 10  # a page far from the head the reader holds


@pytest.fixture(scope="module")
def database(tmp_path_factory) -> tuple[Path, bytes]:
    """An OCDBT database (written by TensorStore) holding a Zarr v3 group whose array `arr` is one raw
    1 MiB chunk; and that chunk's bytes."""
    pytest.importorskip("tensorstore")
    root = tmp_path_factory.mktemp("changed") / "db"
    return root, write_one_chunk(root)


def _holder(root: Path, value: bytes) -> tuple[Path, bytes]:
    """The one file under `root` holding `value`, and its content with `value`'s bytes flipped."""
    holders = [f for f in root.rglob("*") if f.is_file() and value in f.read_bytes()]
    assert len(holders) == 1
    data = holders[0].read_bytes()
    at = data.index(value)
    return holders[0], data[:at] + flipped(value) + data[at + len(value):]


def _read(path: Path) -> bytes | int:
    try:
        return path.read_bytes()
    except OSError as e:
        return e.errno or -1


def _what(got: bytes | int, old: bytes, new: bytes) -> str:
    if isinstance(got, int):
        return os.strerror(got)
    return "old" if got == old else "new" if got == new else f"a mix of {len(got):,} bytes"


CASES = [(how, False) for how in CHANGES] + [(RESTORED, True)]


@pytest.mark.parametrize("engine", ["kernel", "pyfuse3"])
@pytest.mark.parametrize(("how", "stat_between"), CASES, ids=[f"{h}{', stat' if s else ''}" for h, s in CASES])
@pytest.mark.parametrize("store", ["ocdbt", "directory"])
def test_a_chunk_held_open_while_its_file_changes_is_never_a_mix(database, tmp_path, mount, engine, how, store,
                                                                 stat_between):
    root, old = database
    if store == "ocdbt":
        source = tmp_path / "db"
        shutil.copytree(root, source)
        holder, changed = _holder(source, old)
        name = KEY
    else:  # a plain file beside a Zarr group, shown as it is
        source = tmp_path / "dir"
        source.mkdir()
        (source / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
        holder = source / "chunk.bin"
        holder.write_bytes(old)
        changed = flipped(old)
        name = "chunk.bin"
    new = flipped(old)
    m = mount(source, "--fuse-engine", engine, *(("--cache-timeout", "0") if stat_between else ()))
    path = m.path / name
    with open(path, "rb", buffering=0) as f:
        # No read-ahead: the kernel holds the head just read (4 pages) and nothing beyond it.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        assert f.read(16 << 10) == old[:16 << 10]
        CHANGES[how](holder, changed)
        if stat_between:
            assert os.stat(path).st_size == CHUNK  # the same attributes: the kernel keeps its pages
        try:
            f.seek(FAR)
            part: bytes | int = f.read(4096)
        except OSError as e:
            part = e.errno or -1
        assert part in (errno.EIO, old[FAR:FAR + 4096]), \
            "the new bytes after the old head" if part == new[FAR:FAR + 4096] else part
        try:
            f.seek(0)
            again: bytes | int = f.read()
        except OSError as e:
            again = e.errno or -1
        assert again in (errno.EIO, old), f"read again through the same handle: {_what(again, old, new)}"
    seen = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # opened again: old, new or EIO, each whole; soon the new bytes
        got = _read(path)
        seen.append(_what(got, old, new))
        assert got in (errno.EIO, old, new), seen
        if got == new:
            break
        time.sleep(0.05)
    assert seen[-1] == "new", seen
    assert wait_for(lambda: _read(path) == new)
