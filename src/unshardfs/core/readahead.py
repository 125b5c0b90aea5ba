"""Read-ahead: recognise scans of a sharded directory and declare what they read next.

Tools that copy or walk a directory read its chunk files one after another,
each read a round trip to an object store. A `ScanScope` watches the order
in which a directory's chunk files are first read and recognises scans in
three orders (`ScanOrder`), each a numbering of the chunks by position:

- id order: ascending chunk ids, which is inode order (`cp -r` sorts a
  directory by inode number before copying, and our computed inodes are the
  ids) and, for grids, a walk over neighbouring cells;
- listing order: the order of the directory's listing (`tar`, `find`,
  `ls -f | xargs`), which is the order of the index tables, shard by shard;
- name order: the names sorted as strings (grids only, see nameorder.py),
  as scripts that split a sorted file list over parallel readers walk it.

Each read is a position in each order, found in constant time (a dict, a
mixed-radix number, or one search of a sorted array). A read at position p
*follows* in an order when the chunk at p-1 was among the last RECENT reads.
A guess is made at each read no scan explains; it becomes a stream (is
confirmed) when

- its reads follow one another exactly, CONFIRM times, each within EXACT_GAP
  reads of the one before and with no read of the chunks just after its
  first in between (one reader: `cp -r`, a script);
- it began at a listing batch's first entry and its next chunk is read soon
  after (a tool that lists a directory and reads it from its first file,
  which a viewer never does); such a read also prefetches the next
  OPEN_WINDOW chunks at once, so the read that confirms it finds them on
  their way;
- JOINT_CONFIRM of the JOINT_READS reads after its first were of distinct
  chunks among the JOINT_SPAN after it (readers taking every n-th name
  together: their reads of one instant arrive in any order);
- SPREAD_CONFIRM guesses of one order, within MAX_WINDOW positions of each
  other, have each been followed SPREAD_FOLLOWS times (readers each reading
  their own run of files, as `xargs -P 8 -n 16` gives them).

Scattered reads (a viewer) do none of these, and start no prefetch. A
stream covers every position from its lowest read on: a read anywhere from
BEHIND (or its window, if larger) below its furthest read up to SLACK past
what it declared is its own. It *declares* a window of the chunks that come
next (through the fetcher's `DeclaredScan`), starting with FIRST_WINDOW
chunks (JOINT_WINDOW, or twice the readers' spread, when several readers
confirmed it together) and doubling up to MAX_WINDOW as its readers read
on, each window stretched to the end of the shard's run it ends in (one
request per run) and bounded to a quarter of the prefetch budget. A read of
a chunk a stream declared is matched by one dict lookup: the steady state of
a scan costs each read a few operations and no task. Several streams per
directory are tracked at once (readers each scanning their part); where
several orders' streams predict the same chunks, the first in precedence
(listing, name, id) leads, and the next one reads ahead only once the
first's order has ended (a listing of one nested Zarr directory ends, the
id stream carries the scan into the next) or the first has caught up with
the positions its order knows (`find` still listing the nested directories
its readers read: the id stream reads ahead past what is listed). A stream
that has caught up declares nothing more until more is listed.

A window does not stop at a chunk whose index table (a shard's stat and
index, a minishard index) nobody has read yet: it reads that table in the
background, at most OPENS_MAX at once, goes on past the chunks it holds and
prefetches them once it is read; the tables the next window reaches are read
too. The lookups by name of a directory are watched the same way by a second
scope (`of_lookups`), which reads only index tables: readers that look up
their files before reading them show their scan a chain of index reads
earlier than their reads do, and the tables of the chunks they reach next are
there when they do. Neither scope reads anything without a stream.
"""

from __future__ import annotations

import bisect
import enum
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Protocol, Sequence

import numpy as np

from unshardfs.core.blob import Blob, Identity
from unshardfs.core.fetch import Extent, Fetcher
from unshardfs.core.nameorder import NameOrder
from unshardfs.core.policy import POLICY
from unshardfs.core.scan import DeclaredScan
from unshardfs.core.table import ChunkTable, int_list
from unshardfs.util.errors import DataError
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap

log = logging.getLogger(__name__)

MAX_STREAMS = POLICY.max_streams
FIRST_WINDOW = POLICY.first_window
JOINT_WINDOW = POLICY.joint_window
OPEN_WINDOW = POLICY.open_window
MAX_WINDOW = POLICY.max_window
SLACK = POLICY.slack
CONFIRM = POLICY.confirm
LISTED_IDS_MAX = POLICY.listed_ids_max
WHOLE_READ_MAX = POLICY.whole_read_max
JOINT_SPAN = POLICY.joint_span
JOINT_CONFIRM = POLICY.joint_confirm
JOINT_READS = POLICY.joint_reads
BEHIND = POLICY.behind
OPENS_MAX = POLICY.opens_max
RECENT = POLICY.recent
SPREAD_CONFIRM = POLICY.spread_confirm
SPREAD_FOLLOWS = POLICY.spread_follows
GUESSES_MAX = 4 * MAX_STREAMS  # guesses kept at once (each a few integers)
STALE_READS = 4 * MAX_STREAMS * FIRST_WINDOW  # (`_refill`)
EXACT_GAP = 2  # other reads that may come between one reader's reads of a scan's next chunks
GUESS_AGE = 4 * JOINT_READS  # reads after which a guess nothing followed is dropped
READY_MAX = 1 << 16  # index tables remembered as read (a cache may drop them since: then a window waits)
OFFSETS_MAX = 1 << 18  # listed ids whose listing positions are kept in dicts at once (the batches last asked)
CARRY = FIRST_WINDOW // 2  # chunks declared ahead of an ending stream that still carry a scan alone

