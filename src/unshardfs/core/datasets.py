"""A tree of datasets: SOURCE's directories, each one that is a dataset shown in place.

When SOURCE is not itself one dataset (a release: a bucket prefix holding an
EM image, a segmentation, a few Zarr arrays and a README), the tree shows its
directories as they are stored, each directory that is a dataset in its
unsharded layout in place, and every other file as it is stored. A directory
is a dataset only by the rules SOURCE itself is detected by (its format's
marker files; an OCDBT database or Icechunk repository by theirs), and the
first dataset on a path ends the search there: a dataset inside a dataset is
shown as the outer one shows it.

Detection is lazy and per directory: a directory is looked into when it is
looked up or listed itself, never while its parent is listed, so a bucket
with 10^5 prefixes lists page by page for the cost of its listing, and a
lookup of one dataset costs one round trip of probes (its own stat with
them) before the dataset's metadata is read. What a directory turned out to
be is kept for the most recent `KEPT` directories (the most recent
`OPEN_DATASETS` of the datasets: one is opened again, its metadata read
again, when it is used after that); datasets open share the
mount's caches and read path (`Runtime.beside`).

Bounds: directories deeper than the tree's depth below SOURCE (`TREE_DEPTH`
unless `inspect --depth` says less) are not shown, nor is a directory that
is one of its own ancestors (a symlink loop on a local disk), each logged
once; names that are not one path segment (`..`, `/`) are never shown. A
directory that detects as a dataset but cannot be opened (damaged metadata)
is shown as stored, the reason logged once and listed by `inspect`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import trio

from unshardfs.core.inventory import InventoryPart, NotShown, Progress
from unshardfs.core.registry import Dataset, plugin
from unshardfs.sources.base import ByteSource, ObjectStat, Version, join_path, name_problem
from unshardfs.tree.namespaced import NamespacedDir
from unshardfs.tree.nodes import Batch, Closable, DirNode, Entry, Node
from unshardfs.tree.passthrough import LIST_BATCH, PassthroughDir, PassthroughFile
from unshardfs.util.errors import ConfigError
from unshardfs.util.flight import Flights
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap

log = logging.getLogger(__name__)

TREE_DEPTH = 16  # directories below SOURCE a tree of datasets shows (and looks for datasets in)
KEPT = 1 << 12  # directories whose outcome (a dataset opened, or none) is kept
OPEN_DATASETS = 64  # ... of which datasets (each holds its format's state: parsed metadata, directories)

# Opens the dataset at a directory of the tree's source (its path, and its depth below SOURCE): None
# when the directory is no dataset; ConfigError when it is one that cannot be opened.
OpenDir = Callable[[str, int], Awaitable["Dataset | None"]]


@dataclass
class Outcome:
    """What a directory of the tree turned out to be: the node shown for it, and the dataset it is
    (None: a directory of the tree), or why it is shown as stored although it is one."""

    node: DirNode
    dataset: Dataset | None = None
    problem: str | None = None


class DatasetTree:
    """A tree of datasets over `source`: what its directories share.

    `open_dir` opens the dataset at a directory; `probes` are the paths (relative to a directory) that
    detection stats, statted with the directory's own stat on a remote source (one round trip)."""

    def __init__(self, source: ByteSource, open_dir: OpenDir, probes: Sequence[str] = (),
                 depth: int = TREE_DEPTH) -> None:
        self.source = source
        self.open_dir = open_dir
        self.probes = tuple(dict.fromkeys(probes))
        self.depth = depth
        self._found: BoundedMap[str, Outcome] = BoundedMap(KEPT)  # directories of the tree, shown as stored
        self._open: BoundedMap[str, Outcome] = BoundedMap(OPEN_DATASETS)  # datasets
        self._files: BoundedMap[str, bool] = BoundedMap(KEPT, counted=False)  # paths found to be files
        self._flights = Flights()

    def root(self, st: ObjectStat) -> "DatasetsDir":
        return DatasetsDir(self, "", st, 0, ())

    def known(self, path: str) -> Outcome | None:
        """What directory `path` was found to be, if that is still kept."""
        return self._open.get(path) or self._found.get(path)

    async def found(self, path: str, st: ObjectStat, depth: int, ancestors: tuple[Version, ...]) -> Outcome:
        """What directory `path` is (looked into once while kept)."""
        known = self.known(path)
        if known is not None:
            return known

        async def look() -> Outcome:
            outcome = await self._look(path, st, depth, ancestors)
            (self._found if outcome.dataset is None else self._open)[path] = outcome
            return outcome

        return await self._flights.run(path, look)

    async def _look(self, path: str, st: ObjectStat, depth: int, ancestors: tuple[Version, ...]) -> Outcome:
        try:
            dataset = await self.open_dir(path, depth)
        except ConfigError as e:
            log_once(log, f"tree:{path}", "%s/: shown as stored: %s", path, e)
            return Outcome(PassthroughDir(self.source, path, st), None, str(e))
        if dataset is None:
            return Outcome(DatasetsDir(self, path, st, depth, ancestors))
        return Outcome(NamespacedDir(dataset.tree, path), dataset)

    def shows(self, path: str, st: ObjectStat, depth: int, ancestors: tuple[Version, ...]) -> bool:
        """Whether directory `path` at `depth` is within the tree's bounds (else logged once)."""
        if depth > self.depth:
            log_once(log, "tree:depth", "%s/: deeper than %d directories below the source: not shown "
                     "(nor any directory as deep)", path, self.depth)
            return False
        if st.version and st.version in ancestors:
            log_once(log, f"tree:loop:{path}", "%s/: a directory that holds itself (a symlink loop): not shown",
                     path)
            return False
        return True

    async def child(self, path: str, st: ObjectStat, depth: int, ancestors: tuple[Version, ...]) -> Node | None:
        """The node shown for `path` (a directory of the tree at `depth - 1` holds it), looked into
        now; None where it is not shown."""
        if not st.is_dir:
            return PassthroughFile(self.source, path, st)
        if not self.shows(path, st, depth, ancestors):
            return None
        return (await self.found(path, st, depth, ancestors)).node

    async def stat(self, path: str) -> ObjectStat | None:
        """`path`'s stat (a file's, or a directory's). Over a remote source its first one sends the
        probes a directory's detection will stat beside it (one round trip for both); a path found to
        be a file is statted alone after that (a front end looks a file up again and again)."""
        source = self.source
        if not source.remote or path in self._files:
            return await source.stat(path) or await source.stat_dir(path)
        found: list[ObjectStat | None] = [None, None]

        async def stat() -> None:
            found[0] = await source.stat(path)

        async def stat_dir() -> None:
            found[1] = await source.stat_dir(path)

        async def probe(rel: str) -> None:
            try:
                await source.stat(join_path(path, rel))
            except Exception:  # the detection's own stat meets it and says what it is
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stat)
            nursery.start_soon(stat_dir)
            for rel in self.probes:
                nursery.start_soon(probe, rel)
        if found[0] is not None and not found[0].is_dir:
            self._files[path] = True
        return found[0] or found[1]

    async def inventory(self) -> AsyncIterator[InventoryPart]:
        """The datasets found within the tree's depth (each with its own inventory, its paths in the
        tree's), and the directories shown as stored although they are datasets; by path."""
        found: list[tuple[str, Outcome]] = []
        async for path, outcome in self.walk():
            found.append((path, outcome))
        for path, outcome in sorted(found, key=lambda item: item[0]):
            if outcome.dataset is None:
                yield NotShown("shown as stored", path, outcome.problem or "")
                continue
            named = outcome.dataset.format
            about = outcome.dataset.about
            yield DatasetPart(path, named or "tree", plugin(named).description if named else "a tree of datasets",
                              await about() if about is not None else [])
            async for part in outcome.dataset.inventory():
                yield InTree(part, path)

    async def walk(self, at: "DatasetsDir | None" = None) -> AsyncIterator[tuple[str, Outcome]]:
        """Every directory of the tree that is a dataset or is shown as stored, depth first."""
        directory = at
        if directory is None:
            st = await self.source.stat_dir("") or ObjectStat(0, 0, True)
            directory = self.root(st)
        listing = directory.entries().__aiter__()
        try:
            async for batch in listing:
                for _name, node in batch:
                    if not isinstance(node, PendingDir):
                        continue
                    outcome = await node.outcome()
                    if isinstance(outcome.node, DatasetsDir):
                        async for item in self.walk(outcome.node):
                            yield item
                    else:
                        yield node.path, outcome
        finally:
            if isinstance(listing, Closable):
                await listing.aclose()


