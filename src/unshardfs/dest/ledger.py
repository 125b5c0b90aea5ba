"""What an export records beneath DEST: its plan, the ledger of finished tasks, the manifest.

Everything lives in one reserved directory, `DEST/.unshardfs/` (inside DEST,
so nothing is written outside it and the record travels with the copy):

    plan.json              the source, its format options and the number of tasks, fixed
                           by the first run; `--resume` refuses a different source
    tasks.jsonl            what each task does (one JSON line per task, written before
                           plan.json): a resume runs the very same tasks
    tasks/NNNNNN.journal   one JSON line per file of task NNNNNN renamed into place, appended
                           as it happens (a killed task leaves it; `--resume` re-verifies
                           each line's file and writes only the others)
    tasks/NNNNNN.jsonl     the task's ledger entry: its file lines and a closing
                           {"task": N, "files": F, "bytes": B} line, renamed into place
                           once every file of the task is in place and flushed; its
                           presence is what "task complete" means
    manifest.jsonl         once every task is complete: a header line, then every file line
                           of every task, in task order

A file line: {"path", "size", "crc32c" (8 hex digits, the Castagnoli CRC of
the file's bytes), "mtime_ns", "source" (the shard or source file it came
from), "offset" and "length" (the stored byte range in that shard, absent
for files copied whole)}.
"""

from __future__ import annotations

import json
import re
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, TypeGuard

from unshardfs.dest.atomic import is_temp, stops
from unshardfs.dest.base import LEDGER_DIR, LINE_LIMIT, JournalLog, RecordStore, WriteStopped
from unshardfs.dest.opener import manifest_lines
from unshardfs.sources import RemoteOptions
from unshardfs.util.errors import ConfigError, DataError
from unshardfs.util.fields import MetadataError, load_json

PLAN = f"{LEDGER_DIR}/plan.json"
TASK_LIST = f"{LEDGER_DIR}/tasks.jsonl"
TASKS = f"{LEDGER_DIR}/tasks"
MANIFEST = f"{LEDGER_DIR}/manifest.jsonl"
MANIFEST_FORMAT = "unshardfs-manifest"
PLAN_FORMAT = "unshardfs-export"
VERSION = 1
_TASK_FILE = re.compile(r"^(\d{6})\.jsonl$")
# One ledger document (the plan, a line) read back is at most this big: the ledger is ours, but DEST
# is writable by others too.
_PLAN_LIMIT = 1 << 20
# What a record may state: sizes and offsets as the kernel's off_t, times as int64 nanoseconds,
# counts of files as a task could hold.
_INT64 = (1 << 63) - 1
_MAX_FILES = 1 << 40
_MAX_TASKS = 10**6 - 1
ENTRY_LINES = 4096  # file lines of a ledger entry (or the manifest) made and written at once
MANIFEST_READERS = 8  # ledger entries in object storage read at once while the manifest is gathered ...
MANIFEST_AHEAD = 1 << 19  # ... holding at most this many file lines between them (but always one entry)


def reserved(rel: str) -> bool:
    """Names export never takes from a source: the ledger's directory, and temporary names."""
    return rel == LEDGER_DIR or rel.startswith(LEDGER_DIR + "/") or is_temp(rel.rpartition("/")[2])