Picked = tuple[int, int, Extent, ChunkTable]  # a stream position, its chunk id, extent and table


class ScanOrder(enum.Enum):
    """An order a scan may walk a directory's chunks in (see the module's docstring)."""

    LISTING = "listing"
    NAME = "name"
    ID = "id"


PRECEDENCE = (ScanOrder.LISTING, ScanOrder.NAME, ScanOrder.ID)  # which stream leads where several agree


class ScanTarget(Protocol):
    """What read-ahead needs of a directory of chunk files (a `ChunkContext` is one)."""

    @property
    def fetcher(self) -> Fetcher: ...

    @property
    def dense(self) -> bool:
        """Whether ids fill a range (the id after k is k+1)."""

    async def locate(self, chunk_id: int) -> tuple[ChunkTable, int] | None:
        """The table holding chunk `chunk_id` and its position (None: absent; DataError: damaged)."""

    def table_of(self, chunk_id: int) -> Hashable | None:
        """What names the index table that would hold `chunk_id` (no I/O; None: no such table)."""

    def has_payload(self, ext: Extent) -> bool:
        """Whether the payload at `ext` is already kept for its reader."""

    @property
    def name_order(self) -> NameOrder | None:
        """The string order of the chunk names, where it is known without a listing."""


class Listings:
    """What a directory's listing batches said: ids in listing order, each at a position (the
    order a scan in listing order walks, across batches), and each blob's chunk extents (to name
    the chunks a prefetch reads in its gaps). A position is found in constant time: the batches
    holding an id are those of its index table (`add`'s keys), and the ids of the batches last
    asked about are kept in dicts. Bounded by LISTED_IDS_MAX entries; a listing read again adds
    nothing."""

    def __init__(self) -> None:
        self.batches: list[np.ndarray] = []
        self.firsts: list[int] = []  # the position of each batch's first entry
        self.count = 0
        self._seen: set[tuple[Identity, int, int]] = set()
        self.heads: set[int] = set()  # each batch's first id (a scan in listing order starts there)
        self.lowests: set[int] = set()  # ... and its lowest (a scan in id order starts at either)
        self._by_table: dict[Hashable, list[int]] = {}  # index table -> the batches holding its ids
        self._offsets: BoundedMap[int, dict[int, int]] = BoundedMap(
            OFFSETS_MAX, getsizeof=len, counted=False)  # batch -> {id: offset in it}, built on demand
        self._last = 0  # the batch the last position was found in (scans move forward)
        self._sorted: np.ndarray | None = None  # every listed id, sorted (id order over sparse ids)
        self._unsorted: list[np.ndarray] = []  # batches not yet merged into `_sorted`
        self._tables: dict[Identity, list[ChunkTable]] = {}  # blob identity -> its listed tables
        # ... as (starts, lengths, ids) sorted by start
        self._spans: dict[Identity, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def add(self, table: ChunkTable, keys: Iterable[Hashable]) -> None:
        """A listing batch in listing order; `keys`: the index tables its ids are in."""
        mark = (table.blob.identity, int(table.ids[0]), len(table))
        if mark in self._seen or self.count >= LISTED_IDS_MAX:
            return
        self._seen.add(mark)
        b = len(self.batches)
        self.heads.add(int(table.ids[0]))
        self.lowests.add(int(table.ids.min()))
        self.batches.append(table.ids)
        self.firsts.append(self.count)
        self.count += len(table.ids)
        for key in dict.fromkeys(keys):
            self._by_table.setdefault(key, []).append(b)
        self._unsorted.append(table.ids)
        self._tables.setdefault(table.blob.identity, []).append(table)
        self._spans.pop(table.blob.identity, None)

    def position(self, chunk_id: int, key: Hashable | None) -> int | None:
        """The id's position in listing order (None: not listed); `key`: its index table."""
        if not self.batches or key is None:
            return None  # (no table can hold it: not a chunk of this directory)
        for b in (self._last, *self._by_table.get(key, ())):
            if b >= len(self.batches):
                continue
            offsets = self._offsets.get(b)
            if offsets is None:
                ids = self.batches[b]
                offsets = self._offsets[b] = dict(zip(ids.tolist(), range(len(ids))))
            i = offsets.get(chunk_id)
            if i is not None:
                self._last = b
                return int(self.firsts[b] + i)
        return None

    def ids(self, position: int, n: int) -> list[int]:
        """The ids of up to `n` positions from `position` on (fewer where the listing ends)."""
        if position < 0 or position >= self.count or n <= 0:
            return []
        b = bisect.bisect_right(self.firsts, position) - 1
        out = int_list(self.batches[b][position - self.firsts[b]:position - self.firsts[b] + n])
        for later in self.batches[b + 1:]:
            if len(out) >= n:
                break
            out += int_list(later[:n - len(out)])
        return out

    def sorted_ids(self) -> np.ndarray | None:
        """Every listed id, sorted and distinct; each batch merged once (two sorted runs: linear)."""
        if self._unsorted:
            merged = np.concatenate(([] if self._sorted is None else [self._sorted]) + self._unsorted)
            merged.sort(kind="stable")
            keep = np.empty(len(merged), dtype=bool)
            keep[:1] = True
            np.not_equal(merged[1:], merged[:-1], out=keep[1:])
            self._sorted = merged[keep]
            self._unsorted = []
        return self._sorted

    def within(self, blob: Blob, start: int, end: int, after: int | None = None) -> list[Extent]:
        """Listed chunk extents of `blob` lying inside [start, end) (of ids above `after`, if given)."""
        spans = self._spans.get(blob.identity)
        if spans is None:
            tables = self._tables.get(blob.identity)
            if not tables:
                return []
            starts = np.concatenate([t.starts for t in tables])
            order = np.argsort(starts, kind="stable")
            spans = self._spans[blob.identity] = (starts[order], np.concatenate([t.lengths for t in tables])[order],
                                               np.concatenate([t.ids for t in tables])[order])
        starts, lengths, ids = spans
        lo, hi = starts.searchsorted(np.uint64(start)), starts.searchsorted(np.uint64(end))
        if after is not None:
            ahead = ids[lo:hi] > np.uint64(after)
            pairs = zip(starts[lo:hi][ahead].tolist(), lengths[lo:hi][ahead].tolist())
        else:
            pairs = zip(starts[lo:hi].tolist(), lengths[lo:hi].tolist())
        return [Extent(blob, s, n) for s, n in pairs if s + n <= end]


@dataclass(eq=False)
class Stream:
    """A guess at a scan in one order, or (confirmed) a scan: positions, not ids."""

    order: ScanOrder
    lo: int  # the position of its first read
    hi: int  # its furthest position read
    last: int  # the position of its last exact follow (the walk of one reader)
    follows: int = 0  # exact follows so far
    exact: bool = True  # no read of the chunks just after its first came out of turn (one reader)
    seen: set[int] = field(default_factory=set)  # positions read close after `lo` while a guess
    age: int = 0  # reads the scope saw since the guess was made, or since it last moved
    opens: bool = False  # its first read was a listing batch's first entry (or lowest id)
    confirmed: bool = False
    hits: int = 0  # reads matched, once confirmed
    last_hit: int = 0  # the scope's read count at its last match (a stream nobody reads any more is dropped)
    window: int = FIRST_WINDOW
    frontier: int = 0  # positions below it have been declared or passed
    ended: bool = False  # the order has no positions past `frontier`
    extended: bool = False  # a window has been declared since it was confirmed
    # The listings' size when a window last reached the end of its order's known positions: until
    # more are listed, extending it again finds nothing (a scan that has caught up with `find`).
    caught_up: int = -1
    # Chunks declared and not read yet, with their positions: a read of one is matched by a lookup.
    declared: dict[int, int] = field(default_factory=dict)
    # Positions a window passed while their index tables were being read: each is declared once
    # its table is (`_fill_holes`), so the window goes on past them meanwhile.
    holes: list[int] = field(default_factory=list)
    looked: int = 0  # positions below this have had their tables asked for (a window's reach)

    @property
    def ahead(self) -> int:
        """Positions declared past its furthest read."""
        return self.frontier - self.hi - 1

    def covers(self, p: int) -> bool:
        """Whether a read at `p` is one of the scan's (confirmed streams)."""
        return self.lo - max(BEHIND, self.window) <= p < max(self.frontier, self.hi + 1) + SLACK

    def reached(self, p: int, now: int) -> None:
        self.hi = max(self.hi, p)
        self.hits += 1
        self.age = 0
        self.last_hit = now


class Positions:
    """Where each chunk is in each order, and which chunks are at given positions."""

    def __init__(self, ctx: ScanTarget, listings: Listings) -> None:
        self.ctx = ctx
        self.listings = listings

    def orders(self) -> tuple[ScanOrder, ...]:
        return tuple(order for order in PRECEDENCE if order is not ScanOrder.NAME or self.ctx.name_order is not None)

    def of(self, order: ScanOrder, chunk_id: int) -> int | None:
        if order is ScanOrder.LISTING:
            return self.listings.position(chunk_id, self.ctx.table_of(chunk_id))
        if order is ScanOrder.NAME:
            names = self.ctx.name_order
            return None if names is None else names.position(chunk_id)
        if self.ctx.dense:
            return chunk_id
        listed = self.listings.sorted_ids()
        if listed is None:
            return None
        j = int(listed.searchsorted(np.uint64(chunk_id)))
        return j if j < len(listed) and int(listed[j]) == chunk_id else None

    def ids(self, order: ScanOrder, position: int, n: int) -> list[int]:
        if position < 0 or n <= 0:
            return []
        if order is ScanOrder.LISTING:
            return self.listings.ids(position, n)
        if order is ScanOrder.NAME:
            names = self.ctx.name_order
            return [] if names is None else names.ids(position, n)
        if self.ctx.dense:
            return list(range(position, position + n))
        listed = self.listings.sorted_ids()
        return [] if listed is None else int_list(listed[position:position + n])

    def at(self, order: ScanOrder, position: int) -> int | None:
        found = self.ids(order, position, 1)
        return found[0] if found else None


@dataclass(eq=False)
class TableStates:
    """The index tables of one directory (`table_of`) known to be read, and those being read
    ahead of its scans: shared by the scope of its reads and the scope of its lookups, each
    woken when a table has been read (a window may have passed chunks it holds)."""

    ready: BoundedMap[Hashable, bool] = field(default_factory=lambda: BoundedMap(READY_MAX, lru=False, counted=False))
    opening: set[Hashable] = field(default_factory=set)
    scopes: list["ScanScope"] = field(default_factory=list)


class ScanScope:
    """Read-ahead for one directory of chunk files: the reads (or lookups) it sees, the guesses
    and streams they make, and the scans those declare."""

    def __init__(self, ctx: ScanTarget, listings: Listings | None = None, tables: TableStates | None = None,
                 lookups: bool = False) -> None:
        self.ctx = ctx
        self.listings = listings if listings is not None else Listings()
        self.tables = tables if tables is not None else TableStates()
        self.positions = Positions(ctx, self.listings)
        # A scope of lookups rather than reads: its windows read the index tables of the chunks a
        # scan looks up next, never their payloads (a lookup needs its chunk's table; the payload
        # is read ahead once reads show the scan, by the scope of reads).
        self.lookups = lookups
        self.streams: list[Stream] = []  # confirmed streams, in the order they lead
        self.guesses: list[Stream] = []  # newest last
        self.recent: dict[int, None] = {}  # the last RECENT ids read, oldest first
        self.last_read: int | None = None
        self.reads = 0  # reads seen (what a stream's `last_hit` is counted in)
        self.pending: deque[int | None] = deque(maxlen=4096)  # reads to follow (None: refill)
        self.working = False
        self.scan: DeclaredScan | None = None  # what the streams declared (made on first use)
        self.tables.scopes.append(self)

    def of_lookups(self) -> "ScanScope":
        """The scope of the same directory's lookups, sharing its listings and index tables."""
        return ScanScope(self.ctx, listings=self.listings, tables=self.tables, lookups=True)

    # -- fed by the chunk files and listings --------------------------------------------

    def note(self, chunk_id: int) -> None:
        """Chunk `chunk_id`'s file is being read from its start, or (a scope of lookups) looked
        up by name, before its table is read. A read of a chunk a stream declared is followed here,
        in a few operations, even while other reads wait to be followed (a scan's foreseen reads
        say nothing about guesses, whatever their order); any other in the background, after
        the reads before it."""
        fetcher = self.ctx.fetcher
        if not fetcher.can_prefetch:
            return
        try:
            stream = self._declared(chunk_id)
        except Exception as e:  # noqa: BLE001 - inline, it runs in the reader's read: a bug in
            # read-ahead must cost the scan its prefetch, never the read (as in the background)
            log_once(log, f"readahead:{type(e).__name__}:{e}", "read-ahead failed: %s: %s", type(e).__name__, e)
            return
        if stream is not None:
            if not self._wants_more(stream):
                return  # a scan's steady state: nothing to read, no task
            if self.pending and self.pending[-1] is None:
                return  # a refill is queued already
            self.pending.append(None)
        else:
            self.pending.append(chunk_id)
        if not self.working:
            self.working = fetcher.spawn(self._work)

    async def observe(self, chunk_id: int) -> None:
        """Follow one read (or lookup) and do all the read-ahead it calls for before returning
        (what `note` leaves to the background)."""
        if self._declared(chunk_id) is None:
            await self._follow(chunk_id)
        await self._refill()

    def listed(self, table: ChunkTable, parts: Sequence[ChunkTable] = ()) -> None:
        """Ids of a listing batch, in listing order; `parts`: the index tables it was made of."""
        if len(table):
            sources = parts or (table,)
            self.listings.add(table, (self.ctx.table_of(int(t.ids[0])) for t in sources if len(t)))

    def tables_read(self, tables: Iterable[ChunkTable]) -> None:
        """Index tables a listing has read (a scan reaching them needs no read of its own)."""
        if not self.ctx.fetcher.can_prefetch:
            return  # local shards: nothing is read ahead
        for table in tables:
            if len(table):
                self._ready(self.ctx.table_of(int(table.ids[0])))

    # -- following reads -----------------------------------------------------------------

    def _declared(self, chunk_id: int) -> Stream | None:
        """The stream that declared chunk `chunk_id`, moved on to it (a read it foresaw)."""
        for stream in self.streams:
            p = stream.declared.pop(chunk_id, None)
            if p is not None:
                stream.reached(p, self.reads)
                self._remember(chunk_id)
                return stream
        return None

    def _remember(self, chunk_id: int) -> None:
        recent = self.recent
        recent[chunk_id] = None
        if len(recent) > RECENT:
            del recent[next(iter(recent))]
        self.last_read = chunk_id
        self.reads += 1

    async def _work(self) -> None:
        try:
            while self.pending:
                item = self.pending.popleft()
                try:
                    if item is not None:
                        await self._follow(item)
                    await self._refill()
                except DataError:
                    pass  # the reader's own read reports it
                except Exception as e:  # noqa: BLE001 - a bug in read-ahead costs a read its
                    # prefetch, never the reads after it (nor the read itself: it runs here)
                    log_once(log, f"readahead:{type(e).__name__}:{e}", "read-ahead failed: %s: %s",
                             type(e).__name__, e)
        finally:
            self.working = False

    async def _follow(self, chunk_id: int) -> None:
        """A read no stream declared: a read of a stream's all the same, or a guess's, or a new guess."""
        if not self.lookups:
            self._ready(self.ctx.table_of(chunk_id))  # the reader's lookup found the id in its table
        positions = self.positions
        at = {order: positions.of(order, chunk_id) for order in positions.orders()}
        for stream in self.streams:
            p = at.get(stream.order)
            if p is not None and stream.covers(p):
                stream.reached(p, self.reads)
                self._remember(chunk_id)
                return
        listings = self.listings
        for guess in self.guesses:
            guess.age += 1
        confirmed: list[Stream] = []
        for order, p in at.items():
            if p is None:
                continue
            follows = p > 0 and positions.at(order, p - 1) in self.recent
            exactly = False  # a guess followed by it exactly (else it may be the first read of a scan)
            for guess in self.guesses:
                if guess.order is order and self._match(guess, p, follows):
                    exactly = exactly or guess.last == p
                    if guess.confirmed:
                        confirmed.append(guess)
            if not exactly:
                opens = order is not ScanOrder.NAME and (chunk_id in listings.heads or chunk_id in listings.lowests)
                guess = Stream(order, p, p, p, opens=opens, frontier=p + 1)
                if follows:  # a reader's next file, whose guess is gone: as if it had been kept
                    guess = Stream(order, p - 1, p, p, follows=1, exact=False, frontier=p + 1)
                    if self._spread(guess):
                        guess.confirmed = True
                        confirmed.append(guess)
                self._take_later_guesses(guess)
                if guess.confirmed and guess not in confirmed:
                    confirmed.append(guess)
                self.guesses.append(guess)
                if order is ScanOrder.LISTING and chunk_id in listings.heads and not guess.confirmed:
                    # A listing read from its first entry is most likely read on in its order
                    # (or in id order, where the two agree: a dense directory's). Not so from
                    # its lowest id alone (`cp -r` over hashed shards: id order, which is
                    # scattered over every shard), which waits for a follow.
                    await self._extend(guess, tentative=OPEN_WINDOW)
        self._remember(chunk_id)
        for stream in confirmed:
            if stream in self.guesses:
                self._promote(stream)
        self.guesses = [g for g in self.guesses if not g.confirmed and g.age <= GUESS_AGE][-GUESSES_MAX:]

    def _match(self, guess: Stream, p: int, follows: bool) -> bool:
        """Whether a read at `p` (its order's) continues the guess, which it moves on."""
        if p == guess.last + 1 and (follows or guess.exact):
            if guess.age > EXACT_GAP:
                guess.exact = False  # not one reader's next read: others' reads came between
            guess.follows += 1
            guess.last = guess.hi = max(guess.hi, p)
            guess.age = 0
        elif guess.lo < p <= guess.lo + JOINT_SPAN and guess.age <= JOINT_READS and p not in guess.seen:
            guess.seen.add(p)
            guess.exact = False
            guess.hi = max(guess.hi, p)
        else:
            return False
        followed = guess.follows >= CONFIRM and guess.exact or guess.follows >= 1 and guess.opens
        joint = len(guess.seen) >= JOINT_CONFIRM and guess.age <= JOINT_READS
        guess.confirmed = followed or joint or self._spread(guess)
        if joint and not followed:
            guess.window = max(guess.window, JOINT_WINDOW)  # several readers read as fast as several
        return True

    def _take_later_guesses(self, guess: Stream) -> None:
        """Joint readers' reads of one instant reach the daemon in any order: a read may come
        after reads of chunks just after it, whose guesses did not see it. The new guess made at
        it takes the recent guesses of its order made at the JOINT_SPAN positions after it: their
        first reads and what they saw count as seen after its own, so the reads of one round make
        one guess, however they arrived."""
        lo, top = guess.lo, guess.lo + JOINT_SPAN
        taken = [g for g in self.guesses if g.order is guess.order and lo < g.lo <= top and g.age <= JOINT_READS]
        if not taken:
            return
        for other in taken:
            guess.seen |= {other.lo} | {p for p in other.seen if p <= top}
            guess.age = max(guess.age, other.age)
            guess.hi = max(guess.hi, other.hi)
        guess.exact = False
        self.guesses = [g for g in self.guesses if g not in taken]
        if len(guess.seen) >= JOINT_CONFIRM and guess.age <= JOINT_READS:
            guess.confirmed = True
            guess.window = max(guess.window, JOINT_WINDOW)

    def _spread(self, guess: Stream) -> bool:
        """Several readers each walking their own run of one order, near each other: SPREAD_CONFIRM
        guesses (this one among them) followed SPREAD_FOLLOWS times each, within MAX_WINDOW."""
        if guess.follows < SPREAD_FOLLOWS:
            return False
        near = [g for g in self.guesses if g is not guess and g.order is guess.order
                and g.follows >= SPREAD_FOLLOWS and abs(g.lo - guess.lo) <= MAX_WINDOW]
        if len(near) + 1 < SPREAD_CONFIRM:
            return False
        guess.window = max(guess.window, JOINT_WINDOW)
        return True

    def _promote(self, stream: Stream) -> None:
        """A confirmed guess becomes a stream, taking the guesses and streams of its order it
        overlaps (the other readers of the same scan)."""
        stream.confirmed = True
        reach = max(stream.window, stream.frontier - stream.lo) + MAX_WINDOW
        taken = [g for g in [*self.guesses, *self.streams] if g is not stream and g.order is stream.order
                 and (g.follows or g.seen or g.confirmed) and stream.lo - reach <= g.lo <= stream.hi + reach]
        running = [s for s in taken if s.confirmed]
        if running:  # a scan going on already: declared up to its frontier
            stream.frontier = max(s.frontier for s in running)
        for other in taken:
            stream.lo, stream.hi = min(stream.lo, other.lo), max(stream.hi, other.hi)
            if not running:  # guesses: from the lowest position none of them declared
                stream.frontier = min(stream.frontier, other.frontier)
            stream.declared.update(other.declared)
            stream.holes += other.holes
            if other.confirmed or other.follows:
                stream.window = max(stream.window, JOINT_WINDOW)
        if taken:
            stream.window = min(max(stream.window, 2 * (stream.hi - stream.lo)), MAX_WINDOW)
        self.guesses = [g for g in self.guesses if g not in taken and g is not stream]
        self.streams = [s for s in self.streams if s not in taken]
        # Where name order and id order agree so far (Zarr's nested keys and their ids, up to
        # c/1/... and c/10/...), the name stream leads: readers walk the names they were given.
        self.streams.append(stream)
        self.streams.sort(key=lambda s: PRECEDENCE.index(s.order))
        del self.streams[MAX_STREAMS:]

    # -- reading ahead ---------------------------------------------------------------------

    @staticmethod
    def _due(stream: Stream) -> bool:
        """Whether the stream's window should be declared further (half of it is read)."""
        return stream.ahead < stream.window // 2

    def _wants_more(self, stream: Stream) -> bool:
        """Whether the stream's window should be declared further: half of it is read, and positions
        past it may be known (not so while it has caught up with its order's known end)."""
        return self._due(stream) and stream.caught_up != self.listings.count

    async def _refill(self) -> None:
        """The first stream reads ahead; the next ones too while those before them do not carry
        the scan alone, each passing over what those before it have declared."""
        skip: set[int] = set()
        last = self.last_read
        # A stream none of the last STALE_READS reads (and at least twice its window) was of has been
        # left by its readers: what it would read ahead now they read long ago, or never will.
        self.streams = [s for s in self.streams if self.reads - s.last_hit <= max(STALE_READS, 2 * s.window)]
        for i, stream in enumerate(self.streams):
            if i and last is not None:  # (reads the streams before it took)
                p = self.positions.of(stream.order, last)
                if p is not None and stream.covers(p):
                    stream.hi = max(stream.hi, p)
            if stream.holes or not stream.extended or self._wants_more(stream):
                await self._extend(stream, skip)
            if self._carries(stream):
                return
            skip.update(stream.declared)

    async def _extend(self, stream: Stream, skip: set[int] | frozenset[int] = frozenset(),
                      tentative: int = 0) -> None:
        """Declare `window` chunks ahead of the stream's reader (but those in `skip`). With
        `tentative`, that many chunks for a guess not yet confirmed, its window left as it is."""
        if stream.holes:
            await self._fill_holes(stream)
        if not tentative and stream.extended and not self._due(stream):
            return
        if len(stream.declared) > 2 * MAX_WINDOW + BEHIND:  # forget what the readers passed by
            low = stream.hi - max(BEHIND, stream.window)
            stream.declared = {k: p for k, p in stream.declared.items() if p >= low}
        start = max(stream.frontier, stream.lo + 1)
        want = (stream.hi + 1 + tentative) if tentative else stream.hi + 1 + stream.window
        picked, stop = await self._window(stream, start, want, skip, stretch=not tentative)
        taken = self._declare(stream, picked) if picked else 0
        # The frontier passes only what the fetcher took (its budget may stop it early): the rest
        # is asked for again at the next extension, holes included.
        stream.frontier = picked[taken][0] if taken < len(picked) else stop
        # (`ended`: the window went through every position known; none was left to the budget)
        stream.caught_up = self.listings.count if stream.ended and stream.frontier == stop else -1
        stream.holes = [p for p in stream.holes if p < stream.frontier]
        if not tentative:
            stream.window = min(stream.window * 2, MAX_WINDOW)
            stream.extended = True

    async def _fill_holes(self, stream: Stream) -> None:
        """Declare the chunks a window passed while their index tables were being read, those
        whose tables are read now; those the readers have passed are left to them."""
        low = stream.hi - max(BEHIND, stream.window)
        waiting: list[int] = []
        picked: list[Picked] = []
        for p in stream.holes:
            if p < low:
                continue
            chunk_id = self.positions.at(stream.order, p)
            if chunk_id is None or chunk_id in self.recent:
                continue
            if not self._opened(chunk_id):
                waiting.append(p)
                continue
            found = await self._extent(chunk_id)
            if found is not None:
                picked.append((p, chunk_id, *found))
        taken = self._declare(stream, picked) if picked else 0
        stream.holes = sorted(waiting + [p for p, _, _, _ in picked[taken:]])

    def _declare(self, stream: Stream, picked: list[Picked]) -> int:
        """Declare the picked chunks of the stream; how many of them, from the first, the fetcher
        took (its budget may stop it early)."""
        tables: dict[Identity, dict[int, ChunkTable]] = {}  # blob -> the tables the window's chunks are in
        for _, _, _, table in picked:
            tables.setdefault(table.blob.identity, {})[id(table)] = table

        # A scan in id order over hashed shards wants chunks scattered over each shard: the
        # chunks between them come later in the same scan (those above the id just read), so a
        # request may span them (fewer, larger requests) and keep them rather than read them again.
        last = self.last_read
        after = last if stream.order is ScanOrder.ID and last is not None else None

        def fill(blob: Blob, start: int, end: int) -> list[Extent]:
            return self._fill(blob, start, end, tables.get(blob.identity, {}).values(), after)

        # The same over name and listing order (a nested Zarr directory's listing walks every
        # shard of a row at once): what lies between its chunks is mostly chunks of the same scan
        # (those read already are kept for their readers, and not named by `fill`).
        if self.scan is None:
            self.scan = DeclaredScan(self.ctx.fetcher)
        taken = self.scan.declare([ext for _, _, ext, _ in picked], fill, wide=True)
        declared = stream.declared
        for p, chunk_id, _, _ in picked[:taken]:
            declared[chunk_id] = p
        return taken

    def _carries(self, stream: Stream) -> bool:
        """Whether the stream has chunks declared ahead of its reader, more than the last few of
        its order (a directory's listing ending), and has not caught up with the positions its
        order knows (a walk listing nested directories as its readers read them): else the next
        stream reads ahead as well."""
        ahead = stream.ahead
        return (ahead > 0 and (not stream.ended or ahead >= CARRY)
                and stream.caught_up != self.listings.count)

    async def _window(self, stream: Stream, start: int, want: int, skip: set[int] | frozenset[int] = frozenset(),
                      stretch: bool = True) -> tuple[list[Picked], int]:
        """(position, extent, table) of the stream's chunks from position `start` on, and where they
        stop: up to `want`, then (with `stretch`) on while they stay in the last one's blob, or for
        a listing in the blobs the window reads from (a window never splits a shard's run of chunks
        into two requests), with at most MAX_WINDOW more and a quarter of the prefetch budget in
        bytes. Chunks read already are passed over;
        one whose index table is being read too (a hole, declared once it is read: `_fill_holes`);
        the window stops early only at one whose table cannot be read yet (OPENS_MAX being read
        already)."""
        picked: list[Picked] = []
        # A listing's window is stretched while it stays in the shards it reads from (a nested Zarr
        # directory's listing walks every shard of a row in turn); the others' while in the last one's.
        blobs: set[Identity] = set()
        listing = stream.order is ScanOrder.LISTING
        limit = want + MAX_WINDOW if stretch else want
        budget = self.ctx.fetcher.policy.prefetch_bytes // 4
        recent = self.recent
        ids = self.positions.ids(stream.order, start, max(limit - start, 0))
        stream.ended = len(ids) < limit - start
        p = start
        for chunk_id in ids:
            if budget <= 0:
                stream.ended = False
                break
            found: tuple[Extent, ChunkTable] | None = None
            hole = False
            if chunk_id not in recent and chunk_id not in skip and chunk_id not in stream.declared:
                opened = self._opened(chunk_id)
                if opened is None:
                    stream.ended = False
                    break  # as many tables are being read as may be: the window goes on once they are
                if not opened:
                    hole = not self.lookups  # declared once its table is read (`_fill_holes`)
                elif not self.lookups:
                    found = await self._extent(chunk_id)
            if p >= want and (found is None or (found[0].blob.identity not in blobs if listing else
                                                not picked or found[0].blob.identity != picked[-1][2].blob.identity)):
                stream.ended = False
                break
            if self.lookups:
                stream.declared[chunk_id] = p  # its table asked for: a lookup of it is the scan's
            elif hole:
                stream.holes.append(p)
            elif found is not None:
                picked.append((p, chunk_id, *found))
                budget -= found[0].length
                blobs.add(found[0].blob.identity)
            p += 1
        # The tables the next window reaches, asked for now in the background (all at once), so
        # neither it nor the readers' lookups wait for them one after another.
        reach = p + min(2 * max(want - start, FIRST_WINDOW), MAX_WINDOW)
        at = max(p, stream.looked)  # (asked once per position: each is a hash for hashed shards)
        if at < reach:
            for chunk_id in self.positions.ids(stream.order, at, reach - at):
                if self._opened(chunk_id) is None:
                    break
                at += 1
        stream.looked = max(stream.looked, at)
        return picked, p

    def _opened(self, chunk_id: int) -> bool | None:
        """Whether the index table of `chunk_id` is known to be read (True), or being read in the
        background (False: started now if it was not, once per table, with a task per table);
        None when it is neither and OPENS_MAX tables are being read already. Without a
        background, True: the caller reads it."""
        table = self.ctx.table_of(chunk_id)
        tables = self.tables
        if table is None or table in tables.ready:
            return True
        if table not in tables.opening:
            if len(tables.opening) >= OPENS_MAX:
                return None
            if not self.ctx.fetcher.spawn(self._open, table, chunk_id):
                return True
            tables.opening.add(table)
        return False

    async def _open(self, table: Hashable, chunk_id: int) -> None:
        try:
            await self.ctx.locate(chunk_id)
        except DataError:
            pass  # the reader's own lookup reports it
        finally:
            self.tables.opening.discard(table)
            self._ready(table)
        # The windows that passed or stopped at this table go on now, not at the next read:
        # readers waiting for the same table in their lookups read on as soon as it is there.
        for scope in self.tables.scopes:
            scope.wake()

    def wake(self) -> None:
        """Extend the leading streams again in the background (an index table has been read):
        once for the tables read since the last time it did, and only if there is a stream."""
        if not self.streams:
            return  # nothing to extend
        if not self.pending or self.pending[-1] is not None:
            self.pending.append(None)
        if not self.working:
            self.working = self.ctx.fetcher.spawn(self._work)

    def _ready(self, table: Hashable | None) -> None:
        ready = self.tables.ready
        if table is not None and table not in ready:
            ready[table] = True

    async def _extent(self, chunk_id: int) -> tuple[Extent, ChunkTable] | None:
        """The chunk's extent and the table it is in, if it is worth prefetching."""
        try:
            found = await self.ctx.locate(chunk_id)
        except DataError:
            return None
        if found is None:
            return None
        table, i = found
        ext = Extent(table.blob, table.starts.item(i), table.lengths.item(i))
        return (ext, table) if self._wanted(ext) else None

    def _wanted(self, ext: Extent) -> bool:
        """Whether prefetching the chunk's payload could save its reader a request."""
        return ext.length <= WHOLE_READ_MAX and not self.ctx.has_payload(ext)

    def _fill(self, blob: Blob, start: int, end: int, tables: Iterable[ChunkTable],
              after: int | None = None) -> list[Extent]:
        """The chunks a prefetch of [start, end) of `blob` reads anyway, known from the listing
        and from `tables` (a scan in id order wants them later: keep them rather than read them
        again); with `after`, only those of ids above it (the scan has read the others)."""
        found = {ext.key: ext for ext in self.listings.within(blob, start, end, after)}
        for table in tables:
            ends = table.starts + table.lengths
            inside = (table.starts >= np.uint64(start)) & (ends <= np.uint64(end))
            if after is not None:
                inside &= table.ids > np.uint64(after)
            for i in np.nonzero(inside)[0].tolist():
                ext = Extent(blob, int(table.starts[i]), int(table.lengths[i]))
                found.setdefault(ext.key, ext)
        return [ext for ext in found.values() if self._wanted(ext)]
