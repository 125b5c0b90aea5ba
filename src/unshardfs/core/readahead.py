"""Read-ahead: recognise scans of a sharded directory and fetch what comes next.

Tools that copy or walk a directory read its chunk files one after another,
each read a round trip to an object store. A `ScanScope` watches the order
in which a directory's chunk files are first read and recognises three kinds
of scan:

- id order: ascending chunk ids, which is inode order (`cp -r` sorts a
  directory by inode number before copying, and our computed inodes are the
  ids) and, for grids, a walk over neighbouring cells;
- listing order: the order of the directory's listing (`tar`, `find`,
  `ls -f | xargs`), which is the order of the index tables, shard by shard;
  before any listing, consecutive entries of one index table;
- name order: the names sorted as strings (grids only, see nameorder.py),
  as scripts that split a sorted file list over parallel readers walk it.

A guess becomes a stream after two reads that match it exactly, so a viewer
reading scattered chunks starts no prefetch; after one where the guess began
at the start of a listing batch (a tool that lists a directory and reads it
from its first file, which a viewer does not do). A guess in listing order
made at a listing's first entry also prefetches the listing's next few
chunks at once (OPEN_WINDOW), so the read that confirms it finds them on
their way. Several readers walking one
order together (each taking every n-th name) reach the daemon out of order:
a guess also becomes a stream once JOINT_CONFIRM of the JOINT_READS reads
that follow its first read were of distinct chunks among the JOINT_SPAN
that follow it (dense reading close behind, which scattered reads do not
do: a viewer's reads would land there now and then over a long time, not
most of a few), whatever order the reads of one instant arrive in (a guess
made behind recent guesses takes what they saw), and a stream counts reads
up to BEHIND chunks behind its furthest one as its own (readers lagging
behind). A stream so confirmed starts with a larger window (JOINT_WINDOW).
A confirmed stream keeps a window of upcoming chunks prefetched (doubling up
to MAX_WINDOW), coalesced by the fetcher; a window that ends inside a
shard's run of upcoming chunks is stretched to the end of that run, so each
run of adjacent chunks costs one request rather than one per window. Several
streams per directory are tracked at once (parallel readers each scanning
their part).

A window does not stop at a chunk whose index table (a shard's stat and
index, a minishard index) nobody has read yet: it reads that table in the
background, at most OPENS_MAX at once, goes on past the chunks it holds and
prefetches them once it is read; the tables the next window reaches are read
too. The lookups by name of a directory are watched the same way by a second
scope (`of_lookups`), which reads only index tables: readers that look up
their files before reading them show their scan a chain of index reads
earlier than their reads do, and the tables of the chunks they reach next are
there when they do. Neither scope reads anything without a confirmed stream
(a viewer's scattered lookups and reads read no table ahead).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Protocol, cast

import numpy as np

from unshardfs.core.blob import Blob, Identity
from unshardfs.core.fetch import Extent, Fetcher
from unshardfs.core.nameorder import NameOrder
from unshardfs.core.policy import POLICY
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
READY_MAX = 1 << 16  # index tables remembered as read (a cache may drop them since: then a window waits)
CARRY = FIRST_WINDOW // 2  # chunks prefetched ahead of an ending stream that still carry a scan alone

Picked = tuple[int, Extent, ChunkTable]  # a stream position, its chunk's extent, and the chunk's table


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


@dataclass(eq=False)
class _Stream:
    order: str  # "id", "listing" or "name"
    upcoming: list[int]  # predicted ids, in order
    cursor: int = 0  # index in `upcoming` after the furthest id read
    frontier: int = 0  # ids before this index have been prefetched
    extended: bool = False  # a window has been prefetched since it was confirmed
    hits: int = 0
    window: int = FIRST_WINDOW
    confirmed: bool = False
    follows: int = 0  # reads of exactly the next predicted id, all of them so far
    exact: bool = True  # whether the last read matched so (and every read before it)
    seen: set[int] = field(default_factory=set)  # ids read while a guess
    age: int = 0  # reads observed since the guess was made
    # Positions in `upcoming` a window passed while their index tables were being read: each is
    # prefetched once its table is (`_fill_holes`), so the window goes on past them meanwhile.
    holes: list[int] = field(default_factory=list)
    looked: int = 0  # positions before this one have had their tables asked for (`_window`'s reach)
    ended: bool = False  # no ids are expected after `upcoming` (a listing stream's directory ends)
    # The guess began where a listing batch begins (its first entry, its lowest id): a tool that
    # lists a directory and then reads its files from the first one (`cp -r`, `tar`, `find
    # -exec`), which a viewer never does; one exact follow confirms it.
    opens: bool = False
    first: int | None = None  # the id whose read made the guess

    def match(self, chunk_id: int) -> bool:
        self.age += 1
        if self.confirmed:
            # Tolerates skips ahead (a reader skipping files) and reads a little behind (parallel
            # readers arrive out of order).
            i = self._find(chunk_id, max(self.cursor - BEHIND, 0), self.cursor + SLACK)
            if i is None:
                return False
        else:
            # A guess is followed exactly, or densely close behind its first read (joint readers):
            # scattered reads (a viewer) would otherwise land within the slack of some guess often
            # enough to look like a scan on a small directory.
            i = self._find(chunk_id, self.cursor, self.cursor + 1) if self.exact else None
            if i is not None:
                self.follows += 1
            else:
                i = self._find(chunk_id, 0, JOINT_SPAN) if self.age <= JOINT_READS else None
                if i is None or chunk_id in self.seen:
                    return False
                self.exact = False
            self.seen.add(chunk_id)
            self._confirm()
        self.cursor = max(self.cursor, i + 1)
        self.hits += 1
        return True

    def absorb(self, other: "_Stream") -> None:
        """Take a guess of the same order that predicted the same id (so the same ids after it):
        what it saw counts as seen here, as if since the older one's first read."""
        self.seen |= other.seen
        self.age = max(self.age, other.age)
        self.hits = max(self.hits, other.hits)
        self._confirm()

    def _confirm(self) -> None:
        followed = self.exact and self.follows >= (1 if self.opens else CONFIRM)
        joint = len(self.seen) >= JOINT_CONFIRM and self.age <= JOINT_READS
        self.confirmed = followed or joint
        if joint and not followed and not self.extended:
            self.window = max(self.window, JOINT_WINDOW)  # several readers read as fast as several

    def _find(self, chunk_id: int, lo: int, hi: int) -> int | None:
        try:
            return self.upcoming.index(chunk_id, lo, hi)
        except ValueError:
            return None


