"""DEST's two faces, each a small Protocol: the files export writes, and the records it keeps.

`FileSink` is what the walk writing a tree and `check --manifest` need:
files written so that their final name never holds anything but complete
bytes, read back (size and CRC-32C), listed. `RecordStore` is what the
ledger needs (`dest.ledger`): small records beside the files, replaced
whole, read back as the untrusted input they are (DEST is writable by
others too), and journals appended to as files land.

Paths are relative, '/'-separated, already checked to be plain names ('..',
'', NUL refused by the caller and again by each implementation). Each
implementation turns what its storage raises into our errors in one place:

- writing that DEST no longer takes (a full disk, a refused or failing
  upload) raises `WriteStopped`, which ends a run with one line;
- a file that cannot be written for a reason of its own (a name no key
  may hold, a directory planted where a file goes) raises `DataError` or
  `OSError`, which fails that file alone;
- a record or listing that cannot be read raises `DataError` naming it:
  never is an outage read as "absent".

`Dest` is both, over one directory or one bucket prefix, opened by
`dest.opener.open_dest`.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol

LEDGER_DIR = ".unshardfs"  # the export's own records, inside DEST (`dest.ledger`)
LINE_LIMIT = 1 << 16  # bytes of one record line read back; a longer line comes cut into pieces


class WriteStopped(Exception):
    """DEST cannot take more: the one line that ends the run."""

    def __init__(self, rel: str, error: OSError | str) -> None:
        """`error`: the OSError of a file system, or the one-line reason an object store gave."""
        self.rel = rel
        if isinstance(error, str):
            self.errno = None
            super().__init__(f"cannot write {rel or '.'}: {error}")
            return
        self.errno = error.errno
        code = errno.errorcode.get(error.errno or 0, "?")
        super().__init__(f"cannot write {rel or '.'}: {error.strerror or error} ({code})")


@dataclass(frozen=True)
class Measured:
    """What a file in DEST holds: its size and CRC-32C, or why it could not be read (`problem`;
    `MISSING` when there is no such file)."""

    size: int = 0
    crc32c: int = 0
    problem: str | None = None

    @classmethod
    def failed(cls, problem: str) -> "Measured":
        return cls(problem=problem)

    @property
    def missing(self) -> bool:
        """There is no such file (not: it could not be read)."""
        return self == MISSING


MISSING = Measured.failed("missing")


class PendingFile(Protocol):
    """One file being written: its pieces in order, then `commit` (in place, whole) or `abort`."""

    def add(self, piece: bytes) -> None: ...

    def commit(self, size: int, mtime_ns: int | None) -> bool:
        """Put it in place, stamped with `mtime_ns` where DEST keeps modification times (a
        directory does; an object store keeps the time of the upload); False when an identical
        complete file was there already (kept)."""
        ...

    def abort(self) -> None: ...


class FileSink(Protocol):
    """DEST's files: written whole or not at all, measured, listed; nothing outside DEST."""

    description: str  # DEST as the user named it

    def where(self, rel: str) -> str:
        """`rel` as a user would name it (a path or URL)."""
        ...

    def for_task(self, task: int) -> "FileSink":
        """This sink for export task `task`: what a killed run of that task left unfinished is its
        own to `sweep` (temporaries are tagged with the task where DEST has any)."""
        ...

    def make_dir(self, rel: str) -> None:
        """A directory for files to go in (DataError if something else is there)."""
        ...

    def write(self, rel: str, pieces: Iterable[bytes], mtime_ns: int | None = None) -> bool:
        """Write `rel` whole from `pieces`; False when it was not written because a complete file
        holding these bytes was there."""
        ...

    def open_file(self, rel: str) -> PendingFile:
        """A file written piece by piece, appearing under `rel` only when committed."""
        ...

    def measure(self, rel: str) -> Measured:
        """Size and CRC-32C of the complete file `rel`, or why there is none."""
        ...

    def sweep(self, parent: str) -> None:
        """Remove what a killed run of this sink's task left unfinished in directory `parent`."""
        ...

    def clear(self) -> int:
        """Remove everything a killed run left unfinished anywhere (before `--resume`); how many."""
        ...

    def sync_dir(self, rel: str) -> None:
        """Make the renames into directory `rel` durable (where DEST is set to flush)."""
        ...

    def files(self) -> Iterator[tuple[str, str]]:
        """(path, a note for the user) of every file beneath DEST but the ledger's own."""
        ...


class JournalLog(Protocol):
    """A task's journal being appended to: one line per file in place (a kill loses at most the
    lines not yet stored, whose files `--resume` then finds in DEST and checks)."""

    rerun: bool  # the journal was there already: the task ran before

    def append(self, line: bytes) -> None: ...

    def close(self) -> None: ...


class RecordStore(Protocol):
    """The ledger's records in DEST: small documents replaced whole, and journals. Everything read
    back is bounded (`limit`, LINE_LIMIT a line) and parsed by the caller as untrusted."""

    remote: bool  # each record is requests away (object storage): worth reading several at once

    def make_dir(self, rel: str) -> None: ...

    def replace(self, rel: str, pieces: Iterable[bytes]) -> None:
        """Write the record `rel` whole from `pieces`, over whatever record is there."""
        ...

    def read_small(self, rel: str, limit: int) -> bytes | None:
        """A record's bytes (None if absent); DataError beyond `limit` bytes."""
        ...

    def lines(self, rel: str) -> Iterator[bytes]:
        """A record's lines, streamed, none longer than LINE_LIMIT (nothing if absent)."""
        ...

    def tail(self, rel: str, size: int) -> bytes:
        """A record's last `size` bytes (DataError if it is absent or cannot be read)."""
        ...

    def names(self, rel: str) -> list[str]:
        """The names directly in directory `rel` (none if it is absent)."""
        ...

    def exists(self, rel: str) -> bool:
        """Whether the record `rel` is there (DataError when that cannot be known)."""
        ...

    def journal(self, rel: str) -> JournalLog: ...

    def journal_lines(self, rel: str) -> Iterator[bytes]: ...

    def drop_journal(self, rel: str) -> None: ...


@dataclass
class Dest:
    """DEST opened: its files and its records, over one directory or one bucket prefix."""

    description: str
    files: FileSink
    records: RecordStore
    remote: bool  # object storage: unfinished uploads rather than temporaries
    release: Callable[[], None]  # what `close` lets go of (a directory descriptor, a connection pool)

    def where(self, rel: str) -> str:
        return self.files.where(rel)

    def close(self) -> None:
        self.release()


def split_lines(pieces: Iterable[bytes], limit: int = LINE_LIMIT) -> Iterator[bytes]:
    """The lines of a byte stream (each with its newline); a line over `limit` bytes comes cut into
    pieces of `limit` (which no JSON parser accepts), so none is ever held whole."""
    rest = b""
    for piece in pieces:
        data = rest + piece if rest else piece
        start = 0
        while True:
            end = data.find(b"\n", start, start + limit)
            if end >= 0:
                yield data[start:end + 1]
                start = end + 1
            elif len(data) - start >= limit:
                yield data[start:start + limit]
                start += limit
            else:
                break
        rest = data[start:]
    if rest:
        yield rest
