"""DEST in object storage (s3://bucket/prefix/, gs://bucket/prefix/): its files and records as objects.

Files are objects under the prefix, written by `dest.store`: one
conditional PUT of at most 8 MiB with its checksums, or an upload in parts
that the store assembles under the key only when completed (aborted on any
failure). Object stores have no directories, temporaries, renames or fsync:
a file is complete the moment its key exists, so those steps are nothing here.

A data file is created only where no object is; when one is there already
(a run killed after the PUT and before its journal line was stored, or a
store that repeated a PUT), it is kept if it holds these bytes, and
otherwise replaced by a write conditional on that very object (S3
`If-Match`, GCS generation), never blindly. Records are replaced whole.

Journals cannot be appended to: each is a set of segment objects
(`tasks/NNNNNN.journal/RUN-SEQ`), one stored every `SEGMENT_LINES` files or
`SEGMENT_SECONDS` seconds and at the end. A kill loses at most the lines of
one segment; their files are found complete in DEST when the task runs again.

What the store raises becomes our errors in one place per side: a write
the store does not carry out stops the run (`WriteStopped`); a record or
listing it cannot give is a `DataError` naming it, never an absence.
"""

from __future__ import annotations

import secrets
import threading
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

import crc32c
import httpx

from unshardfs.dest.base import (LEDGER_DIR, MISSING, Dest, JournalLog, Measured, PendingFile, WriteStopped,
                                 split_lines)
from unshardfs.dest.store import PART, Exists, ObjectStore, SinkOptions, StoredObject, StoreError, Upload, open_store
from unshardfs.sources import RemoteOptions
from unshardfs.util.errors import ConfigError, DataError

SEGMENT_LINES = 1000
SEGMENT_SECONDS = 10.0


def sink_options(scheme: str, remote: RemoteOptions) -> SinkOptions:
    """The object store client's settings from the command line's remote options (the same
    endpoints, timeouts and retries as reading)."""
    http = remote.http
    endpoint = remote.s3_endpoint if scheme == "s3" else remote.gcs_endpoint
    return SinkOptions(endpoint=endpoint, timeout=http.timeout, retrying=http.retrying(),
                       deadline=max(http.request_deadline(), 60.0), connections=max(4, http.concurrency))


@contextmanager
def _writing(rel: str) -> Iterator[None]:
    """A write the store did not carry out: DEST takes no more, the run stops."""
    try:
        yield
    except StoreError as e:
        raise WriteStopped(rel, str(e)) from None


@contextmanager
def _reading(rel: str, what: str = "cannot be read") -> Iterator[None]:
    """A record or listing the store did not give: a DataError naming it (never an absence)."""
    try:
        yield
    except StoreError as e:
        raise DataError(rel, f"{what}: {e}") from None


def _checked_key(store: ObjectStore, rel: str) -> None:
    """A path no key may hold is refused before any request (DataError: that path fails)."""
    try:
        store.key(rel)
    except StoreError as e:
        raise DataError(rel, str(e)) from None


def _holds(store: ObjectStore, rel: str, size: int, crc: int) -> bool:
    """Whether the object under `rel` holds `size` bytes of CRC-32C `crc`."""
    found = _measure(store, rel)
    return found.problem is None and (found.size, found.crc32c) == (size, crc)


def _measure(store: ObjectStore, rel: str) -> Measured:
    """The store's own CRC-32C where it states one (no bytes read); else the object read back."""
    try:
        there = store.head(rel)
        if there is None:
            return MISSING
        if there.crc32c is not None:
            return Measured(there.size, there.crc32c)
        crc = size = 0
        for piece in store.read(rel, there.size):
            crc = crc32c.crc32c(piece, crc)
            size += len(piece)
        return Measured(size, crc)
    except StoreError as e:
        return Measured.failed(f"cannot read: {e}")


