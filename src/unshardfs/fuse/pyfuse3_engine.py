"""The pyfuse3 engine: pyfuse3 (libfuse) serving the operations layer, read-only.

A thin binding: each handler converts pyfuse3's arguments, calls
`unshardfs.fuse.ops.Bridge` and converts the answer to pyfuse3's types.
Every handler is guarded (`guarded`): errors are classified once by
`unshardfs.tree.edge`, so no exception reaches pyfuse3's main loop.

pyfuse3 cannot use the kernel's no-open mode (its `read` is not told the
inode), never asks for parallel directory operations and keeps libfuse's
background limit; see the kernel engine (`unshardfs.fuse.kernel`) for those.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from typing import Any, Awaitable, Callable, Coroutine, ParamSpec, Sequence, TypeVar, cast

import pyfuse3
import trio

from unshardfs.fuse.abi import FsError
from unshardfs.fuse.ops import BLOCK_SIZE, DIR_MODE, FILE_MODE, STATS_XATTR, MountOptions, Bridge
from unshardfs.tree import edge
from unshardfs.tree.nodes import DirNode, FileNode, Node, size_of
from unshardfs.util.concurrency import stray_cancellation

log = logging.getLogger(__name__)

ROOT = pyfuse3.ROOT_INODE
__all__ = ["MountOptions", "STATS_XATTR", "Pyfuse3Operations", "guarded"]


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
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except BaseException as e:
            # A cancellation of another task's, handed on by a handler, is a bug like any other:
            # let through, it would end pyfuse3's main loop and the mount.
            if not isinstance(e, Exception) and not stray_cancellation(e):
                raise
            args[0].counters["eio"] += 1
            raise pyfuse3.FUSEError(edge.answer(log, e, handler.__name__).errno) from None

    return cast(Callable[P, Coroutine[Any, Any, R]], wrapper)  # the same signature, errors mapped


def read_only(*_args: Any, **_kwargs: Any) -> Awaitable[Any]:
    async def fail() -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    return fail()


class Pyfuse3Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, root: DirNode | Bridge, options: MountOptions | None = None,
                 stats: Callable[[], dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.ops = root if isinstance(root, Bridge) else Bridge(root, options, stats, engine="pyfuse3")
        self.options = self.ops.options
        self.counters = self.ops.counters
        self.inodes = self.ops.inodes
        self.files: dict[int, tuple[int, FileNode]] = {}
        self.ops.features = {"protocol": "libfuse", "no_open": False, "parallel_dirops": False}
        self.ops.invalidate = self.invalidate_inode

    def invalidate_inode(self, ino: int, done: Callable[[], None]) -> None:
        """Drop the kernel's pages of `ino`, after the request that found the change is answered
        (libfuse documents a deadlock when a notification is sent from inside a request); then
        `done`."""
        self.counters["invalidations"] += 1

        located = self.ops.inodes.parent_of(ino)

        async def later() -> None:
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino)
                if located is not None:  # a retired inode's name must be looked up again
                    await trio.to_thread.run_sync(pyfuse3.invalidate_entry, located[0], located[1])
            except (OSError, RuntimeError) as e:  # the kernel forgot it meanwhile: nothing cached
                log.debug("invalidating inode %d: %s", ino, e)
            finally:
                done()

        trio.lowlevel.spawn_system_task(later)

    # -- attributes ---------------------------------------------------------

    def attributes(self, ino: int, node: Node) -> pyfuse3.EntryAttributes:
        size = size_of(node)
        return self._attributes(ino, DIR_MODE if node.is_dir else FILE_MODE, size, node.mtime_ns)

    def _attributes(self, ino: int, mode: int, size: int, mtime_ns: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.generation = 0
        attr.entry_timeout = self.options.entry_timeout
        attr.attr_timeout = self.options.attr_timeout
        attr.st_blksize = BLOCK_SIZE
        attr.st_uid = self.ops.uid
        attr.st_gid = self.ops.gid
        attr.st_ino = ino
        attr.st_mode = mode
        attr.st_nlink = 2 if mode == DIR_MODE else 1
        attr.st_size = size
        attr.st_blocks = (size + 511) >> 9
        attr.st_mtime_ns = attr.st_ctime_ns = attr.st_atime_ns = mtime_ns
        return attr

    @guarded
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        found = await self.ops.lookup(parent_inode, name)
        if found is None:
            # ino 0 with a timeout lets the kernel cache the miss: tools probe
            # for absent chunks a lot.
            miss = pyfuse3.EntryAttributes()
            miss.st_ino = 0
            miss.entry_timeout = self.options.entry_timeout
            return miss
        return self.attributes(*found)

    @guarded
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self.attributes(inode, await self.ops.getattr(inode))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self.ops.forget(ino, n)

    # -- directories --------------------------------------------------------

    @guarded
    async def opendir(self, inode: int, ctx: Any = None) -> int:
        return self.ops.opendir(inode, await self.ops.directory(inode))

    @guarded
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        await self.ops.readdir(fh, start_id, _TokenSink(self, token))

    @guarded
    async def releasedir(self, fh: int) -> None:
        await self.ops.releasedir(fh)

    # -- files --------------------------------------------------------------

    @guarded
    async def open(self, inode: int, flags: int, ctx: Any = None) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND | os.O_CREAT):
            raise pyfuse3.FUSEError(errno.EROFS)
        node = await self.ops.file(inode)
        fh = self.ops.next_fh
        self.ops.next_fh += 1
        self.counters["opens"] += 1
        self.files[fh] = (inode, node)
        self.ops.open_files = len(self.files)
        # Content never changes under a mount, so the kernel may keep its page cache.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @guarded
    async def read(self, fh: int, off: int, size: int) -> bytes:
        ino, node = self.files[fh]
        served, data = await self.ops.read(ino, off, size, node)
        if served is not node:
            self.files[fh] = (ino, served)
        return data

    @guarded
    async def release(self, fh: int) -> None:
        self.files.pop(fh, None)
        self.ops.open_files = len(self.files)

    # -- extended attributes -------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return self.ops.snapshot()

    @guarded
    async def getxattr(self, inode: int, name: bytes, ctx: Any = None) -> bytes:
        try:
            return await self.ops.getxattr(inode, name)
        except FsError as e:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR if e.errno == errno.ENODATA else e.errno) from None

    @guarded
    async def listxattr(self, inode: int, ctx: Any = None) -> list[bytes]:
        return await self.ops.listxattr(inode)

    # -- the file system ------------------------------------------------------

    async def statfs(self, ctx: Any = None) -> pyfuse3.StatvfsData:
        s = self.ops.statfs()
        data = pyfuse3.StatvfsData()
        data.f_bsize, data.f_frsize = s["bsize"], s["frsize"]
        data.f_blocks = data.f_bfree = data.f_bavail = 0
        data.f_files = s["files"]
        data.f_ffree = data.f_favail = 0
        data.f_namemax = s["namelen"]
        return data

    # Every write-type operation fails: the mount is a view, never a store. (One handler under
    # every name: pyfuse3's stubs give each its own signature, hence the ignores.)
    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = read_only  # type: ignore[assignment]
    create = write = setxattr = removexattr = read_only  # type: ignore[assignment]


class _TokenSink:
    """Listing entries into pyfuse3's readdir token (always READDIRPLUS: pyfuse3 forces it).

    `readdir_reply` copies the attributes out at once, so one attributes
    object serves a whole call; only the fields that differ are set per entry.
    """

    plus = True

    def __init__(self, ops: Pyfuse3Operations, token: Any) -> None:
        self.token = token
        self.ops = ops
        self.file_attr: pyfuse3.EntryAttributes | None = None
        self.mtime_ns = -1

    def add(self, name: bytes, ino: int, node: Node | None, size: int, mtime_ns: int, next_cookie: int) -> bool:
        if node is not None and node.is_dir:
            return pyfuse3.readdir_reply(self.token, name, self.ops.attributes(ino, node), next_cookie)
        attr = self.file_attr
        if attr is None or mtime_ns != self.mtime_ns:
            attr = self.file_attr = self.ops._attributes(ino, FILE_MODE, size, mtime_ns)
            self.mtime_ns = mtime_ns
        attr.st_ino = ino
        attr.st_size = size
        attr.st_blocks = (size + 511) >> 9
        return pyfuse3.readdir_reply(self.token, name, attr, next_cookie)
