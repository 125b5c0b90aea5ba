"""inspect, check and export against datasets written by TensorStore and CloudVolume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.formats.precomputed.test_damaged import DAMAGES, SCALE_KEY, damage_delete, damage_gzip_payload
from unshardfs.testing.mounts import UNSHARDFS, run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_objects, write_volume
from unshardfs.testing.trees import exported_files, walk_files

MINISHARD_BITS = 1  # as the damage planters assume


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    spec = sharding(minishard=MINISHARD_BITS, shard=2, data_enc="gzip")
    return write_volume(root, [Scale((64, 64, 32), (16, 16, 8), spec, fill=0.75),
                               Scale((32, 32, 16), (16, 16, 8), None, resolution=(2, 2, 2))], "uint16")


def test_inspect_counts_match_the_writer(volume):
    result = run_cli("inspect", "--json", str(volume["sharded"]))
    assert result.returncode == 0, result.stderr
    (report,) = json.loads(result.stdout)
    assert report["key"] == SCALE_KEY and report["kind"] == "volume scale"
    assert report["chunks"] == len(os.listdir(volume["plain"] / SCALE_KEY))
    assert report["shards_present"] == len(list((volume["sharded"] / SCALE_KEY).glob("*.shard")))
    assert report["shards_expected"] == 4
    assert report["grid_cells"] == 4 * 4 * 4
    shard_bytes = sum(p.stat().st_size for p in (volume["sharded"] / SCALE_KEY).glob("*.shard"))
    assert 0 < report["stored_bytes"] < shard_bytes
    text = run_cli("inspect", str(volume["sharded"])).stdout
    assert f"{report['chunks']:,} of 64 grid cells" in text


def test_inspect_objects(tmp_path):
    paths = write_objects(tmp_path, "skeletons", sharding(minishard=2, shard=1, data_enc="gzip"), n=25)
    (report,) = json.loads(run_cli("inspect", "--json", str(paths["sharded"])).stdout)
    assert report["kind"] == "neuroglancer_skeletons"
    assert report["chunks"] == len(os.listdir(paths["plain"] / "skeletons")) - 1  # minus info


def test_check_intact(volume):
    result = run_cli("check", str(volume["sharded"]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "intact" in result.stdout and "damaged:" not in result.stdout
    files = len(walk_files(volume["plain"]))
    assert f"intact: {files:,} files" in result.stdout
    parallel = run_cli("check", "--jobs", "3", str(volume["sharded"]))
    assert parallel.returncode == 0 and f"intact: {files:,} files" in parallel.stdout


@pytest.mark.parametrize("damage", [d for d in DAMAGES if d is not damage_delete],
                         ids=lambda f: f.__name__.removeprefix("damage_"))
def test_check_finds_planted_damage(volume, tmp_path, damage):
    src = tmp_path / "src"
    shutil.copytree(volume["sharded"], src)
    victim = sorted((src / SCALE_KEY).glob("*.shard"))[0]
    damage(victim)
    serial = run_cli("check", str(src))
    assert serial.returncode == 1, serial.stdout
    assert "DAMAGED" in serial.stdout
    assert victim.name in serial.stdout, serial.stdout
    parallel = run_cli("check", "--jobs", "3", str(src))
    assert parallel.returncode == 1
    damaged = sorted(line for line in serial.stdout.splitlines() if line.startswith("damaged:"))
    assert damaged == sorted(line for line in parallel.stdout.splitlines() if line.startswith("damaged:"))


def test_missing_shard_is_not_damage(volume, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(volume["sharded"], src)
    sorted((src / SCALE_KEY).glob("*.shard"))[0].unlink()
    assert run_cli("check", str(src)).returncode == 0


def test_export_equals_reference_and_is_resumable(volume, tmp_path):
    dest = tmp_path / "out"
    result = run_cli("export", str(volume["sharded"]), str(dest))
    assert result.returncode == 0, result.stderr
    diff = subprocess.run(["diff", "-r", "-x", "info", "-x", ".unshardfs", str(dest), str(volume["plain"])],
                          capture_output=True, text=True)
    assert diff.returncode == 0, diff.stdout[:2000]
    assert json.loads((dest / "info").read_text())["scales"][0].get("sharding") is None
    again = run_cli("export", "--resume", str(volume["sharded"]), str(dest))
    n = len(exported_files(dest))
    assert f"0 written, {n:,} already complete" in again.stdout


@pytest.mark.slow
def test_export_resumes_after_kill(tmp_path):
    root = tmp_path / "many"
    # 16,000 one-byte-per-voxel chunks: long enough to be killed mid-way.
    paths = write_volume(root, [Scale((40, 40, 80), (2, 2, 2), sharding(minishard=3, shard=3))], "uint8")
    reference = exported_files(paths["plain"])
    dest = tmp_path / "out"
    proc = subprocess.Popen([*UNSHARDFS, "export", "--jobs", "2", str(paths["sharded"]), str(dest)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len([p for p in (dest / "1_1_1").glob("*") if not p.name.startswith(".")]
               if (dest / "1_1_1").exists() else []) < 300:  # (files under their final names)
        assert proc.poll() is None and time.monotonic() < deadline, "export finished before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    partial = exported_files(dest)
    assert 300 <= len(partial) < len(reference)
    # Whatever a kill leaves under a final name is the whole file, byte for byte.
    for rel, path in partial.items():
        assert path.read_bytes() == reference[rel].read_bytes(), rel
    result = run_cli("export", "--resume", str(paths["sharded"]), str(dest), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "already complete" in result.stdout and " 0 already complete" not in result.stdout
    final = exported_files(dest)
    assert sorted(final) == sorted(reference)
    assert all(final[r].read_bytes() == reference[r].read_bytes() for r in reference if r != "info")
    assert not [p for p in dest.rglob("*unshardfs-tmp*")]


def test_export_reports_damage(volume, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(volume["sharded"], src)
    damage_gzip_payload(sorted((src / SCALE_KEY).glob("*.shard"))[0])
    result = run_cli("export", str(src), str(tmp_path / "out"))
    assert result.returncode == 1
    assert "not exported" in result.stderr and "bad gzip" in result.stderr


def test_export_never_writes_through_links_in_dest(volume, tmp_path):
    """Links planted in DEST (where a chunk directory and a chunk file go) are not followed:
    those parts fail, everything else is exported, nothing outside DEST changes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("untouched")
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(outside, dest / SCALE_KEY)  # the sharded scale's directory
    (dest / "2_2_2").mkdir()
    victim = sorted(os.listdir(volume["plain"] / "2_2_2"))[0]
    os.symlink(outside / "planted", dest / "2_2_2" / victim)
    result = run_cli("export", "-q", str(volume["sharded"]), str(dest))
    assert result.returncode == 1
    assert sorted(os.listdir(outside)) == ["keep"] and (outside / "keep").read_text() == "untouched"
    assert (dest / SCALE_KEY).is_symlink() and os.path.islink(dest / "2_2_2" / victim)
    others = sorted(set(os.listdir(volume["plain"] / "2_2_2")) - {victim})
    assert others and all((dest / "2_2_2" / n).read_bytes() == (volume["plain"] / "2_2_2" / n).read_bytes()
                          for n in others)
    assert (dest / "info").exists()
