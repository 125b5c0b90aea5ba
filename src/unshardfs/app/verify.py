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
import os
import stat as statmod
import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from unshardfs.tools.atomic import is_temp, measure
from unshardfs.tools.ledger import LEDGER_DIR, FileRecord, read_manifest
from unshardfs.util.errors import ConfigError
from unshardfs.util.fdpath import Beneath

BATCH = 512  # files per task: large enough that a task's overhead is small beside reading its files


@dataclass
class Verdict:
    """What one batch of files found: the lines to print and the counts."""

    lines: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    missing: int = 0
    differing: int = 0


def verify_batch(dest: str, records: list[FileRecord]) -> Verdict:
    """Compare each record's file beneath `dest` with the record (runs in a thread or a Dask worker)."""
    out = Beneath(dest, links=False)
    verdict = Verdict()
    try:
        for record in records:
            found = measure(out, record.path)
            verdict.files += 1
            if found.problem == "missing":
                verdict.missing += 1
                verdict.lines.append(f"missing: {record.path}")
            elif found.problem is not None:
                verdict.differing += 1
                verdict.lines.append(f"differs: {record.path}: {found.problem}")
            elif found.size != record.size:
                verdict.differing += 1
                verdict.lines.append(f"differs: {record.path}: {found.size:,} bytes, the manifest says {record.size:,}")
            elif found.crc32c != record.crc32c:
                verdict.differing += 1
                verdict.lines.append(f"differs: {record.path}: crc32c {found.crc32c:08x}, "
                                     f"the manifest says {record.crc32c:08x}")
            else:
                verdict.bytes += found.size
    finally:
        out.close()
    return verdict


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


def extras(out: Beneath, names: set[str], rel: str = "") -> Iterator[str]:
    """Entries beneath DEST the manifest does not name (the ledger's own directory aside)."""
    fd = out.open(rel, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as entries:
            listed = sorted((e.name, e.is_dir(follow_symlinks=False), e.is_symlink()) for e in entries)
    finally:
        os.close(fd)
    for name, is_dir, is_link in listed:
        child = f"{rel}/{name}" if rel else name
        if child == LEDGER_DIR:
            continue
        if is_dir:
            yield from extras(out, names, child)
        elif child not in names:
            kind = " (a symlink)" if is_link else " (a leftover temporary: run export --resume)" if is_temp(name) else ""
            yield f"{child}{kind}"


def _windowed(submit: Callable[[list[FileRecord]], Any], result: Callable[[Any], Verdict],
              work: Iterator[list[FileRecord]], window: int, each: Callable[[Verdict], None]) -> None:
    """Keep at most `window` batches in flight (the manifest is streamed, never held whole)."""
    flight: deque[Any] = deque()
    for batch in work:
        flight.append(submit(batch))
        if len(flight) >= window:
            each(result(flight.popleft()))
    while flight:
        each(result(flight.popleft()))


def verify_copy(args: argparse.Namespace) -> int:
    dest = args.source
    header, records = read_manifest(args.manifest)
    try:
        out = Beneath(dest, links=False)
    except OSError as e:
        raise ConfigError(f"DEST {dest}: {e.strerror}") from None
    if not statmod.S_ISDIR(os.fstat(out.fd).st_mode):
        out.close()
        raise ConfigError(f"DEST {dest} is not a directory")
    names: set[str] = set()
    total = Verdict()

    def each(verdict: Verdict) -> None:
        for line in verdict.lines:
            print(line)
        total.files += verdict.files
        total.bytes += verdict.bytes
        total.missing += verdict.missing
        total.differing += verdict.differing

    work = batches(records, names)
    if args.scheduler is not None:
        from unshardfs.app.cluster import close_client, open_client

        client = open_client(args.scheduler, args.debug, args.quiet)
        try:
            threads = max(1, sum(client.nthreads().values()))
            _windowed(lambda b: client.submit(verify_batch, str(Path(dest).resolve()), b, pure=False),
                      lambda f: f.result(), work, 4 * threads, each)
        finally:
            close_client(client)
    else:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            def submit(batch: list[FileRecord]) -> Future[Verdict]:
                return pool.submit(verify_batch, dest, batch)
            _windowed(submit, lambda f: f.result(), work, 4 * max(1, args.jobs), each)
    extra = 0
    for line in extras(out, names):
        print(f"extra: {line}")
        extra += 1
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
