"""The `unshard` fsspec filesystem: the tree a mount shows, through fsspec's synchronous API, no FUSE."""

from __future__ import annotations

import errno
import json
import multiprocessing
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import fsspec
import numpy as np
import pytest
import trio
import zarr

from tests.fsspec.conftest import Datasets
from tests.support.dask import dask_cluster
from tests.support.s3 import CREDENTIALS, moto_s3, upload
from unshardfs.fsspec.session import SESSIONS
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.inprocess import opened, read_file, walk

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    """Every test leaves no session (loop thread, connections) behind."""
    yield
    for cls in (fsspec.get_filesystem_class("unshard"),):
        for fs in list(cls._cache.values()):
            fs.close()
        cls.clear_instance_cache()
    SESSIONS.stop_all()
    assert not [t for t in threading.enumerate() if t.name == "unshardfs-fsspec"]


def mounted_view(source: str, *options: str) -> dict[str, bytes]:
    """Every file of the tree and its bytes, walked in process the way every front end reaches it."""
    async def main() -> dict[str, bytes]:
        async with opened(source, *options) as session:
            return {path: await read_file(node) for path, node in (await walk(session.tree)).items()}
    return trio.run(main)


@pytest.mark.parametrize("kind,view", [("hier", "zarr3"), ("hier", "zarr2"), ("raw", None), ("gzip", None),
                                       ("stored_zip", None), ("deflated_zip", "zarr2"), ("ome_image", "zarr2")])
