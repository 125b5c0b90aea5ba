"""A SOURCE opened for serving: counted byte source, caches, read path, format, virtual tree.

The FUSE mount, the offline tools and the HTTP server all start the same
way; this is that one way, so none of them knows how the source stack is
layered or what a format needs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

import trio

from unshardfs.app.pipeline import open_spec, parse_source
from unshardfs.core.caches import Caches
from unshardfs.core.fetch import FetchPolicy
from unshardfs.core.registry import Dataset, index_levels, open_dataset
from unshardfs.core.runtime import Runtime
from unshardfs.core.versions import VersionsRoot
from unshardfs.sources import CountingSource, LocalSource, RemoteOptions, open_source
from unshardfs.sources.base import ByteSource, VersionedSource
from unshardfs.sources.icechunk import IcechunkOptions
from unshardfs.sources.ocdbt import OcdbtOptions
from unshardfs.sources.zip import ZipSource, ZipSummary
from unshardfs.tree.nodes import DirNode
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
        source = await open_spec(spec, lambda base: open_source(base, options.remote), options.limits, options.icechunk,
                                 ocdbt)
        return await cls.over(source if layer is None else layer(source), spec.format, options, caches)

    @classmethod
    async def over(cls, source: ByteSource, named: str | None = None, options: OpenOptions | None = None,
                   caches: Caches | None = None) -> "OpenedSource":
        """The dataset in `source` (a byte source made elsewhere: a test's in-memory store), as
        `open` serves it; `named` is a format plug-in's name (None: detect). `source` is closed
        with the result, or at once when no dataset opens."""
        options = options or OpenOptions()
        counted = CountingSource(source)
        runtime = Runtime(counted, caches or Caches(levels=index_levels()), options.limits, options.policy)
        try:
            dataset = await open_dataset(runtime, named, options.formats)
        except BaseException:
            await counted.aclose()
            raise
        if isinstance(source, VersionedSource) and not source.pinned and options.versions:
            chosen = named or dataset.format

            async def open_tree(version: ByteSource) -> DirNode:
                other = Runtime(version, runtime.caches, runtime.limits, runtime.policy)
                other.fetcher.follow(runtime.fetcher)  # prefetch and read-ahead while the mount's run
                return (await open_dataset(other, chosen, options.formats)).tree

            dataset = Dataset(VersionsRoot(dataset.tree, source, open_tree), dataset.inventory, dataset.format)
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
