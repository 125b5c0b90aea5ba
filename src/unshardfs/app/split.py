"""One `check` or `export` split into parts by shard, for worker processes or a Dask cluster.

A part is a small, picklable description (the SOURCE, the options, which
part of how many); the worker opens the source itself (remote sources take
credentials from the worker's own environment), walks the whole tree
but its listings show only the shards that hash to its part, so each
shard's indexes and payloads are read by exactly one part, in order. Files
with no shard (metadata, unsharded data) go by their path.
Only counts and problem lines travel back.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import trio

from unshardfs.app.opened import OpenedSource, OpenOptions
from unshardfs.tools.walk import Dest, Select, WalkSummary, check, export
from unshardfs.util.logonce import collect_problems

# Files held in a shard carry their chunk id (passthrough files only their source path).
CHUNK_XATTR = "user.unshardfs.chunk_id"


@dataclass(frozen=True)
class Part:
    source: str
    options: OpenOptions
    part: int
    parts: int
    dest: str | None = None  # export: where every worker writes (a shared file system)
    write_jobs: int = 4


@dataclass
class PartResult:
    problems: list[str]
    summary: WalkSummary
    reads: int


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


async def _run(job: Part) -> PartResult:
    out = None if job.dest is None else Dest.open(Path(job.dest))
    session = await OpenedSource.open(job.source, job.options)
    if job.parts > 1:
        session.runtime.shard_filter = shard_filter(job.part, job.parts)
    try:
        with collect_problems() as problems:
            async with session.running():
                if out is None:
                    summary = await check(session.tree, None, selector(job.part, job.parts))
                else:
                    summary = await export(session.tree, out, job.write_jobs, None, selector(job.part, job.parts))
    finally:
        await session.aclose()
        if out is not None:
            out.close()
    return PartResult(list(problems), summary, session.source.counters.reads)


def run_part(job: Part) -> PartResult:
    """Run one part to completion (in a worker process or a Dask worker thread)."""
    return trio.run(_run, job)
