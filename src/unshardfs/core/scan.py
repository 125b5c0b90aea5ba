"""A declared scan: chunks a reader says it will read, fetched ahead in large reads.

The one way to say "I will read all of this". A reader that knows what it
reads next -- a planned task exporting its shards, a directory listing whose
every file a walker reads, a scan that read-ahead recognised in a mount's
reads -- declares the extents, in the order it will read them, to a
`DeclaredScan`. The scan hands them to the fetcher's prefetch, which joins
the extents of each shard into large ranged reads (a shard's run of chunks is
one request, up to the fetcher's span) and runs them concurrently within the
prefetch budget; each extent is handed over once, to the first read of it.

Two ways to declare:

- `declare(extents)` asks for them now, as far as the budget lets, and says
  how many were taken: read-ahead declares one window at a time and asks
  again for the rest;
- `queue(extents)` hands over a whole plan: the scan keeps at most `ahead`
  bytes declared and not yet read, and declares more as the reader reads
  (or as the prefetch cache drops what was never read). A task that declares
  its shards' chunks so waits one round trip for each shard's index and one
  for its data, as TensorStore's batched reads do.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Sequence

import trio

from unshardfs.core.blob import Blob
from unshardfs.core.fetch import Extent, ExtentKey, Fetcher

Fill = Callable[[Blob, int, int], Iterable[Extent]]


class DeclaredScan:
    """Extents one reader declared it will read (see the module's docstring).

    `ahead`: bytes of a queued plan kept declared and unread at once (by default half the
    fetcher's prefetch budget, which bounds them in any case). `skip(ext)`: whether a queued
    extent's reader has it already (read before its turn came), so it is not fetched again.
    """

    def __init__(self, fetcher: Fetcher, ahead: int | None = None,
                 skip: Callable[[Extent], bool] | None = None) -> None:
        self.fetcher = fetcher
        self.ahead = ahead if ahead is not None else fetcher.policy.prefetch_bytes // 2
        self._skip = skip
        self._queue: deque[Extent] = deque()
        self.queued = 0  # bytes queued and not declared yet
        self.outstanding = 0  # bytes declared and neither read nor dropped
        self.declared = 0  # extents declared so far
        self.read = 0  # ... and handed over to their reader
        self.closed = False
        self._moved = trio.Event()  # set when queued bytes were declared (room for more)

    def declare(self, extents: Sequence[Extent], fill: Fill | None = None, wide: bool = False) -> int:
        """Fetch `extents` ahead now, as far as the prefetch budget lets; how many of them, from the
        first, were taken (the caller declares the rest again later). `fill` and `wide` are the
        fetcher's (`Fetcher.prefetch`): what lies between them that the same scan reads later."""
        if self.closed or not extents:
            return 0
        taken = self.fetcher.prefetch(extents, fill, wide)
        for ext in extents[:taken]:
            if self.fetcher.watch(ext, self):
                self.outstanding += ext.length
                self.declared += 1
        return taken

    def queue(self, extents: Iterable[Extent]) -> None:
        """Declare a whole plan, in reading order: fetched `ahead` bytes at a time as it is read."""
        for ext in extents:
            self._queue.append(ext)
            self.queued += ext.length
        self._pump()

    async def room(self) -> None:
        """Wait until fewer than `ahead` bytes are queued and not declared (a planner queueing a
        long plan keeps its queue, and its memory, that short), or the scan is closed."""
        while self.queued >= self.ahead and not self.closed:
            self._moved = trio.Event()
            await self._moved.wait()

    def took(self, key: ExtentKey) -> None:
        """The fetcher handed a declared extent to its reader."""
        self.outstanding -= key[2]
        self.read += 1
        self._pump()

    def dropped(self, key: ExtentKey) -> None:
        """A declared extent will not be handed over (evicted unread, or its read failed)."""
        self.outstanding -= key[2]
        self._pump()

    def close(self) -> None:
        """Declare nothing more; what was declared stays for its readers (or is evicted, wasted)."""
        self.closed = True
        self._queue.clear()
        self.queued = 0
        self._moved.set()

    def _pump(self) -> None:
        """Declare the queue's next extents while less than `ahead` bytes are outstanding."""
        queue = self._queue
        skip = self._skip
        before = self.queued
        while queue and not self.closed and self.outstanding < self.ahead:
            room = self.ahead - self.outstanding
            batch: list[Extent] = []
            while queue and (not batch or room >= queue[0].length):
                ext = queue.popleft()
                self.queued -= ext.length
                if self.fetcher.holds(ext) or (skip is not None and skip(ext)):
                    continue  # prefetched, being read, or read already
                batch.append(ext)
                room -= ext.length
            if not batch:
                break
            taken = self.declare(batch)
            if taken < len(batch):
                rest = batch[taken:]
                queue.extendleft(reversed(rest))
                self.queued += sum(ext.length for ext in rest)
                break  # the budget is full: more once something is read or dropped
        if self.queued < before:
            self._moved.set()