def test_files_sizes_and_bytes_are_the_mounts(datasets: Datasets, kind: str, view: str | None) -> None:
    source = str(getattr(datasets, kind))
    expected = mounted_view(source, *(["--view", view] if view else []))
    fs = fsspec.filesystem("unshard", source=source, **({"view": view} if view else {}))
    found = fs.find("", detail=True)
    assert {p: info["size"] for p, info in found.items()} == {p: len(b) for p, b in expected.items()}
    assert fs.cat(sorted(expected)) == expected
    for path, data in list(expected.items())[:5]:
        assert fs.cat_file(path) == data
        with fs.open(path) as f:
            f.seek(len(data) // 3)
            assert f.read(100) == data[len(data) // 3:len(data) // 3 + 100]
    directories = {p for p, info in fs.find("", withdirs=True, detail=True).items() if info["type"] == "directory"}
    assert all(fs.isdir(d) for d in directories) and all(fs.isfile(p) for p in list(expected)[:10])


def test_zarr_and_chained_urls_read_the_arrays(datasets: Datasets) -> None:
    group = zarr.open_group(f"unshard::{datasets.hier}", mode="r")
    assert np.array_equal(group["em"][...], datasets.em) and np.array_equal(group["seg"][...], datasets.seg)
    # A file inside the dataset: its nearest parent holding a dataset is opened.
    with fsspec.open(f"unshard::{datasets.raw}/info", "rb") as f:
        assert json.loads(f.read())["scales"][0]["key"] == "1_1_1"
    v2 = fsspec.get_mapper(f"unshard::{datasets.hier}", unshard={"view": "zarr2"})
    assert json.loads(v2[".zattrs"])["about"] == "fsspec and references"
    assert json.loads(v2["em/.zattrs"])["_ARRAY_DIMENSIONS"] == ["z", "y", "x"]


def test_byte_ranges_as_fsspec_defines_them(datasets: Datasets) -> None:
    fs = fsspec.filesystem("unshard", source=str(datasets.raw))
    path = "1_1_1/0-16_0-16_0-16"
    data = (datasets.raw.parent / "plain" / path).read_bytes()
    size = len(data)
    for start, end in [(None, None), (0, 10), (-10, None), (None, -10), (10, 5), (size, None), (size + 5, None),
                       (0, size + 10**12), (-10**12, 3), (5, -10**12), (2**63, 2**64)]:
        assert fs.cat_file(path, start, end) == data[start:end], (start, end)
    assert fs.cat_ranges([path, path, "1_1_1/nothing"], [0, -4, 0], [4, None, 1]) [:2] == [data[:4], data[-4:]]
    with pytest.raises(TypeError):
        fs.cat_file(path, 1.5, None)
    with fs.open(path) as f:
        f.seek(size + 100)
        assert f.read() == b""
        f.seek(-3, 2)
        assert f.read() == data[-3:]


@pytest.mark.parametrize("path", ["..", "../sharded/info", "1_1_1/../../gzip/sharded/info", "/../etc/passwd",
                                  "1_1_1/x\0y", "info/..", "1_1_1/0-16_0-16_0-16/child"])
def test_hostile_paths_name_nothing(datasets: Datasets, path: str) -> None:
    fs = fsspec.filesystem("unshard", source=str(datasets.raw))
    with pytest.raises((FileNotFoundError, NotADirectoryError)):
        fs.cat_file(path)
    assert not fs.exists(path)


def test_read_only(datasets: Datasets) -> None:
    fs = fsspec.filesystem("unshard", source=str(datasets.raw))
    for call in (lambda: fs.pipe_file("x", b"1"), lambda: fs.rm("info"), lambda: fs.mkdir("d"),
                 lambda: fs.open("info", "wb"), lambda: fs.touch("y")):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.EROFS
    with pytest.raises(IsADirectoryError):
        fs.cat_file("1_1_1")
    with pytest.raises(TypeError):
        fsspec.filesystem("unshard", source=str(datasets.raw), no_such_option=3)


def test_damaged_chunk_is_eio_never_missing(datasets: Datasets, tmp_path: Path) -> None:
    copy = tmp_path / "raw"
    shutil.copytree(datasets.raw, copy)
    fs = fsspec.filesystem("unshard", source=str(copy))
    names = [p for p in fs.find("1_1_1")]
    shard = copy / "1_1_1" / "0.shard"
    shard.write_bytes(shard.read_bytes()[:-9000])  # listed, then cut: a minishard index is gone
    results = fs.cat(names, on_error="return")
    failed = {p: r for p, r in results.items() if isinstance(r, Exception)}
    assert failed, "a cut shard must fail some chunk"
    for error in failed.values():
        assert isinstance(error, OSError) and not isinstance(error, FileNotFoundError)
        assert error.errno == errno.EIO and "0.shard" in str(error)
    plain = datasets.raw.parent / "plain"
    assert all(r == (plain / p).read_bytes() for p, r in results.items() if p not in failed)


def test_threads_share_one_session(datasets: Datasets) -> None:
    expected = mounted_view(str(datasets.hier))
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        try:
            fs = fsspec.filesystem("unshard", source=str(datasets.hier))  # fsspec: one instance per thread
            paths = sorted(expected)[i::3] + sorted(expected)
            for path in paths:
                assert fs.cat_file(path) == expected[path]
            assert fs.cat(paths) == {p: expected[p] for p in paths}
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert len(SESSIONS) == 1  # twelve instances, one loop and one set of caches


def test_many_files_in_one_cat_cost_few_requests(datasets: Datasets) -> None:
    with DatasetServer(datasets.raw) as server:
        fs = fsspec.filesystem("unshard", source=server.url, read_ahead=False)
        names = fs.find("1_1_1")
        server.faults.delay = 0.05  # an object store's latency: round trips can be told apart
        server.reset_log()
        fs.cat(names)
        # 24 chunks in two shards, indexes cached by the listing: each chunk read once, all at the
        # same time (one round trip, where fsspec's own `cat` would wait for 24 one after another).
        assert len(server.requests()) == 24 and server.round_trips() <= 2, server.round_trips()
        server.reset_log()
        for name in names:
            fs.cat_file(name)  # cached: no request
        assert server.requests() == []


def test_pickled_and_forked_it_opens_again(datasets: Datasets) -> None:
    fs = fsspec.filesystem("unshard", source=str(datasets.raw))
    data = fs.cat_file("1_1_1/0-16_0-16_0-16")
    clone = pickle.loads(pickle.dumps(fs))
    assert clone.cat_file("1_1_1/0-16_0-16_0-16") == data
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:  # the child inherits the instance, not its loop thread
        assert pool.apply(fs.cat_file, ("1_1_1/0-16_0-16_0-16",)) == data
    fs.close()
    assert fs.cat_file("1_1_1/0-16_0-16_0-16") == data  # used after close: opened again


def test_no_dataset_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as e:
        fsspec.filesystem("unshard", source=str(tmp_path))
    assert "no dataset" in str(e.value)
    assert len(SESSIONS) == 0


def test_using_it_imports_nothing_of_fuse(datasets: Datasets) -> None:
    script = (
        "import sys, fsspec\n"
        f"fs = fsspec.filesystem('unshard', source={str(datasets.hier)!r}, view='zarr2')\n"
        "assert fs.cat_file('em/.zarray')\n"
        "fs.close()\n"
        "bad = [m for m in sys.modules if m.startswith(('unshardfs.fuse', 'pyfuse3'))]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def _worker_read(fs: Any, path: str) -> tuple[bytes, list[str]]:
    return fs.cat_file(path), [m for m in sys.modules if m.startswith(("unshardfs.fuse", "pyfuse3"))]


@pytest.mark.slow
def test_dask_worker_reads_it_without_fuse(datasets: Datasets, tmp_path: Path) -> None:
    """A worker started by Dask's own command (as a batch system starts one), sent the pickled instance."""
    pytest.importorskip("distributed")
    fs = fsspec.filesystem("unshard", source=str(datasets.hier))
    path = sorted(fs.find("em"))[-1]
    scheduler_file = tmp_path / "scheduler.json"
    task_module = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with dask_cluster(scheduler_file, 1, "--nthreads", "2", env=task_module) as client:
        data, fuse_modules = client.submit(_worker_read, fs, path).result(timeout=120)
    assert data == fs.cat_file(path) and fuse_modules == []


def test_over_s3_with_storage_options_passed_through(datasets: Datasets, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    pytest.importorskip("s3fs")
    with moto_s3() as (endpoint, client):
        upload(client, "bucket", datasets.hier, "em.zarr")
        group = zarr.open_group("unshard::s3://bucket/em.zarr", mode="r",
                                storage_options={"s3": {"endpoint_url": endpoint, "anon": False}})
        assert np.array_equal(group["em"][...], datasets.em)
        fs = fsspec.filesystem("unshard", source="s3://bucket/em.zarr", s3_endpoint=endpoint, view="zarr2")
        assert json.loads(fs.cat_file("seg/.zarray"))["compressor"]["id"] == "gzip"
        fsspec.get_filesystem_class("unshard").clear_instance_cache()
        SESSIONS.stop_all()


def test_over_http(datasets: Datasets) -> None:
    with DatasetServer(datasets.raw.parent) as server:
        with fsspec.open(f"unshard::{server.url}/sharded/info", "rb") as f:
            assert json.loads(f.read())["scales"][0]["key"] == "1_1_1"
        fs = fsspec.filesystem("unshard", source=f"{server.url}/sharded")
        plain = datasets.raw.parent / "plain" / "1_1_1" / "16-32_0-16_0-16"
        assert fs.cat_file("1_1_1/16-32_0-16_0-16") == plain.read_bytes()
        SESSIONS.stop_all()


def test_pipelines_and_versioned_stores(datasets: Datasets, tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.support.ocdbt import write_zarr

    pipeline = f"{datasets.stored_zip}|zip:|zarr3:"
    fs = fsspec.filesystem("unshard", source=pipeline)
    expected = mounted_view(pipeline)
    assert fs.cat(sorted(expected)) == expected
    db = tmp_path_factory.mktemp("ocdbt")
    write_zarr(db)
    expected = mounted_view(str(db))
    assert any(p.startswith("@v") for p in expected)  # every version a directory, as a mount shows them
    fs = fsspec.filesystem("unshard", source=str(db))
    assert {p: i["size"] for p, i in fs.find("", detail=True).items()} == {p: len(b) for p, b in expected.items()}
    assert fs.cat(sorted(expected)) == expected


def test_a_session_opening_may_call_back_into_the_registry(datasets: Datasets, monkeypatch: pytest.MonkeyPatch) -> None:
    """Garbage collection in an opening session's thread runs finalizers that come back to the
    registry: the registry's lock must not be held while a session opens (it was: a deadlock)."""
    from unshardfs.app.opened import OpenedSource

    real = OpenedSource.open.__func__  # type: ignore[attr-defined]

    async def open_calling_back(cls: Any, *args: Any, **kwargs: Any) -> Any:
        len(SESSIONS)  # what a finalizer's note taken up there does: the registry, from the loop thread
        return await real(cls, *args, **kwargs)

    monkeypatch.setattr(OpenedSource, "open", classmethod(open_calling_back))
    done: list[object] = []
    opener = threading.Thread(target=lambda: done.append(fsspec.filesystem("unshard", source=str(datasets.raw))),
                              daemon=True)
    opener.start()
    opener.join(30)
    assert not opener.is_alive() and done, "opening a session deadlocked on the registry"


def test_an_instance_collected_as_garbage_releases_its_session(datasets: Datasets) -> None:
    import gc

    cls = fsspec.get_filesystem_class("unshard")
    fs = cls(source=str(datasets.raw), skip_instance_cache=True)
    assert fs.cat_file("info") and len(SESSIONS) == 1
    del fs
    gc.collect()
    assert len(SESSIONS) == 0  # the note taken up: the session's last user is gone