@dataclass(frozen=True)
class FileRecord:
    """One exported file as the manifest states it."""

    path: str
    size: int
    crc32c: int
    mtime_ns: int
    source: str = ""
    offset: int | None = None
    length: int | None = None

    def line(self) -> str:
        doc: dict[str, Any] = {"path": self.path, "size": self.size, "crc32c": f"{self.crc32c:08x}",
                               "mtime_ns": self.mtime_ns, "source": self.source}
        if self.offset is not None:
            doc["offset"], doc["length"] = self.offset, self.length
        return json.dumps(doc, separators=(",", ":")) + "\n"

    @classmethod
    def parse(cls, doc: Any) -> "FileRecord":
        """A record from a decoded line; ValueError for anything that is not one (a path that is no
        plain relative path, a size, time, offset or length out of range, a source that is no text)."""
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        path, size, crc, mtime = doc.get("path"), doc.get("size"), doc.get("crc32c"), doc.get("mtime_ns", 0)
        if not isinstance(path, str) or not path or path.startswith("/") or \
                any(part in ("", ".", "..") for part in path.split("/")) or "\0" in path:
            raise ValueError(f"bad path {path!r:.200}")
        if not _count(size, _INT64):
            raise ValueError(f"{path}: bad size")
        if not isinstance(crc, str) or not re.fullmatch(r"[0-9a-f]{8}", crc):
            raise ValueError(f"{path}: bad crc32c")
        if not isinstance(mtime, int) or isinstance(mtime, bool) or not -_INT64 <= mtime <= _INT64:
            raise ValueError(f"{path}: bad mtime_ns")
        offset, length = doc.get("offset"), doc.get("length")
        if (offset is None) != (length is None) or offset is not None and not (
                _count(offset, _INT64) and _count(length, _INT64)):
            raise ValueError(f"{path}: bad offset or length")
        source = doc.get("source", "")
        if not isinstance(source, str):
            raise ValueError(f"{path}: bad source")
        return cls(path, size, int(crc, 16), mtime, source, offset, length)


def _count(value: Any, most: int) -> TypeGuard[int]:
    """Whether `value` is an int (not a bool) in 0..most."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most


def source_of(xattrs: dict[str, bytes]) -> tuple[str, int | None, int | None]:
    """Where a file's bytes came from, from its extended attributes (shard and stored range)."""
    source = xattrs.get("user.unshardfs.source", b"").decode(errors="replace")
    offset, length = xattrs.get("user.unshardfs.offset"), xattrs.get("user.unshardfs.length")
    if offset is None or length is None:
        return source, None, None
    return source, int(offset), int(length)


@dataclass(frozen=True)
class Plan:
    """What an export into one DEST is: fixed by its first run, checked by every `--resume`."""

    source: str
    formats: dict[str, Any]
    tasks: int

    def doc(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, "version": VERSION, "source": self.source, "formats": self.formats,
                "tasks": self.tasks}


def task_file(task: int, suffix: str = "jsonl") -> str:
    return f"{TASKS}/{task:06d}.{suffix}"


@dataclass
class Journal:
    """The files of one task already in place: loaded from its journal, appended as files land."""

    records: RecordStore
    task: int
    known: dict[str, FileRecord] = field(default_factory=dict)
    done: dict[str, FileRecord] = field(default_factory=dict)  # this run's, in the order they landed
    log: JournalLog | None = None
    rerun: bool = False  # the task ran before (its journal was there): it may have left temporaries

    @classmethod
    def open(cls, records: RecordStore, task: int) -> "Journal":
        journal = cls(records, task)
        rel = task_file(task, "journal")
        for raw in records.journal_lines(rel):
            try:
                record = FileRecord.parse(_decode(raw))
            except ValueError:
                continue  # a line cut short by a kill: that file is simply written again
            journal.known[record.path] = record
        journal.log = records.journal(rel)
        journal.rerun = journal.log.rerun
        return journal

    def add(self, record: FileRecord) -> None:
        """Record a file in place."""
        self.done[record.path] = record
        assert self.log is not None
        self.log.append(record.line().encode())

    def keep(self, record: FileRecord) -> None:
        """A file found complete from an earlier run: part of this task's record, already journaled."""
        self.done[record.path] = record

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None


