"""Serve any virtual tree through pyfuse3, read-only.

This module knows nothing about formats: it maps inodes to tree nodes,
streams directory listings with stable cookies, and turns `DataError` into
EIO (logged once). Every handler is guarded so no exception can reach
pyfuse3's main loop and take the daemon down.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, ParamSpec, Sequence, TypeVar, cast

import pyfuse3
from cachetools import LRUCache

from .errors import DataError, StaleError, expected_failure
from .logonce import log_once
from .vtree import CHILD_ID_BITS, Batch, DirNode, EntryBatch, FileNode, Node

log = logging.getLogger(__name__)

ROOT = pyfuse3.ROOT_INODE
STATS_XATTR = "user.unshardfs.stats"
DIR_MODE = stat.S_IFDIR | 0o555
FILE_MODE = stat.S_IFREG | 0o444


logged_bugs: LRUCache = LRUCache(maxsize=1024)


P = ParamSpec("P")
R = TypeVar("R")


def guarded(handler: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Map our errors to errno; log and EIO anything unexpected instead of crashing."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as e:
            args[0].counters["eio"] += 1
            known = expected_failure(e)
            if known is not None:  # damaged data, or a backend that failed (after retries)
                log_once(log, f"eio:{known}", "EIO in %s: %s", handler.__name__, known)
            elif f"bug:{handler.__name__}:{type(e).__name__}:{e}" not in logged_bugs:
                # A bug, not damage: one traceback per cause, then quiet (a
                # reader retrying in a loop must not fill the disk).
                logged_bugs[f"bug:{handler.__name__}:{type(e).__name__}:{e}"] = True
                log.exception("unexpected error in %s; answering EIO", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return cast(Callable[P, Coroutine[Any, Any, R]], wrapper)  # the same signature, errors mapped


def read_only(*_args: Any, **_kwargs: Any) -> Awaitable[Any]:
    async def fail() -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    return fail()


class RecentNodes(OrderedDict):
    """Nodes of computed inodes seen lately, oldest dropped first.

    Insertion order, not LRU: cheaper per insert, which matters because a
    listing inserts every entry it returns. (An OrderedDict, because evicting
    the first key of a plain dict with next(iter()) rescans the slots of all
    keys deleted before it: quadratic over a million-entry listing.)
    """

    def __init__(self, maxsize: int) -> None:
        super().__init__()
        self.maxsize = maxsize

    def put(self, key: int, node: Node) -> None:
        self[key] = node
        if len(self) > self.maxsize:
            self.popitem(last=False)


class InodeTable:
    """Inode numbers for the nodes the kernel currently knows about.

    Two kinds of numbers:
    - *computed*: a file with an `ident` inside a directory with a
      `stable_key` gets `slot << CHILD_ID_BITS | ident`, where the slot names
      the directory. Nothing is stored per such inode (a bounded LRU keeps
      recently used nodes); the node is rebuilt from the directory on demand.
      This keeps the daemon's memory flat however many chunks are listed.
    - *tabled*: everything else (directories, passthrough files) is handed a
      counter value on lookup and dropped when the kernel forgets it.
    Numbers are never reused, so no generation counting is needed.
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
        self.recent = RecentNodes(recent_nodes)

    def __len__(self) -> int:
        return len(self.nodes) + len(self.recent)

    @staticmethod
    def computed(ino: int) -> bool:
        return ino >> CHILD_ID_BITS != 0

    def _slot(self, parent: Node | None) -> int:
        key = getattr(parent, "stable_key", None)
        if key is None:
            return 0
        slot = self.slots.get(key)
        if slot is None:
            if len(self.slot_dirs) > self.MAX_SLOTS:
                return 0
            slot = self.slots[key] = len(self.slot_dirs)
            self.slot_dirs.append(None)
        self.slot_dirs[slot] = parent if isinstance(parent, DirNode) else None  # only directories have keys
        return slot

    def slot_of(self, parent: int) -> int:
        """The slot of directory `parent` (0: its children get tabled inodes)."""
        return self._slot(self.nodes.get(parent))

    def add(self, parent: int, name: bytes, node: Node, slot: int | None = None) -> int:
        """The inode for `parent/name`, now showing `node`; no lookup reference taken.

        `slot` may be passed in when the caller adds many children of one
        directory (a listing); it is looked up otherwise.
        """
        if node.ident is not None:
            if slot is None:
                slot = self.slot_of(parent)
            if slot:
                ino = slot << CHILD_ID_BITS | node.ident
                self.recent.put(ino, node)
                return ino
        known = self.by_name.get((parent, name))
        if known is None:
            ino = self.next_ino
            self.next_ino += 1
            self.by_name[(parent, name)] = ino
            self.names[ino] = (parent, name)
            self.counts[ino] = 0
        else:
            ino = known
        self.nodes[ino] = node
        return ino

    def ref(self, ino: int) -> None:
        if not self.computed(ino):
            self.counts[ino] += 1

    def forget(self, ino: int, n: int) -> None:
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
        key = self.names.pop(ino, None)
        if key is not None:
            self.by_name.pop(key, None)

    def drop_if_unreferenced(self, ino: int) -> None:
        if self.counts.get(ino) == 0:
            self.drop(ino)

    def locate(self, ino: int) -> tuple[DirNode | None, str]:
        """The directory holding `ino` and its name there (for re-resolving it)."""
        if self.computed(ino):
            parent = self.slot_dirs[ino >> CHILD_ID_BITS]
            ident = ino & ((1 << CHILD_ID_BITS) - 1)
            return parent, parent.child_name(ident) if parent is not None else ""
        parent_ino, name = self.names.get(ino, (ROOT, b""))
        node = self.nodes.get(parent_ino)
        return (node if isinstance(node, DirNode) else None), os.fsdecode(name)

    def replace(self, ino: int, node: Node) -> None:
        if self.computed(ino):
            self.recent.put(ino, node)
        else:
            self.nodes[ino] = node

    async def get(self, ino: int) -> Node:
        node = self.nodes.get(ino) if not self.computed(ino) else self.recent.get(ino)
        if node is not None:
            return node
        if not self.computed(ino) or (ino >> CHILD_ID_BITS) >= len(self.slot_dirs):
            raise pyfuse3.FUSEError(errno.ESTALE)
        parent, name = self.locate(ino)
        node = await parent.lookup(name) if parent is not None and name else None
        if node is None or node.ident != ino & ((1 << CHILD_ID_BITS) - 1):
            raise pyfuse3.FUSEError(errno.ESTALE)
        self.recent.put(ino, node)
        return node


