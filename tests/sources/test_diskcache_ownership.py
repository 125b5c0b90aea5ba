"""--cache-dir owns only what it wrote: other programs' files, links planted to lead outside and
other file systems survive every trim (checksums before and after)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.swapping import checksums
from unshardfs.sources.diskcache import DiskCachedSource
from unshardfs.sources.local import LocalSource
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.mounts import run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_volume

HEX = "ab" + "0" * 62  # a name the cache itself could have chosen
SUBDIR, MARKER = "unshardfs-index-cache", "CACHEDIR.TAG"  # as docs/untrusted.md documents them


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("cached-site")
    write_volume(root / "volume", [Scale((64, 64, 32), (16, 16, 8), sharding(minishard=2, shard=2, data_enc="gzip"))],
                 "uint16")
    with DatasetServer(root) as server:
        yield f"{server.url}/volume/sharded"


def own_entries(cache: Path) -> list[Path]:
    return [p for p in cache.glob("??/*")
            if not p.parent.is_symlink() and not p.is_symlink() and p.is_file() and len(p.name) == 64]


def plant_foreign(cache_parent: Path, outside: Path) -> None:
    """What a shared directory such as ~/.cache holds, with names the old cache would have trimmed."""
    outside.mkdir()
    (outside / HEX).write_text("outside the cache directory")
    (outside / "notes.txt").write_text("user data")
    (cache_parent / "ab").mkdir(parents=True)
    (cache_parent / "ab" / HEX).write_text("another program's cache entry")
    (cache_parent / "fontconfig").mkdir()
    (cache_parent / "fontconfig" / "cache-7").write_bytes(os.urandom(4096))
    os.symlink(outside, cache_parent / "cd")  # a symlinked subdirectory pointing outside


def test_trims_delete_only_the_caches_own_files(served, tmp_path):
    cache_parent = tmp_path / "dot-cache"
    outside = tmp_path / "outside"
    plant_foreign(cache_parent, outside)
    cache = cache_parent / SUBDIR
    before = {**checksums(cache_parent, skip=cache), **checksums(outside)}

    warm = run_cli("check", "-q", served, "--cache-dir", str(cache_parent))
    assert warm.returncode == 0, warm.stderr
    written = len(own_entries(cache))
    assert written > 4 and (cache / MARKER).is_file()

    # Inside its own directory too: a bucket that is a link out, a link and a FIFO with entry names.
    # A bucket name the cache has not used (bucket names follow the hashed source URL, whose port varies).
    unused = next(name for name in (f"{i:02x}" for i in range(256)) if not (cache / name).exists())
    os.symlink(outside, cache / unused)
    bucket = own_entries(cache)[0].parent
    os.symlink(outside / HEX, bucket / (bucket.name + "1" * 62))
    os.mkfifo(bucket / (bucket.name + "2" * 62))
    (bucket / "user-file").write_text("not the cache's")
    planted = checksums(cache)
    planted = {path: digest for path, digest in planted.items() if "user-file" in path or digest.startswith("link:")}

    trimmed = run_cli("check", "-q", served, "--cache-dir", str(cache_parent), "--cache-dir-size", "0")
    assert trimmed.returncode == 0, trimmed.stderr
    assert own_entries(cache) == []  # every trim ran: a budget of 0 leaves none of its own files
    assert {**checksums(cache_parent, skip=cache), **checksums(outside)} == before
    assert {path: digest for path, digest in checksums(cache).items() if path in planted} == planted
    assert (bucket / (bucket.name + "2" * 62)).exists() and (cache / MARKER).is_file()


@pytest.mark.parametrize("plant", ["foreign file", "symlink"])
def test_a_directory_it_did_not_make_is_refused(served, tmp_path, plant):
    cache_parent = tmp_path / "shared"
    cache_parent.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / HEX).write_text("keep")
    if plant == "symlink":
        os.symlink(outside, cache_parent / SUBDIR)
    else:
        (cache_parent / SUBDIR).mkdir()
        (cache_parent / SUBDIR / HEX).write_text("keep")
    before = {**checksums(cache_parent), **checksums(outside)}
    result = run_cli("check", "-q", served, "--cache-dir", str(cache_parent), "--cache-dir-size", "0")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "another --cache-dir" in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert {**checksums(cache_parent), **checksums(outside)} == before


def test_an_empty_directory_is_taken_and_marked_and_the_marked_one_reused(tmp_path):
    (tmp_path / "src").mkdir()
    given = tmp_path / "given"
    (given / SUBDIR).mkdir(parents=True)
    cache = DiskCachedSource(LocalSource(str(tmp_path / "src")), str(given))
    assert cache.directory == given / SUBDIR and (given / SUBDIR / MARKER).is_file()
    again = DiskCachedSource(LocalSource(str(tmp_path / "src")), str(given / SUBDIR))  # the cache dir itself
    assert again.directory == given / SUBDIR


def test_trim_never_crosses_into_another_file_system(tmp_path):
    (tmp_path / "src").mkdir()
    cache = DiskCachedSource(LocalSource(str(tmp_path / "src")), str(tmp_path / "c"))
    cache.put(("key", 1), b"x" * 100)  # within the budget: kept
    [entry] = own_entries(cache.directory)
    # Another file system mounted on a bucket the entry is not in (its bucket depends on the source's path).
    bucket = "ab" if entry.parent.name != "ab" else "cd"
    other, foreign = cache.directory / bucket, bucket + HEX[2:]
    other.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", str(other)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (other / foreign).write_text("on another file system")
        cache.max_bytes = 0
        cache.trim()
        assert (other / foreign).read_text() == "on another file system"
        assert own_entries(cache.directory) == [other / foreign]  # its own entry went, the other stayed
    finally:
        subprocess.run(["umount", "-l", str(other)], capture_output=True)


def _take(given: str, start, failed) -> None:
    from unshardfs.sources.diskcache import open_cache_dir

    start.wait()
    try:
        os.close(open_cache_dir(given)[0])
    except Exception:  # noqa: BLE001 - counted, the test fails on any
        failed.value += 1


def test_processes_taking_a_new_cache_dir_at_once_all_succeed(tmp_path):
    """`check --jobs N` workers open the same new --cache-dir together: none may take another's
    tag, still being written, for a foreign file."""
    ctx = multiprocessing.get_context("fork")
    failed = ctx.Value("i", 0)
    for attempt in range(30):
        start = ctx.Event()
        workers = [ctx.Process(target=_take, args=(str(tmp_path / f"c{attempt}"), start, failed)) for _ in range(4)]
        for worker in workers:
            worker.start()
        start.set()
        for worker in workers:
            worker.join(timeout=60)
    assert failed.value == 0
