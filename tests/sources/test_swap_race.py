"""Paths of a local source swapped for symlinks out and for FIFOs while they are read: through the
resolver itself (openat2 and the by-hand walk), a real mount and `serve`. Nothing from outside is
ever served or listed, nothing blocks, the daemon keeps answering and SIGTERM still unmounts."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import trio

from tests.support.served import get_body, served
from tests.support.swapping import OUTSIDE_MARK, Swapper, outside_twin
from unshardfs.sources.local import LocalSource
from unshardfs.testing.mounts import daemon_pids
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.util.errors import SourceError

SWAP_SECONDS = 4
PLAIN = "2_2_2"  # an unsharded scale: a directory of passthrough files
NOTES = "notes.txt"  # a passthrough file at the top


@pytest.fixture
def site(tmp_path):
    """A sharded volume with an unsharded scale and a plain file, a reference copy, and an
    outside twin of both (same names, marked content)."""
    paths = write_volume(tmp_path / "vol", [Scale((64, 64, 32), (16, 16, 8), sharding(minishard=1, shard=2)),
                                            Scale((32, 32, 16), (8, 8, 8), None, resolution=(2, 2, 2))], "uint16")
    source = paths["sharded"]
    (source / NOTES).write_bytes(b"the source's own notes\n")
    reference = tmp_path / "reference"
    shutil.copytree(source, reference)
    outside = tmp_path / "outside"
    outside_twin(source / PLAIN, outside)
    (outside / NOTES).write_bytes(OUTSIDE_MARK)
    return source, reference, outside


def targets(source: Path) -> list[Path]:
    return [source / PLAIN, source / NOTES]


@pytest.fixture(params=["openat2", "by hand"])
def resolver(request, monkeypatch):
    from unshardfs.util import fdpath
    if request.param == "openat2" and fdpath.openat2 is None:
        pytest.skip("this kernel has no openat2")
    if request.param == "by hand":
        monkeypatch.setattr(fdpath, "openat2", None)
    return request.param


def test_resolver_contains_links_and_refuses_fifos(tmp_path, resolver):
    from unshardfs.util import fdpath
    root = tmp_path / "root"
    (root / "d" / "e").mkdir(parents=True)
    (root / "d" / "e" / "f").write_text("inside")
    (tmp_path / "secret").write_text("outside")
    os.symlink("d/e", root / "rel-in")
    os.symlink(root / "d", root / "abs-in")
    os.symlink("../secret", root / "rel-out")
    os.symlink(tmp_path / "secret", root / "abs-out")
    os.symlink("../../..", root / "d" / "up")
    os.mkfifo(root / "fifo")
    beneath = fdpath.Beneath(str(root), links=True)
    strict = fdpath.Beneath(str(root), links=False)
    try:
        def read(b: fdpath.Beneath, rel: str) -> str:
            fd = b.open(rel, os.O_RDONLY | os.O_NONBLOCK)
            fdpath.regular_file(fd, rel)
            with os.fdopen(fd) as f:
                return f.read()

        assert read(beneath, "rel-in/f") == read(beneath, "abs-in/e/f") == read(beneath, "d/e/../e/f") == "inside"
        for rel in ("rel-out", "abs-out", "d/up/secret", "../secret", "d/../../secret"):
            with pytest.raises(OSError) as caught:
                read(beneath, rel)
            assert caught.value.errno == errno.EXDEV, rel
        for rel in ("rel-in/f", "abs-in/e/f", "rel-out"):
            with pytest.raises(OSError) as caught:
                read(strict, rel)
            assert caught.value.errno == errno.ELOOP, rel
        with pytest.raises(OSError) as caught:  # opened at once (O_NONBLOCK), refused by fstat
            read(beneath, "fifo")
        assert caught.value.errno == errno.EINVAL
    finally:
        beneath.close()
        strict.close()


def test_local_source_under_a_swap_loop(site, resolver):
    """Stats, listings and reads of the local source itself while the loop runs: every answer is the
    source's own bytes, absence or SourceError; never outside content, never a blocked call."""
    source, reference, outside = site
    local = LocalSource(str(source))
    names = sorted(os.listdir(reference / PLAIN))

    async def run() -> None:
        deadline = time.monotonic() + SWAP_SECONDS / 2
        while time.monotonic() < deadline:
            listed = [name async for name, _ in local.list(PLAIN)]
            assert "secret-outside" not in listed and set(listed) <= set(names)
            for path in [f"{PLAIN}/{names[0]}", NOTES]:
                await local.stat(path)
                try:
                    data = await local.read(path, 0, 1 << 20)
                except SourceError:
                    continue
                assert OUTSIDE_MARK not in data
                assert data == (reference / path).read_bytes()

    with Swapper(targets(source), outside) as swapper:
        trio.run(run)
    local.close()
    assert swapper.cycles > 10


