"""Flights, in-process: concurrent askers share one run, its value or its failure; a cancelled
runner leaves the work to the next asker; `cached` keeps what it computed. Ordering comes from
events and `wait_all_tasks_blocked`, never from timings."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from unshardfs.util.errors import DataError
from unshardfs.util.flight import Flights
from unshardfs.util.maps import BoundedMap, payload_size


def test_concurrent_askers_join_one_run():
    flights = Flights()
    runs = []
    gate = trio.Event()

    async def work() -> bytes:
        runs.append(1)
        await gate.wait()
        return b"value"

    async def main() -> list[bytes]:
        results: list[bytes] = []

        async def ask() -> None:
            results.append(await flights.run("k", work))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            assert len(flights) == 1
            gate.set()
        return results

    assert trio.run(main) == [b"value"] * 8
    assert runs == [1] and len(flights) == 0


def test_a_failure_reaches_every_joined_asker_and_is_not_remembered():
    flights = Flights()
    runs = []
    gate = trio.Event()

    async def fail() -> bytes:
        runs.append(1)
        await gate.wait()
        raise DataError("s.shard", "bad index")

    async def main() -> list[str]:
        reasons: list[str] = []

        async def ask() -> None:
            try:
                await flights.run("k", fail)
            except DataError as e:
                reasons.append(e.reason)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        with pytest.raises(DataError):  # a later ask runs the work again
            await flights.run("k", fail)
        return reasons

    assert trio.run(main) == ["bad index"] * 3
    assert runs == [1, 1]


@pytest.mark.parametrize("in_nursery", [False, True], ids=["bare", "in-a-nursery"])
def test_a_cancelled_runner_hands_the_work_to_a_waiting_asker(in_nursery):
    """Also when the work waits in a nursery, whose cancellation is a group holding Cancelled:
    the runner's cancellation all the same, never an outcome for the waiters to raise."""
    flights = Flights()
    started = []
    gate = trio.Event()

    async def work() -> str:
        started.append(1)
        if in_nursery:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gate.wait)
                nursery.start_soon(gate.wait)
        else:
            await gate.wait()
        return "done"

    async def main() -> list[str]:
        first = trio.CancelScope()
        got: list[str] = []

        async def run_first() -> None:
            with first:
                await flights.run("k", work)

        async def second() -> None:
            got.append(await flights.run("k", work))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            first.cancel()  # the second asker was waiting on the first run: it now runs the work
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        return got

    assert trio.run(main) == ["done"]
    assert started == [1, 1] and len(flights) == 0


def test_cached_computes_once_and_counts_hits():
    flights = Flights()
    cache: BoundedMap[str, bytes] = BoundedMap(1 << 20, getsizeof=payload_size)
    calls = []

    async def work() -> bytes:
        calls.append(1)
        return b"x" * 100

    async def main() -> None:
        for _ in range(3):
            assert await flights.cached(cache, "k", work) == b"x" * 100

    trio.run(main)
    assert calls == [1] and (cache.hits, cache.misses) == (2, 1)

