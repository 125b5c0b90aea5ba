"""What a format supplies to the core for one sharded directory: a `ShardedStore`.

The store knows the format's index structures and nothing else: which
shards exist (in listing order), the chunk tables of one shard, and where
one chunk lives. Everything above it (files, caching, decoding, listings,
read-ahead) is the core's, shared by every format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import AsyncIterator, Hashable

from .runtime import Runtime
from .table import ChunkTable

Shard = Hashable  # a store's own handle for one shard (a number, a grid index)


class ShardedStore(ABC):
    def __init__(self, runtime: Runtime, label: str) -> None:
        self.runtime = runtime
        self.source = runtime.source
        self.fetcher = runtime.fetcher
        self.caches = runtime.caches
        self.limits = runtime.limits
        self.label = label or "."  # for messages: the directory key
        self.flights = runtime.fetcher.flights

    @abstractmethod
    async def locate(self, key: int) -> tuple[ChunkTable, int] | None:
        """The table holding chunk `key` and its position there; None if the chunk is absent.

        Raises DataError when the chunk's shard or index is damaged, or the
        chunk's own index entry is (a `bad` entry of its table).
        """

    @abstractmethod
    def shards(self, within: object = None) -> AsyncIterator[Shard]:
        """Existing shards in listing order (on sources that cannot list: every candidate).

        `within` narrows them to a part of the directory in the format's own
        terms (a slab of a Zarr shard grid, for its nested chunk directories).
        """

    @abstractmethod
    async def tables(self, shard: Shard) -> list[ChunkTable]:
        """The listable entries of one shard, in listing order; [] if the shard is absent.

        Entries whose key could never be looked up in this shard (misplaced
        ids, cells outside the grid) are left out. DataError if the shard
        itself is damaged.
        """

    def is_shard_file(self, name: str) -> bool:
        """Whether `name` in the directory is one of the store's shard files (hidden from the view)."""
        return False

    def describe(self, key: int) -> str:
        """How log lines name a chunk."""
        return f"chunk {key}"
