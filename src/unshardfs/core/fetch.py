"""The one read path for shard bytes: batched, coalesced, deduplicated, bounded, with prefetch.

Every index and payload read of the sharded formats goes through a
`Fetcher`. Reads come in batches of `Extent`s (byte ranges of blobs);
extents of one blob that lie close together are fetched with one ranged
read (a gap of at most `max_gap` bytes, at most `max_span` per read, as
TensorStore batches reads within a shard); runs of different blobs go out
concurrently. A read that is already in flight (another reader's, or a
prefetch) is joined, not repeated. Prefetched bytes wait in their own
byte-bounded cache, which counts what was used and what was wasted.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Protocol, Sequence, TypeVar, cast

import trio

from unshardfs.core.blob import Blob, Identity
from unshardfs.sources.base import ByteSource, CachedRange, FdRange, ReadNow
from unshardfs.util.concurrency import cancellation, stray_cancellation
from unshardfs.util.errors import DataError
from unshardfs.util.flight import Flights
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap, payload_size

log = logging.getLogger(__name__)

T = TypeVar("T")
# Bytes a source gave beside what was asked (a shard index with its stat: `Fetcher.seed`), kept
# for their first read: each at most SEED_MAX, all together at most SEEDED_BYTES.
SEED_MAX = 1 << 20
SEEDED_BYTES = 16 << 20
ExtentKey = tuple[Identity, int, int]  # an extent's cache key: its blob's identity, start and length


@dataclass(frozen=True, slots=True)
class Extent:
    """Bytes [start, start+length) of `blob`."""

    blob: Blob
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def key(self) -> ExtentKey:
        # Offset *and* length: two payloads may start at the same offset of
        # one version of a blob only if one of them is damaged, and then
        # they must not share a cache entry.
        return (self.blob.identity, self.start, self.length)


@dataclass(frozen=True)
class FetchPolicy:
    max_gap: int = 4 << 10  # join extents separated by at most this many bytes
    max_span: int = 16 << 20  # one read covers at most this many bytes
    concurrency: int = 32  # reads of one batch in flight at once
    # Gap accepted between extents of a prefetch (bytes read only to save a
    # round trip; they count as wasted).
    prefetch_gap: int = 64 << 10
    prefetch_bytes: int = 64 << 20  # budget of the prefetch cache
    read_ahead: bool = True


@dataclass
class FetchCounters:
    batches: int = 0
    reads: int = 0  # backing reads issued (after coalescing)
    extents: int = 0  # extents asked for
    joined: int = 0  # extents served by a read already in flight
    prefetch_reads: int = 0
    prefetch_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_hit_bytes: int = 0
    # Prefetched bytes never read: evicted unread, a failed prefetch, and the
    # gaps a prefetch read only to join its extents into one request.
    prefetch_wasted_bytes: int = 0
    prefetch_skipped: int = 0  # prefetches not issued (budget full)
    seeded: int = 0  # extents a source gave beside what was asked (`Fetcher.seed`)
    seeded_hits: int = 0  # ... and read since

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Watcher(Protocol):
    """Who declared a prefetched extent (a `DeclaredScan`): told when it is handed over or lost."""

    def took(self, key: ExtentKey) -> None: ...

    def dropped(self, key: ExtentKey) -> None: ...


def prefetch_cache(budget: int, counters: FetchCounters,
                   lost: Callable[[ExtentKey], None] = lambda key: None) -> BoundedMap[ExtentKey, bytes]:
    """Prefetched payloads waiting for their reader, within `budget` bytes; what the bound
    evicts unread was wasted (and `lost`)."""

    def wasted(key: ExtentKey, value: bytes) -> None:
        counters.prefetch_wasted_bytes += len(value)
        lost(key)

    return BoundedMap(budget, getsizeof=payload_size, on_evict=wasted)


class _Budget:
    """Bytes of prefetches in flight: one count for a mount's fetcher and those that follow it."""

    __slots__ = ("in_flight",)

    def __init__(self) -> None:
        self.in_flight = 0


