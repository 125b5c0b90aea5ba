"""When a failed request is tried again: one exponential backoff schedule for reads and writes.

Reading (`sources.http`, on trio) and writing (`dest.store`, in worker
threads) retry the same way: up to `retries` more attempts, the n-th after
about `first * 2**(n-1)` seconds (at most `most`), each wait jittered to
between half and one and a half times that so that clients failing together
do not come back together, and no wait that would end at or past the
request's deadline. The caller keeps the clock and does the waiting (a trio
sleep, or a thread's): this module only says how long.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """How a request is retried (the options `--retries`, `--backoff`, `--backoff-max` set)."""

    first: float = 0.25  # seconds before the first retry; doubled for each one after it
    most: float = 8.0  # the longest wait, before jitter
    retries: int = 5  # attempts after the first

    def schedule(self) -> "Retries":
        """The retries of one request, from its first attempt on."""
        return Retries(self)


class Retries:
    """The retries one request has left, and the wait before the next."""

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self.delay = backoff.first
        self.made = 0  # retries granted so far
        self.ended = False  # a wait was refused: none is granted after it

    def wait(self, now: float, deadline: float) -> float | None:
        """The wait before the next attempt, counted as made; None when none is left (every retry
        made, or the wait would end at or past `deadline`, on the clock `now` is read from). Once it
        has answered None it always does: a later call drawing a shorter jitter gets no retry."""
        if self.ended or self.made >= self.backoff.retries:
            self.ended = True
            return None
        wait = min(self.delay, self.backoff.most) * (0.5 + random.random())
        if now + wait >= deadline:
            self.ended = True
            return None
        self.made += 1
        self.delay *= 2
        return wait

    def at_least(self, seconds: float) -> None:
        """The server asked for this long a wait (Retry-After): the next one is no shorter."""
        self.delay = max(self.delay, seconds)
