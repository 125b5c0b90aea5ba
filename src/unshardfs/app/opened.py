"""A SOURCE opened for serving: counted byte source, caches, read path, format, virtual tree.

The FUSE mount, the offline tools and the HTTP server all start the same
way; this is that one way, so none of them knows how the source stack is
layered or what a format needs.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable

import trio

from unshardfs.app.pipeline import as_url, open_found_store, open_spec, parse_source, store_probes
from unshardfs.core.caches import Caches
from unshardfs.core.datasets import TREE_DEPTH, DatasetTree
from unshardfs.core.fetch import FetchPolicy
from unshardfs.core.registry import Dataset, NotDetected, detection_probes, index_levels, open_dataset
from unshardfs.core.runtime import Runtime
from unshardfs.core.versions import VersionsRoot
from unshardfs.sources import CountingSource, LocalSource, RemoteOptions, open_source
from unshardfs.sources.base import ByteSource, ObjectStat, VersionedSource
from unshardfs.sources.subdir import SubdirSource
from unshardfs.sources.icechunk import IcechunkOptions
from unshardfs.sources.ocdbt import OcdbtOptions
from unshardfs.sources.zip import ZipSource, ZipSummary
from unshardfs.tree.nodes import Closable, DirNode
from unshardfs.util.errors import DataError, SourceError
from unshardfs.util.limits import DataLimits


@dataclass(frozen=True)
class OpenOptions:
    """How `OpenedSource.open` reads a SOURCE and shows it: what a command line says
    (`options.open_options`), picklable for the workers of a split check or export."""

    remote: RemoteOptions = field(default_factory=RemoteOptions)  # http(s)://, gs://, s3:// and --cache-dir
    policy: FetchPolicy = field(default_factory=FetchPolicy)  # the read path: coalescing, prefetch
    limits: DataLimits = field(default_factory=DataLimits)  # bounds on untrusted data
    # Per format (by plug-in name), the options its plug-in made from the command line (the
    # plug-in's own frozen dataclass); only formats given any.
    formats: dict[str, object] = field(default_factory=dict)
    icechunk: IcechunkOptions = field(default_factory=IcechunkOptions)  # which virtual references may be read
    versions: bool = True  # a versioned store's other versions shown as `@NAME/` directories (`core.versions`)
    depth: int = TREE_DEPTH  # a tree of datasets: directories below SOURCE shown and looked into (`core.datasets`)


@dataclass
class OpenedSource:
    source: CountingSource
    runtime: Runtime
    dataset: Dataset

    @property
    def tree(self) -> DirNode:
        return self.dataset.tree

    @property
    def caches(self) -> Caches:
        return self.runtime.caches

    @classmethod
    async def open(cls, url: str, options: OpenOptions | None = None, caches: Caches | None = None,
                   named: str | None = None, layer: Callable[[ByteSource], ByteSource] | None = None
                   ) -> "OpenedSource":
        """Open `url` with `options` (the defaults without): its format the one the URL names, else
        `named`, else detected; its byte source seen through `layer` if given."""
        options = options or OpenOptions()
        spec = parse_source(url)
        if spec.format is None and named is not None:
            spec = replace(spec, format=named)  # (so no versioned store is probed for either)
        ocdbt = OcdbtOptions(gap=options.policy.max_gap)
        open_base = functools.partial(open_source, remote=options.remote)
        source = await open_spec(spec, open_base, options.limits, options.icechunk, ocdbt)
        # Where a reader elsewhere finds a directory of a tree of datasets (virtual references into an
        # Icechunk repository there); none inside an archive or a versioned store.
        base = None if spec.zip_path is not None or spec.ocdbt or spec.icechunk else as_url(spec.base)

        async def open_store(directory: ByteSource, path: str) -> ByteSource:
            url = None if base is None or isinstance(source, VersionedSource) else f"{base.rstrip('/')}/{path}"
            return await open_found_store(directory, options.limits, options.icechunk, ocdbt, url, open_base)

        return await cls.over(source if layer is None else layer(source), spec.format, options, caches, open_store)

    @classmethod
    async def over(cls, source: ByteSource, named: str | None = None, options: OpenOptions | None = None,
                   caches: Caches | None = None, open_store: OpenStore | None = None) -> "OpenedSource":
        """The dataset in `source` (a byte source made elsewhere: a test's in-memory store), as
        `open` serves it; `named` is a format plug-in's name (None: detect; a source that is no
        dataset is shown as a tree of datasets). `open_store` opens the versioned store a directory
        of such a tree holds (default: the directory as it is). `source` is closed with the result,
        or at once when no dataset opens."""
        options = options or OpenOptions()
        counted = CountingSource(source)
        runtime = Runtime(counted, caches or Caches(levels=index_levels()), options.limits, options.policy)
        try:
            dataset = await _shown(runtime, source, named, options, open_store or _as_stored, options.depth)
        except BaseException:
            await counted.aclose()
            raise
        return cls(counted, runtime, dataset)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator["OpenedSource"]:
        """Serve with background work (prefetch, index read-ahead) enabled; cancelled on exit."""
        async with trio.open_nursery() as nursery:
            self.runtime.fetcher.attach(nursery)
            try:
                yield self
            finally:
                self.runtime.fetcher.attach(None)
                nursery.cancel_scope.cancel()

    @property
    def versioned(self) -> VersionedSource | None:
        """The versioned store the source is one version of (None when it is not)."""
        inner = self.source.inner
        return inner if isinstance(inner, VersionedSource) else None

    @property
    def archive(self) -> "ZipSummary | None":
        """What the zip archive the source is read through holds (None when there is none)."""
        inner = self.source.inner
        return inner.summary if isinstance(inner, ZipSource) else None

    def local_directories(self) -> list[tuple[LocalSource, bool]]:
        """The local directories the source reads, each with whether its whole tree is served
        (False for the directory an archive is read from: only that one file is)."""
        found: list[tuple[LocalSource, bool]] = []
        whole = True
        layer: object = self.source
        while layer is not None:
            if isinstance(layer, LocalSource):
                found.append((layer, whole))
            elif isinstance(layer, ZipSource):
                whole = False
            layer = getattr(layer, "inner", None)
        return found

    def stats(self) -> dict[str, Any]:
        """Backing-source sections (reads, HTTP, disk cache), the read path and the caches."""
        return {**self.source.stats(), **self.runtime.stats(), "caches": self.caches.usage(),
                # the daemon's CPU so far: what a workload cost per file, beside the round trips it waited for
                "process": {"cpu_seconds": round(time.process_time(), 4)}}

    async def aclose(self) -> None:
        await self.source.aclose()


# Opens the versioned store a directory of a tree of datasets holds (`directory`: a source of it;
# `path`: where it is in the tree's source), or gives `directory` back when it holds none.
OpenStore = Callable[[ByteSource, str], Awaitable[ByteSource]]
# A directory that could hold a dataset is looked for among this many entries of the root's listing:
# a source with none there is refused as no dataset (a mistyped path), not shown as an empty tree.
LOOK_FOR_DIRECTORY = 4096


async def _as_stored(directory: ByteSource, path: str) -> ByteSource:
    return directory


async def _shown(runtime: Runtime, store: ByteSource, named: str | None, options: OpenOptions,
                 open_store: OpenStore, depth: int, strict: bool = True, tree: bool = True) -> Dataset:
    """The dataset `runtime` reads (`store`: its source below the counting, a versioned store's
    version perhaps), with the store's other versions beside it; or, when no format detects it (and
    `tree`), the tree of datasets it holds (`depth` directories deep). NotDetected when it is neither.
    `strict`: refuse options given for formats other than the one found."""
    try:
        dataset = await open_dataset(runtime, named, options.formats, strict)
    except NotDetected as e:
        if not tree:
            raise
        dataset = await _tree(runtime, store, options, open_store, depth, e)
    if isinstance(store, VersionedSource) and not store.pinned and options.versions:
        chosen = named or dataset.format

        async def open_tree(version: ByteSource) -> DirNode:
            other = Runtime(version, runtime.caches, runtime.limits, runtime.policy)
            other.fetcher.follow(runtime.fetcher)  # prefetch and read-ahead while the mount's run
            return (await _shown(other, version, chosen, options, open_store, depth, strict, tree)).tree

        dataset = Dataset(VersionsRoot(dataset.tree, store, open_tree), dataset.inventory, dataset.format)
    return dataset


async def _tree(runtime: Runtime, store: ByteSource, options: OpenOptions, open_store: OpenStore,
                depth: int, refused: NotDetected) -> Dataset:
    """The tree of datasets `runtime`'s source holds (`core.datasets`); `refused` (the one line
    detection gave) when it cannot hold one: it cannot list, or holds no directory."""
    source = runtime.source
    if not source.listable or depth < 1 or not await _holds_a_directory(source):
        raise refused
    # A store inside a versioned store is not looked for (no pipeline reads one).
    nested = not isinstance(store, VersionedSource)
    below = runtime.fetcher.source  # what the fetcher reads: `source` without its read-ahead of files

    async def open_dir(path: str, at: int) -> Dataset | None:
        plain: ByteSource = SubdirSource(below, path)
        found = await open_store(plain, path) if nested else plain
        if found is plain:
            # The format reads through the tree's read-ahead of files shown as stored; the shards
            # are read below it, as a dataset's own are.
            other = runtime.beside(SubdirSource(source, path) if source is not below else plain, plain)
        else:
            other = runtime.beside(found)
        try:
            # A plain directory that is no dataset is a directory of this tree; a versioned store's
            # version that is none holds a tree of its own.
            dataset = await _shown(other, found, None, options, open_store, depth - at, strict=False,
                                   tree=found is not plain)
        except NotDetected:
            return None
        if found is not plain and isinstance(found, VersionedSource):
            dataset = replace(dataset, about=functools.partial(store_lines, found, found.description))
        return dataset

    # (an object store's prefix has no time of its own: no request asks for one)
    root = (None if source.remote else await source.stat_dir("")) or ObjectStat(0, 0, True)
    tree = DatasetTree(source, open_dir, store_probes() if nested else detection_probes(), depth)
    return Dataset(tree.root(root), tree.inventory)


async def store_lines(store: VersionedSource, description: str) -> list[str]:
    """What `inspect` says of a versioned store a dataset of a tree of datasets is read from: its
    versions (how many, which one is shown) and what the store says of itself (an Icechunk
    repository: its spec version, the tags and branches it deleted)."""
    try:
        count = len(await store.versions())
        lines = [f"  versions      {count:,} in {description} (@{store.current} shown)"]
    except (DataError, SourceError) as e:
        lines = [f"  versions      unreadable: {e}"]
    summary = getattr(store, "summary_lines", None)  # optional: what else the store says of itself
    if summary is not None:
        lines += await summary()
    return lines


async def _holds_a_directory(source: ByteSource) -> bool:
    """Whether the root's listing shows a directory among its first LOOK_FOR_DIRECTORY entries (or
    has more entries than that)."""
    seen = 0
    listing = source.list("").__aiter__()
    try:
        async for _name, st in listing:
            seen += 1
            if st.is_dir or seen >= LOOK_FOR_DIRECTORY:
                return True
    finally:
        if isinstance(listing, Closable):
            await listing.aclose()
    return False
