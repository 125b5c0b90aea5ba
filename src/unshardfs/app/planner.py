"""The plan of a split `check` or `export`: its tasks, made once by the client.

Planning walks SOURCE's tree once with chunk listings switched to recording
(`core.runtime.ShardScope`): every directory is listed once, every sharded
directory's shards are enumerated by its store (one listing of the
directory, or the probes a source that cannot list needs) and no shard
index is read. The shards are then dealt, in listing order, into tasks of at
most `shards_per_task` shards; the files with no shard (metadata, unsharded
data) and the directories go, in walk order, into their own tasks of at most
TASK_FILES entries and TASK_BYTES bytes.

A task (`TaskWork`) names its work, so a worker goes straight to it: the
directories and files by path (a lookup per path component, no listing),
and the chunk files of its shards through the chunk listing of their
directory, told which shards to read (their indexes only, then their
chunks, in shard order, through the mount's coalesced, bounded fetcher).
No task lists what another task reads, and no task lists a directory.
"""

from __future__ import annotations

import json
import logging
import math
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Hashable, Iterable, cast

import trio

from unshardfs.app.opened import OpenedSource, OpenOptions
from unshardfs.app.timeline import source_requests
from unshardfs.core.runtime import ShardScope
from unshardfs.sources.base import ByteSource, ObjectStat, SourceLayer, name_problem
from unshardfs.dest.ledger import reserved
from unshardfs.tools.walk import unlisted
from unshardfs.tree.namespaced import inner_dir
from unshardfs.tree.nodes import Closable, DirNode, FileNode, Node
from unshardfs.tree.overlay import OverlayDir
from unshardfs.util.errors import ConfigError
from unshardfs.util.logonce import collect_problems, log_once
from unshardfs.util.waits import Waits, now

log = logging.getLogger(__name__)

# Files held in a shard carry their chunk id (passthrough files only their source path).
CHUNK_XATTR = "user.unshardfs.chunk_id"

TASK_SHARDS_MAX = 16  # shards in one task unless --parts asks for fewer, bigger tasks
TASK_SHARDS_LIMIT = 1024  # ... whatever --parts asks (a task's line in the task list stays within a ledger line)
TASKS_PER_THREAD = 4  # below that many shards per task, enough tasks to keep every worker thread busy ...
TASK_MIN_BYTES = 256 << 20  # ... where shard sizes are known: while each task keeps this many bytes
TASK_MAX_BYTES = 16 << 30  # ... and holds at most this many (unless one shard is bigger)
FOLD_FILES = 256  # files with no shard (and directories) that go with the last task of shards ...
FOLD_BYTES = 4 << 20  # ... of at most this many bytes, instead of a task of their own
TASK_FILES = 4096  # directories and files with no shard in one task
TASK_BYTES = 1 << 30  # ... and their bytes (a bigger file is a task of its own)
TASK_NAMES = 48 << 10  # ... and the length of their paths (a task's line in the task list stays within a ledger line)


@dataclass(frozen=True)
class ShardGroup:
    """Shards of one store, read through the chunk listing of the directory `dir` (a tree path)."""

    dir: str
    store: str
    shards: tuple[Hashable, ...]


@dataclass(frozen=True)
class TaskWork:
    """What one task does: the directories to make and the files with no shard to copy (by path),
    and the chunk files of its shard groups."""

    dirs: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    groups: tuple[ShardGroup, ...] = ()
    format: str | None = None  # the format planning found (a task detects nothing)

    @property
    def shards(self) -> int:
        return sum(len(g.shards) for g in self.groups)

    def directories(self) -> set[str]:
        """Every directory the task goes through by path (those above its files and groups too)."""
        found: set[str] = set()
        for rel in (*self.dirs, *(f.rpartition("/")[0] for f in self.files), *(g.dir for g in self.groups)):
            while rel and rel not in found:
                found.add(rel)
                rel = rel.rpartition("/")[0]
        return found

    def doc(self, task: int) -> dict[str, Any]:
        doc: dict[str, Any] = {"task": task}
        if self.format is not None:
            doc["format"] = self.format
        if self.dirs:
            doc["dirs"] = list(self.dirs)
        if self.files:
            doc["files"] = list(self.files)
        if self.groups:
            doc["groups"] = [{"dir": g.dir, "store": g.store, "shards": [_json_shard(s) for s in g.shards]}
                             for g in self.groups]
        return doc

    @classmethod
    def parse(cls, doc: Any) -> "TaskWork":
        """A task from its decoded line; ValueError for anything that is not one."""
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        groups = doc.get("groups", [])
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ValueError("bad groups")
        named = doc.get("format")
        if named is not None and not (isinstance(named, str) and named.isidentifier()):
            raise ValueError("bad format")
        return cls(_paths(doc.get("dirs", [])), _paths(doc.get("files", [])),
                   tuple(ShardGroup(_path(g.get("dir"), empty=True), _label(g.get("store")), _shards(g.get("shards")))
                         for g in groups), named)


