"""Handing freed memory back to the operating system."""

from __future__ import annotations

import contextlib
import ctypes


def give_back_freed() -> None:
    """Return the allocator's free memory to the OS (glibc's `malloc_trim`); nothing elsewhere.

    After a large structure is built from many smaller temporaries (a zip
    archive's index of millions of entries), the freed temporaries otherwise
    stay resident in the C heap between live blocks, and the daemon's RSS
    keeps the build's high-water mark instead of what the structure needs.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its own policy
        ctypes.CDLL(None).malloc_trim(0)
