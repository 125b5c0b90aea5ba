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
        mounting = False  # only the engine's failures to mount are the mountpoint's (not a RuntimeError of the source's)
        try:
            check_mountpoint(request.mountpoint)
            session = await open_session()
            ops = Bridge(session.tree, request.options, session.stats, engine=request.engine)
            mounting = True
            engine = open_engine(request.engine, ops, request.mountpoint, request.fsname,
                                 [*request.fuse_options, *(["debug"] if request.debug else [])])
            engine.mount()
        except BaseException as e:
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


def detach(argv: list[str], log_file: str) -> int:
    """Run `argv` (a foreground mount) as a daemon; return once it is mounted or failed."""
    read_fd, write_fd = os.pipe()
    os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
    with open(log_file, "ab") as log_out:
        child = subprocess.Popen(
            [sys.executable, "-m", "unshardfs", *argv, "--ready-fd", str(write_fd)],
            pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=log_out, stderr=log_out,
            start_new_session=True, close_fds=True,
        )
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


def unmount(mountpoint: str, lazy: bool = False) -> int:
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [mountpoint]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        cmd[0] = "umount"
        cmd.remove("-u")
        result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        print(f"unshardfs: cannot unmount {mountpoint}: {detail[-1] if detail else 'failed'}", file=sys.stderr)
        return 1
    return 0
