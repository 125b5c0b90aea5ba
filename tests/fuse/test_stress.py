"""The real mount under differential reads, concurrent load, killed readers,
signals to the daemon, and other users. All loops are bounded in count."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.memory import MiB, rss
from unshardfs.testing.mounts import daemon_pids, force_unmount, run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_volume


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Chunks from 4 bytes to 512 KiB, raw and gzip, so reads span many FUSE requests."""
    root = tmp_path_factory.mktemp("big")
    return write_volume(root, [
        Scale((150, 130, 70), (64, 64, 64), sharding(minishard=2, shard=2, data_enc="gzip")),
        Scale((75, 65, 35), (64, 64, 32), sharding(hash="identity", minishard=1, shard=1), resolution=(2, 2, 2)),
        Scale((37, 33, 17), (2, 1, 1), sharding(minishard=4, shard=3, index_enc="gzip"), resolution=(4, 4, 4)),
    ], "uint16")


def files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "info")


def test_differential_pread_mmap_seek(big, mount):
    m = mount(big["sharded"])
    rng = random.Random(1)
    names = files_of(big["plain"])
    sample = rng.sample(names, 40) + [n for n in names if (big["plain"] / n).stat().st_size > 300_000][:5]
    for rel in sample:
        want = (big["plain"] / rel).read_bytes()
        path = m.path / rel
        assert path.stat().st_size == len(want)
        fd = os.open(path, os.O_RDONLY)
        try:
            for _ in range(30):
                off = rng.randrange(0, len(want) + 64)
                size = rng.choice([1, 7, 4096, 65536, 131072 + 3, 1 << 20])
                assert os.pread(fd, size, off) == want[off:off + size], (rel, off, size)
            # seek + sequential read in odd steps
            os.lseek(fd, len(want) // 3, os.SEEK_SET)
            parts = []
            while chunk := os.read(fd, 12345):
                parts.append(chunk)
            assert b"".join(parts) == want[len(want) // 3:]
        finally:
            os.close(fd)
        if want:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                assert mm[:] == want
                i = rng.randrange(len(want))
                assert mm[i:i + 100] == want[i:i + 100]


def _reader(mnt: str, ref: str, names: list[str], seed: int, count: int, out) -> None:
    rng = random.Random(seed)
    bad = 0
    for _ in range(count):
        rel = rng.choice(names)
        want = Path(ref, rel).read_bytes()
        off = rng.randrange(0, len(want) + 1)
        size = rng.choice([1, 512, 4096, 70000, len(want)])
        try:
            with open(Path(mnt, rel), "rb") as f:
                f.seek(off)
                if f.read(size) != want[off:off + size]:
                    bad += 1
        except OSError:
            bad += 1
    out.put(bad)


def _walker(mnt: str, ref_names: list[str], count: int, out) -> None:
    bad = 0
    for _ in range(count):
        got = sorted(str(p.relative_to(mnt)) for p in Path(mnt).rglob("*") if p.is_file() and p.name != "info")
        bad += got != ref_names
    out.put(bad)


def test_concurrent_load_with_tiny_caches(big, mount):
    # Tiny caches force constant eviction while 32 readers and 4 walkers run.
    m = mount(big["sharded"], "--shard-index-cache", "1", "--minishard-index-cache", "1", "--chunk-cache", "1",
              "--metadata-cache", "1", "--cache-timeout", "0.2")
    names = files_of(big["plain"])
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(str(m.path), str(big["plain"]), names, i, 150, out))
             for i in range(32)]
    procs += [ctx.Process(target=_walker, args=(str(m.path), names, 3, out)) for _ in range(4)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 240
    for p in procs:
        p.join(timeout=max(1, deadline - time.monotonic()))
        assert not p.is_alive(), "load test exceeded its time bound"
    results = [out.get(timeout=5) for _ in procs]
    assert results == [0] * len(procs)
    s = m.stats()
    assert s["fuse"]["eio"] == 0
    for name, usage in s["caches"].items():
        assert usage["bytes"] <= usage["limit"] <= 1 << 20, (name, usage)
    pid = daemon_pids(m.path)[0]
    assert rss(pid) < 250 * MiB, f"daemon RSS {rss(pid) / MiB:.0f} MiB"


def test_killed_readers_leave_a_healthy_daemon(big, mount):
    m = mount(big["sharded"])
    names = files_of(big["plain"])
    large = [n for n in names if (big["plain"] / n).stat().st_size > 300_000][:4]
    script = "import sys\nwhile True:\n    [open(p, 'rb').read() for p in sys.argv[1:]]\n"
    victims = [subprocess.Popen(["python3", "-c", script, *[str(m.path / n) for n in large]]) for _ in range(6)]
    time.sleep(1.0)
    for v in victims:
        v.kill()
        v.wait(timeout=10)
    deadline = time.monotonic() + 10
    while m.stats()["fuse"]["open_files"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.stats()["fuse"]["open_files"] == 0
    for rel in large + names[:20]:
        assert (m.path / rel).read_bytes() == (big["plain"] / rel).read_bytes()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_detached_daemon_unmounts_on_signal(big, mount, sig):
    m = mount(big["sharded"])
    pids = daemon_pids(m.path)
    assert len(pids) == 1
    os.kill(pids[0], sig)
    deadline = time.monotonic() + 20
    while (os.path.ismount(m.path) or daemon_pids(m.path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.ismount(m.path)
    assert not daemon_pids(m.path)
    assert "unmounted" in m.log_text()


def _as_nobody(*cmd: str) -> subprocess.CompletedProcess:
    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)

    return subprocess.run(list(cmd), capture_output=True, text=True, preexec_fn=drop, timeout=30)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch to another user")
def test_private_unless_allow_other(big):
    base = Path(tempfile.mkdtemp(prefix="unshardfs-private-"))
    base.chmod(0o755)
    try:
        for options, visible in (((), False), (("-o", "allow_other"), True)):
            mnt = base / f"mnt{int(visible)}"
            mnt.mkdir()
            mnt.chmod(0o755)
            try:
                result = run_cli("mount", str(big["sharded"]), str(mnt), *options)
                assert result.returncode == 0, result.stderr
                listing = _as_nobody("ls", str(mnt))
                assert (listing.returncode == 0) == visible, listing.stderr
                if visible:
                    assert "info" in listing.stdout
            finally:
                force_unmount(mnt)
    finally:
        shutil.rmtree(base, ignore_errors=True)
