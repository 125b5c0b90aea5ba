"""Files written beneath DEST so that no final name ever holds anything but complete bytes.

Every file is written under a temporary name in its own directory
(`.NAME.unshardfs-tmp-XXXXXXXXXXXX`), sized, stamped, flushed to stable
storage and only then renamed over its final name, as rsync does: a reader,
a crash, a kill or a full disk can leave a temporary behind, never a short
file under the name a reader opens. A temporary is removed when its write
fails; one left by a killed run is removed by the next `--resume`.

Errors that mean the destination cannot take more (ENOSPC, EDQUOT, EIO,
EROFS, EFBIG) raise `WriteStopped`: the run stops at the first with one line
naming the file and the cause, instead of failing every later file the same
way.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat as statmod
from typing import Iterable

import crc32c

from unshardfs.dest.base import MISSING, Measured, WriteStopped
from unshardfs.util.fdpath import Beneath, regular_file

TEMP_MARK = ".unshardfs-tmp-"
# Names longer than this are cut in their temporary twin (NAME_MAX is 255 on common file systems).
_TEMP_STEM = 200
# The destination refuses more bytes: stop the whole run at the first, never per file.
STOP_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})
READ_PIECE = 8 << 20


def stops(error: OSError) -> bool:
    return error.errno in STOP_ERRNOS


_TEMP_TAIL = re.compile(r"(?:t(\d+)-)?[0-9a-f]{12}")


def temp_name(name: str, task: int | None = None) -> str:
    """A fresh temporary name for `name`, in the same directory; `task` (the export task writing
    it) lets a rerun of that task find and remove what a killed run of it left."""
    tag = "" if task is None else f"t{task}-"
    return f".{name[:_TEMP_STEM]}{TEMP_MARK}{tag}{secrets.token_hex(6)}"


def is_temp(name: str, task: int | None = None) -> bool:
    """A name `temp_name` makes (and that export never takes from a source); of `task`'s, if given."""
    stem, mark, tail = name.rpartition(TEMP_MARK)
    match = _TEMP_TAIL.fullmatch(tail) if mark and stem.startswith(".") else None
    if match is None:
        return False
    return task is None or match.group(1) == str(task)


def _split(rel: str) -> tuple[str, str]:
    parent, _, name = rel.rpartition("/")
    return parent, name


