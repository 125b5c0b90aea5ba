"""The kernel engine: our own FUSE protocol session serving the operations layer.

Requests answered inline (no task): FORGET, BATCH_FORGET, GETATTR of a
directory, OPEN (ENOSYS once: the kernel stops sending OPEN/RELEASE and keeps
pages across opens), RELEASE, OPENDIR of a known directory, READDIR while the
batch at hand lasts, RELEASEDIR of a listing that needs no closing, xattrs
and STATFS of known inodes; READ of page-cached bytes of a local file stored as
shown (spliced from the shard: `splice`). LOOKUP, file GETATTR (revalidated
against the shard), other READs and READDIR past a batch are coroutines,
which get a task of their own only if they wait (`server`).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import Any, Callable

import numpy as np
import trio

from unshardfs.fuse import abi
from unshardfs.fuse.abi import FsError
from unshardfs.fuse.ops import BLOCK_SIZE, DIR_MODE, FILE_MODE, ROOT, Bridge
from unshardfs.fuse.server import Negotiated, Request, Connection, failed_errno
from unshardfs.tree.nodes import DirNode, FileNode, Node, WholeLocalFile, size_of

log = logging.getLogger(__name__)

# Smaller READs are copied: below this, the four calls of a spliced reply (cachestat, header,
# splice in, splice out) cost more than copying the bytes twice.
SPLICE_MIN = 64 << 10

DT_DIR = stat.S_IFDIR >> 12
DT_REG = stat.S_IFREG >> 12


class DirentBuffer:
    """A READDIR(PLUS) reply being filled: the `EntrySink` of the operations layer."""

    def __init__(self, size: int, plus: bool, encoder: "KernelHandlers") -> None:
        self.size = size
        self.plus = plus
        self.parts = bytearray()  # one buffer: writev takes at most 1024 pieces
        self.used = 0
        self.refs: list[int] = []  # inodes referenced by this reply (READDIRPLUS)
        self.encoder = encoder

    def add(self, name: bytes, ino: int, node: Node | None, size: int, mtime_ns: int, next_cookie: int) -> bool:
        is_dir = node is not None and node.is_dir
        namelen = len(name)
        if self.plus:
            record = abi.pad8(abi.ENTRY_OUT.size + abi.DIRENT.size + namelen)
            if self.used + record > self.size:
                return False
            entry = self.encoder.entry(ino, DIR_MODE if is_dir else FILE_MODE, size, mtime_ns)
            self.refs.append(ino)
        else:
            record = abi.pad8(abi.DIRENT.size + namelen)
            if self.used + record > self.size:
                return False
            entry = b""
        parts = self.parts
        parts += entry
        parts += abi.DIRENT.pack(ino, next_cookie, namelen, DT_DIR if is_dir else DT_REG)
        parts += name
        parts += b"\0" * (record - len(entry) - abi.DIRENT.size - namelen)
        self.used += record
        return True

    def add_files(self, names: list[str], child_ids: list[int | None], start: int, slot_bits: int,
                  next_cookie: int) -> int | None:
        """Plain entries of files `names[start:]`, whose inodes are `slot_bits | child_ids[i]`, as
        many as fit, packed at once: how many were taken (the `EntrySink.add_files` extension);
        None if these cannot be (READDIRPLUS, an entry without an child_id, a name that is not
        ASCII): then they are added one by one."""
        if self.plus:
            return None
        taken = 0
        while start + taken < len(names):
            room = self.size - self.used
            # Names of one batch are of about one length: slice as many as fit at that length.
            most = room // abi.pad8(abi.DIRENT.size + len(names[start + taken])) + 8
            child_ids_here = child_ids[start + taken:start + taken + most]
            if None in child_ids_here:
                return None if not taken else taken
            inos = np.array(child_ids_here, dtype=np.uint64)
            inos |= np.uint64(slot_bits)
            packed = pack_dirents(names[start + taken:start + taken + most], inos, next_cookie + taken, room)
            if packed is None:
                return None if not taken else taken
            n, data = packed
            self.parts += data.data
            self.used += len(data)
            taken += n
            if n < len(inos):
                break  # full
        return taken


DIRENT_MIN = abi.pad8(abi.DIRENT.size + 1)  # the smallest record: a one-byte name


def pack_dirents(names: list[str], inos: np.ndarray, first_cookie: int, room: int) -> tuple[int, np.ndarray] | None:
    """READDIR records of regular files for as many of `names` as fit in `room` bytes:
    (how many, their bytes); None if a name is not ASCII (then they are packed one by one).

    Vectorised: the per-entry work is numpy's, not the interpreter's; a million-entry `ls -f`
    spent a quarter of its time packing entries one at a time."""
    joined = "".join(names)
    if not joined.isascii():
        return None
    lengths = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
    records = (abi.DIRENT.size + lengths + 7) & ~7
    ends = np.cumsum(records)
    n = int(np.searchsorted(ends, room, side="right"))
    if n == 0:
        return 0, np.empty(0, np.uint8)
    lengths, records, ends = lengths[:n], records[:n], ends[:n]
    starts = ends - records
    out = np.zeros(int(ends[-1]), np.uint8)  # the padding after each name stays zero
    # Records start 8-byte aligned and their header is three 8-byte words: ino, off, and
    # namelen | type << 32 (little-endian).
    words = out.view("<u8")
    at = starts // 8
    words[at] = inos[:n]
    words[at + 1] = np.arange(first_cookie, first_cookie + n, dtype=np.uint64)
    words[at + 2] = lengths.astype(np.uint64) | np.uint64(DT_REG << 32)
    # Each name fills the record after its header up to the record's end (24 is a multiple of
    # 8, so a name's room is pad8(len) bytes, whole words): the names as zero-padded rows of
    # words, of which each record takes its first (record - 24) / 8.
    width = abi.pad8(max(1, int(lengths.max())))
    rows = np.array(names[:n], dtype=f"S{width}").view("<u8").reshape(n, width // 8)
    column = np.arange(width // 8)
    take = column < ((records - abi.DIRENT.size) // 8)[:, None]
    words[(at[:, None] + 3 + column)[take]] = rows[take]
    return n, out


# fh of an OPEN reply, given back by its RELEASE: how the file was opened.
CACHED_FH = 0  # read through the daemon, its pages kept across opens (FOPEN_KEEP_CACHE)
PASSTHROUGH_FH = 1  # read by the kernel from a registered backing file (FOPEN_PASSTHROUGH)
HELD_CACHED_FH = 2  # read through the daemon although it has a backing file (`PassthroughOpens.cached`)


class PassthroughOpens:
    """Opens of `WholeLocalFile` nodes answered with FOPEN_PASSTHROUGH (FUSE passthrough).

    The kernel lets every open of one inode that is open for passthrough use only the same
    registered backing file (EBUSY otherwise), and refuses passthrough while the inode is open
    through its page cache (ETXTBSY): so one backing id per inode, registered at its first
    passthrough open and dropped at its last RELEASE, and an inode opened the other way (its
    backing file could not be registered) stays that way until its last RELEASE. A kernel that
    refuses registrations for good (EPERM without CAP_SYS_ADMIN, ENOTTY) turns it off: every
    file is then read through the daemon, as without passthrough."""

    def __init__(self, session: Connection, ops: Bridge) -> None:
        self.session = session
        self.ops = ops
        self.counters = ops.counters
        self.counters.setdefault("passthrough_opens", 0)
        self.counters.setdefault("passthrough_refused", 0)
        self.enabled = True
        self.held: dict[int, list[int]] = {}  # ino -> [backing id, passthrough opens]
        self.cached: dict[int, int] = {}  # ino of a WholeLocalFile -> its opens through the daemon

    def open(self, request: Request, node: Node) -> None:
        """Answer OPEN of the file `node` (here: its reply must not be lost, or the counts would
        wait for a RELEASE that never comes)."""
        ino = request.nodeid
        whole = isinstance(node, WholeLocalFile)
        held = self.held.get(ino)
        if held is None and whole and self.enabled and ino not in self.cached:
            backing_id = self._register(node)  # type: ignore[arg-type]
            if backing_id is not None:
                held = self.held[ino] = [backing_id, 0]
        if held is not None:
            held[1] += 1
            if self.session.reply(request.unique, abi.OPEN_OUT.pack(PASSTHROUGH_FH, abi.FOPEN_PASSTHROUGH, held[0])):
                self.ops.open_files += 1
                self.counters["passthrough_opens"] += 1
            else:
                self.release(ino, PASSTHROUGH_FH)
            return None
        fh = HELD_CACHED_FH if whole else CACHED_FH
        if self.session.reply(request.unique, abi.OPEN_OUT.pack(fh, abi.FOPEN_KEEP_CACHE, 0)):
            self.ops.open_files += 1
            if whole:
                self.cached[ino] = self.cached.get(ino, 0) + 1
        return None

    def _register(self, node: WholeLocalFile) -> int | None:
        fd = node.open_backing()
        if fd is None:
            return None
        try:
            return self.session.backing_open(fd)
        except OSError as e:
            self.counters["passthrough_refused"] += 1
            if e.errno in (errno.EPERM, errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                self.enabled = False
                log.warning("passthrough refused by the kernel (%s): files are read through the daemon",
                            e.strerror)
            else:  # ELOOP (a stacked file system), EMFILE, ENOMEM: this file only
                log.info("passthrough refused for one file: %s", e.strerror)
            return None
        finally:
            os.close(fd)

    def release(self, ino: int, fh: int) -> None:
        if fh == PASSTHROUGH_FH:
            held = self.held.get(ino)
            if held is not None:
                held[1] -= 1
                if held[1] <= 0:
                    del self.held[ino]
                    self.session.backing_close(held[0])
        elif fh == HELD_CACHED_FH:
            left = self.cached.pop(ino, 0) - 1
            if left > 0:
                self.cached[ino] = left


class KernelHandlers:
    """Decodes requests for `Bridge` and encodes its answers (see the module docstring)."""

    def __init__(self, ops: Bridge) -> None:
        self.ops = ops
        self.counters = ops.counters
        self.session: Connection | None = None
        self.no_open = False
        self.backing: PassthroughOpens | None = None  # with FUSE_PASSTHROUGH negotiated
        options = ops.options
        self.entry_valid = abi.split_time(options.entry_timeout)
        self.attr_valid = abi.split_time(options.attr_timeout)
        self.uid, self.gid = ops.uid, ops.gid
        self.handlers: dict[int, Callable[[Request], Any]] = {
            abi.Op.LOOKUP: self.lookup, abi.Op.FORGET: self.forget, abi.Op.BATCH_FORGET: self.batch_forget,
            abi.Op.GETATTR: self.getattr, abi.Op.OPEN: self.open, abi.Op.READ: self.read,
            abi.Op.RELEASE: self.release, abi.Op.OPENDIR: self.opendir, abi.Op.READDIR: self.readdir,
            abi.Op.READDIRPLUS: self.readdirplus, abi.Op.RELEASEDIR: self.releasedir,
            abi.Op.GETXATTR: self.getxattr, abi.Op.LISTXATTR: self.listxattr, abi.Op.STATFS: self.statfs,
        }

    def attach(self, session: Connection) -> None:
        self.session = session
        self.ops.invalidate = self.invalidate_inode
        self.ops.live = lambda: {"requests": session.requests, "in_flight": len(session.scopes),
                                 "spliced": session.splicer.spliced if session.splicer is not None else 0,
                                 "quick_wait_us": round(session.config.quick_wait * 1e6),
                                 "quick_waits": session.quick_waits, "ring_requests": session.ring_requests}

    def negotiated(self, n: Negotiated) -> None:
        # Passthrough is chosen in OPEN replies: a kernel that stops sending OPEN (no-open)
        # could never be told to read a file from its backing file.
        if n.has(abi.PASSTHROUGH) and self.session is not None:
            self.backing = PassthroughOpens(self.session, self.ops)
        self.no_open = n.has(abi.NO_OPEN_SUPPORT) and self.backing is None
        self.ops.features = {**n.describe(), "no_open": self.no_open}

    # -- the Dispatcher protocol -------------------------------------------------------------

    def dispatch(self, request: Request) -> Any:
        handler = self.handlers.get(request.opcode)
        if handler is None:
            raise FsError(errno.ENOSYS)
        return handler(request)

    def failed(self, request: Request, error: BaseException) -> int:
        if isinstance(error, FsError):
            return error.errno
        self.counters["eio"] += 1
        try:
            where = abi.Op(request.opcode).name.lower()
        except ValueError:
            where = f"opcode {request.opcode}"
        return failed_errno(log, error, where)

    # -- encoding ----------------------------------------------------------------------------

    def attr(self, ino: int, mode: int, size: int, mtime_ns: int) -> bytes:
        sec, nsec = divmod(mtime_ns, 1_000_000_000)
        return abi.ATTR.pack(ino, size, (size + 511) >> 9, sec, sec, sec, nsec, nsec, nsec, mode,
                             2 if mode == DIR_MODE else 1, self.uid, self.gid, 0, BLOCK_SIZE, 0)

    def entry(self, ino: int, mode: int, size: int, mtime_ns: int) -> bytes:
        sec, nsec = divmod(mtime_ns, 1_000_000_000)
        entry_sec, entry_nsec = self.entry_valid
        attr_sec, attr_nsec = self.attr_valid
        return abi.ENTRY_OUT.pack(ino, 0, entry_sec, attr_sec, entry_nsec, attr_nsec,
                                  ino, size, (size + 511) >> 9, sec, sec, sec, nsec, nsec, nsec, mode,
                                  2 if mode == DIR_MODE else 1, self.uid, self.gid, 0, BLOCK_SIZE, 0)

    def node_entry(self, ino: int, node: Node) -> bytes:
        if node.is_dir:
            return self.entry(ino, DIR_MODE, 0, node.mtime_ns)
        return self.entry(ino, FILE_MODE, node.size if isinstance(node, FileNode) else 0, node.mtime_ns)

    def node_attr(self, ino: int, node: Node) -> bytes:
        size = size_of(node)
        attr_sec, attr_nsec = self.attr_valid
        return (abi.ATTR_OUT_HEAD.pack(attr_sec, attr_nsec, 0)
                + self.attr(ino, DIR_MODE if node.is_dir else FILE_MODE, size, node.mtime_ns))

    # -- names and attributes ----------------------------------------------------------------

    def lookup(self, request: Request) -> Any:
        return self._lookup(request.nodeid, request.body.split(b"\0", 1)[0])

    async def _lookup(self, parent: int, name: bytes) -> bytes:
        found = await self.ops.lookup(parent, name)
        if found is None:
            # nodeid 0 with a timeout lets the kernel cache the miss: tools probe for absent
            # chunks a lot.
            entry_sec, entry_nsec = self.entry_valid
            return abi.ENTRY_OUT.pack(0, 0, entry_sec, 0, entry_nsec, 0, *([0] * 16))
        ino, node = found
        return self.node_entry(ino, node)

    def forget(self, request: Request) -> None:
        (n,) = abi.FORGET_IN.unpack_from(request.body)
        self.ops.forget(request.nodeid, n)

    def batch_forget(self, request: Request) -> None:
        body = request.body
        (count, _) = abi.BATCH_FORGET_IN.unpack_from(body)
        forget = self.ops.forget
        for ino, n in abi.FORGET_ONE.iter_unpack(body[abi.BATCH_FORGET_IN.size:
                                                      abi.BATCH_FORGET_IN.size + count * abi.FORGET_ONE.size]):
            forget(ino, n)

    def getattr(self, request: Request) -> Any:
        ino = request.nodeid
        node = self.ops.inodes.peek(ino)
        if node is not None and (node.is_dir or ino == ROOT):
            return self.node_attr(ino, node)
        return self._getattr(ino)

    async def _getattr(self, ino: int) -> bytes:
        return self.node_attr(ino, await self.ops.getattr(ino))

    # -- files ---------------------------------------------------------------------------

    def open(self, request: Request) -> Any:
        self.counters["opens"] += 1
        if self.no_open:
            # Once: the kernel then never sends OPEN (nor RELEASE) again on this mount and
            # keeps each file's pages across opens, revalidated through its attributes.
            raise FsError(errno.ENOSYS)
        flags, _ = abi.OPEN_IN.unpack_from(request.body)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND | os.O_CREAT):
            raise FsError(errno.EROFS)
        node = self.ops.inodes.peek(request.nodeid)
        if node is not None and node.is_dir:
            raise FsError(errno.EISDIR)
        if self.backing is not None:
            if node is None:
                return self._open_resolving(request)
            return self.backing.open(request, node)
        self.ops.open_files += 1
        return abi.OPEN_OUT.pack(CACHED_FH, abi.FOPEN_KEEP_CACHE, 0)

    async def _open_resolving(self, request: Request) -> None:
        node = await self.ops.inodes.get(request.nodeid)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        assert self.backing is not None
        return self.backing.open(request, node)

    def release(self, request: Request) -> bytes:
        self.ops.open_files = max(0, self.ops.open_files - 1)
        if self.backing is not None:
            fh, *_ = abi.RELEASE_IN.unpack_from(request.body)
            self.backing.release(request.nodeid, fh)
        return b""

    def read(self, request: Request) -> Any:
        _fh, offset, size, *_ = abi.READ_IN.unpack_from(request.body)
        session = self.session
        if session is not None and SPLICE_MIN <= size <= session.splice_max:
            # Page-cached bytes of a local file: moved by the kernel, answered here and now.
            found = self.ops.read_cached(request.nodeid, offset, size)
            if found is not None and session.splice_reply(request.unique, *found):
                self.ops.sent(request.nodeid, found)
                return None
        else:
            # Page-cached bytes of a local file, small: read and answered here and now, no coroutine.
            data = self.ops.read_now(request.nodeid, offset, size)
            if data is not None:
                return data
        return self._read(request.nodeid, offset, size)

    async def _read(self, ino: int, offset: int, size: int) -> list[Any]:
        _node, data = await self.ops.read(ino, offset, size)
        return [data]

    # -- directories ---------------------------------------------------------------------

    def opendir(self, request: Request) -> Any:
        ino = request.nodeid
        node = self.ops.inodes.peek(ino)
        if node is not None:
            return self._opened(ino, node)
        return self._opendir(ino)

    async def _opendir(self, ino: int) -> bytes:
        return self._opened(ino, await self.ops.inodes.get(ino))

    def _opened(self, ino: int, node: Node) -> bytes:
        if not isinstance(node, DirNode):
            raise FsError(errno.ENOTDIR)
        return abi.OPEN_OUT.pack(self.ops.opendir(ino, node), 0, 0)

    def readdir(self, request: Request) -> Any:
        return self._readdir(request, False)

    def readdirplus(self, request: Request) -> Any:
        return self._readdir(request, True)

    def _readdir(self, request: Request, plus: bool) -> Any:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(request.body)
        listing = self.ops.listing(fh)
        sink = DirentBuffer(size, plus, self)
        state = self.ops.fill(listing, offset, sink)
        if state is not None and (state or sink.parts):
            return self._sent(request, sink)
        return self._readdir_io(request, fh, offset, sink)

    async def _readdir_io(self, request: Request, fh: int, offset: int, sink: DirentBuffer) -> None:
        try:
            await self.ops.readdir(fh, offset, sink)
        except BaseException:
            self.ops.unref_entries(sink.refs)
            raise
        self._sent(request, sink)
        return None

    def _sent(self, request: Request, sink: DirentBuffer) -> None:
        """Reply with the entries; if the kernel no longer wants them, take their references back."""
        assert self.session is not None
        if not self.session.reply(request.unique, sink.parts) and sink.refs:
            self.ops.unref_entries(sink.refs)
        return None

    def releasedir(self, request: Request) -> Any:
        fh, *_ = abi.RELEASE_IN.unpack_from(request.body)
        listing = self.ops.listings.get(fh)
        if listing is None or listing.iterator is None:
            self.ops.listings.pop(fh, None)
            return b""
        return self._releasedir(fh)

    async def _releasedir(self, fh: int) -> bytes:
        await self.ops.releasedir(fh)
        return b""

    # -- extended attributes, statfs -------------------------------------------------------

    def getxattr(self, request: Request) -> Any:
        size, _ = abi.GETXATTR_IN.unpack_from(request.body)
        name = request.body[abi.GETXATTR_IN.size:].split(b"\0", 1)[0]
        return self._sized(self.ops.getxattr(request.nodeid, name), size)

    def listxattr(self, request: Request) -> Any:
        size, _ = abi.GETXATTR_IN.unpack_from(request.body)
        return self._sized(self._names(request.nodeid), size)

    async def _names(self, ino: int) -> bytes:
        return b"".join(name + b"\0" for name in await self.ops.listxattr(ino))

    async def _sized(self, value_coroutine: Any, size: int) -> bytes:
        """getxattr/listxattr: size 0 asks for the length; a smaller buffer is ERANGE."""
        value = await value_coroutine
        if size == 0:
            return abi.GETXATTR_OUT.pack(len(value), 0)
        if len(value) > size:
            raise FsError(errno.ERANGE)
        return bytes(value)

    def statfs(self, request: Request) -> bytes:
        s = self.ops.statfs()
        return abi.STATFS_OUT.pack(s["blocks"], s["bfree"], s["bavail"], s["files"], s["ffree"], s["bsize"],
                                   s["namelen"], s["frsize"], 0)

    # -- invalidation --------------------------------------------------------------------

    def invalidate_inode(self, ino: int, done: Callable[[], None]) -> None:
        """Ask the kernel to drop the pages and attributes it holds for `ino` (sent after the
        current request is answered, by the session's notifier task); `done` once it has.

        If the notification cannot be queued, the kernel drops them itself when it next fetches
        the attributes (AUTO_INVAL_DATA sees the new mtime): `done` after the attribute timeout."""
        if self.session is None:
            done()
            return
        self.counters["invalidations"] += 1
        if not self.session.notify(abi.Notify.INVAL_INODE, abi.NOTIFY_INVAL_INODE.pack(ino, 0, 0), done):
            self._after_attribute_timeout(done)
        located = self.ops.inodes.parent_of(ino)
        if located is not None:
            parent, name = located
            self.session.notify(abi.Notify.INVAL_ENTRY,
                                abi.NOTIFY_INVAL_ENTRY.pack(parent, len(name), 0) + name + b"\0")

    def _after_attribute_timeout(self, done: Callable[[], None]) -> None:
        async def later() -> None:
            await trio.sleep(self.ops.options.attr_timeout + 0.1)
            done()

        trio.lowlevel.spawn_system_task(later)