@dataclass
class _Listing:
    """Where a directory handle is in its listing; cookies are 1-based positions.

    `batch[index:]` are entries produced but not yet accepted by the kernel.
    """

    ino: int
    node: DirNode
    iterator: AsyncIterator[Batch] | None = None
    position: int = 0
    batch: Batch = field(default_factory=list)
    index: int = 0


@dataclass
class MountOptions:
    entry_timeout: float = 3600.0
    attr_timeout: float = 3600.0


class TreeOperations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, root: DirNode, options: MountOptions | None = None,
                 stats: Callable[[], dict] | None = None) -> None:
        super().__init__()
        self.options = options or MountOptions()
        self.stats = stats
        self.counters = {"lookups": 0, "opens": 0, "reads": 0, "read_bytes": 0, "eio": 0}
        self.inodes = InodeTable(root)
        self.files: dict[int, tuple[int, FileNode]] = {}
        self.listings: dict[int, _Listing] = {}
        self.next_fh = 1
        self.uid = os.getuid()
        self.gid = os.getgid()

    # -- attributes ---------------------------------------------------------

    def attributes(self, ino: int, node: Node, attr: pyfuse3.EntryAttributes | None = None) -> pyfuse3.EntryAttributes:
        """Fill `attr` for `node`: a fresh object, or one being reused across a
        listing (then only the fields that differ from its last use are set)."""
        if attr is None:
            attr = self._fresh_attributes()
            attr.st_mode = 0
        attr.st_ino = ino
        if node.is_dir:
            if attr.st_mode != DIR_MODE:
                attr.st_mode = DIR_MODE
                attr.st_nlink = 2
            attr.st_size = 0
        else:
            if attr.st_mode != FILE_MODE:
                attr.st_mode = FILE_MODE
                attr.st_nlink = 1
            attr.st_size = cast(FileNode, node).size  # not a directory: a file
        attr.st_blocks = (attr.st_size + 511) >> 9
        if attr.st_mtime_ns != node.mtime_ns:
            attr.st_mtime_ns = attr.st_ctime_ns = attr.st_atime_ns = node.mtime_ns
        return attr

    def _fresh_attributes(self) -> pyfuse3.EntryAttributes:
        """What every entry of this mount shares: owner, timeouts, block size."""
        attr = pyfuse3.EntryAttributes()
        attr.generation = 0
        attr.entry_timeout = self.options.entry_timeout
        attr.attr_timeout = self.options.attr_timeout
        attr.st_blksize = 1 << 17
        attr.st_uid = self.uid
        attr.st_gid = self.gid
        return attr

    def file_attributes(self, mtime_ns: int) -> pyfuse3.EntryAttributes:
        """Attributes shared by the files of a lazy listing batch (size and inode set per entry)."""
        attr = self._fresh_attributes()
        attr.st_mode = FILE_MODE
        attr.st_nlink = 1
        attr.st_mtime_ns = attr.st_ctime_ns = attr.st_atime_ns = mtime_ns
        return attr

    async def _dir(self, ino: int) -> DirNode:
        node = await self.inodes.get(ino)
        if not isinstance(node, DirNode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return node

    @guarded
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        self.counters["lookups"] += 1
        parent = await self._dir(parent_inode)
        try:
            text = os.fsdecode(name)
        except UnicodeError:
            text = None
        node = await parent.lookup(text) if text and text not in (".", "..") else None
        if node is None:
            # ino 0 with a timeout lets the kernel cache the miss: tools probe
            # for absent chunks a lot, and data does not change under us.
            miss = pyfuse3.EntryAttributes()
            miss.st_ino = 0
            miss.entry_timeout = self.options.entry_timeout
            return miss
        ino = self.inodes.add(parent_inode, name, node)
        self.inodes.ref(ino)
        return self.attributes(ino, node)

    @guarded
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self.attributes(inode, await self.inodes.get(inode))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self.inodes.forget(ino, n)

    # -- directories --------------------------------------------------------

    @guarded
    async def opendir(self, inode: int, ctx: Any = None) -> int:
        node = await self._dir(inode)
        fh = self.next_fh
        self.next_fh += 1
        self.listings[fh] = _Listing(inode, node)
        return fh

    @guarded
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        listing = self.listings[fh]
        if start_id != listing.position or listing.iterator is None:
            await self._rewind(listing, start_id)
        slot = self.inodes.slot_of(listing.ino)
        iterator = listing.iterator
        assert iterator is not None  # `_rewind` opened it
        while True:
            if listing.index >= len(listing.batch):
                try:
                    listing.batch = await iterator.__anext__()
                except StopAsyncIteration:
                    listing.batch = []
                    return
                finally:
                    listing.index = 0
                continue
            batch = listing.batch
            full = (self._reply_lazy(listing, batch, token, slot) if isinstance(batch, EntryBatch)
                    else self._reply_nodes(listing, batch, token, slot))
            if full:
                return

    def _reply_nodes(self, listing: _Listing, batch: list, token: Any, slot: int) -> bool:
        """Send entries of a batch of (name, node); True when the kernel's buffer is full."""
        inodes = self.inodes
        attr = None
        while listing.index < len(batch):
            name, node = batch[listing.index]
            bname = name.encode("utf-8", "surrogateescape")  # os.fsencode, minus its overhead
            ino = inodes.add(listing.ino, bname, node, slot)
            # readdir_reply copies the attributes out at once, so one object
            # serves the whole call.
            attr = self.attributes(ino, node, attr)
            if not pyfuse3.readdir_reply(token, bname, attr, listing.position + 1):
                inodes.drop_if_unreferenced(ino)
                return True
            inodes.ref(ino)  # READDIRPLUS counts as a lookup
            listing.index += 1
            listing.position += 1
        return False

    def _reply_lazy(self, listing: _Listing, batch: EntryBatch, token: Any, slot: int) -> bool:
        """Send entries of a lazy batch: names, sizes and idents straight from its lists.

        Files with a computed inode need no node at all (one is rebuilt from
        the directory if the kernel later asks for it), which keeps a
        million-entry listing from building a million objects.
        """
        inodes = self.inodes
        names, sizes, idents = batch.names, batch.sizes, batch.idents
        attr = self.file_attributes(batch.mtime_ns)
        slot_bits = slot << CHILD_ID_BITS
        i = listing.index
        position = listing.position
        try:
            while i < len(names):
                bname = names[i].encode("utf-8", "surrogateescape")
                ident = idents[i]
                if slot and ident is not None:
                    ino = slot_bits | ident
                    tabled = False
                else:
                    ino = inodes.add(listing.ino, bname, batch.node(i), slot)
                    tabled = True
                size = sizes[i]
                attr.st_ino = ino
                attr.st_size = size
                attr.st_blocks = (size + 511) >> 9
                if not pyfuse3.readdir_reply(token, bname, attr, position + 1):
                    if tabled:
                        inodes.drop_if_unreferenced(ino)
                    return True
                if tabled:
                    inodes.ref(ino)
                i += 1
                position += 1
            return False
        finally:
            listing.index = i
            listing.position = position

    async def _rewind(self, listing: _Listing, start_id: int) -> None:
        """Restart the stream and skip to `start_id` (rare: seekdir, or an NFS-style re-read)."""
        await self._discard(listing)
        listing.iterator = listing.node.entries().__aiter__()
        listing.position = 0
        while listing.position < start_id:
            try:
                listing.batch = await listing.iterator.__anext__()
            except StopAsyncIteration:
                listing.batch = []
                break
            take = min(len(listing.batch), start_id - listing.position)
            listing.index = take
            listing.position += take

    async def _discard(self, listing: _Listing) -> None:
        listing.batch, listing.index = [], 0
        if listing.iterator is not None:
            aclose = getattr(listing.iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            listing.iterator = None

    @guarded
    async def releasedir(self, fh: int) -> None:
        listing = self.listings.pop(fh, None)
        if listing is not None:
            await self._discard(listing)

    # -- files --------------------------------------------------------------

    @guarded
    async def open(self, inode: int, flags: int, ctx: Any = None) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND | os.O_CREAT):
            raise pyfuse3.FUSEError(errno.EROFS)
        node = await self.inodes.get(inode)
        if not isinstance(node, FileNode):
            raise pyfuse3.FUSEError(errno.EISDIR)
        fh = self.next_fh
        self.next_fh += 1
        self.counters["opens"] += 1
        self.files[fh] = (inode, node)
        # Content never changes under a mount, so the kernel may keep its page cache.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @guarded
    async def read(self, fh: int, off: int, size: int) -> bytes:
        ino, node = self.files[fh]
        try:
            data = await node.read(off, size)
        except StaleError as e:
            node = await self._refresh(ino, node, e)
            self.files[fh] = (ino, node)
            data = await node.read(off, size)
        self.counters["reads"] += 1
        self.counters["read_bytes"] += len(data)
        return data

    async def _refresh(self, ino: int, node: FileNode, cause: StaleError) -> FileNode:
        """Resolve a file whose backing object was replaced, by its name, once.

        The kernel already knows the file's size, so the fresh node is used
        only if its size is unchanged; otherwise the file answers EIO until
        the kernel looks the name up again.
        """
        parent, name = self.inodes.locate(ino)
        fresh = await parent.lookup(name) if parent is not None and name else None
        if not isinstance(fresh, FileNode) or fresh.size != node.size:
            raise DataError(cause.where, f"{cause.reason}; its content changed and cannot be re-served")
        log.info("%s: backing data changed; re-resolved %s", cause.where, name)
        self.inodes.replace(ino, fresh)
        return fresh

    @guarded
    async def release(self, fh: int) -> None:
        self.files.pop(fh, None)

    # -- extended attributes -------------------------------------------------

    def snapshot(self) -> dict:
        """Live statistics: our counters, the kernel-visible inode count, and the tree's own."""
        stats = {"fuse": dict(self.counters, inodes_tabled=len(self.inodes.nodes),
                              nodes_recent=len(self.inodes.recent), open_files=len(self.files))}
        if self.stats is not None:
            stats.update(self.stats())
        return stats

    async def _xattrs(self, inode: int) -> dict[str, bytes]:
        attrs = (await self.inodes.get(inode)).xattrs()
        if inode == ROOT:
            # On the root only, so tools walking the tree never trigger it.
            attrs = dict(attrs, **{STATS_XATTR: json.dumps(self.snapshot()).encode()})
        return attrs

    @guarded
    async def getxattr(self, inode: int, name: bytes, ctx: Any = None) -> bytes:
        value = (await self._xattrs(inode)).get(os.fsdecode(name))
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @guarded
    async def listxattr(self, inode: int, ctx: Any = None) -> list[bytes]:
        return [os.fsencode(k) for k in await self._xattrs(inode)]

    # -- the file system ------------------------------------------------------

    async def statfs(self, ctx: Any = None) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = data.f_bfree = data.f_bavail = 0
        data.f_files = len(self.inodes)
        data.f_ffree = data.f_favail = 0
        data.f_namemax = 255
        return data

    # Every write-type operation fails: the mount is a view, never a store. (One refusal for all:
    # pyfuse3 declares each operation with its own signature, hence the two ignores.)
    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = read_only  # type: ignore[assignment]
    create = write = setxattr = removexattr = read_only  # type: ignore[assignment]
