"""The edge of every front end: what a failure means to the user, decided once.

FUSE engines, `serve` and the tools all end a request the same way when
something below them raises: damaged data or a backend that failed (after its
retries) is expected and logged once per cause; anything else is a bug,
logged with one traceback per cause (a reader retrying in a loop must not
fill the disk). `classify` says which, with the errno, HTTP status, log key
and message a front end needs; `report` logs it.

A file whose backing shard was replaced under a running daemon is
re-resolved by name once (`read_current`), never read with offsets from the
old index.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from unshardfs.tree.nodes import FileNode, Node
from unshardfs.util.errors import DataError, StaleError, UnshardfsError, expected_failure
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap

log = logging.getLogger(__name__)

_logged_bugs: BoundedMap[str, bool] = BoundedMap(1024, lru=False)  # the keys of bugs logged lately


@dataclass(frozen=True)
class Failure:
    """How a front end answers an exception."""

    bug: bool            # False: damaged data or a failed backend (expected, logged once)
    errno: int           # what a FUSE request answers
    status: int          # what an HTTP request answers
    key: str             # the log key: one log line (or traceback) per key
    message: str         # one line for the user
    cause: UnshardfsError | None = None  # the DataError/SourceError behind it, if expected


def classify(error: BaseException) -> Failure:
    """Damage and backend failures are EIO/502; everything else is a bug: EIO/500."""
    known = expected_failure(error)
    if known is not None:
        return Failure(False, errno.EIO, 502, f"eio:{known}", str(known), known)
    text = f"{type(error).__name__}: {error}"
    return Failure(True, errno.EIO, 500, f"bug:{text}", f"unexpected {text}")


def report(logger: logging.Logger, failure: Failure, where: str, error: BaseException | None = None,
           answered: str = "EIO") -> None:
    """Log `failure` (met in `where`, e.g. a handler or a path, and `answered` so): once per
    cause; a bug with its traceback."""
    if not failure.bug:
        log_once(logger, f"{answered}:{failure.key}", "%s in %s: %s", answered, where, failure.message)
        return
    key = f"{answered}:{where}:{failure.key}"
    if key in _logged_bugs:
        return
    _logged_bugs[key] = True
    logger.error("unexpected error in %s; answering %s", where, answered,
                 exc_info=(type(error), error, error.__traceback__) if error is not None else None)


def answer(logger: logging.Logger, error: BaseException, where: str) -> Failure:
    """Classify and report `error` for a FUSE request in one call (the engines' catch-all)."""
    failure = classify(error)
    report(logger, failure, where, error)
    return failure


Resolve = Callable[[], Awaitable[Node | None]]


async def read_current(node: FileNode, offset: int, size: int, resolve: Resolve) -> tuple[FileNode, bytes]:
    """`node.read(offset, size)`; if its shard was replaced, resolve the name again, once.

    The fresh node is used only if its size is unchanged (the reader already
    knows the size); otherwise the file answers EIO until it is looked up
    again. Returns the node that served the bytes, for the caller to keep.
    """
    try:
        return node, await node.read(offset, size)
    except StaleError as e:
        fresh = await resolve()
        if not isinstance(fresh, FileNode) or fresh.size != node.size:
            raise DataError(e.where, f"{e.reason}; its content changed and cannot be re-served") from e
        log.info("%s: backing data changed; re-resolved", e.where)
        return fresh, await fresh.read(offset, size)
