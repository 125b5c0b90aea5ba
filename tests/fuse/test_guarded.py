"""Errors at the FUSE edge: EIO for the request, one log line per cause, never a traceback per request."""

from __future__ import annotations

import errno
import logging

import pyfuse3
import pytest
import trio

from tests.support.cancellation import foreign_cancellation
from unshardfs.fuse.pyfuse3_engine import guarded
from unshardfs.util.errors import DataError, SourceError, expected_failure


class _Ops:
    def __init__(self, error: BaseException) -> None:
        self.counters = {"eio": 0}
        self.error = error

    @guarded
    async def read(self) -> None:
        raise self.error


def _eio_count(ops: _Ops, times: int) -> None:
    for _ in range(times):
        with pytest.raises(pyfuse3.FUSEError) as info:
            trio.run(ops.read)
        assert info.value.errno == errno.EIO


def test_a_bug_is_one_traceback_however_often_it_is_hit(caplog):
    ops = _Ops(ValueError("index 24 is out of bounds"))
    with caplog.at_level(logging.ERROR, logger="unshardfs.fuse.pyfuse3_engine"):
        _eio_count(ops, 5)
    assert ops.counters["eio"] == 5
    assert sum(r.exc_info is not None for r in caplog.records) == 1


def test_grouped_data_errors_are_damage_not_bugs(caplog):
    group = ExceptionGroup("tasks", [DataError("0.shard", "bad gzip"), SourceError("GET x: HTTP 500")])
    assert expected_failure(group) is not None
    assert expected_failure(ExceptionGroup("tasks", [DataError("a", "b"), KeyError("k")])) is None
    ops = _Ops(group)
    with caplog.at_level(logging.ERROR, logger="unshardfs.fuse.pyfuse3_engine"):
        _eio_count(ops, 3)
    assert all(r.exc_info is None for r in caplog.records)


class _StrayOps:
    """A handler handing on a cancellation of a scope it has left (another task's outcome)."""

    def __init__(self) -> None:
        self.counters = {"eio": 0}

    @guarded
    async def lookup(self) -> None:
        raise await foreign_cancellation()

    @guarded
    async def read(self) -> None:
        await trio.sleep_forever()


def test_a_cancellation_not_the_handler_s_own_is_eio_its_own_goes_through():
    ops = _StrayOps()
    with pytest.raises(pyfuse3.FUSEError) as info:
        trio.run(ops.lookup)
    assert info.value.errno == errno.EIO and ops.counters["eio"] == 1

    async def cancelled_read() -> bool:
        with trio.move_on_after(0.01) as scope:
            await ops.read()
        return scope.cancelled_caught

    assert trio.run(cancelled_read) and ops.counters["eio"] == 1
