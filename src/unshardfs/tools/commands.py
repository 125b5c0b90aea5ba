"""The offline commands behind `unshardfs inspect | check | export`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import trio
from tqdm import tqdm

from ..caches import Caches
from ..formats.precomputed import open_dataset
from ..logonce import collect_problems
from ..sources import CountingSource, open_source
from .inspect import format_report, inspect_part
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
    dataset, _tree = await open_dataset(open_source(args.source), Caches())
    reports = []
    with _bar(args, "chunk") as bar:
        for part in dataset.sharded:
            bar.set_description(part.key)
            reports.append(await inspect_part(part, bar.update))
    print(json.dumps(reports, indent=2) if args.json else format_report(reports, args.source))
    return 0


async def _check(args: argparse.Namespace) -> int:
    source = CountingSource(open_source(args.source))
    _dataset, tree = await open_dataset(source, Caches())
    with collect_problems() as problems, _bar(args, "file") as bar:
        summary = await check(tree, _progress(bar))
    for line in problems:
        print(f"damaged: {line}")
    listed = set(problems)
    for line in summary.failures:
        if line.split(": ", 1)[1] not in listed:
            print(f"damaged: {line}")
    damaged = bool(problems or summary.failures)
    print(f"{'DAMAGED' if damaged else 'intact'}: {summary.files:,} files, {summary.bytes:,} bytes read through "
          f"{source.counters.reads:,} backing reads; {len(problems) + len(summary.failures)} problem(s)")
    return 1 if damaged else 0


async def _export(args: argparse.Namespace) -> int:
    _dataset, tree = await open_dataset(open_source(args.source), Caches())
    with collect_problems() as problems, _bar(args, "file") as bar:
        summary = await export(tree, Path(args.dest), args.jobs, _progress(bar))
    for line in problems + summary.failures:
        print(f"not exported: {line}", file=sys.stderr)
    print(f"exported {summary.files:,} files ({summary.written:,} written, {summary.skipped:,} already complete, "
          f"{summary.bytes / 2**20:,.1f} MiB) and {summary.dirs:,} directories to {args.dest}"
          + (f"; {len(summary.failures)} failed" if summary.failures else ""))
    return 1 if summary.failures or problems else 0


def run_tool(args: argparse.Namespace) -> int:
    # Problems are printed by the command itself; keep the log quiet.
    logging.basicConfig(level=logging.CRITICAL)
    command = {"inspect": _inspect, "check": _check, "export": _export}[args.command]
    return trio.run(command, args)
