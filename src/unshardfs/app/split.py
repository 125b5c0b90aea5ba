"""One `check` or `export` split into parts by shard, for worker processes or a Dask cluster.

A part is a small, picklable description (the SOURCE, the options, which
part of how many); the worker opens the source itself (remote sources take
credentials from the worker's own environment), walks the whole tree
but its listings show only the shards that hash to its part, so each
shard's indexes and payloads are read by exactly one part, in order. Files
with no shard (metadata, unsharded data) go by their path.
Only counts and problem lines travel back. An export part is a task of the
export's plan: its files are journaled as they land in DEST and its ledger
entry written when all are in place, so a part run again (a lost worker, a
`--resume`) keeps what is there and rewrites nothing complete.
"""

from __future__ import annotations

import zlib
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import trio

from unshardfs.app.opened import OpenedSource, OpenOptions
from unshardfs.tools.atomic import WriteStopped
from unshardfs.tools.dest import Dest, open_dest
from unshardfs.tools.ledger import Journal, Ledger
from unshardfs.tools.walk import Select, WalkSummary, check, export
from unshardfs.util.logonce import collect_problems

# Files held in a shard carry their chunk id (passthrough files only their source path).
CHUNK_XATTR = "user.unshardfs.chunk_id"


@dataclass(frozen=True)
class Part:
    """One task: part `part` of `parts` of a check, or of an export into `dest`."""

    source: str
    options: OpenOptions
    part: int
    parts: int
    dest: str | None = None  # export: where every worker writes (a shared file system, s3:// or gs://)
    write_jobs: int = 4
    sync: bool = True  # export: flush each file before its rename, and the ledger entry's directories


@dataclass
class PartResult:
    problems: list[str]
    summary: WalkSummary
    reads: int
    part: int = 0
    complete: bool = False  # export: the task's ledger entry is in place
    recorded: bool = False  # ... and was before this run began


def _bucket(text: str, parts: int) -> int:
    return zlib.crc32(text.encode()) % parts


def shard_filter(part: int, parts: int) -> Callable[[str, str], bool]:
    """Listings of this part show only the shards that hash to it (so only their indexes are read);
    shards are named by their store's token, the same in every process."""
    return lambda label, token: _bucket(f"{label}\0{token}", parts) == part


def selector(part: int, parts: int) -> Select | None:
    """Files of this part: every chunk file its listings show (their shards are its own), and the
    files with no shard (metadata, unsharded data) whose path hashes to it."""
    if parts <= 1:
        return None
    return lambda rel, node: CHUNK_XATTR in node.xattrs() or _bucket(rel, parts) == part


@asynccontextmanager
async def _opened(job: Part) -> AsyncIterator[tuple[OpenedSource, list[str]]]:
    """The part's own opened SOURCE, listing only the part's shards, running; and the problems
    logged meanwhile."""
    session = await OpenedSource.open(job.source, job.options)
    if job.parts > 1:
        session.runtime.shard_filter = shard_filter(job.part, job.parts)
    try:
        with collect_problems() as problems:
            async with session.running():
                yield session, problems
    finally:
        await session.aclose()


async def _check(job: Part, progress: Callable[[WalkSummary], None] | None) -> PartResult:
    async with _opened(job) as (session, problems):
        summary = await check(session.tree, progress, selector(job.part, job.parts))
    return PartResult(list(problems), summary, session.source.counters.reads, job.part)


async def _export(job: Part, out: Dest, progress: Callable[[WalkSummary], None] | None) -> PartResult:
    """Export one task into DEST: skipped whole if its ledger entry is there; else its journal's
    files are kept where DEST still matches them, the others written, and the entry written once
    every file of the task is in place (none failed, no listing problem)."""
    ledger = Ledger(out)
    if job.part in ledger.complete():
        files, _ = ledger.task_totals(job.part)
        return PartResult([], WalkSummary(files=files, skipped=files), 0, job.part, complete=True, recorded=True)
    try:
        journal = Journal.open(out, job.part)
    except WriteStopped as e:
        return PartResult([], WalkSummary(stopped=str(e)), 0, job.part)
    try:
        async with _opened(job) as (session, problems):
            summary = await export(session.tree, out, job.write_jobs, progress, selector(job.part, job.parts),
                                   journal, job.sync)
        complete = False
        if summary.stopped is None and not summary.failures and not problems:
            try:
                await trio.to_thread.run_sync(_finish, ledger, journal, job.sync)
                complete = True
            except WriteStopped as e:
                summary.stopped = str(e)
            except OSError as e:  # a directory of the task's files moved away meanwhile, say
                summary.failures.append(f"task {job.part}: cannot record it as complete: {e.strerror}: {e.filename}")
    finally:
        journal.close()
    return PartResult(list(problems), summary, session.source.counters.reads, job.part, complete)


def _finish(ledger: Ledger, journal: Journal, sync: bool) -> None:
    """Flush the directories the task renamed files into, then write its ledger entry."""
    if sync:
        for parent in sorted({path.rpartition("/")[0] for path in journal.done}):
            ledger.dest.sync_dir(parent)
    ledger.finish(journal, sync)


async def _run(job: Part, progress: Callable[[WalkSummary], None] | None = None) -> PartResult:
    if job.dest is None:
        return await _check(job, progress)
    out = open_dest(job.dest, job.options.remote)
    try:
        return await _export(job, out, progress)
    finally:
        out.close()


def run_part(job: Part, progress: Callable[[WalkSummary], None] | None = None) -> PartResult:
    """Run one part to completion (in this process, a worker process or a Dask worker thread)."""
    return trio.run(_run, job, progress)
