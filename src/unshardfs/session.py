"""A SOURCE opened for serving: counted byte source, caches, format, virtual tree.

The FUSE mount, the offline tools and the HTTP server all start the same
way; this is that one way, so none of them knows how the source stack is
layered or what a format needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .caches import Caches
from .formats import open_tree, resolve
from .sources import CountingSource
from .vtree import DirNode


@dataclass
class Session:
    source: CountingSource
    caches: Caches
    dataset: object  # the format's own handle (what `inspect` summarises)
    tree: DirNode

    @classmethod
    async def open(cls, url: str, formats: dict, caches: Caches | None = None) -> "Session":
        """Open `url` with the format options `options.format_options` made from a command line."""
        raw, options = resolve(url, **formats)
        source = CountingSource(raw)
        caches = caches or Caches()
        try:
            dataset, tree = await open_tree(source, caches, options)
        except BaseException:
            await source.aclose()
            raise
        return cls(source, caches, dataset, tree)

    def stats(self) -> dict:
        """Backing-source sections (reads, HTTP, disk cache) and the caches."""
        return {**self.source.stats(), "caches": self.caches.usage()}

    async def aclose(self) -> None:
        await self.source.aclose()
