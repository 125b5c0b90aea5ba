"""Walk a virtual tree outside FUSE: export it to a DEST (a directory or object storage), or check it.

Both are format-agnostic: they see exactly what the mount would show, in
the tree's own listing order, which for sharded data is shard by shard and
minishard by minishard, i.e. close to sequential in the backing files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import crc32c
import trio

from unshardfs.sources.base import name_problem
from unshardfs.dest.base import FileSink, PendingFile, WriteStopped
from unshardfs.dest.ledger import FileRecord, Journal, reserved, source_of
from unshardfs.tree.edge import classify
from unshardfs.tree.nodes import DirNode, FileNode
from unshardfs.util.errors import DataError, expected_failure
from unshardfs.util.logonce import log_once
from unshardfs.util.waits import Waits, now

log = logging.getLogger(__name__)

PIECE = 8 << 20  # read big files in pieces so memory stays bounded
# What a walk visits: (relative path, node), directories before what is in them.
Entries = AsyncIterator[tuple[str, FileNode | DirNode]]


@dataclass
class WalkSummary:
    files: int = 0
    written: int = 0
    skipped: int = 0
    bytes: int = 0
    dirs: int = 0
    failures: list[str] = field(default_factory=list)
    stopped: str | None = None  # export: why DEST took no more (the run's one line), if it stopped


def failure(rel: str, error: Exception) -> str:
    """How a file that could not be read is reported (a bug says so, with its type)."""
    return f"{rel}: {classify(error).message}"


def unlisted(rel: str, error: Exception) -> None:
    """A directory whose listing failed (a directory that cannot be read, damage, a backend that
    failed): one problem, logged once and collected as `check` and `export` collect every other, and
    the walk goes on; a bug is raised."""
    if expected_failure(error) is None:
        raise error
    log_once(log, f"unlisted:{rel}:{error}", "listing %s: %s", rel or ".", error)


async def walk(root: DirNode, prefix: str = "") -> AsyncIterator[tuple[str, FileNode | DirNode]]:
    """(relative path, node) of every file and directory below `root`, depth first; the caller
    reads every file (each directory is told so before it is listed: `DirNode.will_read_all`). A
    directory whose listing fails is a problem (`unlisted`), never a directory that looks empty."""
    root.will_read_all()
    try:
        async for batch in root.entries():
            for name, node in batch:
                problem = name_problem(name)
                if problem is not None:  # no tree should show one; a walk that writes must not trust that
                    log_once(log, f"walk:{prefix}:{problem}", "%s: skipping %s", prefix or ".", problem)
                    continue
                if not isinstance(node, (FileNode, DirNode)):
                    continue  # never taken: every Node is a file or a directory (listings are typed Node)
                path = f"{prefix}{name}"
                yield path, node
                if isinstance(node, DirNode):
                    async for item in walk(node, path + "/"):
                        yield item
    except Exception as e:  # (the walks below report their own)
        unlisted(prefix.rstrip("/"), e)


async def file_bytes(node: FileNode, where: str) -> AsyncIterator[bytes]:
    offset = 0
    while offset < node.size:
        data = await node.read(offset, min(PIECE, node.size - offset))
        if not data:
            raise DataError(where, f"short read at offset {offset} of {node.size}")
        offset += len(data)
        yield data


BATCH_FILES = 64  # small files handed to a writer thread at once: one hand-over per batch, not per file
BATCH_SECONDS = 0.02  # ... or fewer, once the first of them has waited this long


class _WriteBatch:
    """Small files read and waiting to be written, handed to a writer thread together (a hand-over
    to a thread costs more CPU than writing a small file)."""

    __slots__ = ("files", "size", "since")

    def __init__(self) -> None:
        self.files: list[tuple[str, FileNode, bytes]] = []
        self.size = 0
        self.since = 0.0

    def add(self, rel: str, node: FileNode, data: bytes) -> None:
        if not self.files:
            self.since = now()
        self.files.append((rel, node, data))
        self.size += len(data)

    def full(self) -> bool:
        return len(self.files) >= BATCH_FILES or self.size >= PIECE or now() - self.since >= BATCH_SECONDS


# What became of one file of a batch: (crc32c, written) once in place, or the error that stopped it.
Outcome = tuple[int, bool] | Exception


def _write_batch(dest: FileSink, files: list[tuple[str, FileNode, bytes]]) -> list[Outcome]:
    """Write each file whole (complete under its name, or not at all), in order: each one's crc32c
    and whether it was written (not found complete already), or its error. A `WriteStopped`
    (DEST takes no more) ends the batch: the files after it are not tried."""
    done: list[Outcome] = []
    for rel, node, data in files:
        try:
            written = dest.write(rel, [data], node.mtime_ns)
        except (WriteStopped, OSError, DataError) as e:
            done.append(e)
            if isinstance(e, WriteStopped):
                break
            continue
        done.append((crc32c.crc32c(data), written))
    return done


def _add_piece(pending: PendingFile, piece: bytes, crc: int) -> int:
    """One piece of a streamed file written; the running crc32c."""
    pending.add(piece)
    return crc32c.crc32c(piece, crc)


def _cannot_write(rel: str, error: OSError) -> str:
    return f"{rel}: cannot write: {error.strerror or error}"


class _Walk:
    """One export walk's shared state: where it writes, what it has done, and whether it must stop."""

    def __init__(self, dest: FileSink, journal: Journal | None, summary: WalkSummary,
                 waits: Waits | None = None) -> None:
        self.dest = dest if journal is None else dest.for_task(journal.task)
        self.journal = journal
        self.summary = summary
        self.waits = waits or Waits()  # what the walk waited for: payload bytes (data), DEST (writes)
        self.scope: trio.CancelScope | None = None
        # A rerun task clears what a killed run of it left, once per directory it writes into.
        self.swept: set[str] | None = set() if journal is not None and journal.rerun else None

    async def sweep(self, rel: str) -> None:
        parent = rel.rpartition("/")[0]
        if self.swept is not None and parent not in self.swept:
            self.swept.add(parent)
            await trio.to_thread.run_sync(self.dest.sweep, parent)

    def stop(self, error: WriteStopped) -> None:
        """The first stop wins; later ones (the same full disk, seen by other writes) are dropped."""
        if self.summary.stopped is None:
            self.summary.stopped = str(error)
        if self.scope is not None:
            self.scope.cancel()

    def landed(self, rel: str, node: FileNode, crc: int, written: bool = True) -> None:
        """A file is in place (`written`, or found there complete with these bytes): count it, then
        journal it (a journal that DEST has no room for stops the run, and the file, whole under
        its final name, is counted all the same)."""
        if written:
            self.summary.written += 1
            self.summary.bytes += node.size
        else:
            self.summary.skipped += 1
        if self.journal is not None:
            source, offset, length = source_of(node.xattrs())
            self.journal.add(FileRecord(rel, node.size, crc, node.mtime_ns, source, offset, length))

    async def already_there(self, rel: str, node: FileNode) -> bool:
        """The file is journaled by an earlier run and what is in DEST still matches its record
        (size and crc32c re-read): kept, never rewritten."""
        record = None if self.journal is None else self.journal.known.get(rel)
        if record is None or record.size != node.size or record.mtime_ns != node.mtime_ns:
            return False
        found = await trio.to_thread.run_sync(self.dest.measure, rel)
        if found.problem is not None or found.size != record.size or found.crc32c != record.crc32c:
            return False
        assert self.journal is not None
        self.journal.keep(record)
        return True


