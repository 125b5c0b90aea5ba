"""`unshardfs check --manifest MANIFEST DEST`: a copy verified against the manifest its export wrote.

Every file the manifest names is read back from DEST (no link followed,
nothing that blocks opened) and its size and crc32c compared; batches of
files go to threads here, or to the Dask cluster with `--scheduler` (every
worker must see DEST). Then DEST is listed for files the manifest does not
name. One line per difference (`missing:`, `differs:`, `extra:`) and a
summary; exit status 0 when the copy matches.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from unshardfs.app.options import open_options
from unshardfs.dest.base import Dest, FileSink
from unshardfs.dest.ledger import FileRecord, read_manifest
from unshardfs.dest.opener import is_object_url, local_path, open_dest
from unshardfs.sources import RemoteOptions
from unshardfs.util.errors import ConfigError, one_line

BATCH = 512  # files per task: large enough that a task's overhead is small beside reading its files


@dataclass
class Findings:
    """What one batch of files found: the lines to print and the counts."""

    lines: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    missing: int = 0
    differing: int = 0


def verify_batch(dest: str, records: list[FileRecord], remote: RemoteOptions | None = None) -> Findings:
    """Compare each record's file in `dest` with the record, on a Dask worker: DEST opened there
    (with the worker's own credentials) for the batch, and closed after it."""
    out = open_dest(dest, remote, create=False)
    try:
        return compare(out.files, records)
    finally:
        out.close()


def compare(files: FileSink, records: list[FileRecord]) -> Findings:
    """Compare each record's file in DEST with the record (runs in a thread or a Dask worker)."""
    findings = Findings()
    for record in records:
        found = files.measure(record.path)
        findings.files += 1
        if found.missing:
            findings.missing += 1
            findings.lines.append(f"missing: {record.path}")
        elif found.problem is not None:
            findings.differing += 1
            findings.lines.append(f"differs: {record.path}: {found.problem}")
        elif found.size != record.size:
            findings.differing += 1
            findings.lines.append(f"differs: {record.path}: {found.size:,} bytes, the manifest says {record.size:,}")
        elif found.crc32c != record.crc32c:
            findings.differing += 1
            findings.lines.append(f"differs: {record.path}: crc32c {found.crc32c:08x}, "
                                  f"the manifest says {record.crc32c:08x}")
        else:
            findings.bytes += found.size
    return findings


def batches(records: Iterable[FileRecord], names: set[str]) -> Iterator[list[FileRecord]]:
    """The records in batches; every path is added to `names` (for the search for extra files)."""
    batch: list[FileRecord] = []
    for record in records:
        if record.path in names:
            raise ConfigError(f"the manifest names {record.path} twice")
        names.add(record.path)
        batch.append(record)
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _windowed(submit: Callable[[list[FileRecord]], Any], result: Callable[[Any], Findings],
              work: Iterator[list[FileRecord]], window: int, each: Callable[[Findings], None]) -> None:
    """Keep at most `window` batches in flight (the manifest is streamed, never held whole)."""
    flight: deque[Any] = deque()
    for batch in work:
        flight.append(submit(batch))
        if len(flight) >= window:
            each(result(flight.popleft()))
    while flight:
        each(result(flight.popleft()))


def _compare_all(args: argparse.Namespace, out: Dest, dest: str, records: Iterator[FileRecord],
                 remote: RemoteOptions) -> tuple[Findings, int]:
    """Every record compared (in threads here, or on the Dask cluster), then DEST listed for what
    the manifest does not name; the totals and the number of extra files."""
    names: set[str] = set()
    total = Findings()

    def each(findings: Findings) -> None:
        for line in findings.lines:
            print(one_line(line))
        total.files += findings.files
        total.bytes += findings.bytes
        total.missing += findings.missing
        total.differing += findings.differing

    work = batches(records, names)
    where = dest if is_object_url(dest) else str(Path(dest).resolve())
    if args.scheduler is not None:
        from unshardfs.app.cluster import close_client, open_client

        client = open_client(args.scheduler, args.debug, args.quiet)
        try:
            threads = max(1, sum(client.nthreads().values()))
            _windowed(lambda b: client.submit(verify_batch, where, b, remote, pure=False),
                      lambda f: f.result(), work, 4 * threads, each)
        finally:
            close_client(client)
    else:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            def submit(batch: list[FileRecord]) -> Future[Findings]:
                return pool.submit(compare, out.files, batch)
            _windowed(submit, lambda f: f.result(), work, 4 * max(1, args.jobs), each)
    extra = 0
    for path, note in out.files.files():
        if path not in names:
            print(one_line(f"extra: {path}{note}"))
            extra += 1
    return total, extra


def verify_copy(args: argparse.Namespace) -> int:
    remote = open_options(args).remote
    dest = args.source if is_object_url(args.source) else local_path(args.source)
    header, records = read_manifest(args.manifest, remote)
    out = open_dest(dest, remote, create=False)
    try:
        total, extra = _compare_all(args, out, dest, records, remote)
    finally:
        out.close()
    expected = header.get("files")
    if isinstance(expected, int) and expected != total.files:
        print(f"unshardfs: the manifest's header counts {expected:,} files but lists {total.files:,}", file=sys.stderr)
        return 1
    bad = total.missing + total.differing + extra
    state = "matches its manifest" if not bad else "DIFFERS from its manifest"
    print(f"{dest} {state}: {total.files:,} files checked, {total.bytes:,} bytes verified; {total.missing:,} missing, "
          f"{total.differing:,} differing, {extra:,} extra")
    return 1 if bad else 0
