"""DEST as a local directory: files written beneath it atomically, the ledger's records beside them.

DEST is held open as a directory; everything is opened beneath that
descriptor with no symlink followed (`fdpath.Beneath(links=False)`), never
by a path rebuilt from strings. Files go through a temporary name, flush
and rename (`dest.atomic`); records too, and journals are appended to with
one write per line.
"""

from __future__ import annotations

import errno
import os
import stat as statmod
from pathlib import Path
from typing import Iterable, Iterator

from unshardfs.dest.atomic import Pending, is_temp, measure, remove_temporaries, stops, sync_dir, write_file
from unshardfs.dest.base import LEDGER_DIR, LINE_LIMIT, Dest, JournalLog, Measured, PendingFile, WriteStopped
from unshardfs.util.errors import ConfigError, DataError
from unshardfs.util.fdpath import Beneath, regular_file


# What the file system raises becomes our errors here, in two places (a plain `except`, not a
# context manager: the journal's append and a record's lines run once per file).

def _write_error(rel: str, error: OSError) -> Exception:
    """What an OSError writing `rel` is: WriteStopped where DEST takes no more (`atomic.stops`);
    else the OSError itself, which fails that file alone."""
    return WriteStopped(rel, error) if stops(error) else error


def _read_error(rel: str, error: OSError) -> DataError:
    """What an OSError reading the record `rel` is: a DataError naming it."""
    return DataError(rel, f"cannot be read: {error.strerror or error}")


def _make_dir(out: Beneath, rel: str) -> None:
    try:
        if out.mkdir(rel):
            return
    except OSError as e:
        raise _write_error(rel, e) from None
    if not statmod.S_ISDIR(out.lstat(rel).st_mode):
        raise DataError(rel, "exists and is not a directory (a symlink is never followed)")