def _put(store: ObjectStore, rel: str, data: bytes, crc: int) -> StoredObject | None:
    """One conditional PUT; when an object is there already: kept (None) if it holds these bytes,
    else replaced by a PUT conditional on it (StoreError if it changes meanwhile)."""
    try:
        return store.put(rel, data, create=True)
    except Exists:
        pass
    there = store.head(rel)
    if there is None:  # gone meanwhile
        return store.put(rel, data, create=True)
    if there.size == len(data) and (there.crc32c == crc if there.crc32c is not None
                                    else _holds(store, rel, len(data), crc)):
        return None
    return store.put(rel, data, replace=there.tag)


class _StoreFile:
    """A file of several pieces: the first PART bytes are held; more make it an upload in parts.
    `create`: a data file (kept if an identical one is there); else a record, replaced."""

    def __init__(self, store: ObjectStore, rel: str, create: bool = True) -> None:
        self.store, self.rel, self.create = store, rel, create
        self.held: list[bytes] = []
        self.held_size = 0
        self.upload: Upload | None = None
        self.size = 0
        self.crc = 0

    def add(self, piece: bytes) -> None:
        self.crc = crc32c.crc32c(piece, self.crc)
        self.size += len(piece)
        try:
            with _writing(self.rel):
                if self.upload is None and self.held_size + len(piece) <= PART:
                    self.held.append(piece)
                    self.held_size += len(piece)
                    return
                upload = self.upload = self.upload or self.store.upload(self.rel, self.create)
                data = b"".join([*self.held, piece])
                self.held, self.held_size = [], 0
                while len(data) > PART:  # whole parts go now; the rest waits for more (or the end)
                    upload.add(data[:PART])
                    data = data[PART:]
                self.held, self.held_size = [data], len(data)
        except WriteStopped:
            self.abort()
            raise

    def commit(self, size: int, mtime_ns: int | None = None) -> bool:
        """In place; False when the object there already held these bytes (kept, not written)."""
        if size != self.size:
            self.abort()
            raise DataError(self.rel, f"{self.size:,} bytes written, {size:,} expected")
        data = b"".join(self.held)
        try:
            with _writing(self.rel):
                if self.upload is None:
                    if not self.create:
                        self.store.put(self.rel, data, create=False)
                        return True
                    return _put(self.store, self.rel, data, self.crc) is not None
                self.upload.add(data)
                try:
                    self.upload.complete()
                    return True
                except Exists:
                    self.upload.abort()
                    if not _holds(self.store, self.rel, self.size, self.crc):
                        raise DataError(self.rel, "DEST holds another object under this name; it is not replaced "
                                                  "by a file of several parts (remove it, then --resume)") from None
                    return False
        except (WriteStopped, DataError):
            self.abort()
            raise

    def abort(self) -> None:
        self.held = []
        if self.upload is not None:
            self.upload.abort()
            self.upload = None


def _write(store: ObjectStore, rel: str, pieces: Iterable[bytes], create: bool) -> bool:
    _checked_key(store, rel)
    pending = _StoreFile(store, rel, create)
    try:
        for piece in pieces:
            pending.add(piece)
    except BaseException:
        pending.abort()
        raise
    return pending.commit(pending.size)


