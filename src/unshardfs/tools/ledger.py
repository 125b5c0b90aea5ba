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
from typing import Any, Generator, Iterable, Iterator

from unshardfs.sources import RemoteOptions
from unshardfs.tools.atomic import WriteStopped, is_temp, stops
from unshardfs.tools.dest import LEDGER_DIR, LINE_LIMIT, Dest, JournalLog, is_object_url, split_lines
from unshardfs.util.errors import ConfigError, DataError
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
_LINE_LIMIT = LINE_LIMIT
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
        """A record from a decoded line; ValueError for anything that is not one."""
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        path, size, crc, mtime = doc.get("path"), doc.get("size"), doc.get("crc32c"), doc.get("mtime_ns", 0)
        if not isinstance(path, str) or not path or path.startswith("/") or \
                any(part in ("", ".", "..") for part in path.split("/")) or "\0" in path:
            raise ValueError(f"bad path {path!r:.200}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"{path}: bad size")
        if not isinstance(crc, str) or not re.fullmatch(r"[0-9a-f]{8}", crc):
            raise ValueError(f"{path}: bad crc32c")
        if not isinstance(mtime, int) or isinstance(mtime, bool):
            raise ValueError(f"{path}: bad mtime_ns")
        offset, length = doc.get("offset"), doc.get("length")
        source = doc.get("source", "")
        return cls(path, size, int(crc, 16), mtime, source if isinstance(source, str) else "",
                   offset if isinstance(offset, int) else None, length if isinstance(length, int) else None)


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

    dest: Dest
    task: int
    known: dict[str, FileRecord] = field(default_factory=dict)
    done: dict[str, FileRecord] = field(default_factory=dict)  # this run's, in the order they landed
    log: JournalLog | None = None
    rerun: bool = False  # the task ran before (its journal was there): it may have left temporaries

    @classmethod
    def open(cls, dest: Dest, task: int) -> "Journal":
        journal = cls(dest, task)
        rel = task_file(task, "journal")
        for raw in dest.journal_lines(rel):
            try:
                record = FileRecord.parse(json.loads(raw))
            except ValueError:
                continue  # a line cut short by a kill: that file is simply written again
            journal.known[record.path] = record
        journal.log = dest.journal(rel)
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
    """The plan, the finished tasks and the manifest of an export, beneath DEST."""

    def __init__(self, dest: Dest) -> None:
        self.dest = dest

    def plan(self) -> Plan | None:
        raw = self.dest.read_small(PLAN, _PLAN_LIMIT)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            if doc.get("format") != PLAN_FORMAT or doc.get("version") != VERSION:
                raise ValueError("not an export plan of this version")
            tasks, source, formats = doc["tasks"], doc["source"], doc["formats"]
            if not (isinstance(tasks, int) and 0 < tasks < 10**6 and isinstance(source, str)
                    and isinstance(formats, dict)):
                raise ValueError("bad fields")
        except (ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"{PLAN} in DEST is not an unshardfs export plan ({e})") from None
        return Plan(source, formats, tasks)

    def start(self, plan: Plan, tasks: Iterable[bytes] = ()) -> None:
        """Make the ledger's directories and write the task list, then the plan (before any task
        runs: the plan's presence means both are whole)."""
        rel = LEDGER_DIR
        try:
            for rel in (LEDGER_DIR, TASKS):
                self.dest.make_dir(rel)
            rel = TASK_LIST
            self.dest.write(TASK_LIST, tasks, create=False)
            rel = PLAN
            self.dest.write(PLAN, [json.dumps(plan.doc(), indent=1).encode() + b"\n"], create=False)
        except WriteStopped:
            raise
        except (OSError, DataError) as e:
            if isinstance(e, OSError) and stops(e):
                raise WriteStopped(rel, e) from None
            why = e.strerror if isinstance(e, OSError) else e
            raise ConfigError(f"cannot write {rel} in DEST: {why}") from None

    def task_list(self) -> Iterator[bytes]:
        """The recorded task list's lines (streamed); ConfigError if the plan has none."""
        if not self.dest.exists(TASK_LIST):
            raise ConfigError(f"DEST holds an export planned without a task list ({TASK_LIST}): "
                              "export into a new DEST")
        return self.dest.lines(TASK_LIST)

    def complete(self) -> set[int]:
        """The tasks whose ledger entry is in place."""
        return {int(m.group(1)) for name in self.dest.names(TASKS) if (m := _TASK_FILE.match(name))}

    def is_complete(self, task: int) -> bool:
        """Whether `task`'s ledger entry is in place (one stat, not a listing of every task's)."""
        return self.dest.exists(task_file(task))

    def finish(self, journal: Journal, sync: bool = True) -> None:
        """Write the task's ledger entry (every file it holds, flushed first), then drop its journal.
        The entry is made and written ENTRY_LINES lines at a time, never held whole."""
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
        self.dest.write(task_file(journal.task), pieces(), sync=sync, task=journal.task, create=False)
        self.dest.drop_journal(task_file(journal.task, "journal"))

    def task_totals(self, task: int) -> tuple[int, int]:
        """(files, bytes) of a complete task, from its closing line (the file's tail, not all of it)."""
        rel = task_file(task)
        try:
            tail = self.dest.tail(rel, _LINE_LIMIT)
            doc = json.loads(tail.rstrip(b"\n").rpartition(b"\n")[2])
            return int(doc["files"]), int(doc["bytes"])
        except (OSError, DataError, ValueError, KeyError, TypeError):
            raise DataError(rel, "ledger entry unreadable or without its closing line") from None

    def records(self, task: int) -> Iterator[FileRecord]:
        for raw in self.dest.lines(task_file(task)):
            doc = json.loads(raw)
            if "path" in doc:
                yield FileRecord.parse(doc)

    def has_manifest(self) -> bool:
        return self.dest.exists(MANIFEST)

    def write_manifest(self, plan: Plan, sync: bool = True) -> tuple[int, int]:
        """Gather every task's file lines into the manifest (streamed); (files, bytes).

        In object storage each entry is a few requests away: up to MANIFEST_READERS entries
        (and MANIFEST_AHEAD file lines) are read at once, ahead of the writing, their closing
        lines first, so thousands of tasks cost their round trips in parallel, not one after
        another. In a directory the entries are streamed one after another."""
        readers = MANIFEST_READERS if self.dest.remote else 1
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
                        yield from checked(task, (record.line().encode() for record in self.records(task)))
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
            self.dest.write(MANIFEST, pieces(), sync=sync, create=False)
        return files, size

    def _entry_lines(self, task: int) -> list[bytes]:
        """A complete task's file lines, each checked and made again as a manifest line."""
        return [record.line().encode() for record in self.records(task)]


def _manifest_lines(path: str, remote: RemoteOptions | None) -> Generator[bytes, None, None]:
    """The lines of a manifest in a file or an object (s3://, gs://), streamed."""
    if is_object_url(path):
        from unshardfs.sources.objectsink import StoreError, open_store
        from unshardfs.tools.objectdest import sink_options

        parent, _, name = path.rstrip("/").rpartition("/")
        if "://" not in parent or not name:
            raise ConfigError(f"manifest {path}: not the URL of an object")
        store = open_store(parent, sink_options(path.partition("://")[0].lower(), remote or RemoteOptions()))
        try:
            there = store.head(name)
            if there is None:
                raise ConfigError(f"manifest {path}: no such object")
            yield from split_lines(store.read(name, there.size))
        except StoreError as e:
            raise ConfigError(f"manifest {path}: {e}") from None
        finally:
            store.close()
        return
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ConfigError(f"manifest {path}: {e.strerror}") from None
    with f:
        yield from iter(lambda: f.readline(_LINE_LIMIT), b"")


def read_manifest(path: str, remote: RemoteOptions | None = None) -> tuple[dict[str, Any], Iterator[FileRecord]]:
    """A manifest's header and its file lines (streamed); ConfigError for one that is not one."""
    lines = _manifest_lines(path, remote)
    try:
        header = json.loads(next(lines, b""))
        if not isinstance(header, dict) or header.get("format") != MANIFEST_FORMAT:
            raise ValueError("no manifest header")
    except ValueError as e:
        lines.close()
        raise ConfigError(f"manifest {path} is not an unshardfs manifest ({e})") from None

    def records() -> Iterator[FileRecord]:
        for number, raw in enumerate(lines, start=2):
            try:
                yield FileRecord.parse(json.loads(raw))
            except ValueError as e:
                raise ConfigError(f"manifest {path} line {number}: {e}") from None
    return header, records()
