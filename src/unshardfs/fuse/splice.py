"""READ replies moved, not copied: file descriptor -> pipe -> /dev/fuse.

A reply written with writev is first read into our memory (a copy, and
fresh pages to fault in for every large buffer), then copied again by the
kernel into the pages of the request. With splice the bytes of the backing
file's page cache go to a pipe as page references, and the kernel copies
them once, from the pipe into the request, when the pipe is spliced to
/dev/fuse. The kernel takes one whole reply per splice: the reply header
and the payload both have to be in the pipe (the header written first,
then the payload spliced in), which is why the pipe is sized for the
largest READ plus one buffer for the header and one for an unaligned start.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from unshardfs.fuse import abi
from unshardfs.util.pagecache import PAGE

log = logging.getLogger(__name__)


class SpliceFailed(Exception):
    """The reply could not be spliced; nothing was sent, so the request still wants an answer."""


class Splicer:
    """One pipe, reused for every spliced reply of a session (replies are spliced one at a time,
    each from start to end within one call: no other request can interleave)."""

    def __init__(self, fuse_fd: int, largest: int) -> None:
        self.fuse_fd = fuse_fd
        self.wanted = largest
        self.max_size = 0  # the largest payload that fits; 0: splicing is off
        self.spliced = 0  # replies sent this way (tests and stats)
        self._r = self._w = -1
        self._open()

    def _open(self) -> None:
        self._r, self._w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # Header buffer + payload pages + one more for a start inside a page.
        want = self.wanted + 2 * PAGE
        got = 0
        for size in (1 << (want - 1).bit_length(), 1 << 20):
            try:
                got = fcntl.fcntl(self._w, fcntl.F_SETPIPE_SZ, size)
                break
            except OSError:  # over /proc/sys/fs/pipe-max-size without CAP_SYS_RESOURCE
                continue
        if not got:
            got = fcntl.fcntl(self._w, fcntl.F_GETPIPE_SZ)
        self.max_size = max(0, got - 2 * PAGE)

    def _reset(self) -> None:
        """A fresh pipe: whatever a failed reply left in the old one goes with it."""
        self.close()
        try:
            self._open()
        except OSError as e:
            log.warning("splice pipe: %s; replies are written from now on", e.strerror)
            self.max_size = 0

    def reply(self, unique: int, fd: int, offset: int, size: int) -> None:
        """Answer READ `unique` with exactly `size` bytes of `fd` at `offset`.

        SpliceFailed if the file has fewer bytes there (it shrank since it was checked) or the
        pipe refused them: nothing reached the kernel. An OSError from the final splice is the
        kernel's answer to the reply, as from a writev (ENOENT: the request was interrupted)."""
        w = self._w
        os.write(w, abi.OUT_HEADER.pack(abi.OUT_HEADER.size + size, 0, unique))
        moved = 0
        try:
            while moved < size:
                n = os.splice(fd, w, size - moved, offset + moved)
                if n == 0:
                    break
                moved += n
        except OSError as e:
            self._reset()
            raise SpliceFailed(f"splice from the file: {e.strerror}") from e
        if moved != size:
            self._reset()
            raise SpliceFailed(f"{moved} of {size} bytes at offset {offset}: the file shrank")
        try:
            os.splice(self._r, self.fuse_fd, abi.OUT_HEADER.size + size)
        except OSError as e:
            self._reset()  # the kernel took the buffers (or not): start clean either way
            if e.errno == errno.EINVAL:  # refused before the request was found: still unanswered
                raise SpliceFailed(f"splice to the device: {e.strerror}") from e
            raise
        self.spliced += 1

    def close(self) -> None:
        for fd in (self._r, self._w):
            if fd >= 0:
                os.close(fd)
        self._r = self._w = -1
