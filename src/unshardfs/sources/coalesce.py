"""Byte ranges of one object asked for together, fetched with one ranged read.

A packed store keeps many files' bytes side by side in one object (an OCDBT
data file holds the values of neighbouring keys one after the other). Readers
that want several of them at the same moment -- concurrent readers of a mount,
a front end's batch, the read path's concurrent reads of several files --
each ask for their own range; over a network each would be a round trip of
its own. `RangeReads` gathers the ranges of one object asked for in the same
moment (the tasks that became ready together: it lets the scheduler run them
for `GATHER` checkpoints before sending) and fetches ranges that lie within
`gap` bytes of each other with one ranged read of at most `span` bytes, as
the sharded formats' read path joins neighbouring chunks of a shard. A range
inside a read already in flight waits for that read instead of asking again.
Bytes read only to join ranges (the gaps) are at most `gap` per join, and
nothing is kept after its readers have it: memory is bounded by what is being
read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

import trio

GATHER = 2  # scheduler checkpoints a first asker waits for others of the same moment
GAP = 4 << 10  # join ranges at most this many bytes apart (the read path's default gap)
SPAN = 16 << 20  # one read covers at most this many bytes

O = TypeVar("O", bound=Hashable)  # what names an object: its path, or a path with the version its reads are held to
Reader = Callable[[O, int, int, bool], Awaitable[bytes]]  # (object, offset, size, index) -> bytes


@dataclass(eq=False)
class _Want:
    start: int
    end: int


@dataclass(eq=False)
class _JoinedRead:
    """One read covering the wants of a batch that lie close together."""

    start: int
    end: int
    wants: list[_Want] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)
    data: bytes = b""
    error: BaseException | None = None
    cancelled: bool = False  # its reader was cancelled before the bytes came: its other readers ask again


@dataclass(eq=False)
class _Batch:
    wants: list[_Want] = field(default_factory=list)
    runs: dict[_Want, _JoinedRead] = field(default_factory=dict)  # each want's run, once planned
    planned: trio.Event = field(default_factory=trio.Event)
    cancelled: bool = False  # its first asker was cancelled while gathering: the others ask again


@dataclass
class RangeCounters:
    asked: int = 0  # ranges asked for
    reads: int = 0  # reads sent for them
    gap_bytes: int = 0  # bytes read only to join ranges

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class RangeReads(Generic[O]):
    """Reads of byte ranges of objects through `read(obj, offset, size, index)`, merged as above (`obj`
    names the object: a path, or a `Pin`, whose reads are merged only with reads held to the same version).
    `index` reads (index structures, which a disk cache may keep) are merged only with each other.
    A read's error is every reader's of its ranges; a reader cancelled while others wait on its read
    leaves them to ask again."""

    def __init__(self, read: Reader[O], gap: int = GAP, span: int = SPAN) -> None:
        self._read = read
        self.gap = gap
        self.span = span
        self.counters = RangeCounters()
        self._open: dict[tuple[O, bool], _Batch] = {}  # batches still gathering, by object
        self._flying: dict[tuple[O, bool], list[_JoinedRead]] = {}  # runs being read, by object

    async def read(self, obj: O, offset: int, size: int, index: bool = False) -> bytes:
        """Bytes [offset, offset+size) of `obj` (shorter only where the object ends)."""
        self.counters.asked += 1
        key = (obj, index)
        end = offset + size
        while True:
            run = next((r for r in self._flying.get(key, ()) if r.start <= offset and end <= r.end), None)
            if run is None:
                batch = self._open.get(key)
                if batch is None:
                    break
                want = _Want(offset, end)
                batch.wants.append(want)
                await batch.planned.wait()
                if batch.cancelled:
                    continue
                run = batch.runs[want]
            await run.done.wait()
            if not run.cancelled:
                return _result(run, offset, end)
        return await self._lead(key, offset, end)

    async def _lead(self, key: tuple[O, bool], start: int, end: int) -> bytes:
        """Gather the ranges of `key` asked for in this moment, then read them."""
        want = _Want(start, end)
        batch = self._open[key] = _Batch([want])
        try:
            for _ in range(GATHER):
                await trio.sleep(0)
        except BaseException:
            batch.cancelled = True
            del self._open[key]
            batch.planned.set()
            raise
        del self._open[key]
        runs = self._plan(batch)
        batch.planned.set()
        await self._fetch(key, runs)
        return _result(batch.runs[want], start, end)

    def _plan(self, batch: _Batch) -> list[_JoinedRead]:
        runs: list[_JoinedRead] = []
        run: _JoinedRead | None = None
        for want in sorted(batch.wants, key=lambda w: (w.start, w.end)):
            if run is not None and want.start - run.end <= self.gap and max(run.end, want.end) - run.start <= self.span:
                if want.start > run.end:
                    self.counters.gap_bytes += want.start - run.end
                run.end = max(run.end, want.end)
            else:
                run = _JoinedRead(want.start, want.end)
                runs.append(run)
            run.wants.append(want)
            batch.runs[want] = run
        return runs

    async def _fetch(self, key: tuple[O, bool], runs: list[_JoinedRead]) -> None:
        """Read every run (concurrently); each one's outcome is kept on it for all its wants."""
        flying = self._flying.setdefault(key, [])
        flying.extend(runs)
        try:
            if len(runs) == 1:
                await self._one(key, runs[0])
            else:
                async with trio.open_nursery() as nursery:
                    for run in runs:
                        nursery.start_soon(self._one, key, run)
        finally:
            for run in runs:
                if not run.done.is_set():
                    run.cancelled = True
                    run.done.set()
                flying.remove(run)
            if not flying:
                del self._flying[key]

    async def _one(self, key: tuple[O, bool], run: _JoinedRead) -> None:
        self.counters.reads += 1
        try:
            run.data = await self._read(key[0], run.start, run.end - run.start, key[1])
        except trio.Cancelled:
            raise
        except Exception as e:  # every reader of the run gets the error its read met
            run.error = e
        run.done.set()


def _result(run: _JoinedRead, start: int, end: int) -> bytes:
    if run.error is not None:
        raise run.error
    if start == run.start and end == run.end:
        return run.data
    return run.data[start - run.start:end - run.start]