class DatasetsDir(DirNode):
    """A directory of a tree of datasets that is not itself a dataset: its files as stored, its
    directories each a dataset in place or a directory of the tree."""

    __slots__ = ("tree", "path", "depth", "ancestors")

    def __init__(self, tree: DatasetTree, path: str, st: ObjectStat, depth: int,
                 ancestors: tuple[Version, ...]) -> None:
        super().__init__(st.mtime_ns)
        self.tree = tree
        self.path = path
        self.depth = depth
        # The versions of the directories above it and its own (a local directory's is its inode):
        # a directory met again below itself is a loop.
        self.ancestors = (*ancestors, st.version) if st.version else ancestors

    async def lookup(self, name: str) -> Node | None:
        if name_problem(name) is not None:
            return None  # never a path: `..` or an embedded `/` would leave this directory
        path = join_path(self.path, name)
        known = self.tree.known(path)
        if known is not None:
            return known.node  # (a directory looked into once is not statted again while kept)
        st = await self.tree.stat(path)
        if st is None:
            return None
        return await self.tree.child(path, st, self.depth + 1, self.ancestors)

    async def entries(self) -> AsyncIterator[Batch]:
        source = self.tree.source
        if not source.listable:
            return
        batch: list[Entry] = []
        async for name, st in source.list(self.path):
            problem = name_problem(name)
            if problem is not None:
                log_once(log, f"tree:{self.path}:{problem}", "%s/: skipping %s", self.path or ".", problem)
                continue
            path = join_path(self.path, name)
            if not st.is_dir:
                batch.append((name, PassthroughFile(source, path, st)))
            elif self.tree.shows(path, st, self.depth + 1, self.ancestors):
                batch.append((name, PendingDir(self.tree, path, st, self.depth + 1, self.ancestors)))
            if len(batch) >= LIST_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def xattrs(self) -> dict[str, bytes]:
        return {"user.unshardfs.source": self.path.encode()} if self.path else {}


