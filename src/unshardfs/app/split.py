"""One `check` or `export` split into planned tasks, for worker processes or a Dask cluster.

A task is a small, picklable description (the SOURCE, the options, its
number and its work as the client planned it, `planner.TaskWork`); the
worker opens the source itself (remote sources take credentials from the
worker's own environment), goes by path to the directories and files the
task names and reads the indexes and chunks of its own shards only, in
shard order, through the same coalesced, bounded fetcher a mount uses. No
task lists a directory. Only counts and problem lines travel back. An
export task is a task of the export's recorded plan: its files are journaled
as they land in DEST and its ledger entry written when all are in place,
so a task run again (a lost worker, a `--resume`) keeps what is there and
rewrites nothing complete.
"""

from __future__ import annotations

import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator, Callable

import trio

from unshardfs.app.opened import OpenedSource, OpenOptions
from unshardfs.app.planner import KnownDirs, TaskWork, task_entries
from unshardfs.app.timeline import TaskTimeline, source_requests
from unshardfs.core.runtime import ShardScope
from unshardfs.dest.base import Dest, WriteStopped
from unshardfs.dest.ledger import Journal, Ledger
from unshardfs.dest.opener import open_dest
from unshardfs.sources.base import ByteSource
from unshardfs.tools.walk import Entries, WalkSummary, check, export
from unshardfs.util.logonce import collect_problems
from unshardfs.util.waits import Waits, now


@dataclass(frozen=True)
class Part:
    """One task: task `part` of a check, or of an export into `dest`, doing `work`."""

    source: str
    options: OpenOptions
    part: int
    work: TaskWork
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
    timeline: TaskTimeline | None = None  # where the task's time went (a task run in this run)


@dataclass
class _Task:
    """One running task: its job, where its time goes, and (for tests) the byte source to open."""

    job: Part
    timeline: TaskTimeline
    waits: Waits
    source: ByteSource | None = None


@asynccontextmanager
async def _opened(task: _Task) -> AsyncIterator[tuple[OpenedSource, Entries, list[str], list[str]]]:
    """The task's own opened SOURCE, running, and what the task visits; the problems logged
    meanwhile, and the paths the plan names that SOURCE no longer holds."""
    job = task.job
    dirs = job.work.directories()
    with task.waits.waiting("open"):
        if task.source is None:
            session = await OpenedSource.open(job.source, job.options, named=job.work.format,
                                              layer=lambda source: KnownDirs(source, dirs))
        else:
            session = await OpenedSource.over(KnownDirs(task.source, dirs), job.work.format, job.options)
    scope = ShardScope(planning=False)
    session.runtime.shard_scope = scope
    missing: list[str] = []
    entries = task_entries(session.tree, scope, job.work, missing, task.waits)
    try:
        with collect_problems() as problems:
            async with session.running():
                try:
                    yield session, entries, problems, missing
                finally:
                    await entries.aclose()  # a walk that stopped early leaves it part way
    finally:
        task.timeline.requests, task.timeline.round_trips = source_requests(session.source.stats())
        await session.aclose()


async def _check(task: _Task, progress: Callable[[WalkSummary], None] | None) -> PartResult:
    async with _opened(task) as (session, entries, problems, missing):
        summary = await check(session.tree, progress, entries, task.waits)
    summary.failures += missing
    return PartResult(list(problems), summary, session.source.counters.reads, task.job.part)


async def _export(task: _Task, out: Dest, progress: Callable[[WalkSummary], None] | None) -> PartResult:
    """Export one task into DEST: skipped whole if its ledger entry is there; else its journal's
    files are kept where DEST still matches them, the others written, and the entry written once
    every file of the task is in place (none failed, none missing, no listing problem)."""
    job, waits = task.job, task.waits
    ledger = Ledger(out.records)
    with waits.waiting("ledger"):
        done = await trio.to_thread.run_sync(ledger.is_complete, job.part)
    if done:
        files, _ = ledger.task_totals(job.part)
        return PartResult([], WalkSummary(files=files, skipped=files), 0, job.part, complete=True, recorded=True)
    try:
        with waits.waiting("ledger"):
            journal = await trio.to_thread.run_sync(Journal.open, out.records, job.part)
    except WriteStopped as e:
        return PartResult([], WalkSummary(stopped=str(e)), 0, job.part)
    try:
        async with _opened(task) as (session, entries, problems, missing):
            summary = await export(session.tree, out.files, job.write_jobs, progress, entries, journal, waits)
        summary.failures += missing
        complete = False
        if summary.stopped is None and not summary.failures and not problems:
            try:
                with waits.waiting("ledger"):
                    await trio.to_thread.run_sync(_finish, out, ledger, journal)
                complete = True
            except WriteStopped as e:
                summary.stopped = str(e)
            except OSError as e:  # a directory of the task's files moved away meanwhile, say
                summary.failures.append(f"task {job.part}: cannot record it as complete: {e.strerror}: {e.filename}")
    finally:
        journal.close()
    return PartResult(list(problems), summary, session.source.counters.reads, job.part, complete)


def _finish(out: Dest, ledger: Ledger, journal: Journal) -> None:
    """Flush the directories the task renamed files into, then write its ledger entry."""
    for parent in sorted({path.rpartition("/")[0] for path in journal.done}):
        out.files.sync_dir(parent)
    ledger.finish(journal)


async def run_task(job: Part, progress: Callable[[WalkSummary], None] | None = None, worker: str = "",
                   source: ByteSource | None = None) -> PartResult:
    """Run one task in this trio run, with its timeline (`worker` names where it runs). With
    `source`, its dataset is opened over that byte source (a test's), not the job's SOURCE."""
    task = _Task(job, TaskTimeline(job.part, worker or f"pid {os.getpid()}", time.time()), Waits(), source)
    start, cpu = now(), time.process_time()
    if job.dest is None:
        result = await _check(task, progress)
    else:
        with task.waits.waiting("ledger"):
            out = await trio.to_thread.run_sync(partial(open_dest, job.dest, job.options.remote, sync=job.sync))
        try:
            result = await _export(task, out, progress)
        finally:
            out.close()
    timeline = task.timeline
    timeline.wall = now() - start
    timeline.cpu = time.process_time() - cpu
    timeline.settle(task.waits.seconds)
    timeline.files, timeline.bytes = result.summary.files, result.summary.bytes
    result.timeline = timeline
    return result


def run_part(job: Part, progress: Callable[[WalkSummary], None] | None = None, worker: str = "") -> PartResult:
    """Run one task to completion (in this process, a worker process or a Dask worker thread)."""
    return trio.run(run_task, job, progress, worker)