@dataclass(eq=False)
class _Run:
    """One backing read covering several extents of a blob."""

    blob: Blob
    start: int
    end: int
    extents: list[Extent] = field(default_factory=list)
    prefetch: bool = False  # its extents go to the prefetch cache when it lands
    # Extents a prefetch wanted that lie inside this run, already in flight:
    # they go to the prefetch cache too (else the bytes would be read twice).
    adopted: list[Extent] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)
    data: bytes = b""
    error: BaseException | None = None

    _keys: set[ExtentKey] | None = None  # of `extents` and `adopted`, once something is adopted

    def adopt(self, ext: Extent) -> None:
        # A set, not a scan: a window's prefetch may adopt each of a long run's extents in turn.
        # Built at the first adoption: `extents` is complete once the run is in flight.
        keys = self._keys
        if keys is None:
            keys = self._keys = {e.key for e in self.extents}
        key = ext.key
        if key not in keys:
            keys.add(key)
            self.adopted.append(ext)


def plan(extents: Sequence[Extent], max_gap: int, max_span: int) -> list[_Run]:
    """Group extents into runs: same blob, sorted by offset, joined across small gaps."""
    runs: list[_Run] = []
    by_blob: dict[Identity, list[Extent]] = {}
    for ext in extents:
        by_blob.setdefault(ext.blob.identity, []).append(ext)
    for group in by_blob.values():
        group.sort(key=lambda e: (e.start, e.length))
        run: _Run | None = None
        for ext in group:
            if (run is not None and ext.start - run.end <= max_gap
                    and max(run.end, ext.end) - run.start <= max_span):
                run.end = max(run.end, ext.end)
            else:
                run = _Run(ext.blob, ext.start, ext.end)
                runs.append(run)
            run.extents.append(ext)
    return runs