class LocalFiles:
    """The files beneath DEST (a FileSink)."""

    def __init__(self, out: Beneath, description: str, sync: bool = True, task: int | None = None) -> None:
        self.out = out
        self.description = description
        self.sync = sync  # each file flushed before its rename, directories after
        self.task = task  # tags the temporaries this sink makes

    def where(self, rel: str) -> str:
        return str(Path(self.description) / rel)

    def for_task(self, task: int) -> "LocalFiles":
        return LocalFiles(self.out, self.description, self.sync, task)

    def make_dir(self, rel: str) -> None:
        _make_dir(self.out, rel)

    def write(self, rel: str, pieces: Iterable[bytes], mtime_ns: int | None = None) -> bool:
        # A rename replaces a regular file there; one this run journaled is never rewritten (the caller).
        write_file(self.out, rel, pieces, mtime_ns, self.sync, self.task)
        return True

    def open_file(self, rel: str) -> PendingFile:
        return Pending(self.out, rel, self.task, self.sync)

    def measure(self, rel: str) -> Measured:
        return measure(self.out, rel)

    def sweep(self, parent: str) -> None:
        remove_temporaries(self.out, parent, self.task, deep=False)

    def clear(self) -> int:
        return remove_temporaries(self.out)

    def sync_dir(self, rel: str) -> None:
        if self.sync:
            sync_dir(self.out, rel)

    def files(self, rel: str = "") -> Iterator[tuple[str, str]]:
        try:
            fd = self.out.open(rel, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with os.scandir(fd) as entries:
                    listed = sorted((e.name, e.is_dir(follow_symlinks=False), e.is_symlink()) for e in entries)
            finally:
                os.close(fd)
        except OSError as e:
            raise _read_error(rel or ".", e) from None
        for name, is_dir, is_link in listed:
            child = f"{rel}/{name}" if rel else name
            if child == LEDGER_DIR:
                continue
            if is_dir:
                yield from self.files(child)
            else:
                yield child, (" (a symlink)" if is_link else
                              " (a leftover temporary: run export --resume)" if is_temp(name) else "")


class _LocalJournal:
    def __init__(self, out: Beneath, rel: str) -> None:
        self.rel = rel
        self.rerun = False
        try:
            try:
                self.fd = out.open(rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NONBLOCK, 0o644)
            except FileExistsError:
                self.rerun = True
                self.fd = out.open(rel, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            regular_file(self.fd, rel)
        except OSError as e:
            self.fd = -1
            if stops(e):
                raise WriteStopped(rel, e) from None
            raise DataError(rel, f"cannot open: {e.strerror}") from None

    def append(self, line: bytes) -> None:
        """One write: a kill cuts at most this line."""
        try:
            os.write(self.fd, line)
        except OSError as e:
            raise _write_error(self.rel, e) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalRecords:
    """The ledger's records beneath DEST (a RecordStore)."""

    remote = False

    def __init__(self, out: Beneath, sync: bool = True) -> None:
        self.out = out
        self.sync = sync

    def make_dir(self, rel: str) -> None:
        _make_dir(self.out, rel)

    def replace(self, rel: str, pieces: Iterable[bytes]) -> None:
        write_file(self.out, rel, pieces, None, self.sync)

    def _open(self, rel: str) -> int | None:
        """A descriptor of the regular file `rel` (None if absent); DataError for anything else."""
        try:
            fd = self.out.open(rel, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _read_error(rel, e) from None
        try:
            regular_file(fd, rel)
        except OSError:
            raise DataError(rel, "is not a regular file") from None  # (regular_file closed it)
        return fd

    def read_small(self, rel: str, limit: int) -> bytes | None:
        fd = self._open(rel)
        if fd is None:
            return None
        try:
            data = os.read(fd, limit + 1)
        except OSError as e:
            raise _read_error(rel, e) from None
        finally:
            os.close(fd)
        if len(data) > limit:
            raise DataError(rel, f"is bigger than {limit:,} bytes: not ours")
        return data

    def lines(self, rel: str) -> Iterator[bytes]:
        fd = self._open(rel)
        if fd is None:
            return
        with os.fdopen(fd, "rb") as f:
            while True:
                try:
                    line = f.readline(LINE_LIMIT)
                except OSError as e:
                    raise _read_error(rel, e) from None
                if not line:
                    return
                yield line

    def tail(self, rel: str, size: int) -> bytes:
        fd = self._open(rel)
        if fd is None:
            raise DataError(rel, "is missing")
        try:
            total = os.fstat(fd).st_size
            return os.pread(fd, size, max(0, total - size))
        except OSError as e:
            raise _read_error(rel, e) from None
        finally:
            os.close(fd)

    def names(self, rel: str) -> list[str]:
        try:
            fd = self.out.open(rel, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _read_error(rel, e) from None
        try:
            with os.scandir(fd) as entries:
                return [e.name for e in entries]
        except OSError as e:
            raise _read_error(rel, e) from None
        finally:
            os.close(fd)

    def exists(self, rel: str) -> bool:
        try:
            return statmod.S_ISREG(self.out.lstat(rel).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            raise _read_error(rel, e) from None

    def journal(self, rel: str) -> JournalLog:
        return _LocalJournal(self.out, rel)

    def journal_lines(self, rel: str) -> Iterator[bytes]:
        return self.lines(rel)

    def drop_journal(self, rel: str) -> None:
        parent, _, name = rel.rpartition("/")
        try:
            fd = self.out.open(parent, os.O_PATH | os.O_DIRECTORY)
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
        except OSError as e:
            raise _write_error(rel, e) from None


def local_dest(out: Beneath, description: str, sync: bool = True) -> Dest:
    """DEST over the directory `out` holds open."""
    return Dest(description, LocalFiles(out, description, sync), LocalRecords(out, sync), False, out.close)


def open_local(path: Path, sync: bool = True, create: bool = True) -> Dest:
    """The directory `path` as DEST; with `create`, made (with its parents) if missing. A DEST that
    cannot be a directory is a one-line ConfigError. DEST itself may be a symlink to a directory
    (the user's own choice, as for `cp -r`); nothing below it is ever followed."""
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            if e.errno == errno.EEXIST or isinstance(e, FileExistsError):
                raise ConfigError(f"DEST {path} exists and is not a directory") from None
            raise ConfigError(f"DEST {path}: cannot create it: {e.strerror}") from None
    try:
        out = Beneath(str(path), links=False)  # O_PATH: a FIFO there does not block
    except OSError as e:
        if create:
            problem = "exists and is not a directory" if e.errno == errno.ENOTDIR else e.strerror
            raise ConfigError(f"DEST {path} {problem}") from None
        raise ConfigError(f"DEST {path}: {e.strerror}") from None
    if not create and not statmod.S_ISDIR(os.fstat(out.fd).st_mode):
        out.close()
        raise ConfigError(f"DEST {path} is not a directory")
    return local_dest(out, str(path), sync)