def _assert_not_frozen(thread: threading.Thread, m, timeout: float, what: str) -> None:
    """A reader still blocked after `timeout` means a frozen daemon: kill it (else the blocked reads
    would hold the unmount at teardown too), then fail."""
    thread.join(timeout=timeout)
    if thread.is_alive():
        for pid in daemon_pids(m.path):
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(what)


def _read_or_error(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def test_mount_under_a_swap_loop(site, mount):
    source, reference, outside = site
    m = mount(source, "--cache-timeout", "0")
    names = sorted(os.listdir(reference / PLAIN))
    seen = {"control": 0, "served": 0, "problems": []}

    def readers() -> None:
        deadline = time.monotonic() + SWAP_SECONDS
        while time.monotonic() < deadline:
            try:
                listed = os.listdir(m.path / PLAIN)
            except OSError:
                listed = []
            if "secret-outside" in listed:
                seen["problems"].append("listed a name from outside")
            for rel in [f"{PLAIN}/{n}" for n in names[:4]] + [NOTES]:
                data = _read_or_error(m.path / rel)
                if data is not None:
                    seen["served"] += 1
                    if data != (reference / rel).read_bytes():
                        seen["problems"].append(f"{rel}: served other bytes")
            if _read_or_error(m.path / "info"):
                seen["control"] += 1

    with Swapper(targets(source), outside) as swapper:
        thread = threading.Thread(target=readers, daemon=True)
        thread.start()
        _assert_not_frozen(thread, m, SWAP_SECONDS + 60, "a read through the mount blocked (the daemon froze)")
        # SIGTERM is honoured while the swapping goes on: the mount goes away within a bound.
        pids = daemon_pids(m.path)
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while os.path.ismount(m.path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.ismount(m.path), "SIGTERM did not unmount"
    assert seen["problems"] == []
    assert seen["control"] > 10 and swapper.cycles > 10
    assert "Traceback" not in m.log_text()


def test_serve_under_a_swap_loop(site, tmp_path):
    source, reference, outside = site
    names = sorted(os.listdir(reference / PLAIN))
    problems = []
    control = 0
    log = tmp_path / "serve.log"
    with Swapper(targets(source), outside) as swapper, served(str(source), log=log) as url:
        deadline = time.monotonic() + SWAP_SECONDS
        while time.monotonic() < deadline:
            status, body = get_body(url, f"/{PLAIN}/")
            if b"secret-outside" in body:
                problems.append("listed a name from outside")
            for rel in [f"{PLAIN}/{n}" for n in names[:4]] + [NOTES]:
                status, body = get_body(url, f"/{rel}")
                if status == 200 and body != (reference / rel).read_bytes():
                    problems.append(f"{rel}: 200 with other bytes")
                elif status not in (200, 404, 502):
                    problems.append(f"{rel}: {status}")
            status, body = get_body(url, "/info")
            control += status == 200
        # leaving `served` sends SIGTERM and requires a clean exit while the swapping goes on
    assert problems == []
    assert control > 10 and swapper.cycles > 10
    assert "Traceback" not in log.read_text()


def test_a_fifo_swapped_in_after_lookup_is_eio_and_blocks_nothing(site, mount):
    """The kernel still holds the file's entry (long --cache-timeout) when it becomes a FIFO: the
    open that follows must not block the daemon's only thread."""
    source, reference, _ = site
    m = mount(source, "--cache-timeout", "3600")
    assert (m.path / NOTES).stat().st_size == len((reference / NOTES).read_bytes())  # looked up: entry cached
    os.unlink(source / NOTES)
    os.mkfifo(source / NOTES)
    outcome: dict[str, object] = {}

    def read() -> None:
        outcome["data"] = _read_or_error(m.path / NOTES)
        outcome["info"] = _read_or_error(m.path / "info")  # the daemon still answers

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    _assert_not_frozen(thread, m, 30, "reading a FIFO swapped into the source froze the mount")
    assert outcome["data"] is None and outcome["info"]
    for pid in daemon_pids(m.path):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while os.path.ismount(m.path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.ismount(m.path), "SIGTERM did not unmount"
