"""Whether a range of an open file is in the page cache, asked without reading it.

cachestat(2) (Linux 6.5) answers for a whole range in one call; the kernel
engine uses it to decide whether a read can be answered from the loop with
splice or must take the ordinary path. It counts every page in the cache,
also those whose read is still in flight (`LocalSource._readable_now` checks
those).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import platform

# cachestat is one of the syscalls numbered alike on every architecture (since 5.x's unification).
_NR_CACHESTAT = 451
PAGE = mmap.PAGESIZE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


class PageCache:
    """`cached(fd, offset, size)`: True/False, or None where the kernel cannot tell (no cachestat)."""

    def __init__(self) -> None:
        self._syscall = None
        if platform.system() == "Linux":
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            self._syscall = libc.syscall
            self._syscall.restype = ctypes.c_long
        # One range and one result, reused: a call costs no allocation.
        self._range = _Range()
        self._stat = _Stat()
        self._args = (ctypes.byref(self._range), ctypes.byref(self._stat))

    def cached(self, fd: int, offset: int, size: int) -> bool | None:
        if self._syscall is None or size <= 0:
            return None
        first = offset // PAGE
        pages = (offset + size - 1) // PAGE - first + 1
        self._range.off = first * PAGE
        self._range.len = pages * PAGE
        if self._syscall(_NR_CACHESTAT, fd, *self._args, 0) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
                self._syscall = None  # an older kernel (or a seccomp filter): never ask again
            return None
        return bool(self._stat.nr_cache >= pages)


page_cache = PageCache()