class Fetcher:
    """The one read path of a mount: every byte a format or chunk file needs comes through here.

    `read(ext)` and `read_many(extents)` return exactly the bytes of each
    extent (coalescing neighbours closer than the policy's gap into one
    request, sharing requests in flight, serving prefetched copies); a range
    the source cannot deliver whole is a DataError. `index=True` marks index
    structures (a disk cache may keep them). `prefetch` and `spawn` are for
    the core's read-ahead; formats only read.
    """

    def __init__(self, source: ByteSource, policy: FetchPolicy | None = None, leader: "Fetcher | None" = None
                 ) -> None:
        """With a `leader` (the mount's own fetcher), this one reads `source` (a dataset of a tree of
        datasets) within the leader's bounds: the same prefetch cache and budget, reads in flight,
        limits on concurrency, counters and background nursery. Every key they share is a blob's
        identity, which the sources of one tree keep apart (`sources/subdir.py`)."""
        self.source = source
        policy = policy or FetchPolicy()
        if not source.remote:
            # Local reads are syscalls, not round trips: nothing to hide by
            # reading ahead, and prefetched copies would only cost memory.
            policy = dataclasses.replace(policy, read_ahead=False)
        self.policy = policy
        # A source that is not remote answers each read with a syscall and
        # never waits on anything: no read of it is ever in flight for another
        # to join, nothing is prefetched, and there is nothing to bound. Its
        # reads skip the batch machinery (no tracking, limiter or nursery: a
        # cold chunk's read is one call, as cheap as the source allows).
        self.direct = not source.remote and source.index_cache is None
        # The source's optional capabilities, decided once (a page-cached READ asks every time).
        self._reads_now = source if isinstance(source, ReadNow) else None
        self._cached_ranges = source if isinstance(source, CachedRange) else None
        self.flights = Flights()
        self._nursery: trio.Nursery | None = None
        self._leader: Fetcher | None = leader
        if leader is None:
            self.counters = FetchCounters()
            self.prefetched = prefetch_cache(self.policy.prefetch_bytes, self.counters, self._lost)
            # Declared extents prefetched or on their way, and who declared them (`watch`).
            self._watchers: dict[ExtentKey, Watcher] = {}
            self._in_flight: dict[Identity, list[_Run]] = {}  # runs being read, by blob
            self._budget = _Budget()  # bytes of prefetches in flight
            self._seeded: BoundedMap[ExtentKey, bytes] = BoundedMap(SEEDED_BYTES, lru=False, getsizeof=len)  # `seed`
            self._limiter = trio.CapacityLimiter(max(1, self.policy.concurrency))
            # Prefetches queue behind their own limiter, so a backlog of them never
            # delays a read someone is waiting for here; as many may be in flight
            # as reads (a scan over hashed shards wants dozens of separate ranges
            # per round trip, and half as many cost its readers a round trip).
            self._prefetch_limiter = trio.CapacityLimiter(max(1, self.policy.concurrency))
        else:
            self.counters = leader.counters
            self.prefetched = leader.prefetched
            self._watchers = leader._watchers
            self._in_flight = leader._in_flight
            self._budget = leader._budget
            self._seeded = leader._seeded
            self._limiter = leader._limiter
            self._prefetch_limiter = leader._prefetch_limiter

    @property
    def _prefetch_in_flight(self) -> int:
        """Bytes of prefetches in flight (this fetcher's, and those of the fetchers sharing its budget)."""
        return self._budget.in_flight

    # -- background work ---------------------------------------------------------

    def attach(self, nursery: trio.Nursery | None) -> None:
        """Where background work (prefetches) runs; without one, nothing is prefetched."""
        self._nursery = nursery

    def follow(self, leader: "Fetcher") -> None:
        """Run background work wherever `leader`'s runs, while it runs (the read path of another version of
        a store, opened beside the mount's own)."""
        self._leader = leader

    @property
    def _where(self) -> trio.Nursery | None:
        return self._nursery if self._leader is None else self._leader._nursery

    @property
    def background(self) -> bool:
        """Whether background work can run (a nursery is attached)."""
        return self._where is not None

    @property
    def can_prefetch(self) -> bool:
        return self._where is not None and self.policy.read_ahead

    def spawn(self, work: Callable[..., Awaitable[object]], *args: object) -> bool:
        """Start `work(*args)` in the background if a nursery is attached."""
        nursery = self._where
        if nursery is None:
            return False
        nursery.start_soon(_guarded, work, args)
        return True

    # -- reads ---------------------------------------------------------------------

    async def read(self, ext: Extent, index: bool = False) -> bytes:
        """The bytes of one extent: from a prefetch, a read in flight, or a new read."""
        if self.direct:
            return await self.read_direct(ext.blob, ext.start, ext.length, index)
        return (await self.read_many([ext], index=index))[0]

    def read_direct(self, blob: Blob, start: int, length: int, index: bool = False) -> Awaitable[bytes]:
        """One read of a `direct` source (the caller checked `direct`): counted like a batch of one.
        The blob's read itself is returned, for the caller to await (one coroutine fewer per read)."""
        counters = self.counters
        counters.batches += 1
        counters.extents += 1
        counters.reads += 1
        return blob.read(self.source, start, length, index=index)

    def read_now(self, blob: Blob, start: int, length: int) -> bytes | bytearray | None:
        """`read_direct`'s bytes if the source has them at once (see `Blob.read_now`); counted
        like the read it replaces. None: `read_direct` reads them."""
        source = self._reads_now
        return None if source is None else self._counted(blob.read_now(source, start, length))

    def cached_direct(self, blob: Blob, start: int, length: int) -> FdRange | None:
        """`read_direct`'s bytes as a page-cached descriptor range, if the source can give one
        (see `Blob.cached_range`); counted like the read it replaces."""
        source = self._cached_ranges
        return None if source is None else self._counted(blob.cached_range(source, start, length))

    def _counted(self, found: T) -> T:
        """`found` (None: nothing), counted like a `read_direct` if it is something."""
        if found is not None:
            counters = self.counters
            counters.batches += 1
            counters.extents += 1
            counters.reads += 1
        return found

    def seed(self, ext: Extent, data: bytes) -> None:
        """The bytes of `ext`, come with another answer (a shard index with its stat): the first
        index read of exactly that extent takes them instead of a request. Kept until then, within
        SEEDED_BYTES (beyond, the oldest are dropped: their reads go to the source)."""
        if len(data) != ext.length or ext.length > SEED_MAX:
            return
        self._seeded[ext.key] = data
        self.counters.seeded += 1

    def _take_seeded(self, ext: Extent) -> bytes | None:
        data = self._seeded.pop(ext.key, None)
        if data is not None:
            self.counters.seeded_hits += 1
        return data

    async def read_many(self, extents: Sequence[Extent], index: bool = False,
                        max_gap: int | None = None) -> list[bytes]:
        """The bytes of each extent, in order; DataError if any one fails."""
        if self.direct:
            return await self._read_many_direct(extents, index, max_gap)
        self.counters.batches += 1
        self.counters.extents += len(extents)
        results: list[bytes | None] = [None] * len(extents)
        wanted: list[tuple[int, Extent]] = []
        joins: list[tuple[int, Extent, _Run]] = []
        kept = self.source.index_cache if index else None
        seeded = index and self._seeded
        for i, ext in enumerate(extents):
            if kept is not None and ext.blob.versioned:
                stored = kept.get(ext.key)
                if stored is not None and len(stored) == ext.length:
                    results[i] = stored
                    if seeded:
                        self._take_seeded(ext)  # not needed after all: not kept either
                    continue
            if seeded:
                given = self._take_seeded(ext)
                if given is not None:
                    results[i] = given
                    if kept is not None and ext.blob.versioned:
                        kept.put(ext.key, given)
                    continue
            hit = self._prefetched(ext)
            if hit is not None:
                results[i] = hit
                continue
            run = self._covering(ext)
            if run is not None:
                if run.prefetch:
                    run.adopt(ext)  # gap bytes of a prefetch, used after all
                joins.append((i, ext, run))
            else:
                wanted.append((i, ext))
        runs = plan([ext for _, ext in wanted], self.policy.max_gap if max_gap is None else max_gap,
                    self.policy.max_span)
        if len(runs) == 1 and not joins:
            await self._read_run(runs[0], index)
        elif runs or joins:
            async with trio.open_nursery() as nursery:
                for run in runs:
                    # Visible before its task starts: a batch asked for at the same instant
                    # (lookups reading one table's neighbours) joins it instead of reading it again.
                    self._track(run)
                    nursery.start_soon(self._read_run, run, index, True)
                for _, _, run in joins:
                    nursery.start_soon(run.done.wait)
        for run in runs:
            self._raise(run)
        for i, ext in wanted:
            results[i] = _slice(self._run_of(runs, ext), ext)
        retry: list[tuple[int, Extent]] = []
        for i, ext, run in joins:
            self.counters.joined += 1
            if run.error is not None:
                retry.append((i, ext))  # a failed or cancelled prefetch: read it ourselves
            else:
                # A prefetch that landed also cached the extent: take it out
                # (a hit), or it would later be evicted as wasted.
                self._prefetched(ext)
                results[i] = _slice(run, ext)
        if retry:
            runs = plan([ext for _, ext in retry], 0, self.policy.max_span)
            for run in runs:
                await self._read_run(run, index)
                self._raise(run)
            for i, ext in retry:
                results[i] = _slice(self._run_of(runs, ext), ext)
        out = cast(list[bytes], results)  # every slot was filled above
        if kept is not None:
            for i, ext in wanted:
                if ext.blob.versioned:
                    kept.put(ext.key, out[i])
        return out

    async def _read_many_direct(self, extents: Sequence[Extent], index: bool, max_gap: int | None) -> list[bytes]:
        """`read_many` on a direct source: the same coalesced runs, read one after the other."""
        self.counters.batches += 1
        self.counters.extents += len(extents)
        runs = plan(extents, self.policy.max_gap if max_gap is None else max_gap, self.policy.max_span)
        for run in runs:
            self.counters.reads += 1
            run.data = await run.blob.read(self.source, run.start, run.end - run.start, index=index)
        if len(runs) == 1:
            return [_slice(runs[0], ext) for ext in extents]
        # Each extent's bytes from the run that took it (a scanned shard's indexes are dozens of
        # runs: no search of every run per extent).
        sliced = {ext.key: _slice(run, ext) for run in runs for ext in run.extents}
        return [sliced[ext.key] for ext in extents]

    def take_prefetched(self, ext: Extent) -> bytes | None:
        """The extent's bytes if a prefetch brought them (taken out of the prefetch cache, a hit),
        without a batch: `read`'s answer when it would find them there, counted like it."""
        hit = self._prefetched(ext)
        if hit is not None:
            self.counters.batches += 1
            self.counters.extents += 1
        return hit

    def _prefetched(self, ext: Extent) -> bytes | None:
        """The extent's bytes if a prefetch brought them (taken out of the prefetch cache)."""
        key = ext.key
        hit: bytes | None = self.prefetched.pop(key, None)
        if hit is not None:
            self.counters.prefetch_hits += 1
            self.counters.prefetch_hit_bytes += len(hit)
            if self._watchers:
                watcher = self._watchers.pop(key, None)
                if watcher is not None:
                    watcher.took(key)
        return hit

    # -- declared scans (core/scan.py) -------------------------------------------------

    def watch(self, ext: Extent, watcher: Watcher) -> bool:
        """Tell `watcher` when the prefetched extent is handed over or lost; False (nothing to
        watch) if it is neither prefetched nor on its way, or watched already."""
        key = ext.key
        if key in self._watchers or not self.holds(ext):
            return False
        self._watchers[key] = watcher
        return True

    def holds(self, ext: Extent) -> bool:
        """Whether the extent is prefetched or on its way (a read of it costs no request)."""
        return ext.key in self.prefetched or self._covering(ext) is not None

    def _lost(self, key: ExtentKey) -> None:
        watcher = self._watchers.pop(key, None) if self._watchers else None
        if watcher is not None:
            watcher.dropped(key)

    @staticmethod
    def _raise(run: _Run) -> None:
        if run.error is not None:
            raise run.error

    @staticmethod
    def _run_of(runs: list[_Run], ext: Extent) -> _Run:
        for run in runs:
            if run.blob.identity == ext.blob.identity and run.start <= ext.start and ext.end <= run.end:
                return run
        raise AssertionError("extent without a run")

    def _covering(self, ext: Extent) -> _Run | None:
        for run in self._in_flight.get(ext.blob.identity, ()):
            if run.start <= ext.start and ext.end <= run.end:
                return run
        return None

    def _track(self, run: _Run) -> None:
        """Make the run visible to readers and prefetches (to join) until it is done."""
        self._in_flight.setdefault(run.blob.identity, []).append(run)

    def _untrack(self, run: _Run) -> None:
        flying = self._in_flight[run.blob.identity]
        flying.remove(run)
        if not flying:
            del self._in_flight[run.blob.identity]
        run.done.set()

    async def _read_run(self, run: _Run, index: bool, tracked: bool = False) -> None:
        """Read one run; failures are stored on the run (every extent of it shares them)."""
        if not tracked:
            self._track(run)
        try:
            async with self._limiter:
                self.counters.reads += 1
                run.data = await run.blob.read(self.source, run.start, run.end - run.start, index=index)
            self._land(run)
        except DataError as e:
            run.error = e
        except BaseException as e:
            if cancellation(e):  # bare, or in a nursery's group: joiners read it themselves
                run.error = DataError(run.blob.label, "read cancelled")
            raise
        finally:
            self._untrack(run)

    # -- prefetch --------------------------------------------------------------------

    def prefetch(self, extents: Sequence[Extent],
                 fill: Callable[[Blob, int, int], Iterable[Extent]] | None = None, wide: bool = False) -> int:
        """Fetch `extents` in the background into the prefetch cache.

        Returns how many of `extents`, from the first, are taken care of
        (cached, on their way, or scheduled now): the prefetch budget (bytes
        in flight, gaps read to join extents included, at most half of the
        cache's) may stop it early, and the
        caller asks again for the rest later. An extent inside a read already
        in flight is adopted by that read rather than read again. `fill(blob,
        start, end)` names the other extents a read will cover between the
        ones wanted (the gaps it reads to save a round trip): they are kept
        too, instead of being read again when their turn comes. With `wide`,
        extents further apart are joined where `fill` names what lies between
        them (bytes that are wanted later, not waste): a run is kept wide only
        if what it reads that nobody wants stays within `prefetch_gap` per
        join, and all runs within the budget.
        """
        if not self.can_prefetch:
            return 0
        budget = self.policy.prefetch_bytes // 2 - self._budget.in_flight
        left = budget
        chosen: list[Extent] = []
        at: list[int] = []  # where each chosen extent is in `extents`
        taken = len(extents)
        for i, ext in enumerate(extents):
            if ext.key not in self.prefetched:
                run = self._covering(ext)
                if run is not None:
                    run.adopt(ext)
                elif ext.length > left:
                    taken = i
                    break
                else:
                    left -= ext.length
                    chosen.append(ext)
                    at.append(i)
        runs, admitted = self._admit(chosen, fill, wide, budget)
        if admitted < len(chosen):
            taken = at[admitted]
        self.counters.prefetch_skipped += len(extents) - taken
        for run in runs:
            run.prefetch = True
            self._budget.in_flight += run.end - run.start
            self.counters.prefetch_bytes += run.end - run.start
            self._track(run)  # visible to readers before it starts
            self.spawn(self._prefetch_run, run)
        return taken

    def _admit(self, chosen: list[Extent], fill: Callable[[Blob, int, int], Iterable[Extent]] | None,
               wide: bool, budget: int) -> tuple[list[_Run], int]:
        """The runs of the longest prefix of `chosen` whose reads fit in `budget` bytes, and its length.

        The budget bounds what is read, so the gaps a run joins across count
        too: extents that fit by their own lengths may not once joined.
        """
        runs = self._runs(chosen, fill, wide, budget)
        if _spanned(runs) <= budget:
            return runs, len(chosen)
        # Shrink the prefix by bisection; `fits` always holds runs within the
        # budget (those of chosen[:lo]), so the bound holds whatever the plan does.
        fits: list[_Run] = []
        lo, hi = 0, len(chosen)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            runs = self._runs(chosen[:mid], fill, wide, budget)
            if _spanned(runs) <= budget:
                lo, fits = mid, runs
            else:
                hi = mid
        return fits, lo

    def _runs(self, chosen: list[Extent], fill: Callable[[Blob, int, int], Iterable[Extent]] | None,
              wide: bool, budget: int) -> list[_Run]:
        """The reads that prefetch `chosen`: wide runs where they fit, else the narrow plan."""
        runs = self._wide_runs(chosen, fill, budget) if wide and fill else None
        return self._narrow_runs(chosen, fill) if runs is None else runs

    def _narrow_runs(self, chosen: list[Extent],
                     fill: Callable[[Blob, int, int], Iterable[Extent]] | None) -> list[_Run]:
        """`chosen` joined across gaps of `prefetch_gap` at most, with what `fill` names inside."""
        runs = plan(chosen, self.policy.prefetch_gap, self.policy.max_span)
        for run in runs:
            if fill is not None and len(run.extents) > 1:
                self._fill_run(run, fill)
        return runs

    def _fill_run(self, run: _Run, fill: Callable[[Blob, int, int], Iterable[Extent]]) -> None:
        """Add the extents `fill` names inside the run (not cached, not in flight elsewhere)."""
        known = {ext.key for ext in run.extents}
        run.extents += [ext for ext in fill(run.blob, run.start, run.end)
                        if run.start <= ext.start and ext.end <= run.end and ext.key not in known
                        and ext.key not in self.prefetched and self._covering(ext) is None]

    def _wide_runs(self, chosen: list[Extent], fill: Callable[[Blob, int, int], Iterable[Extent]],
                   budget: int) -> list[_Run] | None:
        """Runs joined across gaps that `fill` fills. A run that would waste more than the narrow
        plan may (`prefetch_gap` per join) is split, alone, where a gap wastes more than that (the
        bytes between are read already, say), and keeps its other joins: the scan's other runs
        stay wide, and its pieces as wide as they may be. None where the runs exceed `budget`."""
        runs: list[_Run] = []
        for run in plan(chosen, self.policy.max_span, self.policy.max_span):
            joins = len(run.extents) - 1
            if joins:
                wanted = {ext.key for ext in run.extents}
                self._fill_run(run, fill)
                if (run.end - run.start) - _covered(run.extents) > joins * self.policy.prefetch_gap:
                    # Pieces of nothing but filled extents are left to later windows.
                    runs += [piece for piece in plan(run.extents, self.policy.prefetch_gap, self.policy.max_span)
                             if any(ext.key in wanted for ext in piece.extents)]
                    continue
            runs.append(run)
        return runs if _spanned(runs) <= budget else None

    async def _prefetch_run(self, run: _Run) -> None:
        size = run.end - run.start
        try:
            async with self._prefetch_limiter:
                self.counters.prefetch_reads += 1
                run.data = await run.blob.read(self.source, run.start, size)
            self._land(run)
        except DataError as e:
            run.error = e  # a reader joining it gets the same error; logged when it is read
            self.counters.prefetch_wasted_bytes += size
            log_once(log, f"prefetch:{run.blob.label}", "prefetch of %s failed: %s", run.blob.label, e)
        except BaseException as e:
            if cancellation(e):  # bare, or in a nursery's group: joiners read it themselves
                run.error = DataError(run.blob.label, "prefetch cancelled")
            raise
        finally:
            self._budget.in_flight -= size
            self._untrack(run)
            if run.error is not None and self._watchers:
                for ext in run.extents + run.adopted:
                    self._lost(ext.key)

    def _land(self, run: _Run) -> None:
        """Put what prefetches wanted of a run that has been read into the prefetch cache."""
        wanted = (run.extents if run.prefetch else []) + run.adopted
        for ext in wanted:
            self.prefetched[ext.key] = _slice(run, ext)
            if ext.key not in self.prefetched:  # larger than the whole cache
                self.counters.prefetch_wasted_bytes += ext.length
                self._lost(ext.key)
        if run.prefetch:
            # Bytes read only to join extents into one request were read for nothing.
            self.counters.prefetch_wasted_bytes += (run.end - run.start) - _covered(run.extents + run.adopted)
        else:
            # Adopted by a reader's read: prefetched at no cost of their own, but counted
            # like any prefetched bytes (so hits + wasted + cached add up to them).
            self.counters.prefetch_bytes += sum(ext.length for ext in run.adopted)

    def stats(self) -> dict[str, int]:
        return {**self.counters.as_dict(), "prefetch_cached_bytes": int(self.prefetched.currsize),
                "prefetch_cached_entries": len(self.prefetched), "prefetch_limit": int(self.prefetched.maxsize),
                "prefetch_in_flight_bytes": self._budget.in_flight}


