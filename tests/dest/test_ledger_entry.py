"""A task's ledger entry is written a bounded piece at a time, however many files the task holds; the
manifest gathers entries in object storage several at once."""

from __future__ import annotations

import threading
import tracemalloc
from typing import Any, Iterable

from unshardfs.dest.base import RecordStore
from unshardfs.dest.ledger import MANIFEST_READERS, FileRecord, Journal, Ledger, Plan
from unshardfs.dest.opener import open_dest

FILES = 100_000


class Measuring:
    """Records that note the largest piece they are handed to write."""

    def __init__(self, inner: RecordStore) -> None:
        self.inner = inner
        self.largest = 0

    def replace(self, rel: str, pieces: Iterable[bytes]) -> None:
        def seen() -> Iterable[bytes]:
            for piece in pieces:
                self.largest = max(self.largest, len(piece))
                yield piece
        self.inner.replace(rel, seen())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_finishing_a_task_of_many_files_holds_a_bounded_part_of_its_entry(tmp_path):
    out = open_dest(str(tmp_path / "out"), sync=False)
    try:
        Ledger(out.records).start(Plan("src", {}, 1))
        journal = Journal.open(out.records, 0)
        for i in range(FILES):
            journal.add(FileRecord(f"1_1_1/{i}-{i + 1}_0-64_0-64", 4096, i, 1795751084341673249, "1_1_1/0.shard",
                                   64 + 4096 * i, 4096))
        measured = Measuring(out.records)
        ledger = Ledger(measured)  # type: ignore[arg-type]  (the records, measured)
        tracemalloc.start()
        try:
            ledger.finish(journal)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        entry = (tmp_path / "out" / ".unshardfs" / "tasks" / "000000.jsonl").stat().st_size
        assert entry > 10 << 20  # an entry of over 10 MiB ...
        assert measured.largest < 1 << 20 and peak < 4 << 20, (measured.largest, peak)  # ... never held whole
        assert Ledger(out.records).task_totals(0) == (FILES, 4096 * FILES)
        assert sum(1 for _ in Ledger(out.records).records_of(0)) == FILES
        assert Ledger(out.records).is_complete(0) and not (tmp_path / "out" / ".unshardfs" / "tasks" / "000000.journal").exists()
    finally:
        out.close()


class Remote:
    """Records that stand for object storage: reading a ledger entry waits until MANIFEST_READERS
    reads are in flight at once (a barrier: a manifest gathered one entry after another would wait
    in vain, and the test fail after its timeout)."""

    remote = True

    def __init__(self, inner: RecordStore) -> None:
        self.inner = inner
        self.together = threading.Barrier(MANIFEST_READERS, timeout=30)

    def lines(self, rel: str) -> Iterable[bytes]:
        if rel.endswith(".jsonl") and "/tasks/" in rel:
            self.together.wait()
        return self.inner.lines(rel)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_manifest_reads_entries_in_object_storage_together(tmp_path):
    """Thousands of entries in a bucket are each a few requests away: they are read several at once,
    and the manifest is the same as one gathered from a directory, entry after entry."""
    tasks = 2 * MANIFEST_READERS
    out = open_dest(str(tmp_path / "out"), sync=False)
    try:
        plan = Plan("src", {}, tasks)
        Ledger(out.records).start(plan)
        for task in range(tasks):
            journal = Journal.open(out.records, task)
            for i in range(task + 1):
                journal.add(FileRecord(f"d/{task}-{i}", 10 * i, i, 0, "d/s.shard", 64, 10 * i))
            Ledger(out.records).finish(journal)
        manifest = tmp_path / "out" / ".unshardfs" / "manifest.jsonl"
        assert Ledger(out.records).write_manifest(plan) == (tasks * (tasks + 1) // 2, sum(
            10 * i for task in range(tasks) for i in range(task + 1)))
        alone = manifest.read_bytes()
        manifest.unlink()
        assert Ledger(Remote(out.records)).write_manifest(plan)[0] == tasks * (tasks + 1) // 2
        assert manifest.read_bytes() == alone
    finally:
        out.close()
