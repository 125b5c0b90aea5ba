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
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import pyfuse3

from .errors import DataError, StaleError
from .logonce import log_once
from .vtree import DirNode, FileNode, Node

log = logging.getLogger(__name__)

ROOT = pyfuse3.ROOT_INODE
STATS_XATTR = "user.unshardfs.stats"


def guarded(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Map our errors to errno; log and EIO anything unexpected instead of crashing."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except DataError as e:
            args[0].counters["eio"] += 1
            log_once(log, f"eio:{e}", "EIO: %s", e)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception:
            args[0].counters["eio"] += 1
            log.exception("unexpected error in %s; answering EIO", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def read_only(*_args: Any, **_kwargs: Any) -> Awaitable[Any]:
    async def fail() -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    return fail()


class InodeTable:
    """Inode numbers for nodes the kernel currently knows about.

    Numbers are handed out on lookup (and on each READDIRPLUS entry) and
    dropped when the kernel forgets them, so the table is bounded by the
    kernel's own inode cache, not by the size of the dataset. Numbers are
    never reused, so no generation counting is needed.
    """

    def __init__(self, root: DirNode) -> None:
        self.nodes: dict[int, Node] = {ROOT: root}
        self.counts: dict[int, int] = {ROOT: 1}
        self.by_name: dict[tuple[int, bytes], int] = {}
        self.names: dict[int, tuple[int, bytes]] = {}
        self.next_ino = ROOT + 1

    def add(self, parent: int, name: bytes, node: Node) -> int:
        """The inode for `parent/name`, now showing `node`; no lookup reference taken."""
        ino = self.by_name.get((parent, name))
        if ino is None:
            ino = self.next_ino
            self.next_ino += 1
            self.by_name[(parent, name)] = ino
            self.names[ino] = (parent, name)
            self.counts[ino] = 0
        self.nodes[ino] = node
        return ino

    def ref(self, ino: int) -> None:
        self.counts[ino] += 1

    def forget(self, ino: int, n: int) -> None:
        left = self.counts.get(ino, 0) - n
        if left > 0:
            self.counts[ino] = left
        else:
            self.drop(ino)

    def drop(self, ino: int) -> None:
        if ino == ROOT:
            return
        self.counts.pop(ino, None)
        self.nodes.pop(ino, None)
        key = self.names.pop(ino, None)
        if key is not None:
            self.by_name.pop(key, None)

    def drop_if_unreferenced(self, ino: int) -> None:
        if self.counts.get(ino) == 0:
            self.drop(ino)

    def get(self, ino: int) -> Node:
        node = self.nodes.get(ino)
        if node is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        return node


@dataclass
class _Listing:
    """Where a directory handle is in its listing; cookies are 1-based positions."""

    ino: int
    node: DirNode
    iterator: AsyncIterator[tuple[str, Node]] | None = None
    position: int = 0
    pending: tuple[str, Node, int] | None = None


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

    def attributes(self, ino: int, node: Node) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = ino
        attr.generation = 0
        attr.entry_timeout = self.options.entry_timeout
        attr.attr_timeout = self.options.attr_timeout
        if node.is_dir:
            attr.st_mode = stat.S_IFDIR | 0o555
            attr.st_nlink = 2
            attr.st_size = 0
        else:
            attr.st_mode = stat.S_IFREG | 0o444
            attr.st_nlink = 1
            attr.st_size = node.size  # type: ignore[attr-defined]
        attr.st_blksize = 1 << 17
        attr.st_blocks = (attr.st_size + 511) // 512
        attr.st_uid = self.uid
        attr.st_gid = self.gid
        attr.st_mtime_ns = attr.st_ctime_ns = attr.st_atime_ns = node.mtime_ns
        return attr

    def _dir(self, ino: int) -> DirNode:
        node = self.inodes.get(ino)
        if not isinstance(node, DirNode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return node

    @guarded
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        self.counters["lookups"] += 1
        parent = self._dir(parent_inode)
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
        return self.attributes(inode, self.inodes.get(inode))

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self.inodes.forget(ino, n)

    # -- directories --------------------------------------------------------

    @guarded
    async def opendir(self, inode: int, ctx: Any = None) -> int:
        node = self._dir(inode)
        fh = self.next_fh
        self.next_fh += 1
        self.listings[fh] = _Listing(inode, node)
        return fh

    @guarded
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        listing = self.listings[fh]
        if start_id != listing.position or listing.iterator is None:
            await self._rewind(listing, start_id)
        while True:
            if listing.pending is None:
                try:
                    name, node = await listing.iterator.__anext__()  # type: ignore[union-attr]
                except StopAsyncIteration:
                    return
                bname = os.fsencode(name)
                listing.pending = (name, node, self.inodes.add(listing.ino, bname, node))
            name, node, ino = listing.pending
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self.attributes(ino, node), listing.position + 1):
                return
            self.inodes.ref(ino)  # READDIRPLUS counts as a lookup
            listing.pending = None
            listing.position += 1

    async def _rewind(self, listing: _Listing, start_id: int) -> None:
        """Restart the stream and skip to `start_id` (rare: seekdir, or an NFS-style re-read)."""
        await self._discard(listing)
        listing.iterator = listing.node.entries().__aiter__()
        listing.position = 0
        while listing.position < start_id:
            try:
                await listing.iterator.__anext__()
            except StopAsyncIteration:
                break
            listing.position += 1

    async def _discard(self, listing: _Listing) -> None:
        if listing.pending is not None:
            self.inodes.drop_if_unreferenced(listing.pending[2])
            listing.pending = None
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
        node = self.inodes.get(inode)
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
        parent_ino, name = self.inodes.names.get(ino, (None, b""))
        parent = self.inodes.nodes.get(parent_ino) if parent_ino is not None else None
        fresh = await parent.lookup(os.fsdecode(name)) if isinstance(parent, DirNode) else None
        if not isinstance(fresh, FileNode) or fresh.size != node.size:
            raise DataError(cause.where, f"{cause.reason}; its content changed and cannot be re-served")
        log.info("%s: backing data changed; re-resolved %s", cause.where, os.fsdecode(name))
        self.inodes.nodes[ino] = fresh
        return fresh

    @guarded
    async def release(self, fh: int) -> None:
        self.files.pop(fh, None)

    # -- extended attributes -------------------------------------------------

    def snapshot(self) -> dict:
        """Live statistics: our counters, the kernel-visible inode count, and the tree's own."""
        stats = {"fuse": dict(self.counters, inodes=len(self.inodes.nodes), open_files=len(self.files))}
        if self.stats is not None:
            stats.update(self.stats())
        return stats

    def _xattrs(self, inode: int) -> dict[str, bytes]:
        attrs = self.inodes.get(inode).xattrs()
        if inode == ROOT:
            # On the root only, so tools walking the tree never trigger it.
            attrs = dict(attrs, **{STATS_XATTR: json.dumps(self.snapshot()).encode()})
        return attrs

    @guarded
    async def getxattr(self, inode: int, name: bytes, ctx: Any = None) -> bytes:
        value = self._xattrs(inode).get(os.fsdecode(name))
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @guarded
    async def listxattr(self, inode: int, ctx: Any = None) -> list[bytes]:
        return [os.fsencode(k) for k in self._xattrs(inode)]

    # -- the file system ------------------------------------------------------

    async def statfs(self, ctx: Any = None) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = data.f_bfree = data.f_bavail = 0
        data.f_files = len(self.inodes.nodes)
        data.f_ffree = data.f_favail = 0
        data.f_namemax = 255
        return data

    # Every write-type operation fails: the mount is a view, never a store.
    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = read_only  # type: ignore[assignment]
    create = write = setxattr = removexattr = read_only  # type: ignore[assignment]
