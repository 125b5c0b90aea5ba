"""The operations layer both FUSE engines serve: the virtual tree as inodes.

It knows no transport: the kernel engine and the pyfuse3 engine are thin
bindings that decode a request, call one of these methods and encode the
answer. Here live the inode table (computed inodes, exact lookup counts),
directory listings streamed with stable cookies, attributes revalidated
against the backing shards, reads that follow a replaced shard once, and
extended attributes (including the live statistics on the root).

Errors a request should answer are raised as `FsError(errno)`; anything
else is classified by the engine through `unshardfs.tree.edge`.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, TypeGuard, runtime_checkable

from unshardfs.fuse.abi import FsError
from unshardfs.tree.edge import read_current
from unshardfs.tree.nodes import CHILD_ID_BITS, Batch, Closable, DirNode, Entry, EntryBatch, FdRange, FileNode, Node
from unshardfs.util.errors import DataError, StaleError
from unshardfs.util.maps import BoundedMap

ROOT = 1
STATS_XATTR = "user.unshardfs.stats"
DIR_MODE = stat.S_IFDIR | 0o555
FILE_MODE = stat.S_IFREG | 0o444
BLOCK_SIZE = 1 << 17
ENOATTR = errno.ENODATA
FS_ENCODING = sys.getfilesystemencoding()
SERVED_MAX = 1 << 16  # inodes remembered as served (`Bridge.served`), least recently served forgotten


@dataclass(frozen=True)
class MountOptions:
    entry_timeout: float = 3600.0
    attr_timeout: float = 3600.0
    # How long the kernel engine's reader looks for the next request itself before it waits
    # through trio (`transport.QuickWait`, which gives way to trio's own work); 0: never.
    quick_wait: float = 100e-6
    # Kernel engine: files stored whole in a local file are opened for FUSE passthrough (the
    # kernel reads them itself), at the cost of an OPEN round trip for every open() of any file.
    passthrough: bool = False
    # Kernel engine: "dev" (read and write /dev/fuse) or "uring" (FUSE over io_uring where the
    # kernel grants it, experimental).
    transport: str = "dev"


class InodeTable:
    """Inode numbers for the nodes the kernel currently knows about.

    Two kinds of numbers:
    - *computed*: a file with an `child_id` inside a directory with a
      `stable_key` gets `slot << CHILD_ID_BITS | child_id`, where the slot names
      the directory. Nothing is stored per such inode (a bounded LRU keeps
      recently used nodes); the node is rebuilt from the directory on demand.
      This keeps the daemon's memory flat however many chunks are listed.
    - *tabled*: everything else (directories, passthrough files) is handed a
      counter value on lookup and dropped when the kernel forgets it.
    Numbers are never reused, so no generation counting is needed.

    `outstanding` is the kernel's total lookup count over all inodes (one
    integer, so computed inodes cost nothing): every reference handed out by
    a LOOKUP or READDIRPLUS entry minus every FORGET. After the kernel drops
    its caches it is exactly 0 (the root's implicit reference aside).
    """

    MAX_SLOTS = (1 << (64 - CHILD_ID_BITS)) - 1

    def __init__(self, root: DirNode, recent_nodes: int = 1 << 16) -> None:
        self.nodes: dict[int, Node] = {ROOT: root}
        self.counts: dict[int, int] = {ROOT: 1}
        self.by_name: dict[tuple[int, bytes], int] = {}
        self.names: dict[int, tuple[int, bytes]] = {}
        self.next_ino = ROOT + 1
        self.slots: dict[str, int] = {}
        self.slot_dirs: list[DirNode | None] = [None]
        # Nodes of computed inodes seen lately, the one set longest ago dropped first: FIFO, not
        # LRU, because a listing sets every entry it returns and a hit then costs one probe.
        self.recent: BoundedMap[int, Node] = BoundedMap(recent_nodes, lru=False, counted=False)
        # Tabled inodes whose content changed under a reader: their name now leads to a new inode,
        # and every read of them fails until the kernel forgets them.
        self.superseded: set[int] = set()
        self.outstanding = 0
        self._last_slot: tuple[Node | None, int] = (None, 0)  # `slot_of`'s last directory node and its slot

    def __len__(self) -> int:
        return len(self.nodes) + len(self.recent)

    @staticmethod
    def computed(ino: int) -> bool:
        return ino >> CHILD_ID_BITS != 0

    def _slot(self, parent: Node | None) -> int:
        if not isinstance(parent, DirNode):
            return 0
        key = parent.stable_key
        if key is None:
            return 0
        slot = self.slots.get(key)
        if slot is None:
            if len(self.slot_dirs) > self.MAX_SLOTS:
                return 0
            slot = self.slots[key] = len(self.slot_dirs)
            self.slot_dirs.append(None)
        self.slot_dirs[slot] = parent
        return slot

    def slot_of(self, parent: int) -> int:
        """The slot of directory `parent` (0: its children get tabled inodes)."""
        node = self.nodes.get(parent)
        last, slot = self._last_slot
        if node is last and node is not None:  # every lookup asks, mostly of the same directory
            return slot
        slot = self._slot(node)
        self._last_slot = (node, slot)
        return slot

    def add(self, parent: int, name: bytes, node: Node, slot: int | None = None) -> int:
        """The inode for `parent/name`, now showing `node`; no lookup reference taken.

        `slot` may be passed in when the caller adds many children of one
        directory (a listing); it is looked up otherwise.
        """
        if node.child_id is not None:
            if slot is None:
                slot = self.slot_of(parent)
            if slot:
                computed = slot << CHILD_ID_BITS | node.child_id
                if not same_attributes(self.recent.get(computed), node):
                    self.recent[computed] = node
                return computed
        ino = self.by_name.get((parent, name))
        if ino is None:
            ino = self.next_ino
            self.next_ino += 1
            self.by_name[(parent, name)] = ino
            self.names[ino] = (parent, name)
            self.counts[ino] = 0
        elif same_attributes(self.nodes.get(ino), node):
            return ino
        self.nodes[ino] = node
        return ino

    def ref(self, ino: int) -> None:
        self.outstanding += 1
        if not ino >> CHILD_ID_BITS:  # `computed`, inline: every lookup asks
            self.counts[ino] += 1

    def forget(self, ino: int, n: int) -> None:
        self.outstanding -= n
        if self.computed(ino):
            return
        left = self.counts.get(ino, 0) - n
        if left > 0:
            self.counts[ino] = left
        else:
            self.drop(ino)

    def drop(self, ino: int) -> None:
        if ino == ROOT or self.computed(ino):
            return
        self.counts.pop(ino, None)
        self.nodes.pop(ino, None)
        self.superseded.discard(ino)
        key = self.names.pop(ino, None)
        if key is not None and self.by_name.get(key) == ino:
            del self.by_name[key]

    def supersede(self, ino: int) -> bool:
        """Retire tabled inode `ino`: the next lookup of its name gets a new number, and `ino`
        keeps its old node until the kernel forgets it. False for a computed inode (its number
        is its id: it cannot be replaced)."""
        if ino == ROOT or self.computed(ino):
            return False
        key = self.names.get(ino)
        if key is not None and self.by_name.get(key) == ino:
            del self.by_name[key]
        self.superseded.add(ino)
        return True

    def drop_if_unreferenced(self, ino: int) -> None:
        if self.counts.get(ino) == 0:
            self.drop(ino)

    def locate(self, ino: int) -> tuple[DirNode | None, str]:
        """The directory holding `ino` and its name there (for re-resolving it)."""
        if self.computed(ino):
            slot = ino >> CHILD_ID_BITS
            parent = self.slot_dirs[slot] if slot < len(self.slot_dirs) else None
            child_id = ino & ((1 << CHILD_ID_BITS) - 1)
            try:
                return parent, parent.child_name(child_id) if parent is not None else ""
            except KeyError:
                return None, ""
        parent_ino, name = self.names.get(ino, (ROOT, b""))
        holder = self.nodes.get(parent_ino)
        return (holder if isinstance(holder, DirNode) else None), os.fsdecode(name)

    def parent_of(self, ino: int) -> tuple[int, bytes] | None:
        """(parent inode, name) of a tabled inode, for entry invalidation."""
        return self.names.get(ino)

    def replace(self, ino: int, node: Node) -> None:
        if self.computed(ino):
            self.recent[ino] = node
        else:
            self.nodes[ino] = node

    def peek(self, ino: int) -> Node | None:
        """The node of `ino` if it is at hand (no I/O)."""
        return self.recent.get(ino) if ino >> CHILD_ID_BITS else self.nodes.get(ino)  # (`computed`, inline)

    async def get(self, ino: int) -> Node:
        node = self.peek(ino)
        if node is not None:
            return node
        if not self.computed(ino) or (ino >> CHILD_ID_BITS) >= len(self.slot_dirs):
            raise FsError(errno.ESTALE)
        parent, name = self.locate(ino)
        node = await parent.lookup(name) if parent is not None and name else None
        if node is None or node.child_id != ino & ((1 << CHILD_ID_BITS) - 1):
            raise FsError(errno.ESTALE)
        self.recent[ino] = node
        return node


def same_attributes(old: Node | None, new: Node) -> bool:
    """Whether `new` is a file the kernel sees exactly as `old` (same kind, size and mtime): then `old`
    stays the inode's node. The kernel drops its cached pages of a file only when its size or mtime
    changes (AUTO_INVAL_DATA); a file whose content changed under the same attributes (rewritten in
    place with its mtime put back, a data file of a packed store copied over) keeps them, and new bytes
    read through a fresh node would follow them. The node that served them reads with the version it
    was resolved from, so its next read finds the change (`read` then refuses or follows it)."""
    return (isinstance(old, FileNode) and type(old) is type(new) and old.size == new.size
            and old.mtime_ns == new.mtime_ns)


class EntrySink(Protocol):
    """Where a listing puts its entries (an engine's reply buffer).

    `plus` says whether each entry carries attributes and counts as a
    lookup (READDIRPLUS); `node` is None for files of a lazy batch, whose
    attributes are `size`, `mtime_ns` and FILE_MODE. Each call returns False
    when the entry did not fit (it is then offered again next time).
    """

    plus: bool

    def add(self, name: bytes, ino: int, node: Node | None, size: int, mtime_ns: int, next_cookie: int) -> bool: ...


@runtime_checkable
class FileEntrySink(EntrySink, Protocol):
    """A sink that can also take many plain file entries at once (optional, see `Bridge.fill`):
    `add_files(names, child_ids, start, slot_bits, next_cookie)` takes entries `names[start:]`
    with inodes `slot_bits | child_id` and cookies from `next_cookie` on, as many as fit, and
    returns how many it took, or None if it cannot take these (they are then added one by one)."""

    def add_files(self, names: list[str], child_ids: list[int | None], start: int, slot_bits: int,
                  next_cookie: int) -> int | None: ...


_PACKING: dict[type, bool] = {}  # sink class -> whether it is a FileEntrySink (asked once per class)


def _packs_files(sink: EntrySink) -> TypeGuard[FileEntrySink]:
    """Whether `sink` takes many plain file entries at once; decided once per class (every
    READDIR asks, and an isinstance against a runtime-checkable Protocol costs microseconds)."""
    kind = type(sink)
    packs = _PACKING.get(kind)
    if packs is None:
        packs = _PACKING[kind] = isinstance(sink, FileEntrySink)
    return packs


@dataclass
class Listing:
    """Where a directory handle is in its listing; cookies are 1-based positions.

    `batch[index:]` are entries produced but not yet accepted by the kernel.
    """

    ino: int
    node: DirNode
    iterator: AsyncIterator[Batch] | None = None
    position: int = 0
    batch: Batch = field(default_factory=list)
    index: int = 0
    done: bool = False


class Bridge:
    """The virtual tree as the FUSE engines see it (see the module docstring)."""

    def __init__(self, root: DirNode, options: MountOptions | None = None,
                 stats: Callable[[], dict[str, Any]] | None = None, engine: str = "") -> None:
        self.options = options or MountOptions()
        self.stats = stats
        self.engine = engine
        self.counters = {"lookups": 0, "opens": 0, "reads": 0, "read_bytes": 0, "eio": 0, "interrupted": 0,
                         "invalidations": 0}
        self.inodes = InodeTable(root)
        self.listings: dict[int, Listing] = {}
        self.open_files = 0
        self.next_fh = 1
        self.uid = os.getuid()
        self.gid = os.getgid()
        # Inodes whose pages the kernel may hold (True: served a READ since their last
        # invalidation) or cannot (False: it learnt new attributes since): a replaced shard is
        # re-served to the first only after their pages are dropped. Forgetting one must not
        # make it look clean: once any was evicted, an inode not here may hold pages.
        self.served: BoundedMap[int, bool] = BoundedMap(SERVED_MAX, on_evict=self._forgot_served)
        self.served_evicted = False
        # Engines that can tell the kernel to drop what it cached set this: (ino, done) -> None,
        # called for an inode whose backing data changed; never from inside that request. The
        # engine calls `done` (on the loop) once the kernel has dropped them, or cannot hold them.
        self.invalidate: Callable[[int, Callable[[], None]], None] | None = None
        # Inodes whose old pages the kernel may still hold while the new content is ready:
        # their reads fail until the pages are dropped (answered with new bytes, a reader
        # would get old cached pages followed by new ones). Count of drops under way.
        self.dropping: dict[int, int] = {}
        self.features: dict[str, object] = {}
        self.live: Callable[[], dict[str, Any]] | None = None  # the engine's own counters (requests in flight)

    # -- names and attributes --------------------------------------------------------

    async def lookup(self, parent_ino: int, name: bytes) -> tuple[int, Node] | None:
        """The child `name` of `parent_ino` with a lookup reference taken; None if absent."""
        self.counters["lookups"] += 1
        parent = self.inodes.peek(parent_ino)
        if not isinstance(parent, DirNode):
            parent = await self.directory(parent_ino)
        try:
            text = name.decode(FS_ENCODING, "surrogateescape")  # os.fsdecode, minus its calls
        except UnicodeError:
            return None
        if not text or text in (".", "..") or "/" in text:
            return None
        node = await parent.lookup(text)
        if node is None:
            return None
        ino = self.inodes.add(parent_ino, name, node)
        self.inodes.ref(ino)
        return ino, node

    def forget(self, ino: int, n: int) -> None:
        self.inodes.forget(ino, n)

    async def directory(self, ino: int) -> DirNode:
        node = await self.inodes.get(ino)
        if not isinstance(node, DirNode):
            raise FsError(errno.ENOTDIR)
        return node

    async def getattr(self, ino: int) -> Node:
        """The current node of `ino`: a file is looked up again by name, so a
        replaced shard's new size and mtime reach the kernel (which then drops
        the old pages itself, with AUTO_INVAL_DATA)."""
        node = await self.inodes.get(ino)
        if node.is_dir or ino == ROOT or ino in self.inodes.superseded:
            return node  # a retired inode keeps its old attributes (its reads fail)
        parent, name = self.inodes.locate(ino)
        fresh = await parent.lookup(name) if parent is not None and name else None
        if fresh is None or fresh.is_dir != node.is_dir or fresh.child_id != node.child_id:
            raise FsError(errno.ESTALE)
        if same_attributes(node, fresh):
            return node  # (see `same_attributes`)
        if fresh is not node:
            if (self.invalidate is not None and isinstance(node, FileNode) and isinstance(fresh, FileNode)
                    and (fresh.size, fresh.mtime_ns) != (node.size, node.mtime_ns) and self._may_hold(ino)):
                # Once its attributes expired the kernel asks for them before every read: a reader
                # part way through the old content would go on with new bytes.
                self._changed_under_reader(ino, fresh)
                raise FsError(errno.EIO)
            self._note_changed(ino, fresh)
            self.inodes.replace(ino, fresh)
        return fresh

    def _changed_under_reader(self, ino: int, fresh: Node) -> None:
        """`ino`'s content changed while the kernel may hold its old pages, and a reader may be part
        way through them: no read of `ino` may give new bytes. A tabled inode is retired (every read
        of it fails from now on; the name is looked up afresh and gets a new inode with the new
        content); a computed one fails its reads until the kernel has dropped its pages."""
        self.counters["eio"] += 1
        if self.inodes.supersede(ino):
            assert self.invalidate is not None
            self.invalidate(ino, _nothing)  # its pages, and its name's entry
        else:
            self.inodes.replace(ino, fresh)
            self._drop_pages(ino)

    def _note_changed(self, ino: int, node: Node) -> None:
        """Forget that the kernel holds pages of `ino` once it learns new attributes."""
        old = self.inodes.peek(ino)
        if old is not None and old is not node and isinstance(old, FileNode) and isinstance(node, FileNode):
            if (old.size, old.mtime_ns) != (node.size, node.mtime_ns):
                self.served[ino] = False  # the kernel cannot hold pages of it now

    # -- directories -------------------------------------------------------------------

    def opendir(self, ino: int, node: DirNode) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.listings[fh] = Listing(ino, node)
        return fh

    def listing(self, fh: int) -> Listing:
        listing = self.listings.get(fh)
        if listing is None:
            raise FsError(errno.EBADF)
        return listing

    def fill(self, listing: Listing, offset: int, sink: EntrySink) -> bool | None:
        """Put entries from the batch at hand into `sink`, without any I/O.

        True: the sink is full (or the listing ended); False: the batch at
        hand is used up and the sink may take more (call `advance`); None:
        `offset` is not where the listing stands (call `seek`)."""
        if offset != listing.position or (listing.iterator is None and not listing.done):
            return None
        if listing.done:
            return True
        slot = self.inodes.slot_of(listing.ino)
        batch = listing.batch
        while listing.index < len(batch):
            full = (self._fill_lazy(listing, batch, sink, slot) if isinstance(batch, EntryBatch)
                    else self._fill_nodes(listing, batch, sink, slot))
            if full:
                return True
        return False

    async def advance(self, listing: Listing) -> None:
        """Produce the next batch (or mark the listing done)."""
        listing.index = 0
        if listing.iterator is None:  # released meanwhile (RELEASEDIR while this waited)
            listing.batch = []
            listing.done = True
            return
        try:
            listing.batch = await listing.iterator.__anext__()
        except StopAsyncIteration:
            listing.batch = []
            listing.done = True

    async def seek(self, listing: Listing, offset: int) -> None:
        """Restart the stream and skip to `offset` (rare: seekdir, rewinddir, an NFS-style re-read)."""
        await self._discard(listing)
        listing.iterator = listing.node.entries().__aiter__()
        listing.position = 0
        listing.done = False
        while listing.position < offset:
            try:
                listing.batch = await listing.iterator.__anext__()
            except StopAsyncIteration:
                listing.batch = []
                listing.done = True
                break
            take = min(len(listing.batch), offset - listing.position)
            listing.index = take
            listing.position += take
        listing.position = max(listing.position, offset) if listing.done else listing.position

    async def readdir(self, fh: int, offset: int, sink: EntrySink) -> None:
        """Fill `sink` from `offset` on, with whatever I/O that needs."""
        listing = self.listing(fh)
        while True:
            state = self.fill(listing, offset, sink)
            if state is None:
                await self.seek(listing, offset)
            elif state:
                return
            else:
                await self.advance(listing)
                offset = listing.position

    def _fill_nodes(self, listing: Listing, batch: list[Entry], sink: EntrySink, slot: int) -> bool:
        inodes = self.inodes
        plus = sink.plus
        while listing.index < len(batch):
            name, node = batch[listing.index]
            bname = name.encode("utf-8", "surrogateescape")  # os.fsencode, minus its overhead
            ino = inodes.add(listing.ino, bname, node, slot)
            size = 0 if node.is_dir else node.size  # type: ignore[attr-defined]  # not is_dir: a FileNode
            if not sink.add(bname, ino, node, size, node.mtime_ns, listing.position + 1):
                inodes.drop_if_unreferenced(ino)
                return True
            if plus:
                inodes.ref(ino)  # a READDIRPLUS entry counts as a lookup
            else:
                inodes.drop_if_unreferenced(ino)
            listing.index += 1
            listing.position += 1
        return False

    def _fill_lazy(self, listing: Listing, batch: EntryBatch, sink: EntrySink, slot: int) -> bool:
        """Entries of a lazy batch: names, sizes and child_ids straight from its lists.

        Files with a computed inode need no node at all (one is rebuilt from
        the directory if the kernel later asks for it), which keeps a
        million-entry listing from building a million objects.
        """
        inodes = self.inodes
        names, sizes, child_ids = batch.names, batch.sizes, batch.child_ids
        mtime_ns = batch.mtime_ns
        slot_bits = slot << CHILD_ID_BITS
        plus = sink.plus
        add = sink.add
        i = listing.index
        position = listing.position
        add_files = sink.add_files if slot and not plus and _packs_files(sink) else None
        while add_files is not None and i < len(names):
            # Plain entries of computed inodes: the sink packs them a reply at a time.
            taken = add_files(names, child_ids, i, slot_bits, position + 1)
            if taken is None:
                break  # one by one below
            i += taken
            position += taken
            if i < len(names):
                listing.index, listing.position = i, position
                return True  # the sink is full
        counted = 0
        try:
            while i < len(names):
                bname = names[i].encode("utf-8", "surrogateescape")
                child_id = child_ids[i]
                if slot and child_id is not None:
                    ino = slot_bits | child_id
                    if not add(bname, ino, None, sizes[i], mtime_ns, position + 1):
                        return True
                    counted += plus
                else:
                    ino = inodes.add(listing.ino, bname, batch.node(i), slot)
                    if not add(bname, ino, None, sizes[i], mtime_ns, position + 1):
                        inodes.drop_if_unreferenced(ino)
                        return True
                    if plus:
                        inodes.ref(ino)
                    else:
                        inodes.drop_if_unreferenced(ino)
                i += 1
                position += 1
            return False
        finally:
            inodes.outstanding += counted
            listing.index = i
            listing.position = position

    async def _discard(self, listing: Listing) -> None:
        listing.batch, listing.index = [], 0
        if listing.iterator is not None:
            iterator, listing.iterator = listing.iterator, None
            if isinstance(iterator, Closable):
                await iterator.aclose()

    async def releasedir(self, fh: int) -> None:
        listing = self.listings.pop(fh, None)
        if listing is not None:
            await self._discard(listing)

    def unref_entries(self, inos: list[int]) -> None:
        """Take back READDIRPLUS references of entries the kernel never received."""
        for ino in inos:
            self.inodes.forget(ino, 1)

    # -- files -------------------------------------------------------------------------

    async def file(self, ino: int) -> FileNode:
        node = await self.inodes.get(ino)
        if not isinstance(node, FileNode):
            raise FsError(errno.EISDIR)
        return node

    async def read(self, ino: int, offset: int, size: int, node: FileNode | None = None) -> tuple[FileNode, bytes]:
        """Bytes of `ino` (or of `node`, the one an open handle resolved) at `offset`.

        A shard replaced since the file was resolved is followed once. If the
        kernel may already hold pages of the old content, this read fails
        (EIO) and the engine is asked to drop those pages, so a reader sees
        the new bytes or an error, never a mix.
        """
        found = self.inodes.peek(ino)
        if isinstance(found, FileNode):
            # The node whose attributes the kernel was given last. An open handle's may be older:
            # since the handle was opened, the kernel may have been given a replaced shard's new
            # size and mtime (GETATTR, LOOKUP) and dropped its pages; old bytes read through the
            # handle now would be cached under the new attributes, and stay.
            node = found
        elif node is None:
            node = await self.file(ino)
        if offset >= node.size or size <= 0:
            return node, b""
        if ino in self.dropping or ino in self.inodes.superseded:
            self.counters["eio"] += 1
            raise FsError(errno.EIO)
        try:
            served, data = await read_current(node, offset, size, functools.partial(self._resolve, ino))
        except DataError as e:
            if isinstance(e.__cause__, StaleError) and self.invalidate is not None:
                self.invalidate(ino, _nothing)  # its size changed: the kernel must ask for attributes again
            raise
        if served is not node:
            if self.invalidate is not None and self._may_hold(ino):
                self._changed_under_reader(ino, served)
                raise FsError(errno.EIO)
            self.inodes.replace(ino, served)
            if self.invalidate is not None:
                self.invalidate(ino, _nothing)
        self._served(ino, len(data))
        return served, data

    async def _resolve(self, ino: int) -> Node | None:
        """The node now found under the name of `ino` (a read's shard was replaced)."""
        parent, name = self.inodes.locate(ino)
        return await parent.lookup(name) if parent is not None and name else None

    def _forgot_served(self, _ino: int, _may_hold: bool) -> None:
        self.served_evicted = True  # an inode not in `served` may now hold pages

    def _may_hold(self, ino: int) -> bool:
        """Whether the kernel may hold pages of `ino` (forgotten here: it is being re-served).
        One evicted from `served` may (its replaced shard costs an EIO and a page drop, never
        old cached pages followed by new bytes)."""
        known = self.served.pop(ino, None)
        return known if known is not None else self.served_evicted

    def _drop_pages(self, ino: int) -> None:
        """Have the engine drop the kernel's pages of `ino`; its reads fail until that is done."""
        assert self.invalidate is not None
        self.dropping[ino] = self.dropping.get(ino, 0) + 1

        def dropped() -> None:
            left = self.dropping.pop(ino, 1) - 1
            if left:
                self.dropping[ino] = left

        self.invalidate(ino, dropped)

    def read_cached(self, ino: int, offset: int, size: int) -> FdRange | None:
        """Where the bytes of a `read(ino, offset, size)` lie, page-cached, in an open descriptor
        (`FileNode.cached_range`), if that is known without I/O; None: `read` serves them.

        Only for a file whose node is at hand, read as resolved (a changed shard fails the
        source's version check and is left to `read`, which follows or refuses it). The caller
        must move exactly `size` bytes and then call `sent`, or answer through `read` instead
        (which counts the read itself: counted here too, a fallback was counted twice)."""
        node = self.inodes.peek(ino)
        if not isinstance(node, FileNode) or offset >= node.size or ino in self.dropping:
            return None
        return node.cached_range(offset, size)

    def sent(self, ino: int, found: FdRange) -> None:
        """The bytes `read_cached` found went to the kernel: counted, and its pages may now hold them."""
        self._served(ino, found.size)

    def read_now(self, ino: int, offset: int, size: int) -> bytes | bytearray | None:
        """The bytes of a `read(ino, offset, size)` if they can be had at once, without waiting
        on anything (`FileNode.read_now`: page-cached bytes of a local file stored as shown),
        counted like that read; None: `read` serves them. Only for a file whose node is at hand,
        read as resolved, like `read_cached`: a changed shard fails the source's version check
        and is left to `read`, which follows or refuses it."""
        node = self.inodes.peek(ino)
        if not isinstance(node, FileNode) or offset >= node.size or ino in self.dropping:
            return None
        data = node.read_now(offset, size)
        if data is not None:
            self._served(ino, len(data))
        return data

    def _served(self, ino: int, size: int) -> None:
        """`size` bytes of `ino` went to the kernel: counted, and its pages may now hold them."""
        if self.invalidate is not None:
            self.served[ino] = True
        counters = self.counters
        counters["reads"] += 1
        counters["read_bytes"] += size

    # -- extended attributes and statistics -----------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Live statistics: our counters, the kernel-visible inode count, and the tree's own."""
        stats = {"fuse": dict(self.counters, engine=self.engine, inodes_tabled=len(self.inodes.nodes),
                              nodes_recent=len(self.inodes.recent), open_files=self.open_files,
                              listings=len(self.listings),
                              lookups_outstanding=self.inodes.outstanding, features=self.features,
                              **(self.live() if self.live is not None else {}))}
        if self.stats is not None:
            stats.update(self.stats())
        return stats

    def xattrs_of(self, ino: int, node: Node) -> dict[str, bytes]:
        attrs = node.xattrs()
        if ino == ROOT:
            # On the root only, so tools walking the tree never trigger it.
            attrs = dict(attrs, **{STATS_XATTR: json.dumps(self.snapshot()).encode()})
        return attrs

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        value = self.xattrs_of(ino, await self.inodes.get(ino)).get(os.fsdecode(name))
        if value is None:
            raise FsError(ENOATTR)
        return value

    async def listxattr(self, ino: int) -> list[bytes]:
        return [os.fsencode(k) for k in self.xattrs_of(ino, await self.inodes.get(ino))]

    def statfs(self) -> dict[str, int]:
        return {"bsize": 4096, "frsize": 4096, "blocks": 0, "bfree": 0, "bavail": 0,
                "files": len(self.inodes), "ffree": 0, "namelen": 255}


def _nothing() -> None:
    """A `done` for invalidations nothing waits for."""