def _json_shard(shard: Hashable) -> Any:
    return [_json_shard(s) for s in shard] if isinstance(shard, tuple) else shard


def _shard(value: Any) -> Hashable:
    """A shard handle back from JSON: ints, strings and tuples of them (what `shard_token` names)."""
    if isinstance(value, list):
        return tuple(_shard(v) for v in value)
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        return value
    raise ValueError(f"bad shard {value!r:.100}")


def _shards(value: Any) -> tuple[Hashable, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("bad shards")
    return tuple(_shard(v) for v in value)


def _label(value: Any) -> str:
    if not isinstance(value, str) or "\0" in value:
        raise ValueError("bad store label")
    return value


def _path(value: Any, empty: bool = False) -> str:
    """A relative tree path as a plan names it: never absolute, never `..`, `.` or an empty segment."""
    if not isinstance(value, str):
        raise ValueError(f"bad path {value!r:.200}")
    if value == "" and empty:
        return value
    if any(name_problem(part) for part in value.split("/")):
        raise ValueError(f"bad path {value!r:.200}")
    return value


def _paths(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError("bad path list")
    return tuple(_path(v) for v in value)


def task_lines(works: list[TaskWork]) -> Iterable[bytes]:
    """The plan's tasks as JSON lines (what `parse_tasks` reads back)."""
    for task, work in enumerate(works):
        yield json.dumps(work.doc(task), separators=(",", ":")).encode() + b"\n"


def parse_tasks(lines: Iterable[bytes], where: str, most: int) -> list[TaskWork]:
    """The `most` tasks of a recorded plan, numbered 0, 1, ... in order; ConfigError for anything
    else (DEST may be written by others)."""
    works: list[TaskWork] = []
    for number, raw in enumerate(lines, start=1):
        if number > most:
            raise ConfigError(f"{where} in DEST holds more tasks than its plan ({most:,})")
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("task") != len(works):
                raise ValueError("tasks out of order")
            works.append(TaskWork.parse(doc))
        except ValueError as e:
            raise ConfigError(f"{where} in DEST line {number} is not an unshardfs task ({e})") from None
    return works


# -- planning ------------------------------------------------------------------------------


@dataclass
class Survey:
    """What planning found: directories and files with no shard in walk order (size None: a
    directory), and the shards every directory's chunk listing reads."""

    entries: list[tuple[str, int | None]] = field(default_factory=list)
    shards: list[tuple[str, str, Hashable]] = field(default_factory=list)
    sizes: list[int | None] = field(default_factory=list)  # each shard's bytes, where finding it told them

    @property
    def dirs(self) -> int:
        return sum(size is None for _, size in self.entries)

    def shard_bytes(self) -> list[int] | None:
        """Every shard's bytes, or None unless all are known."""
        if len(self.sizes) != len(self.shards) or any(size is None for size in self.sizes):
            return None
        return cast(list[int], self.sizes)


async def survey(root: DirNode, scope: ShardScope, skip_reserved: bool) -> Survey:
    """Walk the tree with `scope` recording (no shard index read); export skips its own records
    (`skip_reserved`)."""
    found = Survey()
    await _survey(root, "", scope, found, skip_reserved)
    found.shards, found.sizes = scope.recorded, scope.sizes
    return found


async def _survey(node: DirNode, rel: str, scope: ShardScope, found: Survey, skip_reserved: bool) -> None:
    listing = node.entries().__aiter__()
    prefix = f"{rel}/" if rel else ""
    try:
        while True:
            scope.where = rel  # what the listing records shards under (a child's walk moved it)
            try:
                batch = await listing.__anext__()
            except StopAsyncIteration:
                return
            except Exception as e:  # a directory that cannot be listed: a problem, not an empty one
                unlisted(rel, e)
                return
            for name, child in batch:
                problem = name_problem(name)
                if problem is not None:
                    log_once(log, f"walk:{rel}:{problem}", "%s: skipping %s", rel or ".", problem)
                    continue
                path = prefix + name
                if skip_reserved and reserved(path):
                    continue
                if isinstance(child, DirNode):
                    found.entries.append((path, None))
                    await _survey(child, path, scope, found, skip_reserved)
                elif isinstance(child, FileNode):
                    found.entries.append((path, child.size))
    finally:
        if isinstance(listing, Closable):
            await listing.aclose()


def shards_per_task(shards: int, threads: int, parts: int | None = None) -> int:
    """How many shards one task holds: `parts` tasks if given, else enough tasks for TASKS_PER_THREAD
    per worker thread, at most TASK_SHARDS_MAX shards each."""
    if parts:
        return max(1, min(TASK_SHARDS_LIMIT, math.ceil(shards / parts)))
    return max(1, min(TASK_SHARDS_MAX, math.ceil(shards / (TASKS_PER_THREAD * max(1, threads)))))


def shard_cuts(sizes: list[int], threads: int) -> list[int]:
    """Where each task of shards of these sizes (in listing order) begins: tasks of about equal bytes,
    at least TASKS_PER_THREAD per worker thread while each keeps TASK_MIN_BYTES, at least one per
    thread anyway (as far as there are shards), at most TASK_MAX_BYTES (unless one shard is bigger)
    and TASK_SHARDS_MAX shards each. Small shards make few tasks: a task's fixed cost (opening
    SOURCE, the first round trips, the scheduler's) is paid by fewer, bigger ones."""
    count, total = len(sizes), sum(sizes)
    if not count:
        return []
    threads = max(1, threads)
    target = min(max(total / (TASKS_PER_THREAD * threads), TASK_MIN_BYTES), TASK_MAX_BYTES)
    tasks = max(math.ceil(total / target), min(threads, count), math.ceil(count / TASK_SHARDS_MAX))
    tasks = min(tasks, count)
    # Each shard goes to the task its middle byte falls in (shards of no bytes: by their number).
    cuts: list[int] = []
    before, last = 0, -1
    for i, size in enumerate(sizes):
        task = min(tasks - 1, int((before + size / 2) * tasks / total) if total else i * tasks // count)
        if task != last:
            cuts.append(i)
            last = task
        before += size
    bounded: list[int] = []
    for start, end in zip(cuts, [*cuts[1:], count]):
        pieces = math.ceil((end - start) / TASK_SHARDS_MAX)
        bounded += [start + (end - start) * k // pieces for k in range(pieces)]
    return bounded


def deal(found: Survey, per_task: int, files: int = TASK_FILES, size: int = TASK_BYTES,
         named: str | None = None, cuts: list[int] | None = None) -> list[TaskWork]:
    """The tasks: directories and files with no shard (at most `files` entries and `size` bytes a
    task), then the shards in listing order, `per_task` to a task or (`cuts`) in tasks beginning at
    those positions. Files with no shard that fit in one small task (FOLD_FILES, FOLD_BYTES) go
    with the last task of shards instead."""
    works: list[TaskWork] = []
    dirs: list[str] = []
    paths: list[str] = []
    held = names = 0
    for path, length in found.entries:
        cost = len(json.dumps(path)) + 1  # what the path takes in the task's line
        if dirs or paths:
            if len(dirs) + len(paths) >= files or names + cost > TASK_NAMES or \
                    (length is not None and held + length > size and paths):
                works.append(TaskWork(tuple(dirs), tuple(paths), format=named))
                dirs, paths, held, names = [], [], 0, 0
        names += cost
        if length is None:
            dirs.append(path)
        else:
            paths.append(path)
            held += length
    if dirs or paths or not found.shards:
        works.append(TaskWork(tuple(dirs), tuple(paths), format=named))  # (an empty tree: one empty task)
    shards = found.shards
    starts = cuts if cuts is not None else list(range(0, len(shards), per_task))
    for at, end in zip(starts, [*starts[1:], len(shards)]):
        groups: list[tuple[str, str, list[Hashable]]] = []
        for where, label, shard in shards[at:end]:
            if groups and groups[-1][:2] == (where, label):
                groups[-1][2].append(shard)
            else:
                groups.append((where, label, [shard]))
        works.append(TaskWork(groups=tuple(ShardGroup(w, s, tuple(h)) for w, s, h in groups), format=named))
    few = len(works) >= 2 and not works[0].groups and bool(works[1].groups)  # one task of files, then shards
    if few and len(works[0].dirs) + len(works[0].files) <= FOLD_FILES and held <= FOLD_BYTES:
        alone, last = works[0], works[-1]
        works = works[1:-1] + [TaskWork(alone.dirs, alone.files, last.groups, named)]
    return works


# -- a task's files ------------------------------------------------------------------------


class KnownDirs(SourceLayer):
    """A task's byte source: the directories its plan names are known to be directories, so on
    an object store a lookup of one sends no listing (the probe a prefix otherwise needs)."""

    def __init__(self, inner: ByteSource, dirs: set[str]) -> None:
        super().__init__(inner)
        self.dirs = dirs if inner.listable and inner.remote else set()

    async def stat_dir(self, path: str) -> ObjectStat | None:
        if path in self.dirs:
            return ObjectStat(0, 0, True)  # what an object store says of a prefix
        return await self.inner.stat_dir(path)


class _Resolver:
    """Directories of the tree by path, looked up one component at a time (each once per task);
    the time the lookups take is the task's `plan` wait."""

    def __init__(self, root: DirNode, waits: Waits) -> None:
        self.known: dict[str, DirNode] = {"": root}
        self.waits = waits

    async def node(self, rel: str) -> Node | None:
        with self.waits.waiting("plan"):
            return await self._node(rel)

    async def dir(self, rel: str) -> DirNode | None:
        if rel in self.known:
            return self.known[rel]
        with self.waits.waiting("plan"):
            return await self._dir(rel)

    async def _node(self, rel: str) -> Node | None:
        parent, _, name = rel.rpartition("/")
        above = await self._dir(parent)
        if above is None:
            return None
        found = await above.lookup(name)
        if isinstance(found, DirNode):
            self.known[rel] = found
        return found

    async def _dir(self, rel: str) -> DirNode | None:
        if rel in self.known:
            return self.known[rel]
        found = await self._node(rel)
        return found if isinstance(found, DirNode) else None


async def task_entries(root: DirNode, scope: ShardScope, work: TaskWork, missing: list[str],
                       waits: Waits | None = None) -> AsyncGenerator[tuple[str, FileNode | DirNode], None]:
    """(relative path, node) of everything one task checks or exports: its directories and the
    directories above its files (each once, before what is in them), its files, and the chunk
    files of its shards. A path the plan names that SOURCE no longer holds is a line in `missing`.
    `waits`, if given, gets the seconds spent looking up the plan's paths (`plan`) and waiting
    for the chunk listings of its shards (`indexes`)."""
    waits = waits or Waits()
    resolver = _Resolver(root, waits)
    shown: set[str] = {""}
    gone: set[str] = set()

    async def above(rel: str) -> AsyncGenerator[tuple[str, DirNode], None]:
        """The directories down to `rel` (itself included) not shown yet."""
        parts = rel.split("/") if rel else []
        for depth in range(1, len(parts) + 1):
            path = "/".join(parts[:depth])
            if path in shown:
                continue
            if path in gone:
                return
            node = await resolver.dir(path)
            if node is None:
                gone.add(path)
                missing.append(f"{path}/: not a directory in SOURCE any more (it was when the task was planned)")
                return
            shown.add(path)
            yield path, node

    for rel in work.dirs:
        async with aclosing(above(rel)) as dirs:
            async for item in dirs:
                yield item
    for rel in work.files:
        parent = rel.rpartition("/")[0]
        async with aclosing(above(parent)) as dirs:
            async for item in dirs:
                yield item
        if parent not in shown:
            continue
        node = await resolver.node(rel)
        if not isinstance(node, FileNode):
            missing.append(f"{rel}: not a file in SOURCE any more (it was when the task was planned)")
            continue
        yield rel, node
    for group in work.groups:
        async with aclosing(above(group.dir)) as dirs:
            async for item in dirs:
                yield item
        at = await resolver.dir(group.dir)
        if at is None:
            continue  # reported by `above`
        scope.give(group.store, group.shards)
        async with aclosing(shard_chunks(at, group.dir, waits)) as chunks:
            async for entry in chunks:
                yield entry


def shard_chunks(node: DirNode, rel: str, waits: Waits) -> AsyncGenerator[tuple[str, FileNode | DirNode], None]:
    """How a task reads its shards, all in this one function: the chunk files (and nested chunk
    directories) of the chunk listing of directory `node` (tree path `rel`), which reads only the
    shards the task's `ShardScope` was given, declared to the core as a scan of them all."""
    return _chunk_entries(node, rel, waits)


async def _chunk_entries(node: DirNode, rel: str, waits: Waits) -> AsyncGenerator[tuple[str, FileNode | DirNode], None]:
    """The chunk files (and nested chunk directories) of one directory's chunk listing: of an
    overlay its computed entries only (its other entries are planned by path). The task reads
    every one of them: the directory declares them first (`DirNode.will_read_all`), so their
    shards' indexes and payloads are fetched in large reads ahead of the walk. The time the walk
    waits for the listing is `indexes` in `waits`."""
    node.will_read_all()
    shown = inner_dir(node)  # (a dataset of a tree of datasets, or a version: as its format built it)
    listing = (shown.virtual_entries() if isinstance(shown, OverlayDir) else node.entries()).__aiter__()
    prefix = f"{rel}/" if rel else ""
    try:
        while True:
            start = now()
            try:
                batch = await listing.__anext__()
            except StopAsyncIteration:
                return
            finally:
                waits.add("indexes", now() - start)
            for name, child in batch:
                if name_problem(name) is not None:
                    continue  # computed names never have one; a walk that writes must not trust that
                if isinstance(child, DirNode):
                    yield prefix + name, child
                    async with aclosing(_chunk_entries(child, prefix + name, waits)) as nested:  # nested chunk dirs
                        async for item in nested:
                            yield item
                elif isinstance(child, FileNode) and CHUNK_XATTR in child.xattrs():
                    yield prefix + name, child
    except Exception as e:  # a directory that cannot be listed: a problem, not an empty one
        unlisted(rel, e)
    finally:
        if isinstance(listing, Closable):
            await listing.aclose()


# -- the client's planning -----------------------------------------------------------------


@dataclass
class Planned:
    """A plan made: its tasks, the problems planning met (the walk's own, e.g. a name skipped), and
    how many shards and directories it found."""

    works: list[TaskWork]
    problems: list[str]
    shards: int
    dirs: int
    requests: int = 0  # what planning asked of the store
    round_trips: int | None = None


@dataclass
class Surveyed:
    """What walking SOURCE found, before it is dealt into tasks for some number of worker threads."""

    found: Survey
    problems: list[str]
    named: str | None  # the format tasks open SOURCE as (None: a versioned store, found again)
    requests: int = 0
    round_trips: int | None = None

    def plan(self, threads: int, parts: int | None = None) -> Planned:
        """Tasks for `threads` worker threads: by the shards' bytes where all are known (`shard_cuts`),
        else by their number (`shards_per_task`); `parts` tasks of shards if given."""
        found = self.found
        sizes = None if parts else found.shard_bytes()
        works = deal(found, shards_per_task(len(found.shards), threads, parts), named=self.named,
                     cuts=None if sizes is None else shard_cuts(sizes, threads))
        return Planned(works, self.problems, len(found.shards), found.dirs, self.requests, self.round_trips)


def survey_source(source: str, options: OpenOptions, skip_reserved: bool = False) -> Surveyed:
    """Walk SOURCE's tree once for a plan, in this process (not inside a trio run; any thread)."""
    return trio.run(_survey_source, source, options, skip_reserved)


def plan_tasks(source: str, options: OpenOptions, threads: int, parts: int | None = None,
               skip_reserved: bool = False) -> Planned:
    """Plan SOURCE's tasks in this process (not inside a trio run)."""
    return survey_source(source, options, skip_reserved).plan(threads, parts)


async def _survey_source(source: str, options: OpenOptions, skip_reserved: bool) -> Surveyed:
    session = await OpenedSource.open(source, options)
    scope = ShardScope(planning=True)
    session.runtime.shard_scope = scope
    try:
        with collect_problems() as problems:
            async with session.running():
                found = await survey(session.tree, scope, skip_reserved)
    finally:
        requests, round_trips = source_requests(session.source.stats())
        await session.aclose()
    # Tasks open SOURCE as the named format (no probing for one); a versioned store is found again.
    named = session.dataset.format if session.versioned is None else None
    return Surveyed(found, list(problems), named, requests, round_trips)