class Pending:
    """One file being written beneath DEST under its temporary name.

    Opened with O_EXCL|O_NOFOLLOW in its directory (itself opened beneath DEST
    with no link followed), so nothing planted in DEST is ever written through.
    `commit` renames it over the final name, which must be absent or a regular
    file (a symlink, FIFO or directory there is refused, never replaced).
    """

    def __init__(self, out: Beneath, rel: str, task: int | None = None, sync: bool = True) -> None:
        self.rel = rel
        self.sync = sync  # flushed to stable storage before the rename
        parent, self.name = _split(rel)
        try:
            self.dirfd = out.open(parent, os.O_PATH | os.O_DIRECTORY)
        except OSError as e:
            if stops(e):
                raise WriteStopped(rel, e) from None
            raise
        self.offset = 0  # where `add` writes next
        self.temp = temp_name(self.name, task)
        try:
            self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o644, dir_fd=self.dirfd)
        except OSError as e:
            os.close(self.dirfd)
            if stops(e):
                raise WriteStopped(rel, e) from None
            raise

    def write_at(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data)
        try:
            while view:
                done = os.pwrite(self.fd, view, offset)
                view = view[done:]
                offset += done
        except OSError as e:
            self.abort()
            if stops(e):
                raise WriteStopped(self.rel, e) from None
            raise

    def add(self, piece: bytes) -> None:
        """The file's next piece; one of zeros only moves on (a hole, as `cp --sparse=auto` leaves,
        which `commit`'s sizing keeps)."""
        if piece.count(0) != len(piece):
            self.write_at(piece, self.offset)
        self.offset += len(piece)

    def commit(self, size: int, mtime_ns: int | None) -> bool:
        """Size it (holes left by skipped zero pieces included), stamp it, flush it, rename it into
        place; True (written)."""
        try:
            os.ftruncate(self.fd, size)
            if mtime_ns is not None:
                os.utime(self.fd, ns=(mtime_ns, mtime_ns))
            if self.sync:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            try:
                st = os.stat(self.name, dir_fd=self.dirfd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if not statmod.S_ISREG(st.st_mode):
                    raise OSError(errno.EEXIST, "exists and is not a regular file (never replaced)", self.rel)
            # rename replaces the name, never what a link there points to, nor another hard link's bytes.
            os.rename(self.temp, self.name, src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)
        except OSError as e:
            self.abort()
            if stops(e):
                raise WriteStopped(self.rel, e) from None
            raise
        os.close(self.dirfd)
        self.dirfd = -1
        return True

    def abort(self) -> None:
        """Close and remove the temporary (best effort: a full disk still allows unlinking)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.dirfd >= 0:
            try:
                os.unlink(self.temp, dir_fd=self.dirfd)
            except OSError:
                pass
            os.close(self.dirfd)
            self.dirfd = -1


def write_file(out: Beneath, rel: str, pieces: Iterable[bytes], mtime_ns: int | None = None,
               sync: bool = True, task: int | None = None) -> int:
    """Write `rel` beneath `out` whole from `pieces` (temporary, then rename); its size."""
    pending = Pending(out, rel, task, sync)
    offset = 0
    try:
        for piece in pieces:
            pending.write_at(piece, offset)
            offset += len(piece)
    except BaseException:
        pending.abort()
        raise
    pending.commit(offset, mtime_ns)
    return offset


def sync_dir(out: Beneath, rel: str) -> None:
    """Flush a directory's entries (the renames into it) to stable storage."""
    try:
        fd = out.open(rel, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        if stops(e):
            raise WriteStopped(rel, e) from None
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno == errno.EINVAL:  # a file system that cannot sync directories
            return
        if stops(e):
            raise WriteStopped(rel, e) from None
        raise
    finally:
        os.close(fd)


def measure(out: Beneath, rel: str) -> Measured:
    """Size and crc32c of the regular file `rel` beneath `out` (no link followed, nothing blocks)."""
    try:
        fd = out.open(rel, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return MISSING
    except OSError as e:
        return Measured.failed(f"cannot open: {e.strerror}")
    try:
        try:
            st = regular_file(fd, rel)
        except OSError:
            return Measured.failed("not a regular file")  # regular_file closed it
        crc, size = 0, 0
        while True:
            data = os.read(fd, READ_PIECE)
            if not data:
                break
            crc = crc32c.crc32c(data, crc)
            size += len(data)
        if size != st.st_size:
            return Measured.failed(f"changed while read ({size} of {st.st_size} bytes)")
        return Measured(size, crc)
    except OSError as e:
        return Measured.failed(f"cannot read: {e.strerror}")
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def remove_temporaries(out: Beneath, rel: str = "", task: int | None = None, deep: bool = True) -> int:
    """Remove the temporaries a killed run left in `rel` (and below it if `deep`; only `task`'s if
    given); links are never followed. How many were removed."""
    removed = 0
    try:
        fd = out.open(rel, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return 0
    try:
        with os.scandir(fd) as entries:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    finally:
        os.close(fd)
    doomed = [name for name, is_dir in names if not is_dir and is_temp(name, task)]
    if doomed:
        parent = out.open(rel, os.O_PATH | os.O_DIRECTORY)
        try:
            for name in doomed:
                try:
                    os.unlink(name, dir_fd=parent)
                    removed += 1
                except FileNotFoundError:
                    pass
        finally:
            os.close(parent)
    if deep:
        for name, is_dir in names:
            if is_dir:
                removed += remove_temporaries(out, f"{rel}/{name}" if rel else name, task)
    return removed
