"""Trio's fast path: everything the daemon does beside trio's public API, in one place.

Three things here read trio's internals or step coroutines by hand; two keep a request that
needs no waiting from costing a trip through trio's scheduler:

- `TrioProbe`: the run queue (tasks ready to run) and the epoll descriptor of the current trio
  run, read from trio's internals. The kernel engine's quick wait (`fuse.server`) spins briefly
  on its connection instead of parking in trio, and must give way the moment trio has work: a
  task ready, or a descriptor trio waits on readable. Trio exposes neither publicly
  (`current_statistics()` counts runnable tasks at about 5 us a call against 0.1 us for the
  queue's length, and names no descriptor).
- `start` and `resume`: a handler's coroutine run by hand in the calling task, up to its first
  wait, so a request answered without waiting costs no task and no scheduler pass; one that
  does wait goes on in the same task from that wait, the trap it yielded handed to trio as if
  the task had awaited the coroutine from the start. This is the coroutine protocol itself
  (`send`, `throw`, `close`), which every trio keeps: only what the trap is belongs to trio.

The third lets the HTTP client reuse a TLS connection: `tls_holds_bytes` looks into a trio
`SSLStream`'s buffer of records read but not decrypted, which trio does not expose.

The probe is checked once per run (`TrioProbe.of_current_run`): where trio's internals are not
what is known (another trio, another I/O backend), it answers None, the quick wait is off, and
that is logged once. pyproject.toml pins trio to the versions this was checked against, and a
test asserts the probe is active with the installed trio, so an upgrade that breaks it fails
the tests instead of silently slowing every request.
"""

from __future__ import annotations

import logging
import select
import ssl
import types
from dataclasses import dataclass
from typing import Any, Coroutine, Generator, Sized, TypeVar

import trio

from unshardfs.util.logonce import log_once

log = logging.getLogger(__name__)

T = TypeVar("T")


def _internals() -> tuple[object, object]:
    """The current run's run queue and I/O manager epoll object, from trio's internals."""
    from trio._core._run import GLOBAL_RUN_CONTEXT

    runner = GLOBAL_RUN_CONTEXT.runner
    return runner.runq, runner.io_manager._epoll


@dataclass(frozen=True)
class TrioProbe:
    """What a quick wait needs to know of the trio run it is in: its run queue (`len(runq)`:
    tasks ready to run) and its epoll descriptor (readable once a descriptor trio waits on is
    ready)."""

    runq: Sized
    epoll_fd: int

    @classmethod
    def of_current_run(cls) -> TrioProbe | None:
        """The probe of the current trio run; None (logged once) where trio's internals are not
        as known. Call it once per run and keep the answer: it is not free."""
        try:
            runq, epoll = _internals()
        except (ImportError, AttributeError, RuntimeError) as e:
            _fell_back(f"{type(e).__name__}: {e}")
            return None
        if not isinstance(runq, Sized) or not isinstance(epoll, select.epoll):
            _fell_back(f"run queue {type(runq).__name__}, I/O manager's epoll {type(epoll).__name__}")
            return None
        return cls(runq, epoll.fileno())


def _fell_back(why: str) -> None:
    log_once(log, "triofast:probe", "trio %s's internals are not as expected (%s): the kernel engine's quick "
             "wait is off, every idle request waits through trio's scheduler", trio.__version__, why)


def tls_holds_bytes(stream: trio.SSLStream[Any]) -> bool:
    """Whether `stream` holds bytes received but not yet read by its caller: records read from
    the socket but not decrypted (its incoming buffer, trio's internal `_incoming`), or decrypted
    bytes (`pending`). True where the buffer is not where it is known (logged once): a caller
    that reuses a connection only when nothing is held then never reuses a TLS one (slower,
    never wrong)."""
    incoming = getattr(stream, "_incoming", None)
    if not isinstance(incoming, ssl.MemoryBIO):
        _fell_back_tls(type(incoming).__name__)
        return True
    return incoming.pending > 0 or stream.pending() > 0


def _fell_back_tls(found: str) -> None:
    log_once(log, "triofast:tls", "trio %s's SSLStream keeps no incoming buffer where known (found %s): TLS "
             "connections to servers are not reused", trio.__version__, found)


# -- hand-stepped coroutines ----------------------------------------------------------------

def start(coroutine: Coroutine[Any, Any, T]) -> tuple[bool, Any]:
    """Run `coroutine` in the calling task up to its first wait: (True, what it returned) if it
    finished without one, else (False, the trap it yielded), for `resume` in this same task.
    What it raises before waiting is raised here."""
    try:
        trap = coroutine.send(None)
    except StopIteration as done:
        return True, done.value
    return False, trap


@types.coroutine
def resume(coroutine: Coroutine[Any, Any, T], trap: Any) -> Generator[Any, Any, T]:
    """Go on running `coroutine`, suspended at its first wait (`trap`, from `start`), in the
    awaiting task: the trap goes to trio now, and whatever trio sends or throws back goes on to
    the coroutine (what `await` would have done had the task awaited it from the start)."""
    while True:
        try:
            value = yield trap
        except GeneratorExit:
            coroutine.close()
            raise
        except BaseException as e:
            try:
                trap = coroutine.throw(e)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]  # the coroutine's own T
        else:
            try:
                trap = coroutine.send(value)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]  # the coroutine's own T