class ObjectFiles:
    """The files under the prefix (a FileSink)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.description = store.description

    def where(self, rel: str) -> str:
        return self.store.where(rel)

    def for_task(self, task: int) -> "ObjectFiles":
        return self  # no temporaries: an unfinished upload is no object

    def make_dir(self, rel: str) -> None:
        _checked_key(self.store, rel)  # no directories in object stores

    def write(self, rel: str, pieces: Iterable[bytes], mtime_ns: int | None = None) -> bool:
        return _write(self.store, rel, pieces, create=True)

    def open_file(self, rel: str) -> PendingFile:
        _checked_key(self.store, rel)
        return _StoreFile(self.store, rel)

    def measure(self, rel: str) -> Measured:
        return _measure(self.store, rel)

    def sweep(self, parent: str) -> None:
        """Nothing: an unfinished upload is invisible under its key (`clear` aborts them)."""

    def clear(self) -> int:
        with _writing(""):
            return self.store.abort_unfinished()

    def sync_dir(self, rel: str) -> None:
        """Nothing: an object is durable when its PUT is answered."""

    def files(self) -> Iterator[tuple[str, str]]:
        with _reading(self.description, "cannot be listed"):
            for found in self.store.list(""):
                if found.path != LEDGER_DIR and not found.path.startswith(LEDGER_DIR + "/"):
                    yield found.path, ""


class _SegmentedJournal:
    def __init__(self, records: "ObjectRecords", rel: str) -> None:
        self.records, self.rel = records, rel
        self.rerun = bool(records.names(rel))
        self.run = f"{int(time.time()):010d}-{secrets.token_hex(4)}"
        self.seq = 0
        self.buffer: list[bytes] = []
        self.since = time.monotonic()
        self.lock = threading.Lock()

    def append(self, line: bytes) -> None:
        with self.lock:
            self.buffer.append(line)
            if len(self.buffer) >= SEGMENT_LINES or time.monotonic() - self.since >= SEGMENT_SECONDS:
                self._flush()

    def _flush(self) -> None:
        if not self.buffer:
            return
        data, self.buffer = b"".join(self.buffer), []
        self.since = time.monotonic()
        rel = f"{self.rel}/{self.run}-{self.seq:06d}"
        self.seq += 1
        self.records.replace(rel, [data])

    def close(self) -> None:
        with self.lock:
            self._flush()


class ObjectRecords:
    """The ledger's records under the prefix (a RecordStore)."""

    remote = True

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def make_dir(self, rel: str) -> None:
        _checked_key(self.store, rel)

    def replace(self, rel: str, pieces: Iterable[bytes]) -> None:
        _write(self.store, rel, pieces, create=False)

    def read_small(self, rel: str, limit: int) -> bytes | None:
        with _reading(rel):
            return self.store.get(rel, limit)

    def lines(self, rel: str) -> Iterator[bytes]:
        with _reading(rel):
            there = self.store.head(rel)
            if there is None:
                return
            yield from split_lines(self.store.read(rel, there.size))

    def tail(self, rel: str, size: int) -> bytes:
        with _reading(rel):
            data = self.store.get(rel, size, tail=size)
        if data is None:
            raise DataError(rel, "is missing")
        return data

    def names(self, rel: str) -> list[str]:
        with _reading(rel, "cannot be listed"):
            return [found.path.rpartition("/")[2] for found in self.store.list(f"{rel}/", delimiter=True)]

    def exists(self, rel: str) -> bool:
        with _reading(rel):
            return self.store.head(rel) is not None

    def journal(self, rel: str) -> JournalLog:
        return _SegmentedJournal(self, rel)

    def journal_lines(self, rel: str) -> Iterator[bytes]:
        for name in sorted(self.names(rel)):
            yield from self.lines(f"{rel}/{name}")

    def drop_journal(self, rel: str) -> None:
        with _writing(rel):
            segments = [found.path for found in self.store.list(f"{rel}/", delimiter=True)]
            for segment in segments:
                self.store.delete(segment)


def object_dest(store: ObjectStore) -> Dest:
    """DEST over the objects of `store`'s prefix."""
    return Dest(store.description, ObjectFiles(store), ObjectRecords(store), True, store.close)


def open_objects(url: str, remote: RemoteOptions, probe: bool = True,
                 transport: httpx.BaseTransport | None = None) -> Dest:
    """The prefix an s3:// or gs:// URL names as DEST; with `probe`, a bucket that does not exist or
    credentials that cannot list it are a one-line ConfigError before anything runs."""
    scheme = url.partition("://")[0].lower()
    store = open_store(url, sink_options(scheme, remote), transport)
    if probe:
        try:
            store.probe()
        except ConfigError:
            store.close()
            raise
    return object_dest(store)
