"""A task's ledger entry is written a bounded piece at a time, however many files the task holds."""

from __future__ import annotations

import tracemalloc
from typing import Any, Iterable

from unshardfs.tools.dest import Dest, open_dest
from unshardfs.tools.ledger import FileRecord, Journal, Ledger, Plan

FILES = 100_000


class Measured:
    """A DEST that notes the largest piece it is handed to write."""

    def __init__(self, inner: Dest) -> None:
        self.inner = inner
        self.largest = 0

    def write(self, rel: str, pieces: Iterable[bytes], *args: Any, **kwargs: Any) -> bool:
        def seen() -> Iterable[bytes]:
            for piece in pieces:
                self.largest = max(self.largest, len(piece))
                yield piece
        return self.inner.write(rel, seen(), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_finishing_a_task_of_many_files_holds_a_bounded_part_of_its_entry(tmp_path):
    out = open_dest(str(tmp_path / "out"))
    try:
        Ledger(out).start(Plan("src", {}, 1))
        journal = Journal.open(out, 0)
        for i in range(FILES):
            journal.add(FileRecord(f"1_1_1/{i}-{i + 1}_0-64_0-64", 4096, i, 1795751084341673249, "1_1_1/0.shard",
                                   64 + 4096 * i, 4096))
        measured = Measured(out)
        ledger = Ledger(measured)
        tracemalloc.start()
        try:
            ledger.finish(journal, sync=False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        entry = (tmp_path / "out" / ".unshardfs" / "tasks" / "000000.jsonl").stat().st_size
        assert entry > 10 << 20  # an entry of over 10 MiB ...
        assert measured.largest < 1 << 20 and peak < 4 << 20, (measured.largest, peak)  # ... never held whole
        assert Ledger(out).task_totals(0) == (FILES, 4096 * FILES)
        assert sum(1 for _ in Ledger(out).records(0)) == FILES
        assert Ledger(out).is_complete(0) and not (tmp_path / "out" / ".unshardfs" / "tasks" / "000000.journal").exists()
    finally:
        out.close()
