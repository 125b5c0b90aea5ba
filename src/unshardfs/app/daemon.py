"""Mount lifecycle: check the mountpoint, serve in the foreground, or detach like sshfs.

Detaching is done by re-running ourselves in the foreground as a new session
and waiting on a pipe until the child reports "mounted" or an error; that
way `unshardfs mount` returns 0 only once the mount is live, and every error
(bad source, busy mountpoint) is printed by the command the user typed.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import trio

from unshardfs.app.opened import OpenedSource
from unshardfs.fuse.engines import Engine, open_engine
from unshardfs.fuse.ops import MountOptions, Bridge
from unshardfs.util.errors import ConfigError, DataError, SourceError
from unshardfs.util.fdpath import open_argument
from unshardfs.util.mountinfo import MountEntry, OwnMount, mountpoint_path, mounted_at, open_directory, overlap

log = logging.getLogger(__name__)

SessionOpener = Callable[[], Awaitable[OpenedSource]]


@dataclass
class MountRequest:
    mountpoint: str
    fsname: str
    fuse_options: list[str] = field(default_factory=list)
    debug: bool = False
    options: MountOptions = field(default_factory=MountOptions)
    engine: str = "kernel"


def check_mountpoint(path: str) -> None:
    """Refuse missing, dead, busy or non-empty mountpoints with a message saying what to do."""
    try:
        # A listing, not a stat: the kernel answers stat of a dead FUSE mount
        # from its attribute cache, but a listing must reach the daemon.
        entries = os.listdir(path)
    except FileNotFoundError:
        raise ConfigError(f"mountpoint {path} does not exist") from None
    except NotADirectoryError:
        raise ConfigError(f"mountpoint {path} is not a directory") from None
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.ECONNABORTED):  # the daemon behind it is gone
            raise ConfigError(f"mountpoint {path} has a dead mount (crashed daemon?); "
                              f"run: unshardfs unmount {path}") from None
        raise ConfigError(f"mountpoint {path}: {e.strerror}") from None
    if os.path.ismount(path):
        raise ConfigError(f"mountpoint {path} is busy: something is already mounted there")
    if entries:
        raise ConfigError(f"mountpoint {path} is not empty")


def refuse_overlap(target: str, session: OpenedSource) -> None:
    """Refuse a mount that would read itself: MOUNTPOINT inside a local SOURCE, or SOURCE reached
    through MOUNTPOINT (compared by device and inode, so symlinks and bind mounts count)."""
    try:
        mountpoint = open_directory(target)
    except OSError as e:
        raise ConfigError(f"mountpoint {target}: {e.strerror}") from None
    try:
        for local, whole_tree in session.local_directories():
            found = overlap(mountpoint, local.root_fd, whole_tree)
            if found == "inside":
                raise ConfigError(f"mountpoint {target} lies inside the source {local.root}: the mount would "
                                  "read itself; choose a mountpoint outside the source")
            if found == "through":
                raise ConfigError(f"source {local.root} lies inside the mountpoint {target}: mounting would "
                                  "hide it; choose a mountpoint outside the source")
    finally:
        os.close(mountpoint)


def keep_out(target: str, session: OpenedSource) -> OwnMount | None:
    """After mounting: the local sources never enter the mount (nor, later, a bind mount of it)."""
    locals_ = session.local_directories()
    if not locals_:
        return None
    own = OwnMount.of(target)
    if own is None:
        log.warning("%s is not in the mount table: cannot keep the source out of its own mount", target)
        return None
    for local, _whole in locals_:
        local.keep_out(own)
    return own


def serve(request: MountRequest, open_session: SessionOpener, ready: Callable[[str | None], None]) -> int:
    """Open the source, mount, report readiness, serve until unmounted or signalled."""

    async def main() -> None:
        # Signals are received from before the mount: one arriving as soon as the mount is
        # visible must unmount, not kill the daemon.
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            await mounted(signals)

    async def mounted(signals: AsyncIterator[int]) -> None:
        session: OpenedSource | None = None
        engine: Engine | None = None
        own: OwnMount | None = None
        mounting = False  # only the engine's failures to mount are the mountpoint's (not a RuntimeError of the source's)
        try:
            check_mountpoint(request.mountpoint)
            # Resolved once, before mounting (afterwards a stat of it would reach the mount), the
            # way `unmount` resolves it: a mount made through a symlink is unmounted through it.
            target = mountpoint_path(request.mountpoint)
            session = await open_session()
            refuse_overlap(target, session)
            ops = Bridge(session.tree, request.options, session.stats, engine=request.engine)
            mounting = True
            engine = open_engine(request.engine, ops, target, request.fsname,
                                 [*request.fuse_options, *(["debug"] if request.debug else [])])
            engine.mount()
            own = keep_out(target, session)
        except BaseException as e:
            if engine is not None:
                engine.close()  # (nothing to do unless it mounted)
            if own is not None:
                own.close()
            if session is not None:
                await _release(session)
            if isinstance(e, ConfigError):
                ready(str(e))
                raise
            if isinstance(e, (SourceError, DataError)):  # e.g. a remote store unreachable at mount time
                ready(f"cannot read {request.fsname.removeprefix('unshardfs:')}: {e}")
                raise ConfigError(str(e)) from e
            if mounting and isinstance(e, (RuntimeError, OSError)):  # the engine failing to mount
                ready(f"cannot mount on {request.mountpoint}: {e}")
                raise ConfigError(str(e)) from e
            raise
        ready(None)
        log.info("mounted %s on %s (%s engine)", request.fsname, request.mountpoint, request.engine)
        try:
            async with session.running(), trio.open_nursery() as nursery:
                nursery.start_soon(_stop_on_signal, signals, engine)
                await engine.run()
                nursery.cancel_scope.cancel()
        finally:
            engine.close()
            log.info("unmounted %s", request.mountpoint)
            await _release(session)
            if own is not None:
                own.close()

    try:
        trio.run(main)
    except ConfigError:
        return 1
    return 0


async def _release(session: OpenedSource) -> None:
    """Close the source (HTTP connections), even while being cancelled, within a bound."""
    with trio.CancelScope(shield=True), trio.move_on_after(5):
        await session.aclose()


async def _stop_on_signal(signals: AsyncIterator[int], engine: Engine) -> None:
    async for signum in signals:
        log.info("received %s: unmounting", signal.Signals(signum).name)
        engine.stop()
        return


def open_log(log_file: str, default: bool) -> int:
    """The daemon's log, opened here, before anything detaches, so a bad one is the command's own
    one-line error (`fdpath.open_argument`: a regular file or /dev/null). The default one's
    directory is made; a given one's must exist (a mistyped path makes no directories)."""
    if default:
        try:
            os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot make the log directory {os.path.dirname(log_file)}: {e.strerror}") from None
    return open_argument(log_file, "log file" if default else "--log-file", write=True)


