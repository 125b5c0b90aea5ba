"""The offline commands behind `unshardfs inspect | check | export`."""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import sys
import zlib
from pathlib import Path

import trio
from tqdm import tqdm

from ..logonce import collect_problems
from ..options import format_options
from ..session import Session
from .inspect import format_report
from .walk import WalkSummary, check, export


def _bar(args: argparse.Namespace, unit: str) -> tqdm:
    # tqdm disables itself when stderr is not a terminal (disable=None).
    return tqdm(unit=unit, disable=True if getattr(args, "quiet", False) else None, file=sys.stderr,
                dynamic_ncols=True)


def _progress(bar: tqdm):
    def update(summary: WalkSummary) -> None:
        bar.n = summary.files
        if summary.files % 256 == 0:
            bar.set_postfix(bytes=f"{summary.bytes / 2**20:,.0f}MiB", failed=len(summary.failures), refresh=False)
            bar.refresh()
    return update


async def _inspect(args: argparse.Namespace) -> int:
    session = await Session.open(args.source, format_options(args))
    reports = []
    with _bar(args, "chunk") as bar:
        async for part in session.dataset.inventory():
            bar.set_description(part.key or ".")
            reports.append(await part.report(bar.update))
    await session.aclose()
    print(json.dumps(reports, indent=2) if args.json else format_report(reports, args.source))
    return 0


async def _check_part(source_url: str, formats: dict, part: int, parts: int, quiet: bool
                      ) -> tuple[list[str], WalkSummary, int]:
    """Check the files whose path hashes to `part` (all of them when parts == 1)."""
    session = await Session.open(source_url, formats)

    def mine(rel: str) -> bool:
        return zlib.crc32(rel.encode()) % parts == part

    with collect_problems() as problems, tqdm(unit="file", disable=True if quiet else None,
                                               file=sys.stderr, dynamic_ncols=True) as bar:
        async with session.running():
            summary = await check(session.tree, _progress(bar), mine if parts > 1 else None)
    await session.aclose()
    return problems, summary, session.source.counters.reads


def _check_worker(job: tuple[str, dict, int, int]) -> tuple[list[str], WalkSummary, int]:
    return trio.run(_check_part, *job, True)


def _check(args: argparse.Namespace) -> int:
    """Not a coroutine: worker processes must be forked outside any trio run."""
    if args.jobs > 1:
        # The format layer is single-threaded by design; parallel checking
        # splits the files (not the indexes, which every worker reads) over
        # processes, each with its own tree and caches.
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            results = pool.map(_check_worker, [(args.source, format_options(args), i, args.jobs) for i in range(args.jobs)])
    else:
        results = [trio.run(_check_part, args.source, format_options(args), 0, 1, args.quiet)]
    problems = list(dict.fromkeys(line for found, _, _ in results for line in found))
    failures = [f for _, summary, _ in results for f in summary.failures]
    for line in problems:
        print(f"damaged: {line}")
    listed = set(problems)
    failures = [f for f in failures if f.split(": ", 1)[1] not in listed]
    for line in failures:
        print(f"damaged: {line}")
    files = sum(summary.files for _, summary, _ in results)
    size = sum(summary.bytes for _, summary, _ in results)
    reads = sum(r for _, _, r in results)
    damaged = bool(problems or failures)
    print(f"{'DAMAGED' if damaged else 'intact'}: {files:,} files, {size:,} bytes read through "
          f"{reads:,} backing reads; {len(problems) + len(failures)} problem(s)")
    return 1 if damaged else 0


async def _export(args: argparse.Namespace) -> int:
    session = await Session.open(args.source, format_options(args))
    with collect_problems() as problems, _bar(args, "file") as bar:
        async with session.running():
            summary = await export(session.tree, Path(args.dest), args.jobs, _progress(bar))
    await session.aclose()
    for line in problems + summary.failures:
        print(f"not exported: {line}", file=sys.stderr)
    print(f"exported {summary.files:,} files ({summary.written:,} written, {summary.skipped:,} already complete, "
          f"{summary.bytes / 2**20:,.1f} MiB) and {summary.dirs:,} directories to {args.dest}"
          + (f"; {len(summary.failures)} failed" if summary.failures else ""))
    return 1 if summary.failures or problems else 0


def run_tool(args: argparse.Namespace) -> int:
    # Problems are printed by the command itself; keep the log quiet.
    logging.basicConfig(level=logging.CRITICAL)
    if args.command == "check":
        return _check(args)
    command = {"inspect": _inspect, "export": _export}[args.command]
    return trio.run(command, args)
