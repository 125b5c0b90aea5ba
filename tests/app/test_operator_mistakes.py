"""Operator mistakes a first day brings: a mountpoint inside its own source, a mount made and
unmounted through a symlink, a log or spec file that is a FIFO, a directory or out of reach.
Each is one `unshardfs:` line and a non-zero exit, nothing left mounted, nothing hung."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from unshardfs.testing.mounts import MountFn, abort, blocked, daemon_pids, force_unmount, run_bounded, run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.util.mountinfo import mounted_at, mountpoint_path

ROOT = os.getuid() == 0
USER = 65534  # nobody
needs_root = pytest.mark.skipif(not ROOT, reason="bind mounts, tmpfs and other users need root")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mistakes")
    return write_volume(root, [Scale((32, 32, 16), (16, 16, 8), sharding(minishard=1, shard=1))])["sharded"]


@pytest.fixture
def source(dataset: Path, tmp_path_factory) -> Path:
    """A private copy of the dataset with an empty directory `sub` (for mountpoints and binds)."""
    src = tmp_path_factory.mktemp("source") / "ds"
    shutil.copytree(dataset, src)
    (src / "sub").mkdir()
    return src


def mounted(path: Path) -> bool:
    """From the mount table, never by touching `path`."""
    return mounted_at(mountpoint_path(str(path))) is not None


def one_line(result: subprocess.CompletedProcess, fragment: str) -> str:
    assert result.returncode != 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unshardfs: "), result.stderr
    assert "Traceback" not in result.stderr
    assert fragment in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def cleaned(*mountpoints: Path) -> Iterator[None]:
    """Whatever a test mounts on `mountpoints` is gone afterwards, even when it fails."""
    try:
        yield
    finally:
        for path in mountpoints:
            if mounted(path):
                force_unmount(path)
            for pid in daemon_pids(path):  # a daemon still waiting to report (the test's bound ran out)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)


@contextlib.contextmanager
def bound(what: Path, where: Path, recursive: bool = False) -> Iterator[None]:
    """`what` bind-mounted (with its submounts if `recursive`) on `where`, undone afterwards."""
    result = subprocess.run(["mount", "--rbind" if recursive else "--bind", str(what), str(where)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    try:
        yield
    finally:
        subprocess.run(["umount", "-R", "-l", str(where)], capture_output=True, timeout=30)


# -- a mount never reads itself: refused at mount time ------------------------------------------------


def test_mountpoint_inside_source_is_refused(source, tmp_path):
    mnt = source / "sub"
    with cleaned(mnt):
        line = one_line(run_cli("mount", str(source), str(mnt), "--log-file", str(tmp_path / "log"), timeout=60),
                        "lies inside the source")
        assert str(mnt) in line
        assert not mounted(mnt)
        # In the foreground too (the check is the daemon's own, not the detaching parent's).
        one_line(run_cli("mount", "-f", str(source), str(mnt), timeout=60), "lies inside the source")
        assert not mounted(mnt)


def test_mountpoint_inside_source_through_symlinks_is_refused(source, tmp_path):
    mnt = source / "sub"
    (tmp_path / "source-link").symlink_to(source)
    (tmp_path / "mnt-link").symlink_to(mnt)
    (tmp_path / "parent-link").symlink_to(source)
    with cleaned(mnt):
        for src, target in ((tmp_path / "source-link", mnt), (source, tmp_path / "mnt-link"),
                            (source, tmp_path / "parent-link" / "sub")):
            one_line(run_cli("mount", str(src), str(target), "--log-file", str(tmp_path / "log"), timeout=60),
                     "lies inside the source")
            assert not mounted(mnt)


@needs_root
def test_mountpoint_inside_source_through_a_bind_mount_is_refused(source, tmp_path):
    """The source named by a bind mount of it: no path string says the mountpoint is inside."""
    alias = tmp_path / "alias"
    alias.mkdir()
    mnt = source / "sub"
    with cleaned(mnt, alias / "sub"), bound(source, alias):
        for src, target in ((alias, mnt), (source, alias / "sub")):
            one_line(run_cli("mount", str(src), str(target), "--log-file", str(tmp_path / "log"), timeout=60),
                     "lies inside the source")
            assert not mounted(mnt)


def test_mountpoint_beside_an_archive_is_fine(dataset, tmp_path):
    """An archive's directory is not served, only the archive: a mountpoint next to it is not inside."""
    from unshardfs.testing.zips import zip_tree

    archive = tmp_path / "ds.zip"
    zip_tree(dataset, archive)
    mnt = tmp_path / "ds"
    mnt.mkdir()
    with cleaned(mnt):
        result = run_cli("mount", str(archive), str(mnt), "--log-file", str(tmp_path / "log"), timeout=60)
        assert result.returncode == 0, result.stderr
        assert "info" in os.listdir(mnt)


