"""export never leaves a file that lies: a full disk stops it with one line, `--resume` finishes it,
the ledger and manifest say what is in DEST, and `check --manifest` proves a copy."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import trio

from tests.support.tmpfs import remount, small_tmpfs
from unshardfs.testing.mounts import run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.testing.trees import exported_files, walk_files
from unshardfs.dest.local import open_local
from unshardfs.tools.walk import export
from unshardfs.tree.nodes import DirNode, FileNode

SHARDED, PLAIN = "1_1_1", "2_2_2"


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    """512 chunk files of 1 KiB in shards, 64 plain files and the info: a few MiB on a tmpfs."""
    root = tmp_path_factory.mktemp("resume")
    paths = write_volume(root, [Scale((64, 64, 64), (8, 8, 8), sharding(minishard=2, shard=2)),
                                Scale((32, 32, 32), (8, 8, 8), None, resolution=(2, 2, 2))], "uint16")
    return paths["sharded"]


@pytest.fixture(scope="module")
def reference(volume, tmp_path_factory):
    """A full export into plenty of room: what every finished export must equal."""
    dest = tmp_path_factory.mktemp("reference") / "out"
    result = run_cli("export", "-q", str(volume), str(dest))
    assert result.returncode == 0, result.stderr
    return dest


def same_tree(a: Path, b: Path) -> None:
    fa, fb = exported_files(a), exported_files(b)
    assert sorted(fa) == sorted(fb)
    for rel in fa:
        assert fa[rel].read_bytes() == fb[rel].read_bytes(), rel
        assert fa[rel].stat().st_mtime_ns == fb[rel].stat().st_mtime_ns, rel


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".unshardfs-tmp-" in p.name]


def manifest_lines(dest: Path) -> list[dict]:
    lines = (dest / ".unshardfs" / "manifest.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


@pytest.fixture
def small_disk(tmp_path):
    with small_tmpfs(tmp_path / "disk") as where:
        yield where


def test_a_full_disk_stops_with_one_line_and_resume_finishes(volume, reference, small_disk):
    dest = small_disk / "out"
    full = run_cli("export", "-q", str(volume), str(dest))
    assert full.returncode == 1
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, full.stderr
    assert lines[0].startswith("unshardfs: export stopped: cannot write ") and \
        lines[0].endswith(": No space left on device (ENOSPC)"), lines[0]
    named = lines[0].removeprefix("unshardfs: export stopped: cannot write ").split(": ")[0]
    assert named.startswith((SHARDED, PLAIN, "info", ".unshardfs")), named
    # Every file under a final name is whole, byte for byte; only those are counted.
    landed = exported_files(dest)
    ref = exported_files(reference)
    assert 0 < len(landed) < len(ref)
    assert all(path.read_bytes() == ref[rel].read_bytes() for rel, path in landed.items())
    assert f"exported {len(landed):,} files ({len(landed):,} written" in full.stdout, full.stdout
    assert "tasks complete (run again with --resume)" in full.stdout
    assert not (dest / ".unshardfs" / "manifest.jsonl").exists()

    remount(small_disk, "size=16m")
    resumed = run_cli("export", "-q", "--resume", str(volume), str(dest))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr == ""
    same_tree(dest, reference)
    assert temporaries(dest) == []
    assert sorted(line["path"] for line in manifest_lines(dest)) == sorted(ref)
    checked = run_cli("check", "--manifest", str(dest / ".unshardfs" / "manifest.jsonl"), str(dest))
    assert checked.returncode == 0, checked.stdout


def test_running_out_of_inodes_stops_with_one_line(volume, reference, small_disk):
    """No inode left for a directory (or a temporary): the same single line, and --resume finishes."""
    remount(small_disk, "size=16m,nr_inodes=8")
    dest = small_disk / "out"
    full = run_cli("export", "-q", str(volume), str(dest))
    assert full.returncode == 1
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unshardfs: export stopped: cannot write ") and \
        lines[0].endswith(": No space left on device (ENOSPC)"), full.stderr
    landed = exported_files(dest)
    ref = exported_files(reference)
    assert all(path.read_bytes() == ref[rel].read_bytes() for rel, path in landed.items())
    remount(small_disk, "nr_inodes=4096")
    resumed = run_cli("export", "-q", "--resume", str(volume), str(dest))
    assert resumed.returncode == 0, resumed.stderr
    same_tree(dest, reference)
    assert temporaries(dest) == []


def test_resume_keeps_complete_files_and_rewrites_only_what_is_not(volume, reference, tmp_path):
    dest = tmp_path / "out"
    assert run_cli("export", "-q", "--parts", "4", str(volume), str(dest)).returncode == 0
    tasks = dest / ".unshardfs" / "tasks"
    # Task 1 as a kill would leave it: its journal (the file lines, no closing line), no ledger entry.
    entry = (tasks / "000001.jsonl").read_text().splitlines()
    (tasks / "000001.jsonl").unlink()
    (tasks / "000001.journal").write_text("\n".join(entry[:-2]) + "\n" + entry[-2][:17])  # cut last line
    journaled = [json.loads(line)["path"] for line in entry[:-1]]
    assert len(journaled) >= 4
    flipped, cut, gone = journaled[:3]
    cut_line = journaled[-1]
    data = bytearray((dest / flipped).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (dest / flipped).write_bytes(bytes(data))  # same size, other bytes
    os.truncate(dest / cut, 10)
    (dest / gone).unlink()
    planted = dest / SHARDED / ".x.unshardfs-tmp-0123456789ab"
    planted.write_bytes(b"left by a killed run")
    inodes = {rel: p.stat().st_ino for rel, p in exported_files(dest).items()}

    result = run_cli("export", "-q", "--resume", str(volume), str(dest))
    assert result.returncode == 0, result.stderr
    same_tree(dest, reference)
    assert not planted.exists() and temporaries(dest) == []
    rewritten = sorted(rel for rel, p in exported_files(dest).items() if inodes.get(rel) != p.stat().st_ino)
    # The journal's last line was cut by the "kill": that file is written again too.
    assert rewritten == sorted({flipped, cut, gone, cut_line}), rewritten
    assert "(4 written, " in result.stdout, result.stdout
    lines = manifest_lines(dest)
    assert sorted(line["path"] for line in lines) == sorted(exported_files(reference))


def test_a_second_export_without_resume_is_refused(volume, tmp_path):
    dest = tmp_path / "out"
    assert run_cli("export", "-q", str(volume), str(dest)).returncode == 0
    before = {rel: p.stat().st_ino for rel, p in walk_files(dest).items()}
    again = run_cli("export", "-q", str(volume), str(dest))
    assert again.returncode == 1
    tasks = json.loads((dest / ".unshardfs" / "plan.json").read_text())["tasks"]
    assert again.stderr.strip().splitlines() == [
        f"unshardfs: DEST {dest} holds an export of {volume} ({tasks} of {tasks} tasks complete): add --resume to "
        "continue it, or choose another DEST"]
    other = tmp_path / "other"
    shutil.copytree(volume, other)
    mixed = run_cli("export", "-q", "--resume", str(other), str(dest))
    assert mixed.returncode == 1 and len(mixed.stderr.strip().splitlines()) == 1
    assert f"holds an export of {volume} with options" in mixed.stderr
    replanned = run_cli("export", "-q", "--resume", "--parts", "4", str(volume), str(dest))
    assert replanned.returncode == 1 and f"planned as {tasks} tasks" in replanned.stderr
    assert {rel: p.stat().st_ino for rel, p in walk_files(dest).items()} == before
    # Resuming a finished export rewrites nothing, the manifest included.
    resumed = run_cli("export", "-q", "--resume", str(volume), str(dest))
    assert resumed.returncode == 0 and "(0 written, " in resumed.stdout, resumed.stdout + resumed.stderr
    assert {rel: p.stat().st_ino for rel, p in walk_files(dest).items()} == before


def test_a_link_planted_as_the_ledger_directory_is_refused(volume, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "out"
    dest.mkdir()
    os.symlink(outside, dest / ".unshardfs")
    result = run_cli("export", "-q", str(volume), str(dest))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "unshardfs: .unshardfs/plan.json in DEST cannot be read: Too many levels of symbolic links"]
    assert os.listdir(outside) == []


def test_dest_given_as_a_symlink_to_a_directory_is_followed(volume, reference, tmp_path):
    """DEST itself is the user's choice (as for cp -r); nothing below it is followed."""
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    assert run_cli("export", "-q", "--no-fsync", str(volume), str(tmp_path / "link")).returncode == 0
    same_tree(real, reference)  # without the flushes, the same tree