async def export(root: DirNode, dest: FileSink, jobs: int = 4,
                 progress: Callable[[WalkSummary], None] | None = None, entries: Entries | None = None,
                 journal: Journal | None = None, waits: Waits | None = None) -> WalkSummary:
    """Write the tree under `dest` (or only `entries`, one task's part of it), every file appearing
    under its name only when whole (`FileSink.write`).

    Reads happen on the event loop in listing order (sequential in the
    shards); up to `jobs` writer threads run meanwhile. Files of one piece
    are read whole and handed to a writer in batches (at most BATCH_FILES
    files and one piece of bytes: a hand-over to a thread costs more than
    writing a small file); bigger ones are streamed piece by piece, so
    memory stays within about `jobs + 1` pieces whatever the file sizes. Each file that lands is counted and appended to
    `journal`; files the journal already holds and DEST still matches are
    kept. The first error meaning DEST can take no more (`WriteStopped`)
    ends the walk: `summary.stopped` says which file and why. `waits`, if
    given, gets the seconds the walk was blocked on payload bytes (`data`)
    and on DEST (`writes`: a free write slot, a streamed file, the last
    writes).
    """
    summary = WalkSummary()
    run = _Walk(dest, journal, summary, waits)
    async with trio.open_nursery() as nursery:
        run.scope = nursery.cancel_scope
        try:  # here, not around the nursery: what leaves a nursery comes wrapped in an exception group
            await _export_walk(run, walk(root) if entries is None else entries, nursery, trio.CapacityLimiter(jobs),
                               progress)
        except WriteStopped as e:
            run.stop(e)
        drained = now()  # the writes still running: waited for when the nursery closes
    run.waits.add("writes", now() - drained)
    return summary


