"""Log each distinct data problem once, and let tools collect them.

A damaged shard is hit by every reader that touches it; logging every hit
would flood the log and hide the first, useful line. `unshardfs check`
installs a collector to receive every distinct problem as it is found,
including those a listing skips over.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

from unshardfs.util.errors import QUOTE_LIMIT, one_line
from unshardfs.util.maps import BoundedMap

_seen: BoundedMap[str, bool] = BoundedMap(4096, lru=False)  # the keys logged lately
_collectors: list[list[str]] = []


def log_once(logger: logging.Logger, key: str, message: str, *args: object) -> None:
    # Keys often hold untrusted text (an error, a name): 4,096 of them must stay small.
    key = one_line(key, QUOTE_LIMIT)
    if key in _seen:
        return
    _seen[key] = True
    logger.error(message, *args)
    for collector in _collectors:
        collector.append(one_line(message % args if args else message))


class OneLineFormatter(logging.Formatter):
    """Every log message one line of bounded length (`one_line`), whatever untrusted text its
    arguments carry; a traceback, which is ours, follows unchanged."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)


@contextlib.contextmanager
def collect_problems() -> Iterator[list[str]]:
    """Every problem logged inside the block, in order (each once)."""
    found: list[str] = []
    _collectors.append(found)
    _seen.clear()  # a fresh run reports everything again
    try:
        yield found
    finally:
        _collectors.remove(found)
