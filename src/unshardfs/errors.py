"""The few exception types that cross layer boundaries.

Formats raise `DataError` when backing bytes cannot be trusted; the FUSE
adapter turns it into EIO. `ConfigError` is for bad input found before a mount
goes live, which the CLI prints as a one-line message.
"""

import sys

if sys.version_info < (3, 11):  # pragma: no cover - trio installs the backport there
    from exceptiongroup import BaseExceptionGroup


class UnshardfsError(Exception):
    """Base class, so callers can catch everything of ours in one place."""


class ConfigError(UnshardfsError):
    """Invalid source, metadata or command-line input; reported before mounting."""


class DataError(UnshardfsError):
    """Backing data is damaged or inconsistent: the affected file must fail with EIO.

    `where` names the backing object (shard path, chunk id) so that the log line
    lets an operator find the damage; `reason` says what check failed.
    """

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


class SourceError(UnshardfsError):
    """The byte source failed to deliver (I/O error, vanished object)."""


class StaleError(DataError):
    """The backing object changed since this file was resolved.

    Raised instead of reading a replaced shard at offsets taken from its old
    index; the FUSE adapter then resolves the name afresh.
    """


def expected_failure(error: BaseException) -> UnshardfsError | None:
    """The DataError/SourceError an error stands for, also when concurrent tasks wrapped it
    in an ExceptionGroup whose every leaf is one of ours; None for anything else (a bug)."""
    if isinstance(error, (DataError, SourceError)):
        return error
    if isinstance(error, BaseExceptionGroup):
        leaves = [expected_failure(e) for e in error.exceptions]
        if leaves and all(leaf is not None for leaf in leaves):
            return leaves[0]
    return None
