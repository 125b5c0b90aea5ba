"""One `check` or `export` split into parts by shard, for worker processes or a Dask cluster.

A part is a small, picklable description (the SOURCE, the options, which
part of how many); the worker opens the source itself (remote sources take
credentials from the worker's own environment), walks the whole tree
(listings are index reads only) and reads the files whose backing shard
hashes to its part, so each shard's payloads are read by exactly one part,
in order. Files with no shard (metadata, unsharded data) go by their path.
Only counts and problem lines travel back.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import trio

from ..logonce import collect_problems
from ..session import Session
from ..vtree import FileNode
from .walk import Select, WalkSummary, check, export

SOURCE_XATTR = "user.unshardfs.source"


@dataclass(frozen=True)
class Part:
    source: str
    formats: dict
    part: int
    parts: int
    dest: str | None = None  # export: where every worker writes (a shared file system)
    write_jobs: int = 4


@dataclass
class PartResult:
    problems: list[str]
    summary: WalkSummary
    reads: int


def shard_of(rel: str, node: FileNode) -> str:
    source = node.xattrs().get(SOURCE_XATTR)
    return source.decode() if source else rel


def selector(part: int, parts: int) -> Select | None:
    if parts <= 1:
        return None
    return lambda rel, node: zlib.crc32(shard_of(rel, node).encode()) % parts == part


async def _run(job: Part) -> PartResult:
    session = await Session.open(job.source, job.formats)
    try:
        with collect_problems() as problems:
            async with session.running():
                if job.dest is None:
                    summary = await check(session.tree, None, selector(job.part, job.parts))
                else:
                    summary = await export(session.tree, Path(job.dest), job.write_jobs, None,
                                           selector(job.part, job.parts))
    finally:
        await session.aclose()
    return PartResult(list(problems), summary, session.source.counters.reads)


def run_part(job: Part) -> PartResult:
    """Run one part to completion (in a worker process or a Dask worker thread)."""
    return trio.run(_run, job)