async def _export_walk(run: _Walk, entries: Entries, nursery: trio.Nursery, limiter: trio.CapacityLimiter,
                       progress: Callable[[WalkSummary], None] | None) -> None:
    summary = run.summary
    skip: set[str] = set()  # directories that could not be made: nothing is written below them
    batch = _WriteBatch()  # small files read, not yet handed to a writer
    async for rel, node in entries:
        if summary.stopped is not None:
            return
        if rel.rpartition("/")[0] in skip:
            skip.add(rel)  # below a directory that could not be made (a planted link, say)
            continue
        if reserved(rel):  # an earlier export's own records or temporaries (exporting an export): not data
            skip.add(rel)
            continue
        if isinstance(node, DirNode):
            try:
                await trio.to_thread.run_sync(run.dest.make_dir, rel)
            except WriteStopped as e:
                run.stop(e)
                return
            except (DataError, OSError) as e:
                summary.failures.append(f"{rel}/: {e}")
                skip.add(rel)
                continue
            summary.dirs += 1
            continue
        summary.files += 1
        waits = run.waits
        start = now()
        await run.sweep(rel)
        there = await run.already_there(rel, node)
        waits.add("writes", now() - start)
        if there:
            summary.skipped += 1
        elif node.size > PIECE:
            with waits.waiting("writes"):  # (its reads are few and big: DEST's share dominates)
                await _stream(run, rel, node, limiter)
        else:
            start = now()
            try:
                data = b"".join([piece async for piece in file_bytes(node, rel)])
            except Exception as e:  # noqa: BLE001 - one file's failure never ends the run
                summary.failures.append(failure(rel, e))
                continue
            finally:
                waits.add("data", now() - start)
            batch.add(rel, node, data)
            if batch.full():
                await _hand_over(run, batch, nursery, limiter)
                batch = _WriteBatch()
        if progress is not None:
            progress(summary)
    if batch.files:
        await _hand_over(run, batch, nursery, limiter)


async def _hand_over(run: _Walk, batch: _WriteBatch, nursery: trio.Nursery, limiter: trio.CapacityLimiter) -> None:
    """Give a batch to a writer thread once one of the `jobs` slots is free (waiting for it is the
    walk's `writes` wait)."""
    token = object()  # the write task, not this one, releases the slot
    start = now()
    await limiter.acquire_on_behalf_of(token)
    run.waits.add("writes", now() - start)
    nursery.start_soon(_write_in_thread, run, limiter, token, batch.files)


async def _write_in_thread(run: _Walk, limiter: trio.CapacityLimiter, token: object,
                           files: list[tuple[str, FileNode, bytes]]) -> None:
    try:
        outcomes = await trio.to_thread.run_sync(_write_batch, run.dest, files, limiter=trio.CapacityLimiter(1))
    finally:
        limiter.release_on_behalf_of(token)
    for (rel, node, _), outcome in zip(files, outcomes):
        if isinstance(outcome, WriteStopped):
            run.stop(outcome)
        elif isinstance(outcome, OSError):  # e.g. ELOOP: a symlink where the file's directory goes
            run.summary.failures.append(_cannot_write(rel, outcome))
        elif isinstance(outcome, DataError):  # e.g. DEST holds another object there it does not replace
            run.summary.failures.append(f"{rel}: {outcome}")
        elif isinstance(outcome, tuple):
            try:
                run.landed(rel, node, *outcome)
            except WriteStopped as e:  # the journal has no room: the file is in place all the same
                run.stop(e)


async def _stream(run: _Walk, rel: str, node: FileNode, limiter: trio.CapacityLimiter) -> None:
    """Copy a file of several pieces: each piece read on the loop, then written by a worker before
    the next is read. All-zero pieces are skipped (left as holes), as `cp --sparse=auto` would."""
    async with limiter:
        pending: PendingFile | None = None
        try:
            pending = await trio.to_thread.run_sync(run.dest.open_file, rel)
            crc = 0
            async for piece in file_bytes(node, rel):
                crc = await trio.to_thread.run_sync(_add_piece, pending, piece, crc)
            written = await trio.to_thread.run_sync(pending.commit, node.size, node.mtime_ns)
            pending = None
            run.landed(rel, node, crc, written)
        except WriteStopped as e:
            run.stop(e)
        except OSError as e:  # writing (reads fail with our own errors)
            run.summary.failures.append(_cannot_write(rel, e))
        except Exception as e:  # noqa: BLE001 - one file's failure never ends the run
            run.summary.failures.append(failure(rel, e))
        finally:
            if pending is not None:
                pending.abort()


async def check(root: DirNode, progress: Callable[[WalkSummary], None] | None = None,
                entries: Entries | None = None, waits: Waits | None = None) -> WalkSummary:
    """Read every file the tree shows (or those of `entries`, one task's part of it), fully;
    failures are collected, not raised.

    Reading decodes every gzip payload (CRC and length checked) and, through
    the listing, every shard and minishard index; problems that make a
    listing skip something are reported by the format via `log_once` and
    collected by the caller. `waits`, if given, gets the seconds spent reading
    files (`data`).
    """
    summary = WalkSummary()
    waits = waits or Waits()
    async for rel, node in walk(root) if entries is None else entries:
        if isinstance(node, DirNode):
            summary.dirs += 1
            continue
        summary.files += 1
        start = now()
        try:
            async for piece in file_bytes(node, rel):
                summary.bytes += len(piece)
        except Exception as e:  # noqa: BLE001 - one file's failure never ends the run
            summary.failures.append(failure(rel, e))
        waits.add("data", now() - start)
        if progress is not None:
            progress(summary)
    return summary