class _File(FileNode):
    def __init__(self, data: bytes) -> None:
        super().__init__(len(data), 10**18)
        self.data = data

    async def read(self, offset: int, size: int) -> bytes:
        return self.data[offset:offset + size]


class _Dir(DirNode):
    def __init__(self, entries: list) -> None:
        super().__init__(10**18)
        self.listed = entries

    async def entries(self):
        yield self.listed


def test_names_that_would_leave_dest_or_take_its_own_are_not_exported(tmp_path):
    """A tree that lies about its names (as a hostile archive or listing could): nothing lands
    outside DEST, and the ledger's directory and temporary names (an earlier export's own, when
    an export is exported) are never taken from a source."""
    root = _Dir([("..", _File(b"up")), ("../escape", _File(b"up")), ("a/b", _File(b"deep")),
                 (".unshardfs", _Dir([("plan.json", _File(b"{}"))])),
                 (".f.unshardfs-tmp-0123456789ab", _File(b"temp")), ("ok", _File(b"fine"))])
    dest_dir = tmp_path / "dest"
    dest = open_local(dest_dir)
    try:
        summary = trio.run(export, root, dest.files)
    finally:
        dest.close()
    assert sorted(os.listdir(tmp_path)) == ["dest"]
    assert sorted(os.listdir(dest_dir)) == ["ok"] and (dest_dir / "ok").read_bytes() == b"fine"
    assert summary.written == 1 and summary.failures == []


