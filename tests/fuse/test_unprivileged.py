"""A mount by an unprivileged user (through fusermount3, no root anywhere in the daemon), its
clean-up after SIGKILL, and auto_unmount: a daemon killed with SIGKILL leaves no dead mount."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio

from unshardfs.testing.mounts import daemon_pids, force_unmount, wait_for
from unshardfs.testing.precomputed import Scale, sharding, write_volume

USER = 65534  # nobody
KEY = "1_1_1"

pytestmark = pytest.mark.skipif(os.getuid() != 0 or not shutil.which("fusermount3"),
                                reason="needs root to become another user, and fusermount3")


def _as_user(*cmd: str) -> subprocess.CompletedProcess:
    def drop() -> None:
        os.setgid(USER)
        os.setuid(USER)

    return subprocess.run(list(cmd), capture_output=True, preexec_fn=drop, timeout=60)


def _daemon_as_user(source: Path, mountpoint: Path, log: Path, *options: str) -> int:
    """Fork a daemon that drops to USER before mounting. The interpreter lives where USER may not
    read (root's home), so everything the daemon needs is imported before the switch."""
    from unshardfs.app import cli
    from unshardfs.app.opened import OpenedSource
    from unshardfs.fuse import engines, kernel, mount, server  # noqa: F401

    async def warm() -> None:  # imports the format's modules
        session = await OpenedSource.open(str(source))
        await session.aclose()

    trio.run(warm)
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.dup2(fd, 1)
        os.setgroups([])
        os.setgid(USER)
        os.setuid(USER)
        os.environ["HOME"] = "/nonexistent"
        # Away from pytest's capture: the daemon logs to its own stderr, the log file.
        logging.root.handlers.clear()
        sys.stdout = sys.stderr = open(2, "w", buffering=1, closefd=False)
        code = cli.main(["mount", "-f", *options, str(source), str(mountpoint)])
    finally:
        os._exit(code)


@contextlib.contextmanager
def user_dirs(volume: dict):
    base = Path(tempfile.mkdtemp(prefix="unshardfs-user-"))
    try:
        base.chmod(0o755)
        shutil.copytree(volume["sharded"], base / "src")
        for p in [base / "src", *(base / "src").rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        mnt = base / "mnt"
        mnt.mkdir()
        os.chown(mnt, USER, USER)
        yield base / "src", mnt, base / "log"
    finally:
        if mounted(base / "mnt"):
            subprocess.run(["umount", "-l", str(base / "mnt")], capture_output=True, timeout=30)
        force_unmount(base / "mnt")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    return write_volume(tmp_path_factory.mktemp("user"), [Scale((64, 64, 32), (16, 16, 16), sharding())], "uint16")


def mounted(path: Path) -> bool:
    """From the mount table: root cannot stat a user's mount without allow_other."""
    return f" {path} " in Path("/proc/self/mounts").read_text()


def test_user_mount_reads_and_is_cleaned_up_after_sigkill(volume):
    with user_dirs(volume) as (src, mnt, log):
        pid = _daemon_as_user(src, mnt, log)
        try:
            assert wait_for(lambda: mounted(mnt)), log.read_text() if log.exists() else ""
            mounts = Path("/proc/self/mounts").read_text()
            line = next(entry for entry in mounts.splitlines() if f" {mnt} " in entry)
            assert f"user_id={USER}" in line and "fuse.unshardfs" in line
            name = sorted(os.listdir(volume["plain"] / KEY))[3]
            got = _as_user("cat", str(mnt / KEY / name))
            assert got.returncode == 0, got.stderr
            assert got.stdout == (volume["plain"] / KEY / name).read_bytes()
            # Only its owner may look inside (no allow_other): root is refused.
            with pytest.raises(PermissionError):
                os.listdir(mnt)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pid = 0
            dead = _as_user("ls", str(mnt))
            assert dead.returncode != 0 and b"not connected" in dead.stderr, dead.stderr
            # What `unshardfs unmount` runs, as the user who mounted it.
            assert _as_user("fusermount3", "-u", str(mnt)).returncode == 0
            assert not mounted(mnt)
        finally:
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def test_a_user_s_mount_asked_for_passthrough_reads_every_file_through_the_daemon(volume):
    """Backing files need CAP_SYS_ADMIN: a user's daemon negotiates passthrough off (and keeps
    no-open), says so once, and serves every file as without the option."""
    with user_dirs(volume) as (src, mnt, log):
        (src / "provenance.bin").write_bytes(b"p" * 300_000)
        (src / "provenance.bin").chmod(0o644)
        pid = _daemon_as_user(src, mnt, log, "--fuse-passthrough")
        try:
            assert wait_for(lambda: mounted(mnt)), log.read_text() if log.exists() else ""
            got = _as_user("cat", str(mnt / "provenance.bin"))
            assert got.returncode == 0 and got.stdout == b"p" * 300_000, got.stderr
            name = sorted(os.listdir(volume["plain"] / KEY))[3]
            got = _as_user("cat", str(mnt / KEY / name))
            assert got.stdout == (volume["plain"] / KEY / name).read_bytes()
            text = log.read_text()
            assert "passthrough needs CAP_SYS_ADMIN" in text
            negotiated = next(line for line in text.splitlines() if "negotiated" in line)
            assert "no_open" in negotiated and "passthrough" not in negotiated
        finally:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)


def test_user_mount_unmounts_on_sigterm(volume):
    with user_dirs(volume) as (src, mnt, log):
        pid = _daemon_as_user(src, mnt, log)
        try:
            assert wait_for(lambda: mounted(mnt)), log.read_text() if log.exists() else ""
            os.kill(pid, signal.SIGTERM)
            _, status = os.waitpid(pid, 0)
            pid = 0
            assert os.waitstatus_to_exitcode(status) == 0, log.read_text()
            assert not mounted(mnt)
            assert "unmounted" in log.read_text()
        finally:
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def test_auto_unmount_after_sigkill(volume, mount):
    """-o auto_unmount: fusermount3 watches the daemon and unmounts once it is killed."""
    m = mount(volume["sharded"], "-o", "auto_unmount")
    (pid,) = [p for p in daemon_pids(m.path) if b"fusermount3" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert any(b"fusermount3" in Path(f"/proc/{p}/cmdline").read_bytes() for p in _children(pid))
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not mounted(m.path))
    assert os.listdir(m.path) == []


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found
