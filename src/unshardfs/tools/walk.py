"""Walk a virtual tree outside FUSE: export it to a directory, or check it.

Both are format-agnostic: they see exactly what the mount would show, in
the tree's own listing order, which for sharded data is shard by shard and
minishard by minishard, i.e. close to sequential in the backing files.
"""

from __future__ import annotations

import errno
import logging
import os
import stat as statmod
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import trio

from unshardfs.sources.base import name_problem
from unshardfs.tree.edge import classify
from unshardfs.tree.nodes import DirNode, FileNode
from unshardfs.util.errors import ConfigError, DataError
from unshardfs.util.fdpath import Beneath, regular_file
from unshardfs.util.logonce import log_once

log = logging.getLogger(__name__)

PIECE = 8 << 20  # read big files in pieces so memory stays bounded
# Which files one part of a split run handles: (relative path, node) -> mine?
Select = Callable[[str, FileNode], bool]


@dataclass
class WalkSummary:
    files: int = 0
    written: int = 0
    skipped: int = 0
    bytes: int = 0
    dirs: int = 0
    failures: list[str] = field(default_factory=list)


def failure(rel: str, error: Exception) -> str:
    """How a file that could not be read is reported (a bug says so, with its type)."""
    return f"{rel}: {classify(error).message}"


async def walk(root: DirNode, prefix: str = "") -> AsyncIterator[tuple[str, FileNode | DirNode]]:
    """(relative path, node) of every file and directory below `root`, depth first."""
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


async def file_bytes(node: FileNode, where: str) -> AsyncIterator[bytes]:
    offset = 0
    while offset < node.size:
        data = await node.read(offset, min(PIECE, node.size - offset))
        if not data:
            raise DataError(where, f"short read at offset {offset} of {node.size}")
        offset += len(data)
        yield data


@dataclass
class Dest:
    """DEST held open as a directory; everything export writes is opened beneath this fd with no
    symlink followed (`fdpath.Beneath(links=False)`), never by a path rebuilt from strings."""

    out: Beneath
    created: bool  # made by this run: nothing in it is complete yet

    @classmethod
    def open(cls, dest: Path) -> "Dest":
        """Open (creating it and its parents if missing) before anything runs: a DEST that cannot
        be a directory is a one-line ConfigError."""
        try:
            os.makedirs(dest)
            created = True
        except FileExistsError:
            created = False
        except OSError as e:
            raise ConfigError(f"DEST {dest}: cannot create it: {e.strerror}") from None
        try:
            return cls(Beneath(str(dest), links=False), created)  # O_PATH: a FIFO there does not block
        except OSError as e:
            problem = "exists and is not a directory" if e.errno == errno.ENOTDIR else e.strerror
            raise ConfigError(f"DEST {dest} {problem}") from None

    def close(self) -> None:
        self.out.close()


def is_complete(out: Beneath, rel: str, node: FileNode) -> bool:
    """A finished export of `node`: same size and the node's mtime.

    The mtime is stamped only after the last byte is written, so a file cut
    short by a killed export never passes this test.
    """
    try:
        st = out.lstat(rel)
    except OSError:
        return False
    return statmod.S_ISREG(st.st_mode) and st.st_size == node.size and st.st_mtime_ns == node.mtime_ns


def _open_target(out: Beneath, rel: str) -> int:
    """The file `rel` beneath DEST, open for writing and emptied.

    No link is followed on the way or at the end (a symlink planted in DEST is
    ELOOP); O_NONBLOCK so a FIFO planted where the file goes fails at once
    (ENXIO, or refused after fstat when a reader holds it) instead of
    blocking; a file with other hard links is never written through (the
    other name may lie outside DEST).
    """
    fd = out.open(rel, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o644)
    st = regular_file(fd, rel)
    if st.st_nlink > 1:
        os.close(fd)
        raise OSError(errno.EMLINK, "has other hard links (never written through)", rel)
    if st.st_size:
        os.ftruncate(fd, 0)
    return fd


def _write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view = view[done:]
        offset += done


def _finish(fd: int, size: int, mtime_ns: int) -> None:
    """Size (holes left by skipped zero pieces included) then the mtime, which marks the file complete."""
    try:
        os.ftruncate(fd, size)
        os.utime(fd, ns=(mtime_ns, mtime_ns))
    finally:
        os.close(fd)


def _write_file(out: Beneath, rel: str, data: bytes, mtime_ns: int) -> None:
    fd = _open_target(out, rel)
    try:
        _write_at(fd, data, 0)
    except BaseException:
        os.close(fd)
        raise
    _finish(fd, len(data), mtime_ns)


def _make_dir(out: Beneath, rel: str) -> bool:
    """Create the directory `rel` beneath DEST (False if it was there); refuse anything but a real directory."""
    if out.mkdir(rel):
        return True
    if not statmod.S_ISDIR(out.lstat(rel).st_mode):
        raise DataError(rel, "exists and is not a directory (a symlink is never followed)")
    return False