# -- a mount never reads itself: while serving, its own mount is absent from the source ----------------


@needs_root
@pytest.mark.parametrize("how,engine", [("mount bound in the source", "kernel"),
                                        ("its parent bound in the source with submounts", "kernel"),
                                        ("mount bound in the source", "pyfuse3")])
def test_own_mount_brought_into_the_source_later_is_absent(source, tmp_path, mount: MountFn, how, engine):
    """A bind mount made after mounting brings the mount inside its own source: a walk of the
    mount finishes (no reader, and no daemon thread, ever waits in state D) and the daemon keeps
    serving; the entry that would lead into the mount is absent."""
    m = mount(source, "--fuse-engine", engine)
    if how == "mount bound in the source":
        binding = bound(m.path, source / "sub")
        inside, parent, name = source / "sub", m.path, "sub"
    else:
        binding = bound(tmp_path, source / "sub", recursive=True)
        inside, parent, name = source / "sub" / m.path.name, m.path / "sub", m.path.name
    (daemon,) = [p for p in daemon_pids(m.path) if b"fusermount3" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    try:
        with binding:
            assert mounted(inside)
            for cmd in (["find", str(m.path)], ["ls", "-laR", str(m.path)]):
                walk = run_bounded(cmd, m.path, seconds=30)
                assert not walk.stuck and walk.returncode == 0, (cmd, walk)
                assert not blocked(daemon)
            assert {"info", "1_1_1"} <= set(os.listdir(m.path))
            assert name not in os.listdir(parent)
            assert m.stats()["process"]["cpu_seconds"] >= 0  # still answering
    finally:
        if blocked(daemon):
            abort(m.path)


# -- unmount takes the path the user gave --------------------------------------------------------------


@pytest.fixture
def through_symlink(dataset, tmp_path) -> Iterator[tuple[Path, Path]]:
    """(the real mountpoint, a symlink to it), mounted through the symlink; unmounted afterwards."""
    real = tmp_path / "real"
    real.mkdir()
    alias = tmp_path / "alias"
    alias.symlink_to(real)
    with cleaned(real):
        result = run_cli("mount", str(dataset), str(alias), "--log-file", str(tmp_path / "log"), timeout=60)
        assert result.returncode == 0, result.stderr
        assert mounted(real)
        yield real, alias


def test_unmount_through_the_symlink_it_was_mounted_by(through_symlink):
    real, alias = through_symlink
    result = run_cli("unmount", str(alias), timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert not mounted(real)


def test_lazy_unmount_through_a_symlink_of_a_busy_mount(through_symlink):
    real, alias = through_symlink
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=real)
    try:
        busy = run_cli("unmount", str(alias), timeout=60)
        one_line(busy, "cannot unmount")
        assert mounted(real)
        result = run_cli("unmount", "-z", str(alias), timeout=60)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        assert not mounted(real)
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_unmount_of_what_is_not_a_mount_is_one_line(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    one_line(run_cli("unmount", str(plain), timeout=60), "nothing is mounted there")
    one_line(run_cli("unmount", "-z", str(tmp_path / "missing"), timeout=60), "nothing is mounted there")


@needs_root
def test_unmount_refuses_another_file_system(tmp_path):
    """A mount that is not ours is left alone, even for root (who may unmount anything)."""
    other = tmp_path / "other"
    other.mkdir()
    assert subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(other)], timeout=30).returncode == 0
    try:
        for args in (["unmount", str(other)], ["unmount", "-z", str(other)]):
            one_line(run_cli(*args, timeout=60), "not an unshardfs mount (tmpfs)")
            assert mounted(other)
    finally:
        subprocess.run(["umount", "-l", str(other)], capture_output=True, timeout=30)


