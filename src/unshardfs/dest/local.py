"""Where an export writes: a directory, or a prefix in object storage, behind one small Protocol.

`Dest` is everything export, its ledger and `check --manifest` do to DEST:
write a file so that its final name never holds anything but complete bytes,
read a file back (size and CRC-32C), list, and keep the ledger's small
records. `LocalDest` writes beneath a directory held open (temporary name,
flush, rename: `dest.atomic`); `ObjectDest` (`dest.objects`) writes
objects under an s3:// or gs:// prefix (one conditional PUT, or a multipart
upload completed only when whole). `open_dest` picks by DEST's spelling.
"""

from __future__ import annotations

import errno
import os
import stat as statmod
from pathlib import Path
from typing import Iterable, Iterator, Protocol

from unshardfs.sources import RemoteOptions
from unshardfs.dest.atomic import (Measured, Pending, WriteStopped, is_temp, measure, remove_temporaries, stops, sync_dir,
                                    write_file)
from unshardfs.util.errors import ConfigError, DataError
from unshardfs.util.fdpath import Beneath, regular_file

LEDGER_DIR = ".unshardfs"  # the export's own records, inside DEST (`dest.ledger`)
LINE_LIMIT = 1 << 16  # bytes of one ledger line read back


class PendingFile(Protocol):
    """One file being written: its pieces in order, then `commit` (in place, whole) or `abort`."""

    def add(self, piece: bytes) -> None: ...

    def commit(self, size: int, mtime_ns: int | None, sync: bool = True) -> bool:
        """Put it in place; False when an identical complete file was there already (kept)."""
        ...

    def abort(self) -> None: ...


class JournalLog(Protocol):
    """A task's journal being appended to: one line per file in place (a kill loses at most the
    lines not yet stored, whose files `--resume` then finds in DEST and checks)."""

    rerun: bool  # the journal was there already: the task ran before

    def append(self, line: bytes) -> None: ...

    def close(self) -> None: ...


class Dest(Protocol):
    """DEST: export's files and records beneath it, and nothing anywhere else.

    Paths are relative, '/'-separated, already checked to be plain names
    ('..', '', NUL refused by the caller and again here). Errors meaning DEST
    takes no more (a full disk, a refused or failing upload) raise
    `WriteStopped`, which ends a run with one line.
    """

    description: str  # DEST as the user named it
    remote: bool  # object storage: no directories, no temporaries, no fsync

    def where(self, rel: str) -> str:
        """`rel` as a user would name it (a path or URL)."""
        ...

    def make_dir(self, rel: str) -> None:
        """A directory for files to go in (DataError if something else is there)."""
        ...

    def write(self, rel: str, pieces: Iterable[bytes], mtime_ns: int | None = None, sync: bool = True,
              task: int | None = None, create: bool = True) -> bool:
        """Write `rel` whole from `pieces`; False when it was not written because a complete file
        holding these bytes was there (`create`: object stores create conditionally); the ledger's
        own records pass `create=False` and replace."""
        ...

    def open_file(self, rel: str, task: int | None) -> PendingFile:
        """A file written piece by piece, appearing under `rel` only when committed."""
        ...

    def measure(self, rel: str) -> Measured:
        """Size and CRC-32C of the complete file `rel`, or why there is none."""
        ...

    def sweep(self, parent: str, task: int | None) -> None:
        """Remove what a killed run of `task` left unfinished in directory `parent`."""
        ...

    def clear(self) -> int:
        """Remove everything a killed run left unfinished anywhere (before `--resume`); how many."""
        ...

    def sync_dir(self, rel: str) -> None:
        """Make the renames into directory `rel` durable."""
        ...

    def read_small(self, rel: str, limit: int) -> bytes | None:
        """A record's bytes (None if absent); ConfigError beyond `limit` bytes."""
        ...

    def lines(self, rel: str) -> Iterator[bytes]:
        """A record's lines, streamed (nothing if absent)."""
        ...

    def tail(self, rel: str, size: int) -> bytes:
        """A record's last `size` bytes (OSError/DataError if it cannot be read)."""
        ...

    def names(self, rel: str) -> list[str]:
        """The names directly in directory `rel` (none if it is absent)."""
        ...

    def exists(self, rel: str) -> bool: ...

    def journal(self, rel: str) -> JournalLog: ...

    def journal_lines(self, rel: str) -> Iterator[bytes]: ...

    def drop_journal(self, rel: str) -> None: ...

    def files(self) -> Iterator[tuple[str, str]]:
        """(path, a note for the user) of every file beneath DEST but the ledger's own."""
        ...

    def close(self) -> None: ...