def detach(argv: list[str], log_file: str, default_log: bool = False) -> int:
    """Run `argv` (a foreground mount) as a daemon; return once it is mounted or failed."""
    log_fd = open_log(log_file, default_log)
    read_fd, write_fd = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "unshardfs", *argv, "--ready-fd", str(write_fd)],
            pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
            start_new_session=True, close_fds=True,
        )
    finally:
        os.close(log_fd)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        message = pipe.read().decode(errors="replace").strip()
    if message == "OK":
        return 0
    if not message:
        code = child.wait()
        message = f"daemon exited with status {code} before mounting; see {log_file}"
    print(f"unshardfs: {message}", file=sys.stderr)
    return 1


def is_ours(entry: MountEntry) -> bool:
    """An unshardfs mount (by its file system type, or its name where a subtype was given)."""
    return entry.fstype == "fuse.unshardfs" or (entry.fstype.startswith("fuse") and
                                                 entry.source.startswith("unshardfs:"))


def unmount(mountpoint: str, lazy: bool = False) -> int:
    """Unmount the unshardfs mount at `mountpoint`, resolved as `mount` resolved it (a symlink to
    the mount is followed); anything else mounted there, or nothing, is refused in one line."""
    try:
        target = mountpoint_path(mountpoint)
    except OSError as e:
        print(f"unshardfs: cannot unmount {mountpoint}: {e.strerror}", file=sys.stderr)
        return 1
    entry = mounted_at(target)
    named = "" if target == os.path.abspath(mountpoint) else f" ({target})"
    if entry is None:
        print(f"unshardfs: cannot unmount {mountpoint}{named}: nothing is mounted there", file=sys.stderr)
        return 1
    if not is_ours(entry):
        print(f"unshardfs: cannot unmount {mountpoint}{named}: it is not an unshardfs mount ({entry.fstype})",
              file=sys.stderr)
        return 1
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + ["--", target]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        cmd = ["umount"] + (["-l"] if lazy else []) + ["--", target]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        print(f"unshardfs: cannot unmount {mountpoint}: {cmd[0]} did not finish (try unmount -z)", file=sys.stderr)
        return 1
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        print(f"unshardfs: cannot unmount {mountpoint}: {detail[-1] if detail else 'failed'}", file=sys.stderr)
        return 1
    return 0
