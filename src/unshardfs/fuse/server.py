"""A FUSE session on trio: one request loop over a transport, answering requests, never dying of one.

The server knows no file system. It negotiates INIT (features by the
kernel's protocol minor), keeps the bookkeeping of the protocol itself
(INTERRUPT, DESTROY, unknown opcodes, write-type opcodes), and hands every
other request to a `Dispatcher`, whose answer is either ready at once
(bytes: replied inline) or a coroutine. How requests come in and answers
go out is the transport's (`transport`: /dev/fuse, or the io_uring ring
once the kernel grants it); the loop here is the same over both.

A coroutine is run at once, in the reading task: most finish without ever
waiting (a lookup or read whose indexes are cached, on a local source whose
reads are syscalls) and are answered there, with no task started and no
cancel scope entered (the transport paces passes through the scheduler,
`Transport.due`). One that waits (its first yield to trio) keeps the task
it started in, and a new task takes over reading requests (`_reader`): a
request that waits never holds up the others, and one that does not costs
no task. The reading task's cancel scope becomes the waiting request's,
which an INTERRUPT of that request cancels (it then answers EINTR).

Notifications (cache invalidations) are queued and written by their own
task, never from inside the request that found the change: the kernel may
hold locks for that request that the invalidation waits for.
"""

from __future__ import annotations

import errno
import logging
import types
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Coroutine, Protocol, Union, runtime_checkable

import trio

from unshardfs.fuse import abi
from unshardfs.fuse.splice import Splicer
from unshardfs.fuse.transport import DevTransport, QuickWait, RingTransport, Transport
from unshardfs.fuse.uring import Ring, UringUnavailable, possible_cpus
from unshardfs.tree import edge
from unshardfs.util.concurrency import stray_cancellation
from unshardfs.util.pagecache import PAGE
from unshardfs.util.triofast import resume, start

log = logging.getLogger(__name__)

# What a dispatcher returns: a reply payload now, or a coroutine producing one.
Answer = Union[bytes, bytearray, memoryview, list[Any], Coroutine[Any, Any, Any], None]

# A queued notification: the message, and what to call once it was written (or refused).
Notification = tuple[bytes, Union[Callable[[], None], None]]


@dataclass
class Request:
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    body: bytes


class Dispatcher(Protocol):
    """The file system side of a session (see the module docstring)."""

    def dispatch(self, request: Request) -> Answer:
        """Answer `request`: payload bytes (or a list of buffers), a coroutine
        returning those, or None for requests that take no reply (FORGET)."""

    def failed(self, request: Request, error: BaseException) -> int:
        """The errno to answer for an unexpected exception (and log it); a handler answers an
        errno of its own choosing by raising `abi.FsError`."""


@runtime_checkable
class CountedDispatcher(Dispatcher, Protocol):
    """A dispatcher that counts what it answered by kind (shown by `unshardfs stats`): the
    connection adds the requests the kernel interrupted, which the dispatcher never sees end."""

    counters: dict[str, int]


@dataclass(frozen=True)
class InitConfig:
    """What we ask of the kernel at INIT; each wish is granted only if the kernel offers it."""

    want: int = (abi.ASYNC_READ | abi.AUTO_INVAL_DATA | abi.DO_READDIRPLUS | abi.READDIRPLUS_AUTO
                 | abi.NO_OPEN_SUPPORT | abi.PARALLEL_DIROPS | abi.MAX_PAGES)
    max_background: int = 64
    congestion_threshold: int = 48
    # Pages per request; None: as many as the kernel allows (`abi.max_pages_limit`), within what
    # one spliced reply holds (see `Connection._init`).
    max_pages: int | None = None
    # Ask for FUSE_PASSTHROUGH (files stored whole in a local file are read by the kernel from
    # that file). It costs the no-open mode: the kernel then sends OPEN for every open(). Only
    # where backing files can be registered (CAP_SYS_ADMIN, `may_register_backing_files`).
    passthrough: bool = False
    # "dev": requests read from and answered on /dev/fuse; "uring": through io_uring where the
    # kernel grants FUSE_OVER_IO_URING (`uring`, experimental), else as "dev".
    transport: str = "dev"
    uring_entries: int = 16  # ring entries per queue (one queue per possible CPU)
    splice: bool = True  # READ replies may be spliced from a file (`splice.Splicer`)
    # How long the reader looks for the next request itself (`transport.QuickWait`) before it
    # waits through trio, when no request is waiting on anything; 0: never.
    quick_wait: float = 100e-6


