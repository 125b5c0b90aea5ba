"""Running many source requests at once from the trio loop.

Local reads are cheap one after another; remote ones are round trips, so
the few places that need many independent requests (probing which shards
exist, sizing gzip chunks for a listing) issue them together, bounded.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Sequence, TypeVar

import trio

T = TypeVar("T")


async def gather(calls: Sequence[Callable[[], Awaitable[T]]], limit: int = 32) -> list[T]:
    """Results of `calls` in order; the first exception propagates (the rest are cancelled)."""
    if len(calls) <= 1:
        return [await call() for call in calls]
    results: list = [None] * len(calls)
    limiter = trio.CapacityLimiter(limit)

    async def run(i: int) -> None:
        async with limiter:
            results[i] = await calls[i]()

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(run, i)
    return results
