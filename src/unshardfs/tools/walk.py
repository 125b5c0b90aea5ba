"""Walk a virtual tree outside FUSE: export it to a directory, or check it.

Both are format-agnostic: they see exactly what the mount would show, in
the tree's own listing order, which for sharded data is shard by shard and
minishard by minishard, i.e. close to sequential in the backing files.
"""

from __future__ import annotations

import logging
import os
import stat as statmod
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import trio

from ..errors import DataError, expected_failure
from ..logonce import log_once
from ..sources.base import name_problem
from ..vtree import DirNode, FileNode

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
    known = expected_failure(error)
    return f"{rel}: {known}" if known is not None else f"{rel}: unexpected {type(error).__name__}: {error}"


async def walk(root: DirNode, prefix: str = "") -> AsyncIterator[tuple[str, FileNode | DirNode]]:
    """(relative path, node) of every file and directory below `root`, depth first."""
    async for batch in root.entries():
        for name, node in batch:
            problem = name_problem(name)
            if problem is not None:  # no tree should show one; a walk that writes must not trust that
                log_once(log, f"walk:{prefix}:{problem}", "%s: skipping %s", prefix or ".", problem)
                continue
            path = f"{prefix}{name}"
            yield path, node  # type: ignore[misc]  # entries are typed Node; every Node is a file or a dir
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


def is_complete(target: Path, node: FileNode) -> bool:
    """A finished export of `node`: same size and the node's mtime.

    The mtime is stamped only after the last byte is written, so a file cut
    short by a killed export never passes this test.
    """
    try:
        st = target.lstat()
    except OSError:
        return False
    return statmod.S_ISREG(st.st_mode) and st.st_size == node.size and st.st_mtime_ns == node.mtime_ns


# Never through a symlink: DEST may hold links planted to make a write land
# elsewhere (the names come from an untrusted source; the links need not).
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_file(target: Path, pieces: list[bytes], mtime_ns: int) -> None:
    fd = os.open(target, WRITE_FLAGS, 0o644)
    with open(fd, "wb") as f:
        for piece in pieces:
            f.write(piece)
        f.flush()
        os.utime(fd, ns=(mtime_ns, mtime_ns))  # last: marks the file complete


def _make_dir(target: Path) -> bool:
    """Create the directory `target` (False if it was there); refuse anything but a real directory."""
    try:
        st = target.lstat()
    except FileNotFoundError:
        try:
            target.mkdir()
            return True
        except FileExistsError:  # another part of a split export made it meanwhile
            st = target.lstat()
    if not statmod.S_ISDIR(st.st_mode):
        raise DataError(str(target), "exists and is not a directory (a symlink is never followed)")
    return False


async def export(root: DirNode, dest: Path, jobs: int = 4,
                 progress: Callable[[WalkSummary], None] | None = None, select: Select | None = None) -> WalkSummary:
    """Write the tree under `dest`; files already complete there are skipped.

    Reads happen on the event loop in listing order (sequential in the
    shards); up to `jobs` file writes run in worker threads meanwhile.
    """
    summary = WalkSummary()
    limiter = trio.CapacityLimiter(jobs)
    # Directories this run created hold nothing complete yet: no need to stat
    # their files (a stat per file is a large part of small-file exports).
    fresh = {""} if not dest.exists() else set()
    dest.mkdir(parents=True, exist_ok=True)
    skip: set[str] = set()  # directories that could not be made: nothing is written below them
    async with trio.open_nursery() as nursery:
        async for rel, node in walk(root):
            target = dest / rel
            if rel.rpartition("/")[0] in skip:
                skip.add(rel)  # below a directory that could not be made (a planted link, say)
                continue
            if isinstance(node, DirNode):
                try:
                    if _make_dir(target):
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
            if rel.rpartition("/")[0] not in fresh and is_complete(target, node):
                summary.skipped += 1
            else:
                try:
                    pieces = [piece async for piece in file_bytes(node, rel)]
                except Exception as e:  # noqa: BLE001 - one file's failure never ends the run
                    summary.failures.append(failure(rel, e))
                    continue
                token = object()  # the write task, not this one, releases the slot
                await limiter.acquire_on_behalf_of(token)
                nursery.start_soon(_write_in_thread, limiter, token, target, pieces, node.mtime_ns, summary)
                summary.written += 1
                summary.bytes += node.size
            if progress is not None:
                progress(summary)
    return summary


async def _write_in_thread(limiter: trio.CapacityLimiter, token: object, target: Path,
                           pieces: list[bytes], mtime_ns: int, summary: WalkSummary) -> None:
    try:
        await trio.to_thread.run_sync(_write_file, target, pieces, mtime_ns, limiter=trio.CapacityLimiter(1))
    except OSError as e:  # e.g. ELOOP: a symlink where the file goes
        summary.failures.append(f"{target}: cannot write: {e.strerror}")
    finally:
        limiter.release_on_behalf_of(token)


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