@dataclass
class Negotiated:
    minor: int = 0
    flags: int = 0  # 64 bits: flags2 of INIT as bits 32-63
    max_readahead: int = 0
    max_pages: int = 32
    max_pages_limit: int = abi.DEFAULT_MAX_PAGES_LIMIT  # what the kernel would have allowed
    max_background: int = 12

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)

    def describe(self) -> dict[str, object]:
        return {"protocol": f"7.{self.minor}", "max_background": self.max_background,
                "request_kib": self.max_pages * 4, "request_kib_limit": self.max_pages_limit * 4,
                **{name: self.has(flag) for flag, name in abi.FEATURE_NAMES.items()}}


CAP_SYS_ADMIN = 21


def may_register_backing_files() -> bool:
    """Whether this process holds CAP_SYS_ADMIN, which the kernel demands of whoever registers a
    backing file for passthrough (FUSE_DEV_IOC_BACKING_OPEN answers EPERM otherwise)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


@dataclass
class Connection:
    """One mounted connection: the /dev/fuse fd, what was negotiated on it, and the one request loop
    its transports feed."""

    fd: int
    dispatcher: Dispatcher
    config: InitConfig = field(default_factory=InitConfig)
    negotiated: Negotiated = field(default_factory=Negotiated)
    on_init: Callable[[Negotiated], None] | None = None
    scopes: dict[int, trio.CancelScope] = field(default_factory=dict)
    requests: int = 0

    def __post_init__(self) -> None:
        self._notify_send, self._notify_receive = trio.open_memory_channel[Notification](1024)
        self._nursery: trio.Nursery | None = None
        self._ended = False
        self.quick = QuickWait(self.config.quick_wait)
        self.device = DevTransport(self.fd, self.quick)
        self.uring: RingTransport | None = None  # FUSE over io_uring, once granted at INIT
        # How a reply goes out: written to /dev/fuse, or (`_commit`) to the ring entry it came in.
        self._write: Callable[..., None] = self.device.write

    @property
    def closed(self) -> bool:
        """The session ended, or the kernel ended the connection (unmounted)."""
        return self._ended or self.device.ended

    # -- what the transports count and hold ------------------------------------------------------

    @property
    def splicer(self) -> Splicer | None:
        return self.device.splicer

    @splicer.setter
    def splicer(self, splicer: Splicer | None) -> None:
        self.device.splicer = splicer

    @property
    def quick_waits(self) -> int:
        """Requests that came within a quick wait."""
        return self.quick.waits

    @property
    def ring_requests(self) -> int:
        return self.uring.requests if self.uring is not None else 0

    def backing_open(self, fd: int) -> int:
        """Register `fd` as a backing file (FUSE_PASSTHROUGH): `DevTransport.backing_open`."""
        return self.device.backing_open(fd)

    def backing_close(self, backing_id: int) -> None:
        self.device.backing_close(backing_id)

    @property
    def splice_max(self) -> int:
        """The largest READ reply `splice_reply` can send (0: none)."""
        if self.uring is not None:
            return self.uring.ring.payload_size
        return self.device.splicer.max_size if self.device.splicer is not None else 0

    def splice_reply(self, unique: int, fd: int, offset: int, size: int) -> bool:
        """Answer a READ with `size` bytes of `fd` at `offset`, moved by the kernel (see
        `splice`), or, over io_uring, read straight into the ring entry's buffer (one copy, as
        the spliced reply's). False: nothing was sent (the file had fewer bytes, or the pipe
        failed), and the request must be answered some other way."""
        if self.uring is not None:
            return self.uring.commit_from(unique, fd, offset, size)
        return self.device.splice_reply(unique, fd, offset, size)

    # -- replies ------------------------------------------------------------------------------

    def _commit(self, unique: int, error: int, payload: Any = b"") -> None:
        """A reply over io_uring: committed to the ring entry the request came in, else (FORGET,
        INTERRUPT and INIT come through /dev/fuse) written there."""
        assert self.uring is not None
        if not self.uring.commit(unique, error, payload):
            self.device.write(unique, error, payload)

    def reply(self, unique: int, payload: Any = b"") -> bool:
        """Answer a request; False if the kernel no longer wanted the answer."""
        try:
            self._write(unique, 0, payload)
            return True
        except OSError:
            return False

    def error(self, unique: int, code: int) -> None:
        try:
            self._write(unique, code)
        except OSError:
            pass

    def notify(self, code: abi.Notify, payload: bytes, done: Callable[[], None] | None = None) -> bool:
        """Queue a notification; the notifier task writes it (outside every request) and then
        calls `done` (on the loop), whether or not the kernel accepted it. False if it was not
        queued (the session is closing, or the queue is full): `done` is then never called."""
        if self.closed:
            return False
        message = abi.OUT_HEADER.pack(abi.OUT_HEADER.size + len(payload), code, 0) + payload
        try:
            self._notify_send.send_nowait((message, done))
        except trio.WouldBlock:
            log.warning("notification queue full: a change is left to the attribute timeout")
            return False
        return True

    async def _notifier(self) -> None:
        """Write queued notifications one at a time, each from a worker thread.

        The kernel handles FUSE_NOTIFY_INVAL_INODE inside the write: it drops the inode's pages,
        and waits for every page that is locked -- including pages of a READ still waiting for
        our answer. Written from the loop, that write would stop the loop that has to answer the
        READ, and both would wait for ever. From a thread, the loop keeps answering."""
        async for message, done in self._notify_receive:
            try:
                # abandon_on_cancel: at unmount the write ends with the connection (ENODEV) anyway.
                await trio.to_thread.run_sync(self.device.write_notification, message, abandon_on_cancel=True)
            except OSError as e:
                # ENOENT: the inode or entry is no longer known to the kernel (nothing to drop).
                if e.errno == errno.ENODEV:
                    return
                if e.errno != errno.ENOENT:
                    log.warning("notification failed: %s", e.strerror)
            finally:
                if done is not None:
                    done()

    # -- the request loop -------------------------------------------------------------------------

    def _open_ring(self, n: Negotiated) -> Ring | None:
        """A ring sized for the negotiated requests, made before INIT is answered: once the
        kernel has granted io_uring it queues requests for the ring only, so a ring that cannot
        be made must mean not asking for it."""
        payload = max(abi.MIN_READ_BUFFER, abi.MAX_WRITE, n.max_pages * PAGE)
        try:
            return Ring(self.fd, possible_cpus(), self.config.uring_entries, payload)
        except (UringUnavailable, OSError) as e:
            log.warning("FUSE over io_uring unavailable (%s): requests go through /dev/fuse", e)
            return None

    async def serve(self) -> None:
        """Serve until the kernel ends the connection (unmount, abort) or the caller cancels."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._notifier)
                await self._reader(self.device)
        finally:
            self._ended = True
            self._notify_send.close()
            self.device.close()
            self.quick.close()
            if self.uring is not None:
                self.uring.close()

    async def _reader(self, transport: Transport) -> None:
        """Take and answer requests from `transport` until one has to wait: then a new reader task
        takes over and this one sees that request through. The reader that finds the connection
        ended ends the session (every request still waiting, and the notifier, are cancelled).

        Each reader runs under a cancel scope of its own, which becomes the waiting request's:
        an INTERRUPT of that request cancels it (EINTR). Requests answered without waiting need
        no scope (no INTERRUPT can reach them), so they cost none."""
        scope = trio.CancelScope()
        request: Request | None = None
        take = transport.take
        with scope:
            while True:
                # The next request is usually there already: taken here, without a coroutine.
                data = take()
                if data is None:
                    data = await transport.next(not self.scopes)
                    if data is None:
                        break
                if transport.due:
                    await trio.lowlevel.checkpoint()
                self.requests += 1
                try:
                    waiting = self._handle(data)
                except Exception as e:  # noqa: BLE001 - one request never ends the session
                    log.exception("request dispatch failed: %s", e)
                    continue
                if waiting is not None:
                    transport.flush()
                    request = waiting[0]
                    await self._hand_over(waiting, scope, partial(self._reader, transport))
                    return
            self._ended = True
            self._notify_send.close()
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()
            return
        # Only reached when our scope caught its own cancellation: the request was interrupted.
        if request is not None and scope.cancelled_caught:
            self.on_interrupted(request)
            self.error(request.unique, errno.EINTR)

    async def _hand_over(self, waiting: "_Waiting", scope: trio.CancelScope,
                         reader: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A request that waits: a new `reader` task takes over reading requests, and this task
        sees the request through, under `scope` (the reader's own), which its INTERRUPT cancels."""
        request = waiting[0]
        self.scopes[request.unique] = scope
        assert self._nursery is not None
        self._nursery.start_soon(reader)
        try:
            await self._finish(*waiting)
        finally:
            self.scopes.pop(request.unique, None)

    def _handle(self, data: bytes) -> "_Waiting | None":
        length, opcode, unique, nodeid, uid, gid, pid, _extlen, _pad = abi.IN_HEADER.unpack_from(data)
        body = data[abi.IN_HEADER.size:length]
        if opcode == abi.Op.INIT:
            self._init(unique, body)
            return None
        if opcode == abi.Op.INTERRUPT:
            (target,) = abi.INTERRUPT_IN.unpack_from(body)
            scope = self.scopes.get(target)
            if scope is not None:
                scope.cancel()
            return None  # INTERRUPT itself takes no reply
        if opcode == abi.Op.DESTROY:
            self.reply(unique)
            return None
        if opcode in abi.WRITE_OPS:
            self.error(unique, errno.EROFS)
            return None
        request = Request(opcode, unique, nodeid, uid, gid, pid, body)
        try:
            answer = self.dispatcher.dispatch(request)
        except abi.FsError as e:
            self.error(unique, e.errno)
            return None
        except Exception as e:  # noqa: BLE001
            self.error(unique, self.dispatcher.failed(request, e))
            return None
        if answer is None:
            return None
        if type(answer) is types.CoroutineType:  # an async handler's (typing's isinstance costs ~1 us)
            return self._start(request, answer)
        self.reply(unique, answer)
        return None

    def _start(self, request: Request, coroutine: Coroutine[Any, Any, Any]) -> "_Waiting | None":
        """Run a handler's coroutine in this task until it finishes (answered here) or first waits
        (returned, to be seen through by `_finish` in this same task)."""
        try:
            finished, value = start(coroutine)
        except (abi.FsError, Exception) as e:  # noqa: BLE001 - answered, never raised on
            self._failed(request, e)
            return None
        except BaseException as e:
            if not stray_cancellation(e):
                raise
            self._failed(request, e)  # (see `_finish`)
            return None
        if not finished:
            return request, coroutine, value  # (value: the trap it waits on)
        if value is not None:
            self.reply(request.unique, value)
        return None

    async def _finish(self, request: Request, coroutine: Coroutine[Any, Any, Any], trap: Any) -> None:
        """A request whose handler waits, from its first wait on; a cancellation (INTERRUPT, or
        the session ending) goes on up to the reader's scope."""
        try:
            answer = await resume(coroutine, trap)
        except (abi.FsError, Exception) as e:  # noqa: BLE001
            self._failed(request, e)
            return
        except BaseException as e:
            if not stray_cancellation(e):
                raise  # an INTERRUPT, or the session ending
            # Another task's cancellation handed on by a handler (a bug): let through, no scope
            # here would catch it and it would end every request and the mount with it.
            self._failed(request, e)
            return
        if answer is not None:
            self.reply(request.unique, answer)

    def _failed(self, request: Request, error: BaseException) -> None:
        """Answer a handler's exception: its own errno (FsError), else the dispatcher's for a bug."""
        if isinstance(error, abi.FsError):
            self.error(request.unique, error.errno)
        else:
            self.error(request.unique, self.dispatcher.failed(request, error))

    def on_interrupted(self, request: Request) -> None:
        if isinstance(self.dispatcher, CountedDispatcher):  # (only an INTERRUPT asks)
            counters = self.dispatcher.counters
            counters["interrupted"] = counters.get("interrupted", 0) + 1

    # -- INIT ----------------------------------------------------------------------------

    def _init(self, unique: int, body: bytes) -> None:
        major, minor, max_readahead, flags = abi.INIT_IN.unpack_from(body)
        if major != abi.KERNEL_VERSION:
            # A newer major: answer with ours and the kernel sends INIT again or gives up.
            log.error("kernel speaks FUSE %d.%d; this engine speaks 7.x", major, minor)
            self.reply(unique, abi.INIT_OUT.pack(abi.KERNEL_VERSION, abi.KERNEL_MINOR, *([0] * 10)))
            return
        if minor < abi.MIN_MINOR:
            log.error("kernel FUSE protocol 7.%d is older than 7.%d: use --fuse-engine pyfuse3", minor, abi.MIN_MINOR)
            self.error(unique, errno.EPROTO)
            return
        if flags & abi.INIT_EXT and len(body) >= abi.INIT_IN.size + abi.INIT_IN_FLAGS2.size:
            (flags2,) = abi.INIT_IN_FLAGS2.unpack_from(body, abi.INIT_IN.size)
            flags |= flags2 << 32
        want = (self.config.want | (abi.PASSTHROUGH if self.config.passthrough else 0)
                | (abi.OVER_IO_URING if self.config.transport == "uring" else 0))
        granted = flags & want
        for flag, since in abi.FEATURE_MINOR.items():
            if minor < since:
                granted &= ~flag
        if granted >> 32:
            granted |= abi.INIT_EXT  # the reply's flags2 counts only with it
        n = self.negotiated
        n.minor = min(minor, abi.KERNEL_MINOR)
        n.flags = granted
        n.max_readahead = max_readahead
        n.max_pages_limit = abi.max_pages_limit()
        wanted_pages = self.config.max_pages or n.max_pages_limit
        n.max_pages = min(wanted_pages, n.max_pages_limit) if granted & abi.MAX_PAGES else 32
        n.max_background = self.config.max_background
        # Over io_uring replies are copied into the ring entry's buffer: no pipe bounds them.
        ring = self._open_ring(n) if granted & abi.OVER_IO_URING and self.uring is None else None
        if ring is None:
            granted &= ~abi.OVER_IO_URING
        if self.config.splice and self.device.splicer is None and ring is None:
            try:
                self.device.splicer = Splicer(self.fd, n.max_pages * PAGE)
            except OSError as e:
                log.warning("READ replies are written, not spliced: %s", e.strerror)
            else:
                # Requests no larger than the pipe takes (pipe-max-size, 1 MiB by default, bounds
                # it without CAP_SYS_RESOURCE): a READ that cannot be spliced costs two copies.
                fits = self.device.splicer.max_size // PAGE
                if granted & abi.MAX_PAGES and fits >= 32:
                    n.max_pages = min(n.max_pages, fits)
        n.flags = granted
        ours = abi.URING_MINOR if granted & abi.OVER_IO_URING else abi.KERNEL_MINOR
        n.minor = min(minor, ours)
        out = abi.INIT_OUT.pack(abi.KERNEL_VERSION, ours, max_readahead, granted & 0xFFFFFFFF,
                                self.config.max_background, self.config.congestion_threshold,
                                abi.MAX_WRITE, 1, n.max_pages, 0, granted >> 32,
                                abi.PASSTHROUGH_STACK_DEPTH if granted & abi.PASSTHROUGH else 0)
        if minor < 23:
            out = out[:abi.INIT_OUT_COMPAT_22]
        self.reply(unique, out)
        if ring is not None:
            # Registered only now: the kernel takes ring entries once INIT is answered.
            self.uring = RingTransport(ring, self.quick)
            self._write = self._commit
            ring.register_all()
            assert self._nursery is not None
            self._nursery.start_soon(self._reader, self.uring)
        log.info("FUSE protocol 7.%d negotiated: %s; requests of up to %d KiB (the kernel allows %d KiB)",
                 n.minor, ", ".join(name for flag, name in abi.FEATURE_NAMES.items() if granted & flag)
                 or "no features", n.max_pages * 4, n.max_pages_limit * 4)
        if self.on_init is not None:
            self.on_init(n)


# A request whose handler waits: (request, its coroutine, what it first yielded).
_Waiting = tuple[Request, Coroutine[Any, Any, Any], Any]


def failed_errno(logger: logging.Logger, error: BaseException, where: str) -> int:
    """The errno of an unexpected exception, reported once per cause through the edge module."""
    return edge.answer(logger, error, where).errno
