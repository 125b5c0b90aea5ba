"""A `bytes` object filled in place: a received body becomes its final object without a copy.

The HTTP client receives a body of a known length. Received into buffers of its own, the body
must then be joined into the `bytes` its callers keep: a copy of every body byte, a tenth of the
daemon's CPU when a scan prefetches tens of MiB (measured). `fresh_bytes` instead makes the
`bytes` object first, its contents not yet written, and gives a writable view of them: the
socket receives straight into the object the caller gets.

This relies on CPython's layout of a bytes object (its bytes at a fixed offset from the object's
address, `bytes.__basicsize__ - 1`) and on `PyBytes_FromStringAndSize(NULL, n)`, which CPython
documents as making an object of `n` bytes whose contents the caller is to fill in. The layout is
checked once, on first use, by filling a fresh object and reading it back; where that fails
(another Python implementation, another layout) `fresh_bytes` answers None, the caller keeps its
copying path, and that is logged once.

The caller must write every byte before the object is seen by anyone else, and drop it unseen if
it cannot (a bytes object is immutable to all who hold it: its hash may be cached once computed).
"""

from __future__ import annotations

import ctypes
import logging
import sys

from unshardfs.util.logonce import log_once

log = logging.getLogger(__name__)

_make: "ctypes._NamedFuncPointer | None" = None
_offset = 0
_checked: bool | None = None  # None: not checked yet


def _check() -> bool:
    """Whether objects made and filled here read back as written (once per process)."""
    global _make, _offset, _checked
    if _checked is not None:
        return _checked
    _checked = False
    if sys.implementation.name != "cpython":
        log_once(log, "rawbytes", "received bodies are copied once more on %s (CPython's bytes layout only)",
                 sys.implementation.name)
        return False
    try:
        make = ctypes.pythonapi.PyBytes_FromStringAndSize
        make.restype = ctypes.py_object
        make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
        _make, _offset = make, bytes.__basicsize__ - 1
        probe = bytes(range(256)) * 4
        made = _fill(len(probe))
        if made is not None:
            made[1][:] = probe
            _checked = made[0] == probe and hash(made[0]) == hash(probe)
    except (AttributeError, OSError, TypeError, ValueError) as e:
        log_once(log, "rawbytes", "received bodies are copied once more: %s", e)
        return False
    if not _checked:
        log_once(log, "rawbytes", "received bodies are copied once more: bytes objects are laid out otherwise")
    return _checked


def _fill(size: int) -> tuple[bytes, memoryview] | None:
    assert _make is not None
    made = _make(None, size)
    if not isinstance(made, bytes) or len(made) != size:
        return None
    buffer = (ctypes.c_char * size).from_address(id(made) + _offset)
    setattr(buffer, "owner", made)  # the view keeps the object it writes into alive
    return made, memoryview(buffer).cast("B")


def fresh_bytes(size: int) -> tuple[bytes, memoryview] | None:
    """A new `bytes` object of `size` bytes (at least 2), its contents unwritten, and a writable
    view of them; None where objects cannot be filled in place (the caller copies instead)."""
    if size < 2 or not _check():
        return None
    return _fill(size)
