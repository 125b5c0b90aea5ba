"""A file that exists but is refused is never a file that is absent.

Neuroglancer's committed OME-Zarr 0.6 examples store the chunk `array/c/0/0/0` of `scale.zarr` as a
symbolic link to `../../../../../../base_array/0`, outside the array (vendored under tests/data). The
mount refuses to follow it -- and must say so: the chunk is listed, reads as EIO, fails `check` with
its name and reason, and is reported by `export`; zarr-python reading through the mount fails instead
of reading the fill value. The same for the other ways a file is refused: a link that loops, a FIFO or
socket where a file should be, a file that cannot be opened."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
from pathlib import Path
from typing import AsyncIterator

import numpy as np
import pytest
import trio
import zstandard

from unshardfs.sources.base import ByteSource, ObjectStat, SourceLayer
from unshardfs.testing.inprocess import opened, read_file, resolve
from unshardfs.testing.mounts import run_cli
from unshardfs.tree.nodes import DirNode, FileNode
from unshardfs.util.errors import DataError, SourceError

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "neuroglancer_ome_zarr_0.6"
CHUNK = "array/c/0/0/0"
SHAPE = (27, 226, 186)


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    """A copy of the vendored examples (links kept) with a chunk where the link points: the array's
    values, zstd-compressed, as `base_array/0` holds them in Neuroglancer's tree."""
    root = tmp_path_factory.mktemp("ome06") / "all_0.6"
    shutil.copytree(EXAMPLES, root, symlinks=True)
    (root / "base_array").mkdir()
    values = np.random.default_rng(5).integers(1, 255, size=SHAPE, dtype=np.uint8)
    (root / "base_array" / "0").write_bytes(zstandard.ZstdCompressor(level=3).compress(values.tobytes()))
    return root / "basic" / "scale.zarr"


async def _listing(directory: DirNode) -> dict[str, FileNode | DirNode]:
    out = {}
    async for batch in directory.entries():
        for name, node in batch:
            out[name] = node
    return out


def test_a_link_out_of_the_source_is_listed_and_reads_as_eio(examples):
    async def main() -> None:
        async with opened(str(examples)) as session:
            parent = await resolve(session.tree, "array/c/0/0")
            assert isinstance(parent, DirNode)
            listed = await _listing(parent)
            assert list(listed) == ["0"]  # listed, not hidden
            node = await resolve(session.tree, CHUNK)
            assert isinstance(node, FileNode) and node.size > 0  # found by name too
            for found in (node, listed["0"]):
                with pytest.raises(DataError, match="refused: a symbolic link on its way leads outside the source"):
                    await read_file(found)

    trio.run(main)


def test_in_the_zarr2_view_the_refused_chunk_is_listed_and_reads_as_eio(examples):
    """The v2 view computes its chunk names from the v3 chunk files: the refused one is `array/0/0/0`."""
    async def main() -> None:
        async with opened(str(examples), "--view", "zarr2") as session:
            parent = await resolve(session.tree, "array/0/0")
            assert isinstance(parent, DirNode)
            assert list(await _listing(parent)) == ["0"]
            node = await resolve(session.tree, "array/0/0/0")
            assert isinstance(node, FileNode)
            with pytest.raises(DataError, match="refused: a symbolic link on its way leads outside the source"):
                await read_file(node)

    trio.run(main)
    result = run_cli("check", "--view", "zarr2", str(examples))
    assert result.returncode == 1 and "array/0/0/0" in result.stdout + result.stderr, result.stdout + result.stderr


def test_check_fails_naming_the_refused_chunk(examples):
    result = run_cli("check", str(examples))
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if CHUNK in line]
    assert lines and "leads outside the source" in lines[0], result.stdout + result.stderr


