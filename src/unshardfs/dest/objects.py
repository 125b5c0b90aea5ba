"""DEST in object storage (s3://bucket/prefix/, gs://bucket/prefix/): export's `Dest` as objects.

Files are objects under the prefix, written by `dest.store`: one
conditional PUT of at most 8 MiB with its checksums, or an upload in parts
that the store assembles under the key only when completed (aborted on any
failure). Object stores have no directories, temporaries, renames or fsync:
a file is complete the moment its key exists, so those steps are nothing here.

A data file is created only where no object is (`create`); when one is
there already (a run killed after the PUT and before its journal line was
stored, or a store that repeated a PUT), it is kept if it holds these
bytes, and otherwise replaced by a write conditional on that very object
(S3 `If-Match`, GCS generation), never blindly.

Journals cannot be appended to: each is a set of segment objects
(`tasks/NNNNNN.journal/RUN-SEQ`), one stored every `SEGMENT_LINES` files or
`SEGMENT_SECONDS` seconds and at the end. A kill loses at most the lines of
one segment; their files are found complete in DEST when the task runs again.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Iterable, Iterator

import crc32c

from unshardfs.sources import RemoteOptions
from unshardfs.dest.store import (PART, Exists, ObjectStore, SinkOptions, StoreError, StoredObject, Upload,
                                          open_store)
from unshardfs.dest.atomic import Measured, WriteStopped
from unshardfs.dest.local import LEDGER_DIR, JournalLog, PendingFile, split_lines
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


class _StoreFile:
    """A file of several pieces: the first PART bytes are held; more make it an upload in parts."""

    def __init__(self, dest: "ObjectDest", rel: str, create: bool) -> None:
        self.dest, self.rel, self.create = dest, rel, create
        self.held: list[bytes] = []
        self.held_size = 0
        self.upload: Upload | None = None
        self.size = 0
        self.crc = 0

    def add(self, piece: bytes) -> None:
        self.crc = crc32c.crc32c(piece, self.crc)
        self.size += len(piece)
        try:
            if self.upload is None and self.held_size + len(piece) <= PART:
                self.held.append(piece)
                self.held_size += len(piece)
                return
            upload = self.upload = self.upload or self.dest.store.upload(self.rel, self.create)
            data = b"".join([*self.held, piece])
            self.held, self.held_size = [], 0
            while len(data) > PART:  # whole parts go now; the rest waits for more (or the end)
                upload.add(data[:PART])
                data = data[PART:]
            self.held, self.held_size = [data], len(data)
        except StoreError as e:
            self.abort()
            raise WriteStopped(self.rel, str(e)) from None

    def commit(self, size: int, mtime_ns: int | None, sync: bool = True) -> bool:
        """In place; False when the object there already held these bytes (kept, not written)."""
        if size != self.size:
            self.abort()
            raise DataError(self.rel, f"{self.size:,} bytes written, {size:,} expected")
        data = b"".join(self.held)
        try:
            if self.upload is None:
                return self.dest.put(self.rel, data, self.crc, self.create) is not None
            self.upload.add(data)
            try:
                self.upload.complete()
                return True
            except Exists:
                self.upload.abort()
                if not self.dest.holds(self.rel, self.size, self.crc):
                    raise DataError(self.rel, "DEST holds another object under this name; it is not replaced "
                                              "by a file of several parts (remove it, then --resume)") from None
                return False
        except StoreError as e:
            self.abort()
            raise WriteStopped(self.rel, str(e)) from None

    def abort(self) -> None:
        self.held = []
        if self.upload is not None:
            self.upload.abort()
            self.upload = None


class _SegmentedJournal:
    def __init__(self, dest: "ObjectDest", rel: str) -> None:
        self.dest, self.rel = dest, rel
        self.rerun = bool(dest.names(rel))
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
        self.dest.write(rel, [data], create=False)

    def close(self) -> None:
        with self.lock:
            self._flush()


class ObjectDest:
    """DEST as the objects under an s3:// or gs:// prefix."""

    remote = True

    def __init__(self, store: ObjectStore, description: str) -> None:
        self.store = store
        self.description = description

    @classmethod
    def open(cls, url: str, remote: RemoteOptions) -> "ObjectDest":
        scheme = url.partition("://")[0].lower()
        store = open_store(url, sink_options(scheme, remote))
        try:
            store.probe()  # a bucket that does not exist, or credentials that cannot list it
        except ConfigError:
            store.close()
            raise
        return cls(store, store.description)

    def where(self, rel: str) -> str:
        return self.store.where(rel)

    def _key(self, rel: str) -> None:
        """A path no key may hold is refused before any request (DataError: that path fails)."""
        try:
            self.store.key(rel)
        except StoreError as e:
            raise DataError(rel, str(e)) from None

    def make_dir(self, rel: str) -> None:
        self._key(rel)  # no directories in object stores

    def holds(self, rel: str, size: int, crc: int) -> bool:
        """Whether the object under `rel` holds `size` bytes of CRC-32C `crc`."""
        found = self.measure(rel)
        return found.problem is None and (found.size, found.crc32c) == (size, crc)

    def put(self, rel: str, data: bytes, crc: int, create: bool) -> StoredObject | None:
        """One PUT; when an object is there already: kept if it holds these bytes, else replaced by a
        PUT conditional on it (StoreError if it changes meanwhile)."""
        try:
            return self.store.put(rel, data, create)
        except Exists:
            pass
        there = self.store.head(rel)
        if there is None:  # gone meanwhile
            return self.store.put(rel, data, create)
        if there.size == len(data) and (there.crc32c == crc if there.crc32c is not None
                                        else self.holds(rel, len(data), crc)):
            return None
        return self.store.put(rel, data, replace=there.tag)

    def write(self, rel: str, pieces: Iterable[bytes], mtime_ns: int | None = None, sync: bool = True,
              task: int | None = None, create: bool = True) -> bool:
        self._key(rel)
        pending = _StoreFile(self, rel, create)
        try:
            for piece in pieces:
                pending.add(piece)
        except BaseException:
            pending.abort()
            raise
        return pending.commit(pending.size, mtime_ns)

    def open_file(self, rel: str, task: int | None) -> PendingFile:
        self._key(rel)
        return _StoreFile(self, rel, True)

    def measure(self, rel: str) -> Measured:
        """The store's own CRC-32C where it states one (no bytes read); else the object read back."""
        try:
            there = self.store.head(rel)
            if there is None:
                return Measured(problem="missing")
            if there.crc32c is not None:
                return Measured(there.size, there.crc32c)
            crc = size = 0
            for piece in self.store.read(rel, there.size):
                crc = crc32c.crc32c(piece, crc)
                size += len(piece)
            return Measured(size, crc)
        except StoreError as e:
            return Measured(problem=f"cannot read: {e}")

    def sweep(self, parent: str, task: int | None) -> None:
        """Nothing: an unfinished upload is invisible under its key (`clear` aborts them)."""

    def clear(self) -> int:
        try:
            return self.store.abort_unfinished()
        except StoreError as e:
            raise WriteStopped("", str(e)) from None

    def sync_dir(self, rel: str) -> None:
        """Nothing: an object is durable when its PUT is answered."""

    def read_small(self, rel: str, limit: int) -> bytes | None:
        try:
            return self.store.get(rel, limit)
        except StoreError as e:
            raise ConfigError(f"{rel} in DEST cannot be read: {e}") from None

    def lines(self, rel: str) -> Iterator[bytes]:
        try:
            there = self.store.head(rel)
            if there is None:
                return
            yield from split_lines(self.store.read(rel, there.size))
        except StoreError as e:
            raise DataError(rel, str(e)) from None

    def tail(self, rel: str, size: int) -> bytes:
        try:
            data = self.store.get(rel, size, tail=size)
        except StoreError as e:
            raise DataError(rel, str(e)) from None
        if data is None:
            raise DataError(rel, "missing")
        return data

    def names(self, rel: str) -> list[str]:
        try:
            return [name.rpartition("/")[2] for name, _, _ in self.store.list(f"{rel}/", delimiter=True)]
        except StoreError as e:
            raise ConfigError(f"cannot list {self.where(rel)}: {e}") from None

    def exists(self, rel: str) -> bool:
        try:
            return self.store.head(rel) is not None
        except StoreError:
            return False

    def journal(self, rel: str) -> JournalLog:
        return _SegmentedJournal(self, rel)

    def journal_lines(self, rel: str) -> Iterator[bytes]:
        for name in sorted(self.names(rel)):
            yield from self.lines(f"{rel}/{name}")

    def drop_journal(self, rel: str) -> None:
        try:
            for name in self.names(rel):
                self.store.delete(f"{rel}/{name}")
        except StoreError as e:
            raise WriteStopped(rel, str(e)) from None

    def files(self) -> Iterator[tuple[str, str]]:
        try:
            for name, _, _ in self.store.list(""):
                if name != LEDGER_DIR and not name.startswith(LEDGER_DIR + "/"):
                    yield name, ""
        except StoreError as e:
            raise ConfigError(f"cannot list {self.description}: {e}") from None

    def close(self) -> None:
        self.store.close()
