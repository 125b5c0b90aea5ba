"""`export` against a hostile DEST and source: links, FIFOs and hard links planted or swapped in
while it runs, a DEST that is a FIFO, and a file far bigger than memory should hold."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.swapping import OUTSIDE_MARK, Swapper, checksums, outside_twin
from unshardfs.testing.mounts import UNSHARDFS, run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_volume

SHARDED, PLAIN, NOTES = "1_1_1", "2_2_2", "notes.txt"
SWAP_SECONDS = 6


@pytest.fixture
def site(tmp_path):
    paths = write_volume(tmp_path / "vol", [Scale((64, 64, 32), (16, 16, 8), sharding(minishard=1, shard=2)),
                                            Scale((32, 32, 16), (8, 8, 8), None, resolution=(2, 2, 2))], "uint16")
    source = paths["sharded"]
    (source / NOTES).write_bytes(b"the source's own notes\n")
    return source, paths["plain"]


def export(source: Path, dest: Path, *options: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Bounded: a hang (on a FIFO, say) fails the test instead of stalling the suite."""
    return run_cli("export", "-q", str(source), str(dest), *options, timeout=timeout)


def marked_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if not p.is_symlink() and p.is_file() and OUTSIDE_MARK in p.read_bytes()]


def test_export_under_a_swap_loop(site, tmp_path):
    """DEST's directories swapped for links to a witness tree and for FIFOs, and the source's for
    links out, while exports run: the witness is untouched and no outside byte lands in DEST."""
    source, plain = site
    dest = tmp_path / "dest"
    witness = tmp_path / "witness"
    for scale in (SHARDED, PLAIN):
        outside_twin(plain / scale, witness / scale)  # same names as the files export writes
    source_outside = tmp_path / "source-outside"
    outside_twin(source / PLAIN, source_outside)
    (source_outside / NOTES).write_bytes(OUTSIDE_MARK)
    assert export(source, dest).returncode == 0
    before = checksums(witness)
    runs = 0
    with Swapper([dest / SHARDED, dest / PLAIN], witness) as dest_swapper, \
            Swapper([source / PLAIN, source / NOTES], source_outside) as source_swapper:
        deadline = time.monotonic() + SWAP_SECONDS
        while time.monotonic() < deadline or runs < 2:
            shutil.rmtree(dest / ".unshardfs", ignore_errors=True)  # no ledger: every file is written again
            result = export(source, dest)
            assert "Traceback" not in result.stderr, result.stderr
            runs += 1
    assert checksums(witness) == before
    assert marked_files(dest) == []
    assert dest_swapper.cycles > 10 and source_swapper.cycles > 10


def test_fifos_in_dest_are_refused_without_blocking(site, tmp_path):
    source, plain = site
    dest = tmp_path / "dest"
    (dest / PLAIN).mkdir(parents=True)
    victim = sorted(os.listdir(plain / PLAIN))[0]
    os.mkfifo(dest / PLAIN / victim)  # where a file goes
    os.mkfifo(dest / SHARDED)  # where a directory goes
    result = export(source, dest)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("not exported")]
    assert len(failed) == 2 and any(victim in line for line in failed), result.stderr
    assert (dest / PLAIN / victim).is_fifo() and (dest / SHARDED).is_fifo()
    others = sorted(set(os.listdir(plain / PLAIN)) - {victim})
    assert all((dest / PLAIN / n).read_bytes() == (plain / PLAIN / n).read_bytes() for n in others)


def test_dest_that_is_a_fifo_is_a_one_line_error(site, tmp_path):
    source, _ = site
    dest = tmp_path / "dest"
    os.mkfifo(dest)
    result = export(source, dest)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"unshardfs: DEST {dest} exists and is not a directory"]


def test_a_hard_link_in_dest_is_never_written_through(site, tmp_path):
    """The file lands under a new inode renamed over the name: the other link keeps its bytes."""
    source, plain = site
    witness = tmp_path / "witness"
    witness.mkdir()
    (witness / "keep").write_bytes(b"a file outside DEST")
    dest = tmp_path / "dest"
    (dest / PLAIN).mkdir(parents=True)
    victim = sorted(os.listdir(plain / PLAIN))[0]
    os.link(witness / "keep", dest / PLAIN / victim)
    result = export(source, dest)
    assert result.returncode == 0, result.stderr
    assert (witness / "keep").read_bytes() == b"a file outside DEST"
    assert (dest / PLAIN / victim).read_bytes() == (plain / PLAIN / victim).read_bytes()


RSS_PROBE = """
import resource, subprocess, sys
result = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.stderr.write(result.stderr)
sys.exit(result.returncode)
"""


def test_export_of_a_big_file_streams_in_bounded_memory(site, tmp_path):
    """A 700 MiB passthrough file (sparse, with data at a few places): peak RSS of the export
    stays far below the file's size, the copy is exact, and its zero stretches stay holes."""
    source, _ = site
    big = source / "big.bin"
    size = 700 << 20
    with open(big, "wb") as f:
        f.truncate(size)
        for offset in (0, 123 << 20, 500 << 20 | 12345, size - (1 << 20)):
            f.seek(offset)
            f.write(os.urandom(1 << 20))
    dest = tmp_path / "dest"
    probe = subprocess.run([sys.executable, "-c", RSS_PROBE, *UNSHARDFS, "export", "-q", str(source), str(dest)],
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    peak_mb = int(probe.stdout.strip()) / 1024
    assert peak_mb < 200, f"export peaked at {peak_mb:.0f} MB for a {size >> 20} MiB file"
    out = dest / "big.bin"
    assert out.stat().st_size == size
    assert subprocess.run(["cmp", str(big), str(out)], capture_output=True).returncode == 0
    assert out.stat().st_blocks * 512 < 64 << 20  # written sparse
    assert json.loads((dest / "info").read_text())
    shutil.rmtree(dest)
