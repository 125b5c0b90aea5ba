"""Errors at the FUSE edge: EIO for the request, one log line per cause, never a traceback per request."""

from __future__ import annotations

import errno
import logging

import pyfuse3
import pytest
import trio

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