def test_export_reports_the_refused_chunk(examples, tmp_path):
    result = run_cli("export", str(examples), str(tmp_path / "out"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert any(CHUNK in line and "leads outside the source" in line
               for line in (result.stdout + result.stderr).splitlines()), result.stdout + result.stderr
    assert not (tmp_path / "out" / CHUNK).exists()


@pytest.mark.parametrize("view", ["zarr3", "zarr2"])
def test_refs_never_send_a_reader_where_the_mount_would_not_go(examples, tmp_path, view):
    """`refs` writes where each file's bytes are stored, for readers elsewhere: a refused file has no
    such place (a reference to the link would read the outside file). One line naming it and why."""
    out = tmp_path / "refs.json"
    result = run_cli("refs", "-q", "--view", view, str(examples), "-o", str(out))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "refused: a symbolic link on its way leads outside the source" in result.stderr, result.stderr
    assert not out.exists()


def test_zarr_python_through_the_mount_fails_instead_of_reading_the_fill_value(examples, mount):
    zarr = pytest.importorskip("zarr")
    m = mount(examples)
    assert os.listdir(m.path / "array/c/0/0") == ["0"]
    with pytest.raises(OSError) as caught:
        (m.path / CHUNK).read_bytes()
    assert caught.value.errno == errno.EIO
    array = zarr.open_array(str(m.path / "array"), mode="r")
    with pytest.raises(Exception) as failed:  # noqa: PT011 - whatever zarr-python wraps the EIO in
        array[:]
    assert "Input/output error" in repr(failed.value) or isinstance(failed.value, OSError), repr(failed.value)


# -- the other ways a file is refused, each where a chunk should be --------------------------------


def _loop(chunk: Path) -> str:
    chunk.symlink_to(chunk.name)
    return "loop"


def _fifo(chunk: Path) -> str:
    os.mkfifo(chunk)
    return "not a regular file"


def _socket(chunk: Path) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(chunk))
    return "not a regular file"


def _unreadable(chunk: Path) -> str:
    chunk.write_bytes(b"x" * 100)
    chunk.chmod(0)
    return "Permission denied"


REFUSALS = {"a link that loops": _loop, "a FIFO": _fifo, "a socket": _socket, "a file that cannot be opened": _unreadable}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_every_refused_file_is_listed_and_fails_check(examples, tmp_path, refusal):
    if refusal == "a file that cannot be opened" and os.geteuid() == 0:
        pytest.skip("root opens any file")
    site = tmp_path / "scale.zarr"
    shutil.copytree(examples, site, symlinks=True)
    chunk = site / CHUNK
    chunk.unlink()
    reason = REFUSALS[refusal](chunk)
    try:
        async def main() -> None:
            async with opened(str(site)) as session:
                parent = await resolve(session.tree, "array/c/0/0")
                assert isinstance(parent, DirNode)
                assert list(await _listing(parent)) == ["0"]
                node = await resolve(session.tree, CHUNK)
                assert isinstance(node, FileNode)
                with pytest.raises(DataError, match=reason):
                    await read_file(node)

        trio.run(main)
        result = run_cli("check", str(site))
        assert result.returncode == 1 and CHUNK in result.stdout + result.stderr, result.stdout + result.stderr
    finally:
        if chunk.exists() and not chunk.is_symlink() and stat.S_ISREG(chunk.lstat().st_mode):
            chunk.chmod(0o644)


# -- a refused shard: its chunks fail, never vanish -------------------------------------------------


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory) -> dict[str, Path]:
    from unshardfs.testing.precomputed import Scale, sharding, write_volume

    root = tmp_path_factory.mktemp("refused-shard")
    return write_volume(root, [Scale((64, 64, 32), (16, 16, 8), sharding(minishard=1, shard=2))], "uint16")


@pytest.mark.parametrize("refusal", ["a link out", "a FIFO"])
def test_a_refused_shard_fails_its_chunks_and_check(precomputed, tmp_path, refusal):
    """A shard that is a link leading outside the source (or a FIFO): a chunk it holds reads as EIO when
    looked up by name, never ENOENT; `check` fails naming the shard and why."""
    site = tmp_path / "site"
    shutil.copytree(precomputed["sharded"], site)
    shard = sorted((site / "1_1_1").glob("*.shard"))[0]
    elsewhere = tmp_path / "elsewhere.shard"
    shutil.move(shard, elsewhere)
    if refusal == "a link out":
        shard.symlink_to(elsewhere)
    else:
        os.mkfifo(shard)
    names = sorted(os.listdir(precomputed["plain"] / "1_1_1"))

    async def main() -> tuple[int, int]:
        async with opened(str(site)) as session:
            absent = failed = 0
            for name in names:
                try:
                    node = await resolve(session.tree, f"1_1_1/{name}")
                    if node is None:
                        absent += 1
                        continue
                    await read_file(node)  # type: ignore[arg-type]
                except DataError:
                    failed += 1
            return absent, failed

    absent, failed = trio.run(main)
    assert absent == 0 and failed > 0, (absent, failed)
    result = run_cli("check", str(site))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert any(shard.name in line and ("outside the source" in line or "not a regular file" in line)
               for line in out.splitlines()), out


