"""Paths opened beneath a directory held open, one component at a time.

A path rebuilt from strings and handed to open() is resolved by the kernel
from `/` at the moment of the call: a directory swapped for a symlink
between a containment check and the open sends the open elsewhere, and
`O_NOFOLLOW` guards only the last component. Here every path is resolved
from the file descriptor of a directory opened once (the local source's
root, export's DEST, the disk cache's own directory), so nothing outside it
can be reached however fast files are swapped:

- with `openat2(RESOLVE_BENEATH)` (Linux 5.6+, called through ctypes) the
  kernel does it in one system call, refusing `..` above the root, absolute
  links and, with `RESOLVE_NO_SYMLINKS`, any link at all;
- otherwise (older kernels, seccomp filters) and for what the kernel
  refuses but we allow (an absolute link whose target lies inside the root),
  by hand: `openat` of each component with `O_NOFOLLOW`, links read with
  `readlinkat` and their targets resolved the same way, `..` popping the
  stack of directories we came through (never above the root).

Opens never block: callers add `O_NONBLOCK` (a FIFO opens at once) and check
what they got with `fstat` (`regular_file`), so a FIFO, device or socket
swapped in is refused instead of freezing the caller.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat as statmod
from typing import Callable

# openat2(2) resolve flags (include/uapi/linux/openat2.h).
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every architecture that has it (asm-generic)
MAX_LINKS = 40  # as the kernel's MAXSYMLINKS
# Flags every open here gets: never a controlling terminal, never inherited by children.
BASE_FLAGS = os.O_CLOEXEC | os.O_NOCTTY


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


OpenAt2 = Callable[[int, bytes, int, int, int], int]  # (dirfd, path, flags, mode, resolve) -> fd


def _load_openat2() -> OpenAt2 | None:
    """The raw openat2 call, or None where the kernel (or a seccomp filter) does not offer it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long

    def openat2(dirfd: int, path: bytes, flags: int, mode: int, resolve: int) -> int:
        how = _OpenHow(flags, mode, resolve)
        fd = syscall(_SYS_OPENAT2, ctypes.c_int(dirfd), ctypes.c_char_p(path), ctypes.byref(how),
                     ctypes.c_size_t(ctypes.sizeof(how)))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path.decode(errors="surrogateescape"))
        return int(fd)

    try:
        os.close(openat2(-100, b"/", os.O_PATH | os.O_CLOEXEC, 0, RESOLVE_NO_SYMLINKS))  # AT_FDCWD
    except OSError:  # ENOSYS (before 5.6), EPERM (seccomp), EINVAL: by hand instead
        return None
    return openat2


openat2 = _load_openat2()


def regular_file(fd: int, what: str, directory: bool = False) -> os.stat_result:
    """fstat an opened fd and require a regular file (or a directory): a FIFO, device or socket is refused
    (OSError EINVAL), and so, closed, is the fd."""
    st = os.fstat(fd)
    ok = statmod.S_ISDIR(st.st_mode) if directory else statmod.S_ISREG(st.st_mode)
    if not ok:
        os.close(fd)
        raise OSError(errno.EINVAL, f"not a {'directory' if directory else 'regular file'}", what)
    return st


