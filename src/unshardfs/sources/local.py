"""A local directory as a byte source."""

from __future__ import annotations

import errno
import logging
import os
import stat as statmod
from typing import AsyncIterator, cast

import trio

from unshardfs.sources.base import FdRange, UrlLocation, ObjectStat, Version, join_path, name_problem, opaque_tag
from unshardfs.util.errors import ConfigError, SourceError, StaleError
from unshardfs.util.fdpath import Beneath, kind_of, regular_file
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap
from unshardfs.util.mountinfo import OwnMount, fd_path
from unshardfs.util.pagecache import page_cache

log = logging.getLogger(__name__)


# An open descriptor of a recently read file and the (st_dev, st_ino) it was opened as.
_OpenFile = tuple[int, tuple[int, int]]


def _close_evicted(_path: str, entry: _OpenFile) -> None:
    os.close(entry[0])


# Reads up to this size try the page cache first without waiting (`LocalSource._read_nowait`);
# larger ones (sequential reads) are read as they always were, on the loop: copying a large
# read out of its buffer would cost more than the wait it saves.
NOWAIT_MAX = 256 << 10
KNOWN_FILES = 1 << 16  # files whose last resolution is kept (forgotten all at once past this)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def _pread_all(fd: int, offset: int, size: int) -> bytes:
    """`size` bytes at `offset`, shorter only at end of file."""
    data = os.pread(fd, size, offset)
    if len(data) < size and data:
        # Regular files only return short at EOF; keep reading to be sure.
        parts = [data]
        got = len(data)
        while got < size:
            more = os.pread(fd, size - got, offset + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


def _version(st: os.stat_result) -> Version:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


OUTSIDE = "a symbolic link on its way leads outside the source"
LOOP = "symbolic links on its way loop (or nest too deep)"


def refused(reason: str, st: os.stat_result | None) -> ObjectStat:
    """A file that exists and is not read: `st` (an lstat of it, if one could be made) gives its mtime
    and, at least one byte, its size; no version (nothing of it is ever read)."""
    return ObjectStat(max(st.st_size, 1) if st else 1, st.st_mtime_ns if st else 0, False, (), reason)


def _to_stat(st: os.stat_result) -> ObjectStat:
    """Regular files and directories; anything else (a FIFO, device or socket) is refused: shown, never
    opened."""
    if not (statmod.S_ISDIR(st.st_mode) or statmod.S_ISREG(st.st_mode)):
        return refused(f"{kind_of(st.st_mode)}, not a regular file", st)
    return ObjectStat(
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        is_dir=statmod.S_ISDIR(st.st_mode),
        # ctime too: a shard rewritten in place with its size and mtime
        # restored (cp -p, rsync -t) still changes its ctime.
        version=_version(st),
    )


class LocalSource:
    """Every path is resolved beneath the root's fd (`fdpath.Beneath`): symlinks are followed only
    while they stay inside, however fast files are swapped, and only regular files and
    directories are ever opened. What is there but not read -- a link leading outside or looping,
    a FIFO, device or socket -- is refused (`ObjectStat.refused`): listed and found by name, EIO
    when read, never absent."""

    listable = True
    remote = False
    index_cache = None

    def __init__(self, root: str, max_open_files: int = 256) -> None:
        if not os.path.exists(root):
            raise ConfigError(f"source {root} does not exist")
        if not os.path.isdir(root):
            raise ConfigError(f"source {root} is not a directory")
        try:
            self._beneath = Beneath(root, links=True)
        except OSError as e:
            raise ConfigError(f"source {root}: {e.strerror}") from None
        self.root = self._beneath.path
        self.description = self.root
        # Open descriptors of recently read files (evicted ones closed): a chunk read is one
        # pread instead of open+pread+close, which matters when thousands of small chunks are read.
        self._fds: BoundedMap[str, _OpenFile] = BoundedMap(max_open_files, on_evict=_close_evicted)
        self._known: dict[str, ObjectStat] = {}  # regular files as last resolved, for `_object_stat`
        self._nowait = bool(_RWF_NOWAIT) and hasattr(os, "preadv")
        self._probe = bytearray(1)  # `_readable_now`'s buffer
        self.slow_reads = 0  # reads that had to wait on the disk (done on a worker thread)
        self._own: OwnMount | None = None  # the serving daemon's own mount (`keep_out`)
        self._own_generation = -1
        self._fenced = False  # one of its mount points lies beneath the root

    @property
    def root_fd(self) -> int:
        """The root directory, held open (O_PATH): compare it, never resolve paths from it by hand."""
        return self._beneath.fd

    def keep_out(self, own: OwnMount) -> None:
        """Never stat, open or list anything at `own`'s mount points (the serving daemon's own
        mount and its bind mounts or copies): such an entry is absent. While none lies beneath
        the root (checked again whenever the mount table changes), nothing costs more than a
        poll; while one does, paths are resolved without crossing mount points unseen
        (`Beneath.avoid`), listings skip those names, and known files are resolved afresh."""
        self._own = own
        self._own_generation = -1
        self._guard()

    def _guard(self) -> None:
        own = self._own
        if own is None:
            return
        if not own.refresh() and own.generation == self._own_generation:
            return  # the mount table is as it was when last looked at
        self._own_generation = own.generation
        self._fenced = own.beneath(fd_path(self._beneath.fd))
        self._beneath.avoid = own.hides if self._fenced else None
        if self._fenced:
            self._known.clear()

    def os_path(self, path: str) -> str:
        """For messages only: nothing is ever opened by this string."""
        return os.path.join(self.root, path) if path else self.root

    def _object_stat(self, path: str) -> ObjectStat | None:
        """`path` resolved beneath the root (links followed while inside), or None if absent; refused
        (`refused`) if a link on its way leads outside or loops, or it is neither a regular file nor a
        directory.

        A regular file resolved before is first checked with one `fstatat` of the path (relative
        to the root, the last component not followed): if that finds the very file resolved
        before, unchanged (device, inode, size, mtime, ctime), the answer is the same. Anything
        else -- a replaced, removed or rewritten file, a link, a FIFO -- is resolved again beneath
        the root as below. The fstatat only compares: nothing it reaches is opened, listed or
        served, and a stat never blocks on a FIFO. (Every lookup of a chunk revalidates its shard
        this way: one system call instead of openat2, fstat and close.) Not while the daemon's
        own mount lies beneath the root: that one call could cross into it."""
        self._guard()
        known = None if self._fenced else self._known.get(path)
        if known is not None:
            try:
                if _version(os.stat(path, dir_fd=self._beneath.fd, follow_symlinks=False)) == known.version:
                    return known
            except OSError:
                pass
            self._known.pop(path, None)  # (another thread may have dropped it too)
        try:
            st = self._beneath.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ELOOP):
                return self._refused(path, OUTSIDE if e.errno == errno.EXDEV else LOOP)
            raise SourceError(f"stat {self.os_path(path)}: {e.strerror}") from e
        result = _to_stat(st)
        if result.refused is None and not result.is_dir and path and not self._fenced:
            if len(self._known) >= KNOWN_FILES:
                self._known.clear()
            self._known[path] = result
        return result

    def _refused(self, path: str, reason: str) -> ObjectStat | None:
        """`path`, which a link on its way keeps from being resolved beneath the root: refused, as the
        entry its directory lists (an lstat of it; None where there is none). Below a link that leads
        outside, nothing can be told without looking outside: refused too."""
        try:
            st: os.stat_result | None = self._beneath.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:
            st = None
        return refused(reason, st)

    async def stat(self, path: str) -> ObjectStat | None:
        result = self._object_stat(path)
        if result is None:
            self._drop_fd(path)
            return None
        cached = self._fds.get(path)
        if cached is not None and cached[1] != result.version[:2]:
            # The file was replaced since we opened it: never read the old inode.
            self._drop_fd(path)
        return result

    def _drop_fd(self, path: str) -> None:
        cached = self._fds.pop(path, None)
        if cached is not None:
            os.close(cached[0])

    def _fd(self, path: str, version: Version | None) -> int:
        cached = self._fds.get(path)
        if cached is not None:
            fd, identity = cached
            if version is None:
                return fd
            if identity == version[:2]:
                # Same inode as when the caller resolved it: its bytes are the
                # ones the caller's index describes, even if the path was
                # replaced meanwhile -- unless the file was rewritten in place
                # (one fstat per read: far cheaper than serving other bytes).
                if _version(os.fstat(fd)) != version:
                    raise StaleError(path, "file was modified in place after its index was read")
                return fd
            self._drop_fd(path)
        os_path = self.os_path(path)
        self._guard()
        try:
            # O_NONBLOCK: a FIFO swapped in opens at once (and is refused below) instead of
            # blocking the daemon's only thread.
            fd = self._beneath.open(path, os.O_RDONLY | os.O_NONBLOCK)
            st = regular_file(fd, os_path)
        except FileNotFoundError as e:
            if version is not None:
                raise StaleError(path, "file was removed after its index was read") from e
            raise SourceError(f"open {os_path}: {e.strerror}") from e
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ELOOP):
                raise SourceError(f"{os_path} resolves outside the source") from e
            raise SourceError(f"open {os_path}: {e.strerror}") from e
        if version is not None and _version(st) != version:
            os.close(fd)
            raise StaleError(path, "file changed after its index was read")
        self._fds[path] = (fd, (st.st_dev, st.st_ino))
        return fd

    async def stored_at(self, path: str, version: Version | None) -> UrlLocation | None:
        """Where the file is: `file://` and its absolute path (`StoredAt`)."""
        root = "file://" + os.path.abspath(self.root)
        return UrlLocation(root, path, f"{root}/{path}" if path else root, 0, version or ())

    async def read(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        if size <= 0:
            return b""
        fd = self._fd(path, version)
        try:
            if self._nowait and size <= NOWAIT_MAX:
                data = self._cached_bytes(fd, offset, size)  # the usual case: one call
                got = bytes(data) if data is not None else await self._read_nowait(fd, offset, size)
            else:
                got = _pread_all(fd, offset, size)
            if version is not None and _version(os.fstat(fd)) != version:
                # Rewritten in place while it was read: the bytes may be part old, part new.
                raise StaleError(path, "file was modified in place while it was read")
            return got
        except OSError as e:
            self._drop_fd(path)
            raise SourceError(f"read {self.os_path(path)}: {e.strerror or errno.errorcode.get(e.errno or 0)}") from e

    def read_now(self, path: str, offset: int, size: int, version: Version | None = None) -> bytearray | None:
        """What `read(path, offset, size, version)` returns, if all of it is in the page cache: one
        preadv that does not wait, its buffer handed over as it is (no copy). None otherwise, or
        if the file changed or failed: `read` then reads it (on a worker thread if the disk must
        be waited for) or says why."""
        if not self._nowait or not 0 < size <= NOWAIT_MAX:
            return None
        try:
            fd = self._fd(path, version)
        except (SourceError, StaleError):
            return None
        return self._cached_bytes(fd, offset, size)

    @staticmethod
    def _cached_bytes(fd: int, offset: int, size: int) -> bytearray | None:
        """`size` bytes at `offset` of `fd` if they are all in the page cache; else None (not in
        the page cache, at the end of the file, no RWF_NOWAIT here, an error: the caller sorts
        that out)."""
        buffer = bytearray(size)
        try:
            if os.preadv(fd, [buffer], offset, _RWF_NOWAIT) == size:
                return buffer
        except OSError:
            pass
        return None

    def cached_range(self, path: str, offset: int, size: int, version: Version | None = None) -> FdRange | None:
        """Where `read(path, offset, size, version)` would read, if all those bytes are in the
        page cache (None otherwise, or if the file changed: `read` then says why).

        The descriptor is checked against `version` like a read's, so bytes taken from it
        after this call are the indexed ones -- unless the file is truncated or rewritten in
        place meanwhile, which whoever moves them must detect by their count (a rewrite in
        place of the same size is the one change no reader of a local file can see)."""
        try:
            fd = self._fd(path, version)
        except (SourceError, StaleError):
            return None
        cached = page_cache.cached(fd, offset, size)
        if cached is False or (cached is None and size <= NOWAIT_MAX):
            # Unknown (no cachestat): only reads `read` itself would do on the loop anyway.
            return None
        if cached and not self._readable_now(fd, offset, size):
            return None
        return FdRange(fd, offset, size)

    def _readable_now(self, fd: int, offset: int, size: int) -> bool:
        """Whether the first and last bytes of a page-cached range read without waiting.

        cachestat counts every page in the cache, also those read-ahead has just added and
        whose I/O is still in flight (a sequential read of a cold shard finds its next
        request's pages so): a splice of those waits for the disk, on the loop. The pages of a
        window still being read are contiguous and lie ahead of what was read, so a range
        holding some of them (almost always) holds its first or last page among them: one
        byte of each is read with RWF_NOWAIT (two calls, not one per page)."""
        if not self._nowait:
            return True  # cannot tell: as without cachestat, no worse than `read`'s own pread
        probe = self._probe
        try:
            for at in (offset, offset + size - 1):
                if os.preadv(fd, [probe], at, _RWF_NOWAIT) != 1:
                    return False  # the file shrank: `read` says so
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait = False
                return True
            return False  # `read` reports it
        return True

    async def _read_nowait(self, fd: int, offset: int, size: int) -> bytes:
        """The bytes in the page cache are read here (`read` tries the usual one-call case
        first), on the event loop, without waiting
        (preadv2 with RWF_NOWAIT); only what must come from the disk is read on a worker thread,
        so a cold disk never stalls the requests the loop is serving meanwhile."""
        buffer = bytearray(size)
        got = 0
        try:
            got = os.preadv(fd, [buffer], offset, _RWF_NOWAIT)
            if got == size:  # the usual case: one call
                return bytes(buffer)
            view = memoryview(buffer)
            while got < size:
                n = os.preadv(fd, [view[got:]], offset + got, _RWF_NOWAIT)
                if n == 0:  # end of file
                    return bytes(view[:got])
                got += n
            return bytes(buffer)
        except BlockingIOError:  # EAGAIN: the rest is not in the page cache
            pass
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            # This file system (or kernel) cannot read without waiting: plain reads from now on.
            self._nowait = False
            return bytes(buffer[:got]) + _pread_all(fd, offset + got, size - got)
        # The worker reads from its own descriptor: the cached one may be closed (and its number
        # reused) by another request while the worker waits on the disk.
        own = os.dup(fd)
        try:
            rest = await trio.to_thread.run_sync(_pread_all, own, offset + got, size - got)
        finally:
            os.close(own)
        self.slow_reads += 1
        return bytes(buffer[:got]) + rest if got else rest

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        os_path = self.os_path(path)
        self._guard()
        try:
            fd = self._beneath.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ELOOP):
                return
            raise SourceError(f"list {os_path}: {e.strerror}") from e
        try:
            # The daemon's own mount points here: skipped by name, before any stat could enter them.
            own = self._own.names_in(fd_path(fd)) if self._fenced and self._own is not None else frozenset()
            # Names and lstats relative to the opened directory (DirEntry.stat uses fd itself,
            # so it stays open until the listing ends).
            with os.scandir(fd) as it:
                for entry in it:
                    if entry.name in own:
                        continue
                    problem = name_problem(entry.name)
                    if problem is not None:
                        log_once(log, f"name:{os_path}:{problem}", "%s: skipping %s", os_path, problem)
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found: ObjectStat | None
                    if statmod.S_ISLNK(st.st_mode):
                        # Resolved beneath the root like any path: followed only while it stays inside.
                        found = self._object_stat(join_path(path, entry.name))
                    else:
                        found = _to_stat(st)
                    if found is not None:
                        yield entry.name, found
        finally:
            os.close(fd)

    async def stat_dir(self, path: str) -> ObjectStat | None:
        st = await self.stat(path)
        return st if st is not None and st.is_dir else None

    async def read_index(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return await self.read(path, offset, size, version)

    async def read_if_tagged(self, path: str, offset: int, size: int, etag: str,
                             version: Version | None = None) -> bytes | None:
        """`read`, if the file's entity tag is still `etag`: a local file's tag as object-store clients
        derive it (the `object_store` crate Icechunk reads local files with: inode, mtime in microseconds
        and size, in hexadecimal, `{ino:x}-{mtime_us:x}-{size:x}`). The read is made on the version the
        tag was checked against (or on `version`, which must be that one), so a file rewritten between
        the two is StaleError too, and so is one rewritten with its mtime put back since `version`."""
        st = self._object_stat(path)
        if st is None or st.is_dir:
            raise StaleError(path, "file was removed after its entity tag was recorded")
        if st.refused is not None:
            raise SourceError(f"{self.os_path(path)}: refused: {st.refused}")
        ino, size_now, mtime_ns = cast(tuple[int, int, int], st.version[1:4])  # `_version`'s layout
        current = f"{ino:x}-{mtime_ns // 1000:x}-{size_now:x}"
        if opaque_tag(etag) != current:
            raise StaleError(path, f"file changed after its entity tag was recorded (now {current}, not "
                                   f"{opaque_tag(etag)[:100]})")
        if version is not None and version != st.version:
            raise StaleError(path, "file changed after it was first read")
        return await self.read(path, offset, size, st.version)

    def open_backing(self, path: str, version: Version) -> int | None:
        """A new descriptor of the regular file at `path` if it is still the one `version`
        describes (`BackingFiles`); resolved beneath the root like every open, None otherwise."""
        try:
            fd = self._beneath.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if statmod.S_ISREG(st.st_mode) and _version(st) == version:
                fd, kept = -1, fd
                return kept
            return None
        except OSError:
            return None
        finally:
            if fd >= 0:
                os.close(fd)

    async def aclose(self) -> None:
        self.close()

    def stats(self) -> dict[str, object]:
        return {"disk_waits": self.slow_reads}

    def close(self) -> None:
        for fd, _ in list(self._fds.values()):
            os.close(fd)
        self._fds.clear()
        self._beneath.close()


__all__ = ["LocalSource"]