# -- file arguments are opened without blocking and must be regular files -------------------------------


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _directory(tmp_path: Path) -> Path:
    path = tmp_path / "dir"
    path.mkdir()
    return path


def _socket(tmp_path: Path) -> Path:
    path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()
    return path


@pytest.mark.parametrize("make,fragment", [
    (_fifo, "is a FIFO, not a regular file"),
    (_directory, "is a directory, not a regular file"),
    (_socket, "is a socket, not a regular file"),
    (lambda tmp_path: Path("/dev/zero"), "is a character device, not a regular file"),
    (lambda tmp_path: tmp_path / "no-such-dir" / "log", "No such file or directory"),
])
def test_bad_log_file_is_refused_before_detaching(dataset, tmp_path, make, fragment):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = make(tmp_path)
    with cleaned(mnt):
        line = one_line(run_cli("mount", str(dataset), str(mnt), "--log-file", str(log), timeout=20), fragment)
        assert "--log-file" in line
        assert not mounted(mnt) and not daemon_pids(mnt)
    assert not (tmp_path / "no-such-dir").exists()  # a mistyped directory is not made


def test_log_file_may_be_dev_null(dataset, tmp_path):
    """Decided: /dev/null (and no other device) is a log a user may choose, to keep none."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with cleaned(mnt):
        result = run_cli("mount", str(dataset), str(mnt), "--log-file", os.devnull, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "info" in os.listdir(mnt)


@pytest.mark.parametrize("make,fragment", [
    (_fifo, "is a FIFO, not a regular file"),
    (_directory, "is a directory, not a regular file"),
    (lambda tmp_path: tmp_path / "missing.json", "No such file or directory"),
])
@pytest.mark.parametrize("command", ["mount", "inspect"])
def test_bad_info_file_is_refused(dataset, tmp_path, make, fragment, command):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    spec = make(tmp_path)
    args = [command, "--info", str(spec), str(dataset)] + ([str(mnt), "--log-file", str(tmp_path / "log")]
                                                             if command == "mount" else [])
    with cleaned(mnt):
        line = one_line(run_cli(*args, timeout=20), fragment)
        assert "--info" in line
        assert not mounted(mnt) and not daemon_pids(mnt)


@needs_root
def test_file_arguments_out_of_reach_of_an_unprivileged_user(dataset, tmp_path):
    """As another user: a log file in a directory it may not write, a spec it may not read."""
    from unshardfs.app import cli
    from unshardfs.app.opened import OpenedSource  # noqa: F401 (imported before dropping privileges)

    base = Path(tempfile.mkdtemp(prefix="unshardfs-user-"))  # not under pytest's root-only directory
    base.chmod(0o755)
    private = base / "private"
    private.mkdir(mode=0o700)
    spec = private / "spec.json"
    spec.write_text("{}")
    mnt = base / "mnt"
    mnt.mkdir()
    cases = ((["--log-file", str(private / "log")], "cannot open --log-file"),
             (["--info", str(spec), "--log-file", str(base / "log")], "cannot open --info"))
    try:
        with cleaned(mnt):
            for extra, fragment in cases:
                err = tmp_path / "stderr"
                pid = os.fork()
                if pid == 0:  # pragma: no cover (the child)
                    code = 1
                    try:
                        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
                        os.dup2(fd, 2)
                        os.setgroups([])
                        os.setgid(USER)
                        os.setuid(USER)
                        sys.stderr = open(2, "w", buffering=1, closefd=False)
                        code = cli.main(["mount", str(dataset), str(mnt), *extra])
                    finally:
                        os._exit(code)
                result = subprocess.CompletedProcess([], _wait(pid, 60), "", err.read_text())
                line = one_line(result, fragment)
                assert line.endswith("Permission denied"), line
                assert not mounted(mnt)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _wait(pid: int, seconds: float) -> int:
    """The exit code of child `pid`, killed if it has not exited within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
