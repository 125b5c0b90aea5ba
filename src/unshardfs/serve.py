"""`unshardfs serve`: the virtual tree of a SOURCE over HTTP, on the daemon's trio loop, no FUSE.

hypercorn (which runs on trio) speaks HTTP/1.1; `httpfront.TreeApp` answers.
The same Session as a mount gives the same caches, concurrency limits and
bounds on hostile input; SIGINT/SIGTERM stop the server cleanly.
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

from .errors import ConfigError, DataError, SourceError
from .httpfront import ServeOptions, TreeApp
from .session import Session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeRequest:
    bind: str = "127.0.0.1"  # loopback unless told otherwise: the tree is readable by anyone who connects
    port: int = 8080
    options: ServeOptions = ServeOptions()
    # Bounds on clients: header size (a larger request is refused), idle keep-alive, and
    # how long a request may take to arrive (a slow client cannot hold a connection forever).
    max_header_bytes: int = 16 << 10
    keep_alive_seconds: float = 30
    read_timeout_seconds: float = 60


def _config(request: ServeRequest):
    from hypercorn.config import Config

    config = Config()
    host = f"[{request.bind}]" if ":" in request.bind else request.bind
    config.bind = [f"{host}:{request.port}"]
    config.h11_max_incomplete_size = request.max_header_bytes
    config.keep_alive_timeout = request.keep_alive_seconds
    # hypercorn annotates this as int seconds; it is a timeout, and a float works
    config.read_timeout = request.read_timeout_seconds  # type: ignore[assignment]
    config.accesslog = None  # our own one-line log, with --access-log
    config.errorlog = logging.getLogger("hypercorn.error")
    config.include_server_header = False
    config.graceful_timeout = 2
    return config


def run(source: str, open_session: Callable[[], Awaitable[Session]], request: ServeRequest) -> int:
    """Serve until SIGINT/SIGTERM; print the URL once listening. Returns the exit status."""
    from hypercorn.trio import serve

    async def main() -> None:
        session = await open_session()
        stop = trio.Event()
        try:
            async with session.running(), trio.open_nursery() as nursery:
                nursery.start_soon(_stop_on_signal, stop)
                app = TreeApp(session.tree, session.stats, request.options)
                try:
                    # TreeApp is an ASGI 3 callable over plain dicts; hypercorn's stubs accept only
                    # their own TypedDict scopes and events.
                    urls = await nursery.start(lambda task_status: serve(app, _config(request),  # type: ignore[arg-type]
                                                                           shutdown_trigger=stop.wait,
                                                                           task_status=task_status))
                except OSError as e:
                    raise ConfigError(f"cannot listen on {request.bind}:{request.port}: {e.strerror}") from e
                print(f"serving {source} on {' '.join(urls)}", flush=True)
                await stop.wait()
                nursery.cancel_scope.deadline = trio.current_time() + 5  # graceful, then stop
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
