"""A cancellation of another scope's, for tests of what is done with one handed on.

Work shared by several tasks must never hand its runner's cancellation to the others: raised in a
task outside the cancelled scope, no scope there catches it. The edges answer one that reaches
them as a bug; these make one to raise there."""

from __future__ import annotations

import sys

import trio

if sys.version_info < (3, 11):  # trio installs the backport there
    from exceptiongroup import BaseExceptionGroup


async def foreign_cancellation(grouped: bool = False) -> BaseException:
    """A `trio.Cancelled` of a scope already left (in a nursery's group if `grouped`): raising
    it is what a task waiting on a cancelled runner's outcome would do."""
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as e:
            caught = e
    return BaseExceptionGroup("from a nursery", [caught]) if grouped else caught
