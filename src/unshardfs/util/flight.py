"""Work done once however many requests want it at the same moment.

When eight readers look up chunks of the same cold minishard, one request
must fetch its index and the other seven wait for that result, not send
seven more. `Flights.run(key, work)` does that: the first caller runs
`work`, later callers with the same key wait for its outcome (its value,
or the same exception).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Hashable, TypeVar, cast

import trio

from unshardfs.util.concurrency import cancellation
from unshardfs.util.maps import BoundedMap

T = TypeVar("T")


class _Flight:
    __slots__ = ("done", "value", "error", "cancelled")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: object = None
        self.error: BaseException | None = None
        self.cancelled = False


class Flights:
    def __init__(self) -> None:
        self._flying: dict[Hashable, _Flight] = {}

    def __len__(self) -> int:
        return len(self._flying)

    def __contains__(self, key: Hashable) -> bool:
        """Whether work for `key` is running now."""
        return key in self._flying

    async def run(self, key: Hashable, work: Callable[[], Awaitable[T]]) -> T:
        while True:
            flight = self._flying.get(key)
            if flight is None:
                break
            await flight.done.wait()
            if flight.cancelled:
                continue  # its runner was cancelled: not our failure; run it ourselves
            if flight.error is not None:
                raise flight.error
            return cast(T, flight.value)  # set by the runner, whose `work` returns a T
        flight = self._flying[key] = _Flight()
        try:
            value = flight.value = await work()
            return value
        except BaseException as e:
            # A cancellation (bare, or in a nursery's group) is the runner's, not the work's
            # outcome: a waiter runs the work itself (see `cancellation`).
            if cancellation(e):
                flight.cancelled = True
            else:
                flight.error = e
            raise
        finally:
            del self._flying[key]
            flight.done.set()

    async def cached(self, cache: BoundedMap[Any, Any], key: Hashable, work: Callable[[], Awaitable[T]]) -> T:
        """The value in `cache`, or computed once (concurrent askers share the work) and kept."""
        value = cache.get(key)
        if value is not None:
            return cast(T, value)  # what `work` returned for this key
        return await self.fill(cache, key, work)

    async def fill(self, cache: BoundedMap[Any, Any], key: Hashable, work: Callable[[], Awaitable[T]]) -> T:
        """`cached` after its caller found nothing in `cache`: computed once and kept."""

        async def compute() -> T:
            result = await work()
            cache[key] = result
            return result

        return await self.run((id(cache), key), compute)