class Ledger:
    """The plan, the finished tasks and the manifest of an export, among DEST's records.

    Everything read back is untrusted (DEST is writable by others): a record
    that is not what this module writes is a one-line error naming it, never
    a crash, and no number it states is taken beyond what a record can mean.
    """

    def __init__(self, records: RecordStore) -> None:
        self.records = records

    def plan(self) -> Plan | None:
        try:
            raw = self.records.read_small(PLAN, _PLAN_LIMIT)
        except DataError as e:  # nothing has run yet: DEST is not one to export into
            raise ConfigError(f"{e.where} in DEST {e.reason}") from None
        if raw is None:
            return None
        try:
            doc = load_json(raw, PLAN)
            if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT or doc.get("version") != VERSION:
                raise ValueError("not an export plan of this version")
            tasks, source, formats = doc.get("tasks"), doc.get("source"), doc.get("formats")
            if not (_count(tasks, _MAX_TASKS) and tasks and isinstance(source, str) and isinstance(formats, dict)):
                raise ValueError("bad fields")
        except MetadataError as e:
            raise ConfigError(f"{PLAN} in DEST is not an unshardfs export plan ({e.reason})") from None
        except ValueError as e:
            raise ConfigError(f"{PLAN} in DEST is not an unshardfs export plan ({e})") from None
        return Plan(source, formats, tasks)

    def start(self, plan: Plan, tasks: Iterable[bytes] = ()) -> None:
        """Make the ledger's directories and write the task list, then the plan (before any task
        runs: the plan's presence means both are whole)."""
        rel = LEDGER_DIR
        try:
            for rel in (LEDGER_DIR, TASKS):
                self.records.make_dir(rel)
            rel = TASK_LIST
            self.records.replace(TASK_LIST, tasks)
            rel = PLAN
            self.records.replace(PLAN, [json.dumps(plan.doc(), indent=1).encode() + b"\n"])
        except WriteStopped:
            raise
        except (OSError, DataError) as e:
            if isinstance(e, OSError) and stops(e):
                raise WriteStopped(rel, e) from None
            why = e.strerror if isinstance(e, OSError) else e
            raise ConfigError(f"cannot write {rel} in DEST: {why}") from None

    def task_list(self) -> Iterator[bytes]:
        """The recorded task list's lines (streamed); ConfigError if the plan has none."""
        if not self.records.exists(TASK_LIST):
            raise ConfigError(f"DEST holds an export planned without a task list ({TASK_LIST}): "
                              "export into a new DEST")
        return self.records.lines(TASK_LIST)

    def complete(self) -> set[int]:
        """The tasks whose ledger entry is in place."""
        return {int(m.group(1)) for name in self.records.names(TASKS) if (m := _TASK_FILE.match(name))}

    def is_complete(self, task: int) -> bool:
        """Whether `task`'s ledger entry is in place (one stat, not a listing of every task's)."""
        return self.records.exists(task_file(task))

    def finish(self, journal: Journal) -> None:
        """Write the task's ledger entry (every file it holds), then drop its journal. The entry is
        made and written ENTRY_LINES lines at a time, never held whole."""
        records = journal.done
        closing = {"task": journal.task, "files": len(records), "bytes": sum(r.size for r in records.values())}
        journal.close()

        def pieces() -> Iterator[bytes]:
            batch: list[bytes] = []
            for record in records.values():
                batch.append(record.line().encode())
                if len(batch) >= ENTRY_LINES:
                    yield b"".join(batch)
                    batch = []
            batch.append(json.dumps(closing).encode() + b"\n")
            yield b"".join(batch)
        self.records.replace(task_file(journal.task), pieces())
        self.records.drop_journal(task_file(journal.task, "journal"))

    def task_totals(self, task: int) -> tuple[int, int]:
        """(files, bytes) of a complete task, from its closing line (the file's tail, not all of it)."""
        rel = task_file(task)
        try:
            tail = self.records.tail(rel, LINE_LIMIT)
            doc = _decode(tail.rstrip(b"\n").rpartition(b"\n")[2])
            files, size = doc.get("files"), doc.get("bytes")
            if doc.get("task") == task and _count(files, _MAX_FILES) and _count(size, _INT64):
                return files, size
        except (DataError, ValueError, AttributeError):
            pass
        raise DataError(rel, "ledger entry unreadable or without its closing line")

    def records_of(self, task: int) -> Iterator[FileRecord]:
        """The file lines of a complete task's ledger entry; DataError for a line that is none."""
        rel = task_file(task)
        for number, raw in enumerate(self.records.lines(rel), start=1):
            try:
                doc = _decode(raw)
                if isinstance(doc, dict) and "path" not in doc and doc.get("task") == task:
                    continue  # the closing line
                yield FileRecord.parse(doc)
            except ValueError as e:
                raise DataError(rel, f"line {number}: {e}") from None

    def has_manifest(self) -> bool:
        return self.records.exists(MANIFEST)

    def write_manifest(self, plan: Plan) -> tuple[int, int]:
        """Gather every task's file lines into the manifest (streamed); (files, bytes).

        In object storage each entry is a few requests away: up to MANIFEST_READERS entries
        (and MANIFEST_AHEAD file lines) are read at once, ahead of the writing, their closing
        lines first, so thousands of tasks cost their round trips in parallel, not one after
        another. In a directory the entries are streamed one after another."""
        readers = MANIFEST_READERS if self.records.remote else 1
        with ThreadPoolExecutor(readers, thread_name_prefix="unshardfs-manifest") as pool:
            totals = list(pool.map(self.task_totals, range(plan.tasks)))
            files, size = sum(f for f, _ in totals), sum(b for _, b in totals)
            header = {"format": MANIFEST_FORMAT, "version": VERSION, "source": plan.source, "files": files,
                      "bytes": size, "checksum": "crc32c"}

            def checked(task: int, lines: Iterable[bytes]) -> Iterator[bytes]:
                count = 0
                batch: list[bytes] = []
                for line in lines:
                    batch.append(line)
                    count += 1
                    if len(batch) >= ENTRY_LINES:
                        yield b"".join(batch)
                        batch = []
                if count != totals[task][0]:  # read back short (or grown): the manifest would lie
                    raise DataError(task_file(task), f"{count:,} file lines, its closing line counts {totals[task][0]:,}")
                yield b"".join(batch)

            def pieces() -> Iterator[bytes]:
                yield json.dumps(header).encode() + b"\n"
                if readers == 1:
                    for task in range(plan.tasks):
                        yield from checked(task, (record.line().encode() for record in self.records_of(task)))
                    return
                ahead: deque[tuple[int, Future[list[bytes]]]] = deque()
                held = 0  # file lines read ahead
                following = 0
                while following < plan.tasks or ahead:
                    while following < plan.tasks and len(ahead) < readers and \
                            (not ahead or held + totals[following][0] <= MANIFEST_AHEAD):
                        ahead.append((following, pool.submit(self._entry_lines, following)))
                        held += totals[following][0]
                        following += 1
                    task, entry = ahead.popleft()
                    held -= totals[task][0]
                    yield from checked(task, entry.result())
            self.records.replace(MANIFEST, pieces())
        return files, size

    def _entry_lines(self, task: int) -> list[bytes]:
        """A complete task's file lines, each checked and made again as a manifest line."""
        return [record.line().encode() for record in self.records_of(task)]


def _decode(raw: bytes) -> Any:
    """One record line (at most LINE_LIMIT bytes: a longer one comes cut) decoded; ValueError for
    anything that is not JSON, nesting too deep for the parser included."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deep") from None


def read_manifest(path: str, remote: RemoteOptions | None = None) -> tuple[dict[str, Any], Iterator[FileRecord]]:
    """A manifest's header and its file lines (streamed); ConfigError for one that is not one."""
    lines = manifest_lines(path, remote)
    try:
        header = _decode(next(lines, b""))
        if not isinstance(header, dict) or header.get("format") != MANIFEST_FORMAT:
            raise ValueError("no manifest header")
    except ValueError as e:
        lines.close()
        raise ConfigError(f"manifest {path} is not an unshardfs manifest ({e})") from None

    def records() -> Iterator[FileRecord]:
        for number, raw in enumerate(lines, start=2):
            try:
                yield FileRecord.parse(_decode(raw))
            except ValueError as e:
                raise ConfigError(f"manifest {path} line {number}: {e}") from None
    return header, records()
