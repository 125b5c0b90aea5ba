"""The trio fast path (`unshardfs.util.triofast`): active with the installed trio, and what it
does when trio's internals are not as known, or a coroutine is stepped by hand."""

from __future__ import annotations

import logging
import os
import socket
import ssl

import pytest
import trio
import trio.testing

from unshardfs.util import logonce, triofast
from unshardfs.util.triofast import TrioProbe, resume, start


def fast_path_active() -> bool:
    """Whether the fast path works with the installed trio: the probe of a trio run (checked in
    one of its own), and the incoming buffer of a fresh TLS stream found (holding nothing)."""

    async def probe() -> bool:
        return TrioProbe.of_current_run() is not None

    left, _ = trio.testing.memory_stream_pair()
    stream = trio.SSLStream(left, ssl.create_default_context(), server_hostname="localhost")
    return trio.run(probe) and not triofast.tls_holds_bytes(stream)


def test_the_fast_path_is_active_with_the_installed_trio():
    """If this fails after a trio upgrade, the kernel engine's quick wait is off and every idle
    request pays a trip through trio's scheduler: mend `triofast` for the new trio, or keep the
    pin in pyproject.toml."""
    assert fast_path_active(), f"trio {trio.__version__}: its internals moved"


def test_the_probe_sees_trio_s_run_queue_and_its_epoll():
    async def main() -> tuple[int, int, bool, bool]:
        probe = TrioProbe.of_current_run()
        assert probe is not None
        idle = len(probe.runq)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep, 0)
            nursery.start_soon(trio.sleep, 0)
            queued = len(probe.runq)  # spawned, not yet run: ready in the run queue
        a, b = socket.socketpair()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.lowlevel.wait_readable, a)
                await trio.sleep(0.01)  # trio now waits on `a` through its epoll
                before = readable(probe.epoll_fd)
                b.send(b"x")
                after = readable(probe.epoll_fd)
        finally:
            a.close()
            b.close()
        return idle, queued, before, after

    idle, queued, before, after = trio.run(main)
    assert (idle, queued) == (0, 2)
    assert (before, after) == (False, True)


def readable(fd: int) -> bool:
    import select

    poll = select.epoll()
    try:
        poll.register(fd, select.EPOLLIN)
        return bool(poll.poll(0))
    finally:
        poll.close()


def test_internals_not_as_known_turn_the_fast_path_off_and_say_so_once(monkeypatch, caplog):
    def moved() -> tuple[object, object]:
        raise AttributeError("'Runner' object has no attribute 'runq'")

    monkeypatch.setattr(triofast, "_internals", moved)
    with logonce.collect_problems():  # a fresh log-once record
        with caplog.at_level(logging.ERROR, logger="unshardfs.util.triofast"):
            assert not fast_path_active()
            assert not fast_path_active()
    lines = [r.getMessage() for r in caplog.records if r.name == "unshardfs.util.triofast"]
    assert len(lines) == 1 and "quick wait is off" in lines[0] and "runq" in lines[0]

    monkeypatch.setattr(triofast, "_internals", lambda: ([], os))  # no epoll where one is known
    assert not fast_path_active()


def test_a_tls_stream_whose_buffer_moved_is_said_to_hold_bytes_and_that_is_logged_once(caplog):
    import ssl

    left, _ = trio.testing.memory_stream_pair()
    stream = trio.SSLStream(left, ssl.create_default_context(), server_hostname="localhost")
    assert triofast.tls_holds_bytes(stream) is False  # nothing received yet
    stream._incoming.write(b"a record")  # received, not decrypted: readability of the socket misses it
    assert triofast.tls_holds_bytes(stream) is True
    moved = trio.SSLStream(left, ssl.create_default_context(), server_hostname="localhost")
    del moved._incoming  # as if a trio renamed it
    with logonce.collect_problems():
        with caplog.at_level(logging.ERROR, logger="unshardfs.util.triofast"):
            assert triofast.tls_holds_bytes(moved) and triofast.tls_holds_bytes(moved)
    lines = [r.getMessage() for r in caplog.records if r.name == "unshardfs.util.triofast"]
    assert len(lines) == 1 and "not reused" in lines[0]


async def _answer(waits: int) -> int:
    for _ in range(waits):
        await trio.sleep(0)
    return 42 + waits


def test_a_coroutine_that_never_waits_is_answered_by_start():
    assert start(_answer(0)) == (True, 42)


def test_a_coroutine_that_waits_goes_on_in_the_calling_task():
    spawned: list[trio.lowlevel.Task] = []

    class Spawns(trio.abc.Instrument):
        def task_spawned(self, task: trio.lowlevel.Task) -> None:
            spawned.append(task)

    async def main() -> int:
        trio.lowlevel.add_instrument(Spawns())
        coroutine = _answer(3)
        finished, trap = start(coroutine)
        assert not finished
        return await resume(coroutine, trap)

    assert trio.run(main) == 45 and spawned == []


def test_a_cancellation_reaches_the_resumed_coroutine_and_comes_back_out():
    cleaned: list[str] = []

    async def waits_forever() -> None:
        try:
            await trio.sleep_forever()
        finally:
            cleaned.append("finally")

    async def main() -> bool:
        coroutine = waits_forever()
        finished, trap = start(coroutine)
        assert not finished
        with trio.move_on_after(0.01) as scope:
            await resume(coroutine, trap)
        return scope.cancelled_caught

    assert trio.run(main) is True and cleaned == ["finally"]


def test_what_a_coroutine_raises_before_waiting_comes_out_of_start():
    async def fails() -> None:
        raise ValueError("bad request")

    with pytest.raises(ValueError, match="bad request"):
        start(fails())
