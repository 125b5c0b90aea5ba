"""A SOURCE opened for serving: counted byte source, caches, read path, format, virtual tree.

The FUSE mount, the offline tools and the HTTP server all start the same
way; this is that one way, so none of them knows how the source stack is
layered or what a format needs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator

import trio

from .caches import Caches
from .core.fetch import FetchPolicy
from .core.limits import Limits
from .core.runtime import Runtime
from .formats.registry import Dataset, index_levels, open_dataset, split_format
from .sources import CountingSource, RemoteOptions, open_source
from .vtree import DirNode


@dataclass
class Session:
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
    async def open(cls, url: str, options: dict | None = None, caches: Caches | None = None) -> "Session":
        """Open `url` with the options `options.format_options` made from a command line."""
        options = options or {}
        named, rest = split_format(url)
        source = CountingSource(open_source(rest, options.get("remote") or RemoteOptions()))
        runtime = Runtime(source, caches or Caches(levels=index_levels()), options.get("limits") or Limits(),
                          options.get("policy") or FetchPolicy())
        try:
            dataset = await open_dataset(runtime, named, options.get("formats") or {})
        except BaseException:
            await source.aclose()
            raise
        return cls(source, runtime, dataset)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator["Session"]:
        """Serve with background work (prefetch, index read-ahead) enabled; cancelled on exit."""
        async with trio.open_nursery() as nursery:
            self.runtime.fetcher.attach(nursery)
            try:
                yield self
            finally:
                self.runtime.fetcher.attach(None)
                nursery.cancel_scope.cancel()

    def stats(self) -> dict:
        """Backing-source sections (reads, HTTP, disk cache), the read path and the caches."""
        return {**self.source.stats(), **self.runtime.stats(), "caches": self.caches.usage()}

    async def aclose(self) -> None:
        await self.source.aclose()