class Listings:
    """What a directory's listing batches said: ids in listing order, to continue a scan where
    the listing goes next (the next table, the next shard), and each blob's chunk extents, to
    name the chunks a prefetch reads in its gaps. Bounded by LISTED_KEYS_MAX entries; a
    listing read again adds nothing."""

    def __init__(self) -> None:
        self.batches: list[np.ndarray] = []
        self.count = 0
        self._seen: set[tuple[Identity, int, int]] = set()
        self.heads: set[int] = set()  # each batch's first id (a scan in listing order starts there)
        self.lowests: set[int] = set()  # ... and its lowest (a scan in id order starts at either)
        self._orders: dict[int, np.ndarray] = {}  # batch -> argsort of its ids (on demand)
        self._last = 0  # the batch the last question was answered from (scans move forward)
        self._sorted: np.ndarray | None = None
        self._tables: dict[Identity, list[ChunkTable]] = {}  # blob identity -> its listed tables
        # ... as (starts, lengths, ids) sorted by start
        self._spans: dict[Identity, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def add(self, table: ChunkTable) -> None:
        mark = (table.blob.identity, int(table.ids[0]), len(table))
        if mark in self._seen or self.count >= LISTED_IDS_MAX:
            return
        self._seen.add(mark)
        self.heads.add(int(table.ids[0]))
        self.lowests.add(int(table.ids.min()))
        self.batches.append(table.ids)
        self.count += len(table.ids)
        self._sorted = None
        self._tables.setdefault(table.blob.identity, []).append(table)
        self._spans.pop(table.blob.identity, None)

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
        lo, hi = np.searchsorted(starts, [np.uint64(start), np.uint64(end)])
        if after is not None:
            ahead = ids[lo:hi] > np.uint64(after)
            pairs = zip(starts[lo:hi][ahead].tolist(), lengths[lo:hi][ahead].tolist())
        else:
            pairs = zip(starts[lo:hi].tolist(), lengths[lo:hi].tolist())
        return [Extent(blob, s, n) for s, n in pairs if s + n <= end]

    def after(self, chunk_id: int, n: int) -> list[int] | None:
        """Up to `n` ids listed after `chunk_id`; None if `chunk_id` was not listed."""
        count = len(self.batches)
        for b in [self._last, *range(self._last + 1, count), *range(self._last)] if count else []:
            i = self._position(b, chunk_id)
            if i is not None:
                self._last = b
                out = int_list(self.batches[b][i + 1:i + 1 + n])
                for later in self.batches[b + 1:]:
                    if len(out) >= n:
                        break
                    out += int_list(later[:n - len(out)])
                return out
        return None

    def _position(self, b: int, chunk_id: int) -> int | None:
        ids = self.batches[b]
        order = self._orders.get(b)
        if order is None:
            order = self._orders[b] = np.argsort(ids, kind="stable")
        j = int(np.searchsorted(ids, np.uint64(chunk_id), sorter=order))
        return int(order[j]) if j < len(ids) and int(ids[order[j]]) == chunk_id else None

    def sorted_ids(self) -> np.ndarray | None:
        if not self.batches:
            return None
        if self._sorted is None:
            self._sorted = np.unique(np.concatenate(self.batches))
        return self._sorted


@dataclass(eq=False)
class TableStates:
    """The index tables of one directory (`table_of`) known to be read, and those being read
    ahead of its scans: shared by the scope of its reads and the scope of its lookups, each
    woken when a table has been read (a window may have passed chunks it holds)."""

    ready: BoundedMap[Hashable, bool] = field(default_factory=lambda: BoundedMap(READY_MAX, lru=False, counted=False))
    opening: set[Hashable] = field(default_factory=set)
    scopes: list["ScanScope"] = field(default_factory=list)


@dataclass(eq=False)
class ScanScope:
    ctx: ScanTarget
    streams: list[_Stream] = field(default_factory=list)
    # Reads to follow, with the streams they matched if already matched (None: refill).
    pending: deque[tuple[int, list[_Stream] | None] | None] = field(default_factory=lambda: deque(maxlen=4096))
    working: bool = False
    listings: Listings = field(default_factory=Listings)
    tables: TableStates = field(default_factory=TableStates)
    # A scope of lookups rather than reads: its windows read the index tables of the chunks a
    # scan looks up next, never their payloads (a lookup needs its chunk's table; the payload
    # is read ahead once reads show the scan, by the scope of reads).
    lookups: bool = False

    def __post_init__(self) -> None:
        self.tables.scopes.append(self)

    def of_lookups(self) -> "ScanScope":
        """The scope of the same directory's lookups, sharing its listings and index tables."""
        return ScanScope(self.ctx, listings=self.listings, tables=self.tables, lookups=True)

    # -- fed by the chunk files and listings --------------------------------------------

    def note(self, chunk_id: int) -> None:
        """Chunk `chunk_id`'s file is being read from its start, or (a scope of lookups) looked
        up by name, before its table is read (cheap: the work happens in the background)."""
        fetcher = self.ctx.fetcher
        if not fetcher.can_prefetch:
            return
        if self.working or self.pending:
            self.pending.append((chunk_id, None))  # matched in turn, after the reads before it
        else:
            # A scan's steady state: its streams move on and their windows are still ahead of
            # the reader, so nothing is read and no task is needed (a task per chunk file
            # otherwise, at every read of a `cp -r`).
            try:
                matched = self._match(chunk_id)
                if self._settled(matched):
                    return
            except Exception as e:  # noqa: BLE001 - inline, it runs in the reader's read: a bug in
                # read-ahead must cost the scan its prefetch, never the read (as in the background)
                log_once(log, f"readahead:{type(e).__name__}:{e}", "read-ahead failed: %s: %s", type(e).__name__, e)
                return
            self.pending.append((chunk_id, matched))
        if not self.working:
            self.working = fetcher.spawn(self._work)

    def listed(self, table: ChunkTable) -> None:
        """Ids of a listing batch, in listing order."""
        if len(table):
            self.listings.add(table)

    def tables_read(self, tables: Iterable[ChunkTable]) -> None:
        """Index tables a listing has read (a scan reaching them needs no read of its own)."""
        if not self.ctx.fetcher.can_prefetch:
            return  # local shards: nothing is read ahead
        for table in tables:
            if len(table):
                self._ready(self.ctx.table_of(int(table.ids[0])))

    # -- the background worker -------------------------------------------------------------

    async def _work(self) -> None:
        try:
            while self.pending:
                item = self.pending.popleft()
                if item is None:
                    await self._refill()
                else:
                    chunk_id, matched = item
                    await self._follow(chunk_id, self._match(chunk_id) if matched is None else matched)
        finally:
            self.working = False

    async def _refill(self) -> None:
        """Extend the leading stream again (an index table it waited for has been read)."""
        await self._lead([stream for stream in self.streams if stream.confirmed])

    async def _observe(self, chunk_id: int) -> None:
        await self._follow(chunk_id, self._match(chunk_id))

    def _match(self, chunk_id: int) -> list[_Stream]:
        """Move on every stream that predicted the id, not only the first (one per order), and
        put them in front; the streams that did."""
        if not self.lookups:
            self._ready(self.ctx.table_of(chunk_id))  # the reader's lookup found the id in its table
        matched = self._one_per_order([stream for stream in self.streams if stream.match(chunk_id)])
        if matched:
            # Without a listing, readers walking in order walk the names they were given (a
            # sorted file list, perhaps split between them), not our ids: where name order and
            # id order agree so far (Zarr's nested keys and their ids, up to c/1/... and
            # c/10/...), the name stream leads, not the one its reads would leave at the first
            # name out of the other's order (a round trip's stall there).
            if not any(stream.order == "listing" for stream in matched):
                matched.sort(key=lambda stream: stream.order != "name")
            self.streams = matched + [stream for stream in self.streams if stream not in matched]
        return matched

    def _settled(self, matched: list[_Stream]) -> bool:
        """Whether `_follow` would do nothing for these streams: the leading confirmed ones keep
        their windows without extending them (`_lead` stops at the first that carries the scan)."""
        leading = [stream for stream in matched if stream.confirmed]
        if not leading:
            return False  # new guesses to make
        for stream in leading:
            if not self._ahead(stream):
                return False
            if self._carries(stream):
                return True
        return True

    async def _follow(self, chunk_id: int, matched: list[_Stream]) -> None:
        """Read ahead for the streams that matched the id, or make new guesses from it."""
        # The first confirmed stream reads ahead, and the next too once the first's window has
        # reached its end: a listing stream ends with its directory, and the id stream beside it
        # then carries the scan into the next one (`cp -r` of nested Zarr chunk directories) as
        # soon as the listing stream has prefetched its last chunks, not only once its reader
        # has read them (a round trip's stall at every directory otherwise).
        if matched:
            await self._lead([stream for stream in matched if stream.confirmed])
            if any(stream.confirmed for stream in matched):
                return
        # A new guess in each order no stream of which follows the id exactly (a guess matched
        # only as a joint reader's read may be the first read of a scan all the same).
        followed = {stream.order for stream in matched if stream.confirmed or stream.exact}
        for order in ("name", "id", "listing"):  # each in front: where several match, listing order leads
            if order not in followed:
                upcoming = await self._successors(order, chunk_id, FIRST_WINDOW + SLACK)
                if upcoming:
                    listings = self.listings
                    opens = order != "name" and (chunk_id in listings.heads or chunk_id in listings.lowests)
                    stream = _Stream(order, upcoming, opens=opens, first=chunk_id)
                    self._take_later_guesses(stream)
                    self.streams.insert(0, stream)
                    if stream.confirmed:
                        await self._extend(stream)
                    if order == "listing" and chunk_id in listings.heads:
                        # A listing read from its first entry is most likely read on in its order
                        # (or in id order, where the two agree: a dense directory's). Not so from
                        # its lowest id alone (`cp -r` over hashed shards: id order, which is
                        # scattered over every shard), which waits for a follow.
                        await self._extend(stream, tentative=OPEN_WINDOW)
        del self.streams[MAX_STREAMS:]

    def _take_later_guesses(self, stream: _Stream) -> None:
        """Joint readers' reads of one instant reach the daemon in any order: a read may come
        after reads of chunks just after it, whose guesses did not predict it. The new guess made
        at it takes the recent guesses of its order made at the chunks it predicts next (within
        JOINT_SPAN): their first reads and what they saw count as seen after its own, so the
        reads of one round make one guess, however they arrived."""
        ahead = set(stream.upcoming[:JOINT_SPAN])
        taken = [other for other in self.streams
                 if other.order == stream.order and not other.extended and other.first in ahead
                 and other.age <= JOINT_READS]
        for other in taken:
            stream.seen |= {cast(int, other.first)} | (other.seen & ahead)
            stream.age = max(stream.age, other.age)
        if taken:
            # Its cursor stays: the next read may still follow it exactly (one reader going back
            # a file), and its first window starts there, passing over what was read.
            self.streams = [other for other in self.streams if other not in taken]
            stream._confirm()

    def _one_per_order(self, matched: list[_Stream]) -> list[_Stream]:
        """The streams that matched an id, one per order: two streams of one order that both
        predicted the id predict the same ids after it (several readers starting a scan at
        once make several guesses), so one is kept: the furthest ahead, or the guess nearest
        to confirmation, which takes what the others saw."""
        def progress(stream: _Stream) -> tuple[bool, int, int, int]:
            if stream.confirmed:
                return True, stream.frontier - stream.cursor, 0, 0
            return False, stream.follows if stream.exact else 0, len(stream.seen), -stream.age

        best: dict[str, _Stream] = {}
        for stream in matched:
            kept = best.get(stream.order)
            if kept is None or progress(stream) > progress(kept):
                best[stream.order] = stream
        if len(best) == len(matched):
            return matched
        for stream in matched:
            kept = best[stream.order]
            if kept is not stream and not kept.confirmed:
                kept.absorb(stream)
        dropped = [stream for stream in matched if best[stream.order] is not stream]
        self.streams = [stream for stream in self.streams if stream not in dropped]
        return [stream for stream in matched if best[stream.order] is stream]

    async def _lead(self, streams: list[_Stream]) -> None:
        """The first stream reads ahead; the next ones too while those before them do not carry
        the scan alone, each passing over what those before it have prefetched."""
        skip: set[int] = set()
        for stream in streams:
            if await self._extend(stream, skip):
                return
            skip.update(stream.upcoming[:stream.frontier])  # (readers lagging behind have yet to read some)

    async def _extend(self, stream: _Stream, skip: set[int] | frozenset[int] = frozenset(),
                      tentative: int = 0) -> bool:
        """Keep `window` chunks prefetched ahead of the stream's reader (but those in `skip`);
        whether it carries the scan (`_carries`). With `tentative`, that many chunks for a guess
        not yet confirmed, its window left as it is."""
        if stream.holes:
            await self._fill_holes(stream)
        if not tentative and self._ahead(stream):
            return self._carries(stream)
        if stream.cursor > MAX_WINDOW + BEHIND:  # forget what the readers have passed
            passed = stream.cursor - BEHIND
            del stream.upcoming[:passed]
            stream.frontier -= passed
            stream.cursor -= passed
            stream.holes = [i - passed for i in stream.holes if i >= passed]
            stream.looked = max(stream.looked - passed, 0)
        start = max(stream.frontier, stream.cursor)
        if not stream.extended:  # the first window: also what joint readers passed and have not read yet
            start = min((i for i in range(stream.frontier, stream.cursor) if stream.upcoming[i] not in stream.seen),
                        default=start)
        picked, stop = await self._window(stream, start, stream.cursor + (tentative or stream.window), skip,
                                          stretch=not tentative)
        taken = self._prefetch(stream, picked) if picked else 0
        # The frontier passes only what the fetcher took (its budget may stop it
        # early): the rest is asked for again at the next extension, holes included.
        stream.frontier = picked[taken][0] if taken < len(picked) else stop
        stream.holes = [i for i in stream.holes if i < stream.frontier]
        if not tentative:
            stream.window = min(stream.window * 2, MAX_WINDOW)
            stream.extended = True
        return self._carries(stream)

    async def _fill_holes(self, stream: _Stream) -> None:
        """Prefetch the chunks a window passed while their index tables were being read, those
        whose tables are read now; those the readers have passed are left to them."""
        low = stream.cursor - BEHIND
        waiting: list[int] = []
        picked: list[Picked] = []
        for i in stream.holes:
            if i < low:
                continue
            if not self._opened(stream.upcoming[i]):
                waiting.append(i)
                continue
            found = await self._extent(stream.upcoming[i])
            if found is not None:
                picked.append((i, *found))
        taken = self._prefetch(stream, picked) if picked else 0
        stream.holes = sorted(waiting + [i for i, _, _ in picked[taken:]])

    def _prefetch(self, stream: _Stream, picked: list[Picked]) -> int:
        """Prefetch the picked chunks of the stream; how many of them, from the first, the
        fetcher took (its budget may stop it early)."""
        tables: dict[Identity, dict[int, ChunkTable]] = {}  # blob -> the tables the window's chunks are in
        for _, _, table in picked:
            tables.setdefault(table.blob.identity, {})[id(table)] = table

        # A scan in id order over hashed shards wants chunks scattered over each shard: the
        # chunks between them come later in the same scan (those above the id just read), so a
        # request may span them (fewer, larger requests) and keep them rather than read them again.
        after = stream.upcoming[stream.cursor - 1] if stream.order == "id" and stream.cursor else None

        def fill(blob: Blob, start: int, end: int) -> list[Extent]:
            return self._fill(blob, start, end, tables.get(blob.identity, {}).values(), after)

        # The same over a name-order scan: what lies between its chunks is mostly chunks of later
        # names (those read already are kept for their readers, and not named by `fill`).
        wide = after is not None or stream.order == "name"
        return self.ctx.fetcher.prefetch([ext for _, ext, _ in picked], fill, wide=wide)

    @staticmethod
    def _ahead(stream: _Stream) -> bool:
        """Whether the stream's window is still far enough ahead of its reader to wait (half of it
        prefetched and unread): `_extend` extends it only when not."""
        return stream.frontier - stream.cursor >= stream.window // 2

    @staticmethod
    def _carries(stream: _Stream) -> bool:
        """Whether the stream has chunks prefetched ahead of its reader, and more than the last few
        of its order (a directory's listing ending): else the next stream reads ahead as well."""
        ahead = stream.frontier - stream.cursor
        return ahead > 0 and (not stream.ended or ahead >= CARRY)

    async def _window(self, stream: _Stream, start: int, want: int, skip: set[int] | frozenset[int] = frozenset(),
                      stretch: bool = True) -> tuple[list[Picked], int]:
        """(position, extent, table) of the stream's upcoming ids from `start` on, and where they stop:
        up to `want`, then (with `stretch`) on while they stay in the last one's blob (a window
        never splits a shard's run of upcoming chunks into two requests), with at most MAX_WINDOW
        more ids and a quarter of the prefetch budget in bytes. An id whose index table is being
        read is passed over (a hole, prefetched once it is read: `_fill_holes`); the window stops
        early only at one whose table cannot be read yet (OPENS_MAX being read already)."""
        picked: list[Picked] = []
        limit = want + MAX_WINDOW if stretch else want
        budget = self.ctx.fetcher.policy.prefetch_bytes // 4
        i = start
        while i < limit and budget > 0:
            if i >= len(stream.upcoming):
                more = await self._successors(stream.order, stream.upcoming[-1], max(want - i, FIRST_WINDOW) +
                                              SLACK) if stream.upcoming else []
                stream.ended = not more
                if not more:
                    break
                stream.upcoming.extend(more)
            chunk_id = stream.upcoming[i]
            found: tuple[Extent, ChunkTable] | None = None
            hole = False
            if chunk_id not in stream.seen and chunk_id not in skip:
                opened = self._opened(chunk_id)
                if opened is None:
                    break  # as many tables are being read as may be: the window goes on once they are
                if not opened:
                    found, hole = None, not self.lookups  # prefetched once its table is read (`_fill_holes`)
                elif not self.lookups:
                    found = await self._extent(chunk_id)
            if i >= want and (found is None or not picked or found[0].blob.identity != picked[-1][1].blob.identity):
                break
            if hole:
                stream.holes.append(i)
            elif found is not None:
                picked.append((i, *found))
                budget -= found[0].length
            i += 1
        # The tables the next window reaches, read now in the background (all at once), so
        # neither it nor the readers' lookups wait for them one after another.
        reach = i + min(2 * max(want - start, FIRST_WINDOW), MAX_WINDOW)
        if stream.upcoming and not stream.ended and len(stream.upcoming) < reach:
            stream.upcoming.extend(await self._successors(stream.order, stream.upcoming[-1],
                                                          reach - len(stream.upcoming)))
        at = max(i, stream.looked)  # (asked once per position: each is a hash for hashed shards)
        for chunk_id in stream.upcoming[at:reach]:
            if self._opened(chunk_id) is None:
                break
            at += 1
        stream.looked = max(stream.looked, at)
        return picked, i

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
        once for the tables read since the last time it did, and only if a stream is confirmed."""
        if not any(stream.confirmed for stream in self.streams):
            return  # nothing to extend (`_refill` leads the confirmed streams only)
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
        ext = Extent(table.blob, int(table.starts[i]), int(table.lengths[i]))
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

    async def _successors(self, order: str, chunk_id: int, n: int) -> list[int]:
        """Up to `n` ids expected after `chunk_id` in a scan of the given order."""
        if order == "name":
            names = self.ctx.name_order
            return [] if names is None else names.after(chunk_id, n)
        if order == "id":
            if self.ctx.dense:
                return list(range(chunk_id + 1, chunk_id + 1 + n))
            listed = self.listings.sorted_ids()
            if listed is None:
                return []
            i = int(np.searchsorted(listed, np.uint64(chunk_id), side="right"))
            return int_list(listed[i:i + n])
        listed_after = self.listings.after(chunk_id, n)
        if listed_after is not None:
            return listed_after
        if self.lookups:
            return []  # its table is not read yet: that is what the lookup is reading
        try:  # not listed: the entries after it in its index table
            found = await self.ctx.locate(chunk_id)
        except DataError:
            return []
        if found is None:
            return []
        table, i = found
        return int_list(table.ids[i + 1:i + 1 + n])