async def export(root: DirNode, dest: Dest, jobs: int = 4,
                 progress: Callable[[WalkSummary], None] | None = None, select: Select | None = None) -> WalkSummary:
    """Write the tree under `dest`; files already complete there are skipped.

    Reads happen on the event loop in listing order (sequential in the
    shards); up to `jobs` file writes run in worker threads meanwhile. Files
    of one piece are read whole and written by a worker; bigger ones are
    streamed piece by piece, so memory stays within about `jobs + 1` pieces
    whatever the file sizes.
    """
    out = dest.out
    summary = WalkSummary()
    limiter = trio.CapacityLimiter(jobs)
    # Directories this run created hold nothing complete yet: no need to stat
    # their files (a stat per file is a large part of small-file exports).
    fresh = {""} if dest.created else set()
    skip: set[str] = set()  # directories that could not be made: nothing is written below them
    async with trio.open_nursery() as nursery:
        async for rel, node in walk(root):
            if rel.rpartition("/")[0] in skip:
                skip.add(rel)  # below a directory that could not be made (a planted link, say)
                continue
            if isinstance(node, DirNode):
                try:
                    if _make_dir(out, rel):
                        fresh.add(rel)
                except (DataError, OSError) as e:
                    summary.failures.append(f"{rel}/: {e}")
                    skip.add(rel)
                    continue
                summary.dirs += 1
                continue
            if select is not None and not select(rel, node):
                continue
            summary.files += 1
            if rel.rpartition("/")[0] not in fresh and is_complete(out, rel, node):
                summary.skipped += 1
            elif node.size > PIECE:
                if await _stream(out, rel, node, limiter, summary):
                    summary.written += 1
                    summary.bytes += node.size
            else:
                try:
                    data = b"".join([piece async for piece in file_bytes(node, rel)])
                except Exception as e:  # noqa: BLE001 - one file's failure never ends the run
                    summary.failures.append(failure(rel, e))
                    continue
                token = object()  # the write task, not this one, releases the slot
                await limiter.acquire_on_behalf_of(token)
                nursery.start_soon(_write_in_thread, limiter, token, out, rel, data, node.mtime_ns, summary)
                summary.written += 1
                summary.bytes += node.size
            if progress is not None:
                progress(summary)
    return summary


def _cannot_write(rel: str, error: OSError) -> str:
    return f"{rel}: cannot write: {error.strerror}"


async def _write_in_thread(limiter: trio.CapacityLimiter, token: object, out: Beneath, rel: str,
                           data: bytes, mtime_ns: int, summary: WalkSummary) -> None:
    try:
        await trio.to_thread.run_sync(_write_file, out, rel, data, mtime_ns, limiter=trio.CapacityLimiter(1))
    except OSError as e:  # e.g. ELOOP: a symlink where the file goes
        summary.failures.append(_cannot_write(rel, e))
    finally:
        limiter.release_on_behalf_of(token)


async def _stream(out: Beneath, rel: str, node: FileNode, limiter: trio.CapacityLimiter,
                  summary: WalkSummary) -> bool:
    """Copy a file of several pieces: each piece read on the loop, then written by a worker before
    the next is read. All-zero pieces are skipped (left as holes), as `cp --sparse=auto` would."""
    async with limiter:
        fd = -1
        try:
            fd = await trio.to_thread.run_sync(_open_target, out, rel)
            offset = 0
            async for piece in file_bytes(node, rel):
                if piece.count(0) != len(piece):
                    await trio.to_thread.run_sync(_write_at, fd, piece, offset)
                offset += len(piece)
            fd, finishing = -1, fd  # _finish closes it
            await trio.to_thread.run_sync(_finish, finishing, node.size, node.mtime_ns)
            return True
        except OSError as e:  # writing (reads fail with our own errors)
            summary.failures.append(_cannot_write(rel, e))
        except Exception as e:  # noqa: BLE001 - one file's failure never ends the run
            summary.failures.append(failure(rel, e))
        finally:
            if fd >= 0:
                os.close(fd)
        return False


async def check(root: DirNode, progress: Callable[[WalkSummary], None] | None = None,
                select: Select | None = None) -> WalkSummary:
    """Read every file the tree shows (or those `select` picks), fully;
    failures are collected, not raised.

    Reading decodes every gzip payload (CRC and length checked) and, through
    the listing, every shard and minishard index; problems that make a
    listing skip something are reported by the format via `log_once` and
    collected by the caller.
    """
    summary = WalkSummary()
    async for rel, node in walk(root):
        if isinstance(node, DirNode):
            summary.dirs += 1
            continue
        if select is not None and not select(rel, node):
            continue
        summary.files += 1
        try:
            async for piece in file_bytes(node, rel):
                summary.bytes += len(piece)
        except Exception as e:  # noqa: BLE001 - one file's failure never ends the run
            summary.failures.append(failure(rel, e))
        if progress is not None:
            progress(summary)
    return summary
