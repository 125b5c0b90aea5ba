"""Running many source requests at once from the trio loop.

Local reads are cheap one after another; remote ones are round trips, so
the places that need many independent requests (probing which shards
exist, reading several shards' indexes) issue them together, bounded.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence, TypeVar

import trio

T = TypeVar("T")


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