class Beneath:
    """A directory held open; `open(rel)` reaches only what lies beneath it.

    `links=True`: symlinks are followed while they stay beneath (a relative
    target, or an absolute one inside `path`); one leading outside is refused
    with EXDEV. `links=False`: no symlink is followed anywhere (ELOOP).

    `avoid(dir_fd, name)`, when set, names entries that must never be entered, not even
    stat'ed (a daemon's own mount, `mountinfo.OwnMount`): the kernel then resolves without
    crossing any mount point (RESOLVE_NO_XDEV), and a path that crosses one is walked by hand,
    asking `avoid` before each component; an avoided one is absent (ENOENT).
    """

    avoid: Callable[[int, str], bool] | None = None

    def __init__(self, path: str, links: bool, fd: int | None = None) -> None:
        """Open directory `path` (or adopt `fd`, a directory already opened and checked by the caller)."""
        self.path = os.path.realpath(path) if links else path
        self.links = links
        # The root itself is the user's own choice: a symlink to it is fine.
        self.fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if fd is None else fd
        self._resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | (0 if links else RESOLVE_NO_SYMLINKS)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def open(self, rel: str, flags: int, mode: int = 0) -> int:
        """Open `rel` ('/'-separated, relative; '' is the root itself) with `flags` (O_CLOEXEC and
        O_NOCTTY added; O_NOFOLLOW implied)."""
        # openat2 refuses O_PATH with flags that mean nothing to it (EINVAL), O_NOCTTY among them.
        flags |= os.O_CLOEXEC if flags & os.O_PATH else BASE_FLAGS
        if openat2 is not None:
            guarded = self.avoid is not None
            resolve = self._resolve | (RESOLVE_NO_XDEV if guarded else 0)
            for _ in range(3):
                try:
                    return openat2(self.fd, (rel or ".").encode(errors="surrogateescape"), flags,
                                   mode if flags & os.O_CREAT else 0, resolve)
                except OSError as e:
                    # EXDEV: a link the kernel will not follow beneath (absolute, say) that may still
                    # point inside, or (guarded) a mount point on the way; EAGAIN: a concurrent
                    # rename made the kernel give up. Either way the careful walk below decides.
                    if e.errno == errno.EAGAIN:
                        continue
                    if e.errno != errno.EXDEV or not (self.links or guarded):
                        raise
                    break
        return self._walk(rel, flags, mode)

    def stat(self, rel: str) -> os.stat_result:
        """What `rel` is (links followed beneath, or refused, as `open`); opening with O_PATH never
        opens a device or blocks on a FIFO."""
        fd = self.open(rel, os.O_PATH)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def lstat(self, rel: str) -> os.stat_result:
        """`rel` itself, a symlink as a symlink; its parent resolved as `open` does."""
        parent, _, name = rel.rpartition("/")
        fd = self.open(parent, os.O_PATH | os.O_DIRECTORY)
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)

    def mkdir(self, rel: str, mode: int = 0o777) -> bool:
        """Create directory `rel` (mkdirat in its parent, opened beneath); False if something was there."""
        parent, _, name = rel.rpartition("/")
        fd = self.open(parent, os.O_PATH | os.O_DIRECTORY)
        try:
            os.mkdir(name, mode, dir_fd=fd)
            return True
        except FileExistsError:
            return False
        finally:
            os.close(fd)

    def _walk(self, rel: str, flags: int, mode: int) -> int:
        """Resolve by hand: openat each component with O_NOFOLLOW from the directory before it."""
        todo = [part for part in reversed(rel.split("/")) if part not in ("", ".")]
        stack = [self.fd]  # directories we came through; stack[0] is ours, never closed here
        links = 0
        try:
            while True:
                if not todo:
                    return os.open(".", flags, mode, dir_fd=stack[-1])
                name = todo.pop()
                if name == "..":
                    if len(stack) == 1:
                        raise OSError(errno.EXDEV, "path leads outside", rel)
                    os.close(stack.pop())
                    continue
                last = not todo
                if self.avoid is not None and self.avoid(stack[-1], name):
                    raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), rel)
                try:
                    if last:
                        fd = os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=stack[-1])
                        if not flags & os.O_PATH or not statmod.S_ISLNK(os.fstat(fd).st_mode):
                            return fd
                        os.close(fd)  # O_PATH|O_NOFOLLOW opened the link itself
                        raise OSError(errno.ELOOP, "is a symlink", rel)
                    stack.append(os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                         dir_fd=stack[-1]))
                    continue
                except OSError as e:
                    # A link shows as ELOOP (O_NOFOLLOW) or ENOTDIR (with O_DIRECTORY): read it to know.
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    try:
                        target = os.readlink(name, dir_fd=stack[-1])
                    except OSError:
                        raise e from None  # not a link (any more): the open's own error stands
                    if not self.links:
                        raise OSError(errno.ELOOP, "is a symlink (never followed)", rel) from None
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links", rel)
                if target.startswith("/"):
                    inside = os.path.relpath(target, self.path) if target.startswith(self.path) else None
                    if inside is None or inside == ".." or inside.startswith("../"):
                        raise OSError(errno.EXDEV, "a symlink leads outside", rel)
                    while len(stack) > 1:
                        os.close(stack.pop())
                    target = inside
                todo.extend(part for part in reversed(target.split("/")) if part not in ("", "."))
        finally:
            for fd in stack[1:]:
                os.close(fd)


NULL_DEVICE = (1, 3)  # /dev/null's major and minor: the one device a log may be written to
_KINDS = ((statmod.S_ISDIR, "a directory"), (statmod.S_ISFIFO, "a FIFO"), (statmod.S_ISSOCK, "a socket"),
          (statmod.S_ISCHR, "a character device"), (statmod.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str:
    """What a file of `mode` is, in words ("a FIFO")."""
    return next((name for test, name in _KINDS if test(mode)), "an unknown kind of file")


def open_argument(path: str, what: str, write: bool = False) -> int:
    """Open a file named on the command line (`what` names the option in messages): never
    blocking, never a controlling terminal, never inherited. For reading it must be a regular
    file; for writing (appending; created if missing, its directory is not) a regular file or
    /dev/null. Anything else -- a FIFO (which would block the opener until a reader or writer
    came), a directory, a socket, another device -- is a one-line ConfigError, and so is an
    open that fails. The descriptor returned is blocking again (regular files never wait)."""
    from unshardfs.util.errors import ConfigError

    flags = os.O_NONBLOCK | BASE_FLAGS | (os.O_WRONLY | os.O_APPEND | os.O_CREAT if write else os.O_RDONLY)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        try:  # what is there, named without opening it (a stat never blocks on a FIFO)
            mode = os.stat(path).st_mode
        except OSError:
            mode = statmod.S_IFREG
        if statmod.S_ISREG(mode):
            raise ConfigError(f"cannot open {what} {path}: {e.strerror}") from None
        raise ConfigError(f"{what} {path} is {kind_of(mode)}, not a regular file") from None
    st = os.fstat(fd)
    null = write and statmod.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == NULL_DEVICE
    if not (statmod.S_ISREG(st.st_mode) or null):
        os.close(fd)
        raise ConfigError(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd
