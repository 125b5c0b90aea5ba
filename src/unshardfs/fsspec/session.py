"""A tree served by a trio loop in a background thread, for callers in any other thread.

fsspec's API is synchronous and called from any thread (zarr's, Dask's worker threads, a
notebook's); the core is trio. A `Session` runs one `trio.run` in a daemon thread that opens the
tree, serves calls made with `call` (each one a task in that loop, so calls from many threads run
concurrently and share one read path: coalescing, caches, read-ahead) and closes the tree when
the session stops.

Sessions are shared: instances with the same options in one process (fsspec makes one instance
per thread) use one session, counted by `acquire`/`release`. A process forked from one that had
sessions starts its own on first use (the parent's loop thread does not exist in the child, and
its connections are the parent's: they are dropped, never closed from the child).
"""

from __future__ import annotations

import atexit
import os
import threading
from collections import deque
from typing import AsyncContextManager, Awaitable, Callable, Hashable, Protocol, TypeVar

import trio

from unshardfs.tree.nodes import DirNode

T = TypeVar("T")


class Served(Protocol):
    """What an opener yields: the tree, where it lies, and live counters of what serving it cost."""

    @property
    def tree(self) -> DirNode:
        """The root directory."""

    @property
    def prefix(self) -> str:
        """The root's path in the namespace of the filesystem the dataset lives on, for an instance
        reached through a chained URL (paths are then that filesystem's); "" for paths relative
        to the root."""

    def stats(self) -> dict[str, object]:
        """Requests, backing reads, caches (as `unshardfs stats` shows them for a mount)."""


Opener = Callable[[], AsyncContextManager[Served]]


class Session:
    """One trio loop in a daemon thread, holding one opened tree until `stop`."""

    def __init__(self, opener: Opener, name: str = "unshardfs-fsspec") -> None:
        self.pid = os.getpid()
        self._opener = opener
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._done: trio.Event | None = None
        self._served: Served | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure

    @property
    def served(self) -> Served:
        assert self._served is not None
        return self._served

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # an opening failure: the constructor re-raises it
            if not self._ready.is_set():
                self._failure = e
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        async with self._opener() as served:
            self._served = served
            self._ready.set()
            await self._done.wait()

    @property
    def alive(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive()

    def call(self, fn: Callable[..., Awaitable[T]], *args: object) -> T:
        """`await fn(*args)` in the loop, from any other thread; its exception is raised here."""
        if not self.alive:
            raise OSError("this unshardfs filesystem was closed")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled):  # stopped while the call waited
            raise OSError("this unshardfs filesystem was closed") from None

    def stop(self, wait: bool = True) -> None:
        """Close the tree (its connections) and end the thread; calls after it fail with OSError.
        Never blocks the loop: from any thread (the loop's own, a garbage collector's callback) it
        only asks; `wait` then waits for the thread to end, from any thread but the loop's."""
        if not self.alive or self._token is None or self._done is None:
            return
        try:
            self._token.run_sync_soon(self._done.set)  # thread-safe, returns at once
        except trio.RunFinishedError:
            return
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)


class Sessions:
    """Sessions by key (the options they were opened with), shared by the instances that use them.

    Its lock is never held while a session opens or stops (an opening session's thread may run
    garbage collection, whose callbacks come here), and an instance collected as garbage only
    leaves a note (`dropped`), taken up by the next call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Hashable, tuple[Session, int]] = {}
        self._dropped: deque[tuple[Hashable, Session]] = deque()  # appended without the lock
        self._pid = os.getpid()

    def _settle(self) -> list[Session]:
        """With the lock held: forget a parent's sessions after a fork, take up dropped users; the
        sessions left without one, for the caller to stop once the lock is released."""
        if self._pid != os.getpid():  # the parent's sessions: not ours to use or to close
            self._open.clear()
            self._dropped.clear()
            self._pid = os.getpid()
        unused = []
        while self._dropped:
            key, session = self._dropped.popleft()
            unused += self._less(key, session)
        return unused

    def _less(self, key: Hashable, session: Session) -> list[Session]:
        found = self._open.get(key)
        if found is None or found[0] is not session:
            return []
        if found[1] > 1:
            self._open[key] = (session, found[1] - 1)
            return []
        del self._open[key]
        return [session]

    def acquire(self, key: Hashable, opener: Opener) -> Session:
        """The session for `key`, opened with `opener` when there is none alive; one more user."""
        with self._lock:
            unused = self._settle()
            found = self._open.get(key)
            if found is not None and found[0].alive:
                self._open[key] = (found[0], found[1] + 1)
                session: Session | None = found[0]
            else:
                session = None
        for old in unused:
            old.stop()
        if session is not None:
            return session
        opened = Session(opener)  # the opener's error (no such dataset) propagates from here
        with self._lock:
            found = self._open.get(key)
            if found is not None and found[0].alive:  # another thread opened it meanwhile: theirs
                self._open[key] = (found[0], found[1] + 1)
                session = found[0]
            else:
                self._open[key] = (opened, 1)
                return opened
        opened.stop()
        return session

    def release(self, key: Hashable, session: Session) -> None:
        """One user fewer; the last one stops the session (and waits for it)."""
        with self._lock:
            unused = self._settle() + self._less(key, session)
        for done in unused:
            done.stop()

    def dropped(self, key: Hashable, session: Session) -> None:
        """One user fewer, from a garbage collector's callback in any thread: noted, never waited on."""
        self._dropped.append((key, session))

    def stop_all(self) -> None:
        """Stop every session of this process (at interpreter exit: connections closed cleanly)."""
        with self._lock:
            self._settle()
            sessions = [session for session, _ in self._open.values()]
            self._open.clear()
        for session in sessions:
            session.stop()

    def __len__(self) -> int:
        with self._lock:
            unused = self._settle()
            count = sum(1 for session, _ in self._open.values() if session.alive)
        for session in unused:
            session.stop()
        return count


SESSIONS = Sessions()
atexit.register(SESSIONS.stop_all)
