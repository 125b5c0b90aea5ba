"""An on-disk cache of index reads, so remounting a remote dataset starts warm.

Only index structures go through it (shard indexes, minishard indexes, Zarr
shard indexes, DVID chunk indexes): small, reused on every lookup, and
expensive to fetch again one request per shard after a remount. The fetcher
asks it per index *extent* (object, version, offset, length), whatever
coalesced read later brought the bytes, so a remount whose reads are grouped
differently still hits. A changed object is simply a miss (the version is
part of the key). Files are written atomically; the directory is trimmed to
its byte budget, oldest first, as it grows.

It owns only what it wrote. `--cache-dir DIR` may be any directory (say
~/.cache): the cache lives in `DIR/unshardfs-index-cache/`, which it creates
and marks with a CACHEDIR.TAG naming unshardfs (or DIR itself when DIR bears
that mark). A directory of that name that is not marked is refused unless
empty. Trimming deletes only files it could have written (`ab/<64 hex
digits>` entries, its own stale temporaries) that are regular files owned
by this user on the cache's own file system; it opens every directory
beneath the cache's fd with no link followed and deletes with unlinkat, so
no link, other file system or foreign file is ever touched.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import stat as statmod
import time
from pathlib import Path

from unshardfs.sources.base import ByteSource, IndexKey, SourceLayer
from unshardfs.util.errors import ConfigError
from unshardfs.util.fdpath import Beneath, regular_file

log = logging.getLogger(__name__)

SUBDIR = "unshardfs-index-cache"
MARKER = "CACHEDIR.TAG"
# The Cache Directory Tagging signature (backup tools skip such directories), then ours.
MARKER_TEXT = (b"Signature: 8a477f597d28d172789f06886806bc55\n"
               b"# unshardfs index cache (--cache-dir): every other file here was written by unshardfs.\n")
_ENTRY = re.compile(r"[0-9a-f]{64}")
_BUCKET = re.compile(r"[0-9a-f]{2}")
_TEMP = re.compile(r"\.tmp-[0-9a-f]{16}")
STALE_TEMP_SECONDS = 3600  # a temporary this old was left by a killed writer, not one still writing
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _is_marked(dir_fd: int) -> bool:
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        regular_file(fd, MARKER)
    except OSError:
        return False
    try:
        return os.read(fd, 4096).startswith(MARKER_TEXT)
    finally:
        os.close(fd)


def _write_marker(dir_fd: int) -> None:
    fd = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(MARKER_TEXT)


def _wait_marked(dir_fd: int, seconds: float = 10.0) -> bool:
    """The tag is complete (a concurrent `check --jobs` worker may have created it a moment ago)."""
    deadline = time.monotonic() + seconds
    while not _is_marked(dir_fd):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def open_cache_dir(given: str) -> tuple[int, str]:
    """The fd and path of the cache's own directory for `--cache-dir given` (created and marked
    if new); ConfigError for one that unshardfs did not make and that is not empty."""
    base = Path(given).expanduser()
    try:
        os.makedirs(base, exist_ok=True)
        base_fd = os.open(base, DIR_FLAGS & ~os.O_NOFOLLOW)  # the user's own path: a link to it is fine
    except OSError as e:
        raise ConfigError(f"--cache-dir {given}: {e.strerror}") from None
    try:
        if _is_marked(base_fd):
            return os.dup(base_fd), str(base)  # given the cache directory itself
        home = base / SUBDIR
        try:
            os.mkdir(SUBDIR, 0o700, dir_fd=base_fd)
        except FileExistsError:
            pass
        try:
            fd = os.open(SUBDIR, DIR_FLAGS, dir_fd=base_fd)
        except OSError as e:
            what = "a symlink or other file" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror
            raise ConfigError(f"--cache-dir {given}: {home} is not a directory of unshardfs ({what}); "
                              "remove it or give another --cache-dir") from None
    finally:
        os.close(base_fd)
    if not _is_marked(fd):
        names = os.listdir(fd)
        if not names:
            try:
                _write_marker(fd)
            except FileExistsError:
                pass  # another process taking the same empty directory right now
            except OSError as e:
                os.close(fd)
                raise ConfigError(f"--cache-dir {given}: cannot mark {home} as unshardfs's: {e.strerror}") from None
        # Only the tag may be there, ours or one a concurrent process is still writing.
        if names not in ([], [MARKER]) or not _wait_marked(fd):
            os.close(fd)
            raise ConfigError(f"--cache-dir {given}: {home} holds files unshardfs did not write (it has no "
                              f"{MARKER} of ours); empty it or give another --cache-dir")
    return fd, str(home)


class DiskCachedSource(SourceLayer):
    def __init__(self, inner: ByteSource, directory: str, max_bytes: int = 1 << 30) -> None:
        super().__init__(inner)
        fd, path = open_cache_dir(directory)
        self.directory = Path(path)
        self._home = Beneath(path, links=False, fd=fd)
        self._dev = os.fstat(fd).st_dev
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._written = 0
        self.index_cache = self

    def _name(self, identity: IndexKey) -> tuple[str, str]:
        digest = hashlib.sha256(repr((self.inner.description, identity)).encode()).hexdigest()
        return digest[:2], digest

    def get(self, identity: IndexKey) -> bytes | None:
        data = self._read(*self._name(identity))
        if data is None:
            self.misses += 1
        else:
            self.hits += 1
        return data

    def _read(self, bucket: str, name: str) -> bytes | None:
        try:
            fd = self._home.open(f"{bucket}/{name}", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not statmod.S_ISREG(st.st_mode) or st.st_size > self.max_bytes:
                return None
            data = os.read(fd, st.st_size)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data if len(data) == st.st_size else None

    def put(self, identity: IndexKey, data: bytes) -> None:
        bucket, name = self._name(identity)
        try:
            self._home.mkdir(bucket, 0o700)
            dir_fd = self._home.open(bucket, os.O_PATH | os.O_DIRECTORY)
            try:
                self._store(dir_fd, name, data)
            finally:
                os.close(dir_fd)
        except OSError as e:
            log.warning("index cache %s: cannot write (%s); continuing without it", self.directory, e)
            return
        self._written += len(data)
        if self._written > self.max_bytes // 16:
            self._written = 0
            self.trim()

    @staticmethod
    def _store(dir_fd: int, name: str, data: bytes) -> None:
        """Write a new file and rename it over `name`: readers see the old bytes or the new, whole."""
        temp = f".tmp-{secrets.token_hex(8)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.unlink(temp, dir_fd=dir_fd)
            raise

    def _own_files(self, bucket: str, dir_fd: int, now: float) -> list[tuple[float, int, str, str]]:
        """(atime, size, bucket, name) of the files in one bucket that this cache could have written."""
        found = []
        with os.scandir(dir_fd) as it:
            for entry in it:
                name = entry.name
                temp = _TEMP.fullmatch(name) is not None
                if not temp and not (_ENTRY.fullmatch(name) and name.startswith(bucket)):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if (not statmod.S_ISREG(st.st_mode) or st.st_dev != self._dev or st.st_uid != os.geteuid()
                        or (temp and now - st.st_mtime < STALE_TEMP_SECONDS)):
                    continue
                found.append((st.st_atime, st.st_size, bucket, name))
        return found

    def _bucket_fd(self, bucket: str) -> int | None:
        """A bucket directory opened beneath the cache with no link followed, on the cache's own file system."""
        try:
            fd = self._home.open(bucket, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)
        except OSError:
            return None
        if os.fstat(fd).st_dev != self._dev:
            os.close(fd)
            return None
        return fd

    def trim(self) -> None:
        """Delete this cache's own files, least recently used first, until the rest fit the budget."""
        entries = []
        now = time.time()
        top = self._home.open("", os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)
        try:
            with os.scandir(top) as it:
                buckets = [e.name for e in it if _BUCKET.fullmatch(e.name)]
        finally:
            os.close(top)
        for bucket in buckets:
            fd = self._bucket_fd(bucket)
            if fd is not None:
                try:
                    entries += self._own_files(bucket, fd, now)
                finally:
                    os.close(fd)
        total = sum(size for _, size, _, _ in entries)
        victims: dict[str, list[str]] = {}
        for _, size, bucket, name in sorted(entries):
            if total <= self.max_bytes:
                break
            victims.setdefault(bucket, []).append(name)
            total -= size
        for bucket, names in victims.items():
            fd = self._bucket_fd(bucket)
            if fd is None:
                continue
            try:
                for name in names:
                    try:
                        os.unlink(name, dir_fd=fd)  # unlinkat: removes the name itself, never a link's target
                    except FileNotFoundError:
                        pass
            finally:
                os.close(fd)

    def own_stats(self) -> dict[str, object]:
        return {"index_disk_cache": {"hits": self.hits, "misses": self.misses}}

    async def aclose(self) -> None:
        self._home.close()
        await self.inner.aclose()