async def _guarded(work: Callable[..., Awaitable[object]], args: tuple[object, ...]) -> None:
    """Background work is an optimisation: whatever it raises is logged once and dropped,
    never allowed to end the nursery (and with it the daemon)."""
    try:
        await work(*args)
    except BaseException as e:  # noqa: BLE001 - the daemon outlives any bug in read-ahead
        if not isinstance(e, Exception) and not stray_cancellation(e):
            raise  # this task's own cancellation, or the interpreter stopping
        log_once(log, f"background:{type(e).__name__}:{e}", "background %s failed: %s: %s",
                 getattr(work, "__qualname__", work), type(e).__name__, e)


def _spanned(runs: Sequence[_Run]) -> int:
    """Bytes the runs read, gaps included."""
    return sum(run.end - run.start for run in runs)


def _covered(extents: Sequence[Extent]) -> int:
    """Bytes covered by the union of `extents` (of one blob)."""
    total, reach = 0, -1
    for ext in sorted(extents, key=lambda e: e.start):
        if ext.end > reach:
            total += ext.end - max(ext.start, reach)
            reach = ext.end
    return total


def _slice(run: _Run, ext: Extent) -> bytes:
    if run.start == ext.start and run.end == ext.end:
        return run.data
    return run.data[ext.start - run.start:ext.end - run.start]