class PendingDir(DirNode):
    """A directory of the tree as its parent's listing shows it: looked into (a dataset, or a
    directory of the tree) the first time it is used, never while its parent is listed."""

    __slots__ = ("tree", "path", "st", "depth", "ancestors", "_shown", "_read_all")

    def __init__(self, tree: DatasetTree, path: str, st: ObjectStat, depth: int,
                 ancestors: tuple[Version, ...]) -> None:
        super().__init__(st.mtime_ns)
        self.tree = tree
        self.path = path
        self.st = st
        self.depth = depth
        self.ancestors = ancestors
        self._shown: DirNode | None = None
        self._read_all = False  # told so before it was looked into: told again once it is

    async def outcome(self) -> Outcome:
        found = await self.tree.found(self.path, self.st, self.depth, self.ancestors)
        if self._shown is None:
            self._shown = found.node
            if self._read_all:
                found.node.will_read_all()
        return found

    async def shown(self) -> DirNode:
        """The node this directory turned out to be (looked into on first use)."""
        if self._shown is None:
            await self.outcome()
            assert self._shown is not None
        return self._shown

    @property
    def stable_key(self) -> str | None:  # type: ignore[override]
        return self._shown.stable_key if self._shown is not None else None

    def child_name(self, child_id: int) -> str:
        if self._shown is None:
            raise KeyError(child_id)
        return self._shown.child_name(child_id)

    def will_read_all(self) -> None:
        if self._shown is not None:
            self._shown.will_read_all()
        else:
            self._read_all = True

    def xattrs(self) -> dict[str, bytes]:
        return self._shown.xattrs() if self._shown is not None else {"user.unshardfs.source": self.path.encode()}

    async def lookup(self, name: str) -> Node | None:
        return await (await self.shown()).lookup(name)

    async def entries(self) -> AsyncIterator[Batch]:
        listing = (await self.shown()).entries().__aiter__()
        try:
            async for batch in listing:
                yield batch
        finally:
            if isinstance(listing, Closable):
                await listing.aclose()


@dataclass
class DatasetPart(InventoryPart):
    """A dataset of a tree of datasets, as `inspect` lists it before its sharded directories."""

    path: str
    format: str  # the format plug-in's name ("tree": a versioned store holding a tree of its own)
    description: str
    store: list[str] = field(default_factory=list)  # what the versioned store it is read from says (`Dataset.about`)
    kind: str = "dataset"

    async def report(self, progress: Progress | None = None) -> dict[str, Any]:
        report = {"kind": self.kind, "key": self.path or ".", "format": self.format, "description": self.description}
        return {**report, "store": self.store} if self.store else report


@dataclass
class InTree(InventoryPart):
    """A part of a dataset's inventory, its path the tree's (the dataset's directory before it)."""

    part: InventoryPart
    prefix: str

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.part.kind

    @property
    def path(self) -> str:  # type: ignore[override]
        return join_path(self.prefix, self.part.path)

    async def report(self, progress: Progress | None = None) -> dict[str, Any]:
        report = await self.part.report(progress)
        key = report.get("key")
        report["key"] = self.prefix if key in (None, ".", "") else join_path(self.prefix, str(key))
        return report