def split_lines(pieces: Iterable[bytes], limit: int = LINE_LIMIT) -> Iterator[bytes]:
    """The lines of a byte stream (each with its newline); a line over `limit` bytes comes cut into
    pieces of `limit` (which no JSON parser accepts), so none is ever held whole."""
    rest = b""
    for piece in pieces:
        rest += piece
        while True:
            end = rest.find(b"\n", 0, limit)
            if end < 0:
                if len(rest) >= limit:
                    yield rest[:limit]
                    rest = rest[limit:]
                    continue
                break
            yield rest[:end + 1]
            rest = rest[end + 1:]
    if rest:
        yield rest


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
            if stops(e):
                raise WriteStopped(self.rel, e) from None
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalDest:
    """DEST held open as a directory; everything is opened beneath this fd with no symlink followed
    (`fdpath.Beneath(links=False)`), never by a path rebuilt from strings."""

    remote = False

    def __init__(self, out: Beneath, description: str) -> None:
        self.out = out
        self.description = description

    @classmethod
    def open(cls, dest: Path) -> "LocalDest":
        """Open (creating it and its parents if missing) before anything runs: a DEST that cannot
        be a directory is a one-line ConfigError. DEST itself may be a symlink to a directory
        (the user's own choice, as for `cp -r`); nothing below it is ever followed."""
        try:
            os.makedirs(dest, exist_ok=True)
        except OSError as e:
            if e.errno == errno.EEXIST or isinstance(e, FileExistsError):
                raise ConfigError(f"DEST {dest} exists and is not a directory") from None
            raise ConfigError(f"DEST {dest}: cannot create it: {e.strerror}") from None
        try:
            return cls(Beneath(str(dest), links=False), str(dest))  # O_PATH: a FIFO there does not block
        except OSError as e:
            problem = "exists and is not a directory" if e.errno == errno.ENOTDIR else e.strerror
            raise ConfigError(f"DEST {dest} {problem}") from None

    def where(self, rel: str) -> str:
        return str(Path(self.description) / rel)

    def make_dir(self, rel: str) -> None:
        try:
            if self.out.mkdir(rel):
                return
        except OSError as e:
            if stops(e):
                raise WriteStopped(rel, e) from None
            raise
        if not statmod.S_ISDIR(self.out.lstat(rel).st_mode):
            raise DataError(rel, "exists and is not a directory (a symlink is never followed)")

    def write(self, rel: str, pieces: Iterable[bytes], mtime_ns: int | None = None, sync: bool = True,
              task: int | None = None, create: bool = True) -> bool:
        # A rename replaces a regular file there; one this run journaled is never rewritten (the caller).
        write_file(self.out, rel, pieces, mtime_ns, sync, task)
        return True

    def open_file(self, rel: str, task: int | None) -> PendingFile:
        return Pending(self.out, rel, task)

    def measure(self, rel: str) -> Measured:
        return measure(self.out, rel)

    def sweep(self, parent: str, task: int | None) -> None:
        remove_temporaries(self.out, parent, task, deep=False)

    def clear(self) -> int:
        return remove_temporaries(self.out)

    def sync_dir(self, rel: str) -> None:
        sync_dir(self.out, rel)

    def read_small(self, rel: str, limit: int) -> bytes | None:
        try:
            fd = self.out.open(rel, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ConfigError(f"{rel} in DEST cannot be read: {e.strerror}") from None
        try:
            regular_file(fd, rel)
        except OSError:
            raise ConfigError(f"{rel} in DEST is not a regular file") from None
        try:
            data = os.read(fd, limit + 1)
        finally:
            os.close(fd)
        if len(data) > limit:
            raise ConfigError(f"{rel} in DEST is bigger than {limit:,} bytes: not ours")
        return data

    def lines(self, rel: str) -> Iterator[bytes]:
        try:
            fd = self.out.open(rel, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return
        try:
            regular_file(fd, rel)
        except OSError:
            raise DataError(rel, "not a regular file") from None
        with os.fdopen(fd, "rb") as f:
            while True:
                line = f.readline(LINE_LIMIT)
                if not line:
                    return
                yield line

    def tail(self, rel: str, size: int) -> bytes:
        fd = self.out.open(rel, os.O_RDONLY | os.O_NONBLOCK)
        try:
            total = regular_file(fd, rel).st_size
            return os.pread(fd, size, max(0, total - size))
        finally:
            os.close(fd)

    def names(self, rel: str) -> list[str]:
        try:
            fd = self.out.open(rel, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return []
        try:
            with os.scandir(fd) as entries:
                return [e.name for e in entries]
        finally:
            os.close(fd)

    def exists(self, rel: str) -> bool:
        try:
            return statmod.S_ISREG(self.out.lstat(rel).st_mode)
        except OSError:
            return False

    def journal(self, rel: str) -> JournalLog:
        return _LocalJournal(self.out, rel)

    def journal_lines(self, rel: str) -> Iterator[bytes]:
        return self.lines(rel)

    def drop_journal(self, rel: str) -> None:
        parent, _, name = rel.rpartition("/")
        fd = self.out.open(parent, os.O_PATH | os.O_DIRECTORY)
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    def files(self, rel: str = "") -> Iterator[tuple[str, str]]:
        fd = self.out.open(rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with os.scandir(fd) as entries:
                listed = sorted((e.name, e.is_dir(follow_symlinks=False), e.is_symlink()) for e in entries)
        finally:
            os.close(fd)
        for name, is_dir, is_link in listed:
            child = f"{rel}/{name}" if rel else name
            if child == LEDGER_DIR:
                continue
            if is_dir:
                yield from self.files(child)
            else:
                yield child, (" (a symlink)" if is_link else
                              " (a leftover temporary: run export --resume)" if is_temp(name) else "")

    def close(self) -> None:
        self.out.close()


def is_object_url(dest: str) -> bool:
    return dest.partition("://")[0].lower() in ("s3", "gs") and "://" in dest


def local_path(dest: str) -> str:
    """DEST as a local path: a file:// URL's path; a URL of another scheme is a ConfigError."""
    scheme, sep, rest = dest.partition("://")
    if not sep:
        return dest
    if scheme.lower() == "file" and rest.startswith("/"):
        return rest
    raise ConfigError(f"DEST {dest}: export writes to a directory (a path or file:///path), s3:// or gs://; "
                      f"{scheme}:// is not supported as DEST")


def dest_name(dest: str) -> str:
    """DEST as every process names it: a local path made absolute, a URL as given."""
    return dest if is_object_url(dest) else str(Path(local_path(dest)).absolute())


def open_dest(dest: str, remote: RemoteOptions | None = None) -> Dest:
    """DEST opened for writing: a directory (made if missing), or an object store prefix (its bucket
    checked to exist and be reachable); a one-line ConfigError otherwise."""
    if is_object_url(dest):
        from unshardfs.dest.objects import ObjectDest

        return ObjectDest.open(dest, remote or RemoteOptions())
    return LocalDest.open(Path(local_path(dest)))
