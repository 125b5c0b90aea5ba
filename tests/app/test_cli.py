"""The command line: clear one-line errors, read-only behaviour, lifecycle, URL forms."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from unshardfs.testing.mounts import UNSHARDFS, daemon_pids, force_unmount, run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_volume


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return write_volume(root, [Scale((32, 32, 16), (16, 16, 8), sharding(minishard=1, shard=1))])["sharded"]


def assert_clean_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0], lines[0]


def broken_copy(dataset: Path, tmp_path: Path, mutate) -> Path:
    src = tmp_path / "bad"
    shutil.copytree(dataset, src)
    info = json.loads((src / "info").read_text())
    result = mutate(info)
    (src / "info").write_text(result if isinstance(result, str) else json.dumps(info))
    return src


@pytest.mark.parametrize("mutate,fragment", [
    (lambda i: "{not json", "not valid JSON"),
    (lambda i: "[1, 2]", "must be a JSON object"),
    (lambda i: i["scales"][0]["sharding"].update({"@type": "bogus"}), "@type"),
    (lambda i: i["scales"][0]["sharding"].update({"shard_bits": 70}), "shard_bits"),
    (lambda i: i["scales"][0]["sharding"].update({"minishard_bits": "2"}), "minishard_bits"),
    (lambda i: i["scales"][0].update({"chunk_sizes": [[16, 16, 8], [8, 8, 8]]}), "exactly one chunk size"),
    (lambda i: i["scales"][0].update({"size": [1, 2]}), "size"),
    (lambda i: i["scales"][0].update({"key": "../../etc"}), "outside the source"),
    (lambda i: i["scales"][0].update({"key": "/etc"}), "absolute"),
    (lambda i: i.update({"scales": {"a": 1}}), "info.scales: must be a list"),
    (lambda i: i.update({"mesh": 3}), "mesh"),
])
def test_bad_info_is_a_clean_error(dataset, tmp_path, mutate, fragment):
    src = broken_copy(dataset, tmp_path, mutate)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        assert_clean_error(run_cli("mount", str(src), str(mnt), "--log-file", str(tmp_path / "log")), fragment)
        assert not os.path.ismount(mnt)
    finally:
        force_unmount(mnt)


def test_source_and_mountpoint_errors(dataset, tmp_path, mount):
    mnt = tmp_path / "empty"
    mnt.mkdir()
    assert_clean_error(run_cli("mount", str(tmp_path / "nope"), str(mnt)), "does not exist")
    no_info = tmp_path / "noinfo"
    no_info.mkdir()
    assert_clean_error(run_cli("mount", str(no_info), str(mnt)), "neither an info file")
    assert_clean_error(run_cli("mount", str(dataset), str(tmp_path / "missing")), "does not exist")
    assert_clean_error(run_cli("mount", "--view", "zarr2", str(dataset), str(mnt)), "applies to Zarr v3 stores only")
    assert_clean_error(run_cli("mount", "ftp://host/x", str(mnt)), "unsupported source")
    # A store that cannot be reached: a clean one-line error once the retries are spent.
    assert_clean_error(run_cli("mount", "--retries", "1", "--backoff", "0", "http://127.0.0.1:9/ds", str(mnt)),
                       "cannot read")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    assert_clean_error(run_cli("mount", str(dataset), str(full)), "not empty")
    m = mount(dataset)
    assert_clean_error(run_cli("mount", str(dataset), str(m.path)), "busy")
    assert_clean_error(run_cli("unmount", str(mnt)), "cannot unmount")


@pytest.mark.parametrize("prefix", ["file://", "precomputed://", "precomputed://file://"])
def test_url_forms(dataset, mount, prefix):
    m = mount(f"{prefix}{dataset}")
    assert "info" in os.listdir(m.path)


def test_everything_is_read_only(dataset, mount):
    m = mount(dataset)
    chunk = next((m.path / "1_1_1").iterdir())
    attempts = [
        lambda: open(chunk, "r+b"),
        lambda: open(chunk, "ab"),
        lambda: open(m.path / "new", "wb"),
        lambda: os.mkdir(m.path / "d"),
        lambda: os.unlink(chunk),
        lambda: os.rename(chunk, m.path / "moved"),
        lambda: os.chmod(chunk, 0o666),
        lambda: os.truncate(chunk, 0),
        lambda: os.symlink("x", m.path / "link"),
        lambda: os.setxattr(chunk, "user.x", b"1"),
        lambda: os.rmdir(m.path / "1_1_1"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS, (attempt, e.value)


def test_xattrs_name_the_shard(dataset, mount):
    m = mount(dataset)
    chunk = sorted((m.path / "1_1_1").iterdir())[0]
    source = os.getxattr(chunk, "user.unshardfs.source").decode()
    assert source.startswith("1_1_1/") and source.endswith(".shard")
    offset = int(os.getxattr(chunk, "user.unshardfs.offset"))
    length = int(os.getxattr(chunk, "user.unshardfs.length"))
    assert (dataset / source).read_bytes()[offset:offset + length] == chunk.read_bytes()
    with pytest.raises(OSError) as e:
        os.getxattr(chunk, "user.nothing")
    assert e.value.errno == errno.ENODATA


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_foreground_signal_unmounts_cleanly(dataset, tmp_path, sig):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([*UNSHARDFS, "mount", "-f", str(dataset), str(mnt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        assert "info" in os.listdir(mnt)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert not os.path.ismount(mnt)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # and the pipes closed
        force_unmount(mnt)


def test_crashed_daemon_can_be_unmounted(dataset, tmp_path, mount):
    m = mount(dataset)
    for pid in daemon_pids(m.path):
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    with pytest.raises(OSError) as e:
        os.listdir(m.path)
    assert e.value.errno == errno.ENOTCONN
    result = run_cli("mount", str(dataset), str(m.path))
    assert result.returncode != 0 and "unshardfs unmount" in result.stderr
    assert run_cli("unmount", str(m.path)).returncode == 0
    assert not os.path.ismount(m.path)


def test_help_and_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("unshardfs ")
    for args in (["--help"], ["mount", "--help"], ["unmount", "--help"]):
        result = run_cli(*args)
        assert result.returncode == 0 and "unshardfs" in result.stdout
    assert "examples" in run_cli("mount", "--help").stdout


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("mount"), reason="mount(8) as root")
def test_fstab_line_mounts(dataset, tmp_path):
    """The fstab form documented in docs/mount.md, driven through mount(8) and mount.fuse3."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    program = Path(UNSHARDFS[0]).with_name("unshardfs")
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{program}#{dataset}  {mnt}  fuse  allow_other,noatime,noauto  0  0\n")
    try:
        result = subprocess.run(["mount", "--fstab", str(fstab), str(mnt)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        line = next(l for l in Path("/proc/mounts").read_text().splitlines() if f" {mnt} " in l)
        assert "fuse.unshardfs" in line and " ro," in line and "allow_other" in line
        assert json.loads((mnt / "info").read_text())["scales"]
        assert subprocess.run(["umount", str(mnt)], timeout=60).returncode == 0
        assert not os.path.ismount(mnt)
    finally:
        force_unmount(mnt)


def test_mount_helper_calling_convention(dataset, tmp_path):
    """mount.fuse3 runs `unshardfs SOURCE MNT -o rw,dev,suid,...`: that must mount read-only."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        result = run_cli(str(dataset), str(mnt), "-o", "rw,noatime,dev,suid")
        assert result.returncode == 0, result.stderr
        line = next(l for l in Path("/proc/mounts").read_text().splitlines() if f" {mnt} " in l)
        assert " ro," in line
    finally:
        force_unmount(mnt)
