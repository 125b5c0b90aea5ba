"""Where a piece of work's time went: the seconds it waited, by what it waited for.

A walk adds what it was blocked on (payload bytes, a listing, DEST) to a
`Waits`; the rest of its wall time is its own work. Times come from trio's
clock inside a trio run (so under a `MockClock` a wait on a request is an
exact number of latencies), else from the monotonic clock.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import trio


def now() -> float:
    """Seconds on trio's clock inside a trio run, else on the monotonic clock."""
    try:
        return trio.current_time()
    except RuntimeError:  # not in a trio run (a worker thread, a plain function)
        return time.monotonic()


class Waits:
    """Seconds waited, by kind (`data`, `indexes`, `writes`...): only what was added is kept."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    @contextmanager
    def waiting(self, kind: str) -> Iterator[None]:
        """Count the time spent in the block as a wait of `kind` (also when it raises)."""
        start = now()
        try:
            yield
        finally:
            self.add(kind, now() - start)