def test_check_manifest_names_every_difference(volume, reference, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(reference, dest, symlinks=True)
    manifest = dest / ".unshardfs" / "manifest.jsonl"
    intact = run_cli("check", "--manifest", str(manifest), "-j", "3", str(dest))
    assert intact.returncode == 0, intact.stdout
    files = sorted(exported_files(dest))
    assert intact.stdout.strip().splitlines() == [
        f"{dest} matches its manifest: {len(files):,} files checked, "
        f"{sum((dest / f).stat().st_size for f in files):,} bytes verified; 0 missing, 0 differing, 0 extra"]
    chunks = [f for f in files if f.startswith(SHARDED + "/")]
    gone, flipped, short, linked = chunks[:4]
    (dest / gone).unlink()
    data = bytearray((dest / flipped).read_bytes())
    data[0] ^= 1
    (dest / flipped).write_bytes(bytes(data))
    os.truncate(dest / short, 3)
    (dest / linked).unlink()
    os.symlink(reference / linked, dest / linked)
    (dest / PLAIN / "stray").write_bytes(b"not exported")
    (dest / PLAIN / ".stray.unshardfs-tmp-0123456789ab").write_bytes(b"")
    result = run_cli("check", "--manifest", str(manifest), "-j", "3", str(dest))
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert sorted(lines[:-1]) == sorted([
        f"missing: {gone}",
        f"differs: {flipped}: crc32c {_crc(dest / flipped):08x}, the manifest says {_crc(reference / flipped):08x}",
        f"differs: {short}: 3 bytes, the manifest says {(reference / short).stat().st_size:,}",
        f"differs: {linked}: cannot open: Too many levels of symbolic links",
        f"extra: {PLAIN}/stray",
        f"extra: {PLAIN}/.stray.unshardfs-tmp-0123456789ab (a leftover temporary: run export --resume)",
    ])
    assert lines[-1].startswith(f"{dest} DIFFERS from its manifest: {len(files):,} files checked")
    assert lines[-1].endswith("1 missing, 3 differing, 2 extra")


def test_check_manifest_refuses_a_garbled_manifest(reference, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text((reference / ".unshardfs" / "manifest.jsonl").read_text().splitlines()[0] + "\n"
                   + json.dumps({"path": "../../etc/passwd", "size": 1, "crc32c": "00000000"}) + "\n")
    result = run_cli("check", "--manifest", str(bad), str(reference))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"unshardfs: manifest {bad} line 2: bad path")
    not_one = tmp_path / "not.jsonl"
    not_one.write_text("hello\n")
    result = run_cli("check", "--manifest", str(not_one), str(reference))
    assert result.returncode == 1 and result.stderr.startswith(f"unshardfs: manifest {not_one} is not")


def _crc(path: Path) -> int:
    import crc32c

    return crc32c.crc32c(path.read_bytes())


def test_dest_as_a_file_url_is_its_path_and_other_schemes_are_refused(volume, reference, tmp_path):
    dest = tmp_path / "out"
    assert run_cli("export", "-q", str(volume), f"file://{dest}").returncode == 0
    same_tree(dest, reference)
    refused = run_cli("export", "-q", str(volume), "https://example.org/prefix")
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        "unshardfs: DEST https://example.org/prefix: export writes to a directory (a path or file:///path), "
        "s3:// or gs://; https:// is not supported as DEST"]
    assert not Path("https:").exists()
