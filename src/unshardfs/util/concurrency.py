"""Running many source requests at once from the trio loop.

Local reads are cheap one after another; remote ones are round trips, so
the places that need many independent requests (probing which shards
exist, reading several shards' indexes) issue them together, bounded.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import trio

if sys.version_info < (3, 11):  # pragma: no cover - trio installs the backport there
    from exceptiongroup import BaseExceptionGroup

T = TypeVar("T")


def cancellation(error: BaseException) -> bool:
    """Whether `error` is trio's cancellation: a `trio.Cancelled`, or a group holding one (what a
    nursery raises when a scope outside it was cancelled).

    Work shared by several tasks (one runs it, the others wait for its outcome) must never hand
    this to the waiters as the outcome: it belongs to the runner's cancelled scope, and raised in
    a task outside that scope it is caught by no scope there, so it ends that task's nursery."""
    if isinstance(error, trio.Cancelled):
        return True
    if isinstance(error, BaseExceptionGroup):
        return any(cancellation(e) for e in error.exceptions)
    return False


def stray_cancellation(error: BaseException) -> bool:
    """A cancellation raised in a task that is not being cancelled: another task's outcome handed
    on (a bug), which must be answered as a failure of the one request, not let through."""
    return cancellation(error) and trio.current_effective_deadline() != -math.inf


async def gather(calls: Sequence[Callable[[], Awaitable[T]]], limit: int = 32) -> list[T]:
    """Results of `calls` in order.

    If any call fails, its exception (the first in call order) is raised
    once all have finished, as itself: never an ExceptionGroup, which no
    caller's `except DataError` would catch.
    """
    if len(calls) <= 1:
        return [await call() for call in calls]
    results: list[Any] = [None] * len(calls)
    errors: list[Exception | None] = [None] * len(calls)
    limiter = trio.CapacityLimiter(limit)

    async def run(i: int) -> None:
        async with limiter:
            try:
                results[i] = await calls[i]()
            except Exception as e:  # noqa: BLE001 - re-raised below, in call order
                errors[i] = e

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(run, i)
    for error in errors:
        if error is not None:
            raise error
    return results
