"""`unshardfs serve`: the virtual tree of a SOURCE over HTTP, on the daemon's trio loop, no FUSE.

`httpserver.Server` (h11 on trio, with bounds on what each client may
hold) speaks HTTP/1.1; `httpfront.TreeApp` answers. The same OpenedSource as a
mount gives the same caches, concurrency limits and bounds on hostile input;
SIGINT/SIGTERM stop the server cleanly.
"""

from __future__ import annotations

import logging
import resource
import signal
import sys
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

import trio

from unshardfs.app.opened import OpenedSource
from unshardfs.http.app import ServeOptions, TreeApp
from unshardfs.http.server import ServerLimits, Server, listen, url_of
from unshardfs.util.errors import ConfigError, DataError, SourceError

log = logging.getLogger(__name__)

# File descriptors kept for everything but clients: sources, caches, logs, the listener.
FD_RESERVE = 64


@dataclass(frozen=True)
class ServeRequest:
    bind: str = "127.0.0.1"  # loopback unless told otherwise: the tree is readable by anyone who connects
    port: int = 8080
    options: ServeOptions = ServeOptions()
    limits: ServerLimits = ServerLimits()


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (what an unprivileged process may); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # e.g. above fs.nr_open: keep what we have
            pass
    return soft


def fitted(limits: ServerLimits, fd_limit: int) -> ServerLimits:
    """`limits` with at most half the descriptors (less a reserve) for clients: never EMFILE on accept."""
    room = max(8, (fd_limit - FD_RESERVE) // 2) if fd_limit != resource.RLIM_INFINITY else limits.max_connections
    if limits.max_connections > room:
        log.info("at most %d connections: the file descriptor limit is %d", room, fd_limit)
        return replace(limits, max_connections=room)
    return limits


def run(source: str, open_session: Callable[[], Awaitable[OpenedSource]], request: ServeRequest) -> int:
    """Serve until SIGINT/SIGTERM; print the URL once listening. Returns the exit status."""
    limits = fitted(request.limits, raise_fd_limit())

    async def main() -> None:
        session = await open_session()
        stop = trio.Event()
        try:
            try:
                listeners = listen(request.bind, request.port)
            except OSError as e:
                raise ConfigError(f"cannot listen on {request.bind}:{request.port}: {e.strerror}") from e
            async with session.running(), trio.open_nursery() as nursery:
                nursery.start_soon(_stop_on_signal, stop)
                app = TreeApp(session.tree, session.stats, request.options)
                server = Server(app, limits)
                app.connection_stats = server.stats
                print(f"serving {source} on {' '.join(url_of(li) for li in listeners)}", flush=True)
                await server.serve(listeners, stop)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await session.aclose()
            log.info("stopped serving %s", source)

    try:
        trio.run(main)
    except (ConfigError, SourceError, DataError) as e:
        print(f"unshardfs: {e}", file=sys.stderr)
        return 1
    return 0


async def _stop_on_signal(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: stopping", signal.Signals(signum).name)
            stop.set()
            return