# -- the byte sources over a base: what they refuse is listed and fails check -----------------------


def _check_names(site: str, name: str, reason: str, *options: str) -> None:
    result = run_cli("check", *options, site)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert any(name in line and reason in line for line in out.splitlines()), out


def test_an_ocdbt_data_file_refused(tmp_path):
    """A key whose data file is a link leading outside the database: listed, EIO, `check` names it. (A
    second commit writes the B+tree anew in a data file of its own: the key's value stays where the
    first one put it, beside the first commit's nodes.)"""
    ts = pytest.importorskip("tensorstore")
    from tests.support.ocdbt import write_one_chunk

    db = tmp_path / "db"
    value = write_one_chunk(db)
    ts.KvStore.open({"driver": "ocdbt", "base": f"file://{db}/"}).result().write("notes.txt", b"later").result()
    holder = next(f for f in db.rglob("*") if f.is_file() and value in f.read_bytes())
    moved = tmp_path / "elsewhere"
    shutil.move(holder, moved)
    holder.symlink_to(moved)

    async def main() -> None:
        async with opened(str(db)) as session:
            parent = await resolve(session.tree, "arr/c/0")
            assert isinstance(parent, DirNode) and list(await _listing(parent)) == ["0"]
            node = await resolve(session.tree, "arr/c/0/0")
            assert isinstance(node, FileNode) and node.size == len(value)
            with pytest.raises(DataError, match="outside the source"):
                await read_file(node)

    trio.run(main)
    _check_names(str(db), "arr/c/0/0", "outside the source")


def test_a_zip_member_over_the_payload_limit(tmp_path):
    """A DEFLATE member whose size exceeds --max-payload-size: listed with its size, EIO, `check` names
    it and the limit."""
    import zipfile

    archive = tmp_path / "big.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("zarr.json", '{"zarr_format": 3, "node_type": "group"}')
        z.writestr("notes.bin", b"\0" * (3 << 20))
    _check_names(str(archive), "notes.bin", "exceeds the 1 MiB limit", "--max-payload-size", "1")


class _Unlistable(SourceLayer):
    """A local source one of whose directories cannot be listed (as one without read permission, which
    root, running these tests, would read all the same)."""

    def __init__(self, inner: ByteSource, refused: str) -> None:
        super().__init__(inner)
        self.refused = refused

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:  # type: ignore[override]
        if path == self.refused:
            raise SourceError(f"list {path}: Permission denied")
        async for item in self.inner.list(path):
            yield item


def test_a_directory_that_cannot_be_listed_fails_check_and_export(examples, tmp_path):
    """`check` and `export` went down with the listing's error (a traceback, nothing reported of the
    rest); now the directory is one problem, named with why, and the walk goes on."""
    from unshardfs.sources.local import LocalSource
    from unshardfs.dest.opener import open_dest
    from unshardfs.tools.walk import check, export
    from unshardfs.util.logonce import collect_problems

    async def main() -> tuple[list[str], int, list[str], int]:
        source = _Unlistable(LocalSource(str(examples)), "array/c/0")
        async with opened(source, named="zarr") as session:
            with collect_problems() as checked:
                summary = await check(session.tree)
            with collect_problems() as exported:
                written = await export(session.tree, open_dest(str(tmp_path / "out")).files)
        return checked, summary.files, exported, written.files

    checked, files, exported, written = trio.run(main)
    for problems in (checked, exported):
        assert problems == ["listing array/c/0: list array/c/0: Permission denied"], problems
    assert files == written == 2  # the metadata files: the walk went on
