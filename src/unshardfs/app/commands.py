"""The offline commands behind `unshardfs inspect | check | export`."""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import sys
from pathlib import Path

import trio
from tqdm import tqdm

from unshardfs.app.opened import OpenedSource
from unshardfs.app.options import open_options
from unshardfs.app.split import Part, PartResult, run_part
from unshardfs.tools.inspect import format_report
from unshardfs.tools.walk import Dest, WalkSummary, check, export
from unshardfs.util.logonce import collect_problems


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
    session = await OpenedSource.open(args.source, open_options(args))
    reports = []
    with _bar(args, "chunk") as bar:
        async for part in session.dataset.inventory():
            bar.set_description(part.path or ".")
            reports.append(await part.report(bar.update))
    await session.aclose()
    archive = session.archive
    print(json.dumps(reports, indent=2) if args.json else
          format_report(reports, args.source, archive.lines() if archive else None))
    return 0


async def _one_part(args: argparse.Namespace, dest: Path | None) -> PartResult:
    """The whole check/export in this process, with a progress bar per file."""
    out = None if dest is None else Dest.open(dest)  # first: a bad DEST is a one-line error
    session = await OpenedSource.open(args.source, open_options(args))
    try:
        with collect_problems() as problems, _bar(args, "file") as bar:
            async with session.running():
                if out is None:  # no DEST: a check
                    summary = await check(session.tree, _progress(bar))
                else:
                    summary = await export(session.tree, out, args.jobs, _progress(bar))
    finally:
        await session.aclose()
        if out is not None:
            out.close()
    return PartResult(list(problems), summary, session.source.counters.reads)


def _jobs(args: argparse.Namespace, parts: int, dest: Path | None) -> list[Part]:
    return [Part(args.source, open_options(args), i, parts, None if dest is None else str(dest),
                 args.jobs if dest is not None else 1) for i in range(parts)]


def _on_cluster(args: argparse.Namespace, dest: Path | None) -> list[PartResult]:
    """The parts on a Dask cluster; progress by completed part."""
    from unshardfs.app.cluster import check_dest_visible, connect, dask_log_level, default_parts, run_parts

    client = connect(args.scheduler, dask_log_level(args.debug, args.quiet))
    try:
        if dest is not None:
            check_dest_visible(client, dest)
        parts = args.parts or default_parts(client)
        with tqdm(total=parts, unit="part", disable=True if args.quiet else None, file=sys.stderr,
                  dynamic_ncols=True) as bar:
            return run_parts(client, _jobs(args, parts, dest), lambda: bar.update(1))
    finally:
        cluster = getattr(client, "cluster", None)
        client.close()
        if cluster is not None and args.scheduler.startswith("local:"):
            cluster.close()


def _results(args: argparse.Namespace, dest: Path | None) -> list[PartResult]:
    if args.scheduler:
        return _on_cluster(args, dest)
    if dest is None and args.jobs > 1:
        # The format layer is single-threaded by design; parallel checking
        # splits the shards over processes, each with its own tree and caches.
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            return pool.map(run_part, _jobs(args, args.jobs, None))
    return [trio.run(_one_part, args, dest)]


def _problems(results: list[PartResult]) -> tuple[list[str], list[str]]:
    """Distinct problem lines, and file failures not already named by one (sorted: parts finish in any order)."""
    problems = sorted(dict.fromkeys(line for r in results for line in r.problems))
    listed = set(problems)
    failures = sorted(f for r in results for f in r.summary.failures if f.split(": ", 1)[1] not in listed)
    return problems, failures


def _check(args: argparse.Namespace) -> int:
    """Not a coroutine: worker processes must be forked outside any trio run."""
    results = _results(args, None)
    problems, failures = _problems(results)
    for line in problems + failures:
        print(f"damaged: {line}")
    files = sum(r.summary.files for r in results)
    size = sum(r.summary.bytes for r in results)
    reads = sum(r.reads for r in results)
    damaged = bool(problems or failures)
    print(f"{'DAMAGED' if damaged else 'intact'}: {files:,} files, {size:,} bytes read through "
          f"{reads:,} backing reads; {len(problems) + len(failures)} problem(s)")
    return 1 if damaged else 0


def _export(args: argparse.Namespace) -> int:
    results = _results(args, Path(args.dest))
    problems = sorted(dict.fromkeys(line for r in results for line in r.problems))
    failures = sorted(f for r in results for f in r.summary.failures)
    for line in problems + failures:
        print(f"not exported: {line}", file=sys.stderr)
    total = WalkSummary(files=sum(r.summary.files for r in results), written=sum(r.summary.written for r in results),
                        skipped=sum(r.summary.skipped for r in results), bytes=sum(r.summary.bytes for r in results),
                        dirs=max(r.summary.dirs for r in results))  # every part walks every directory
    print(f"exported {total.files:,} files ({total.written:,} written, {total.skipped:,} already complete, "
          f"{total.bytes / 2**20:,.1f} MiB) and {total.dirs:,} directories to {args.dest}"
          + (f"; {len(failures)} failed" if failures else ""))
    return 1 if failures or problems else 0


def run_tool(args: argparse.Namespace) -> int:
    # Problems are printed by the command itself; keep the log quiet.
    logging.basicConfig(level=logging.CRITICAL)
    if args.command == "check":
        return _check(args)
    if args.command == "export":
        return _export(args)
    return trio.run(_inspect, args)
