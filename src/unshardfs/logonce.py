"""Log each distinct data problem once.

A damaged shard is hit by every reader that touches it; logging every hit
would flood the log and hide the first, useful line.
"""

from __future__ import annotations

import logging

from cachetools import LRUCache

_seen: LRUCache = LRUCache(maxsize=4096)


def log_once(logger: logging.Logger, key: str, message: str, *args: object) -> None:
    if key in _seen:
        return
    _seen[key] = True
    logger.error(message, *args)
