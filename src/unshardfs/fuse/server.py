"""A FUSE session on trio: read requests from /dev/fuse, answer them, never die of one.

The server knows no file system. It negotiates INIT (features by the
kernel's protocol minor), keeps the bookkeeping of the protocol itself
(INTERRUPT, DESTROY, unknown opcodes, write-type opcodes), and hands every
other request to a `Dispatcher`, whose answer is either ready at once
(bytes: replied inline) or a coroutine. A coroutine is run at once, in the
reading task: most finish without ever waiting (a lookup
or read whose indexes are cached, on a local source whose reads are
syscalls) and are answered there, with no task started and no cancel
scope entered (each request still passes the scheduler once, see `_read`).
One that waits (its first yield to trio) keeps the task it
started in, and a new task takes over reading requests (`_reader`): a
request that waits never holds up the others, and one that does not costs
no task. The reading task's cancel scope becomes the waiting request's,
which an INTERRUPT of that request cancels (it then answers EINTR).

Notifications (cache invalidations) are queued and written by their own
task, never from inside the request that found the change: the kernel may
hold locks for that request that the invalidation waits for.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import select
import struct
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Protocol, Union, runtime_checkable

import trio

from unshardfs.fuse import abi
from unshardfs.fuse.splice import SpliceFailed, Splicer
from unshardfs.fuse.uring import Entry, Ring, UringUnavailable, possible_cpus
from unshardfs.tree import edge
from unshardfs.util.pagecache import PAGE
from unshardfs.util.triofast import TrioProbe, resume, start

log = logging.getLogger(__name__)

# Requests handled back to back before the reading task passes the scheduler on purpose (a
# request that had to wait for the connection passed it anyway); small, so background work
# (read-ahead, prefetches) waits at most this many inline answers.
CHECKPOINT_EVERY = 8

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
    # How long the reader looks for the next request itself (`Connection._quick_wait`) before it
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
    """One mounted connection: the /dev/fuse fd and what was negotiated on it."""

    fd: int
    dispatcher: Dispatcher
    config: InitConfig = field(default_factory=InitConfig)
    negotiated: Negotiated = field(default_factory=Negotiated)
    on_init: Callable[[Negotiated], None] | None = None
    scopes: dict[int, trio.CancelScope] = field(default_factory=dict)
    requests: int = 0
    closed: bool = False

    def __post_init__(self) -> None:
        self._notify_send, self._notify_receive = trio.open_memory_channel[Notification](1024)
        self._buffer = bytearray(abi.READ_BUFFER)
        self._buffers = [self._buffer]
        self._view = memoryview(self._buffer)
        self._unscheduled = 0  # requests read without waiting since the scheduler last ran
        self.checkpoints = 0  # passes through the scheduler made only for that
        self._nursery: trio.Nursery | None = None
        self.splicer: Splicer | None = None  # set up at INIT, sized for the negotiated requests
        # per descriptor read from: it and trio's epoll (`_quick_wait`), made on first use
        self._quick: dict[int, select.epoll] = {}
        self.quick_waits = 0  # requests waited for without trio (`_read`)
        self._trio: TrioProbe | None = None
        self.ring: Ring | None = None  # FUSE over io_uring, once granted at INIT
        self._ring_pending: dict[int, Entry] = {}  # unique -> the ring entry the request came in
        self._ring_backlog: collections.deque[tuple[Entry, int]] = collections.deque()
        self._ring_batching = False  # commits are submitted together at the end of a batch
        self.ring_requests = 0

    def backing_open(self, fd: int) -> int:
        """Register the open file `fd` as a backing file of this connection (FUSE_PASSTHROUGH):
        its backing id, for OPEN replies with FOPEN_PASSTHROUGH, until `backing_close`. OSError
        if the kernel refuses it (EPERM without CAP_SYS_ADMIN, ELOOP for a file on a stacked file
        system, ENOTTY where the descriptor is no FUSE device)."""
        arg = bytearray(abi.BACKING_MAP.pack(fd, 0, 0))
        backing_id = fcntl.ioctl(self.fd, abi.FUSE_DEV_IOC_BACKING_OPEN, arg, True)
        if backing_id <= 0:
            raise OSError(errno.EINVAL, f"backing id {backing_id}")
        return int(backing_id)

    def backing_close(self, backing_id: int) -> None:
        """Drop a backing id; files opened on it keep their backing file until they are closed."""
        try:
            fcntl.ioctl(self.fd, abi.FUSE_DEV_IOC_BACKING_CLOSE, struct.pack("<I", backing_id))
        except OSError as e:
            if e.errno != errno.ENODEV:  # (the connection ended: every id went with it)
                log.warning("backing id %d not released: %s", backing_id, e.strerror)

    @property
    def splice_max(self) -> int:
        """The largest READ reply `splice_reply` can send (0: none)."""
        if self.ring is not None:
            return self.ring.payload_size
        return self.splicer.max_size if self.splicer is not None else 0

    def splice_reply(self, unique: int, fd: int, offset: int, size: int) -> bool:
        """Answer a READ with `size` bytes of `fd` at `offset`, moved by the kernel (see
        `splice`), or, over io_uring, read straight into the ring entry's buffer (one copy, as
        the spliced reply's). False: nothing was sent (the file had fewer bytes, or the pipe
        failed), and the request must be answered some other way."""
        if self.ring is not None:
            entry = self._ring_pending.get(unique)
            if entry is None or not self.ring.commit_from(entry, unique, fd, offset, size):
                return False
            del self._ring_pending[unique]
            if not self._ring_batching:
                self._ring_submit()
            return True
        if self.splicer is None:
            return False
        assert self.splicer is not None
        try:
            self.splicer.reply(unique, fd, offset, size)
            return True
        except SpliceFailed as e:
            log.debug("READ %d not spliced: %s", unique, e)
            return False
        except FileNotFoundError:
            log.debug("reply to request %d dropped: it was interrupted", unique)
            return True
        except OSError as e:
            if e.errno == errno.ENODEV:
                self.closed = True
                return True
            log.warning("spliced reply to request %d refused: %s; answering it otherwise", unique, e.strerror)
            return False

    # -- writing ---------------------------------------------------------------------------

    def _write(self, unique: int, error: int, payload: Any = b"") -> None:
        """One reply: header and payload in a single writev (or committed to the ring entry the
        request came in). A reply to a request the kernel gave up on (interrupted, aborted)
        fails with ENOENT: that is expected, not an error."""
        if self.ring is not None:
            entry = self._ring_pending.pop(unique, None)
            if entry is not None:
                if not self.ring.commit(entry, unique, error, payload):
                    log.error("reply to request %d does not fit the ring entry", unique)
                    self.ring.commit(entry, unique, errno.EIO, b"")
                if not self._ring_batching:
                    self._ring_submit()
                return
        if type(payload) is list:
            size = 0
            for part in payload:
                size += len(part)
            buffers = [abi.OUT_HEADER.pack(abi.OUT_HEADER.size + size, -error, unique), *payload]
        else:
            buffers = [abi.OUT_HEADER.pack(abi.OUT_HEADER.size + len(payload), -error, unique), payload]
        try:
            os.writev(self.fd, buffers)
        except FileNotFoundError:
            log.debug("reply to request %d dropped: it was interrupted", unique)
            raise
        except OSError as e:
            if e.errno == errno.ENODEV:  # unmounted meanwhile
                self.closed = True
            else:  # a malformed reply: the request would wait forever, so say so loudly
                log.error("reply to request %d refused by the kernel: %s (%d bytes)", unique, e.strerror,
                          sum(len(b) for b in buffers))
            raise

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

    def _write_notification(self, message: bytes) -> None:
        os.write(self.fd, message)

    async def _notifier(self) -> None:
        """Write queued notifications one at a time, each from a worker thread.

        The kernel handles FUSE_NOTIFY_INVAL_INODE inside the write: it drops the inode's pages,
        and waits for every page that is locked -- including pages of a READ still waiting for
        our answer. Written from the loop, that write would stop the loop that has to answer the
        READ, and both would wait for ever. From a thread, the loop keeps answering."""
        async for message, done in self._notify_receive:
            try:
                # abandon_on_cancel: at unmount the write ends with the connection (ENODEV) anyway.
                await trio.to_thread.run_sync(self._write_notification, message, abandon_on_cancel=True)
            except OSError as e:
                # ENOENT: the inode or entry is no longer known to the kernel (nothing to drop).
                if e.errno == errno.ENODEV:
                    return
                if e.errno != errno.ENOENT:
                    log.warning("notification failed: %s", e.strerror)
            finally:
                if done is not None:
                    done()

    # -- reading ---------------------------------------------------------------------------

    def _due(self) -> bool:
        """Count a request read without waiting: True for every CHECKPOINT_EVERY-th, which passes
        the scheduler on purpose.

        Requests answered inline do not yield by themselves, and while they keep coming, the
        work they started (read-ahead plans, prefetches whose bytes arrived, signal handlers)
        must still run between them: a request that found the connection empty passed the
        scheduler while it waited, and of those read without waiting every CHECKPOINT_EVERY-th
        passes it. (Every one did before; each pass is a few microseconds of Python, and a
        serial reader's requests, a first read's LOOKUP and READ, mostly arrive while the
        previous answer is being written.)"""
        self._unscheduled += 1
        if self._unscheduled < CHECKPOINT_EVERY:
            return False
        self._unscheduled = 0
        self.checkpoints += 1
        return True

    async def _read(self, error: OSError | None = None) -> bytes | None:
        """The next request, or None once the file system is unmounted; `error`: what the
        reader's own first readv (`_reader`, the usual case of a request already queued) raised."""
        waited = False
        while True:
            try:
                if error is not None:
                    raise error
                n = os.readv(self.fd, self._buffers)
            except BlockingIOError:
                error = None
                if not self.scopes and not waited and self.config.quick_wait and self._quick_wait():
                    continue  # read now, as one read without waiting (`_due` counts it)
                await trio.lowlevel.wait_readable(self.fd)
                waited = True
                continue
            except InterruptedError:
                error = None
                continue
            except OSError as e:
                error = None
                if e.errno == errno.ENOENT:  # the request was interrupted before we read it
                    continue
                if e.errno == errno.ENODEV:  # unmounted
                    return None
                raise
            data = bytes(self._view[:n])
            if waited:
                self._unscheduled = 0
            elif self._due():
                await trio.lowlevel.checkpoint()
            return data

    def _quick_wait(self, fd: int | None = None) -> bool:
        """Look for the next request on `fd` (/dev/fuse; the ring's descriptor for its completions,
        which the kernel posts as the sched_yield returns) for up to `config.quick_wait`, giving
        the CPU away in between (sched_yield, then a zero-timeout epoll_wait): whether one came.

        A serial reader (a first read: LOOKUP, READ, next file) sends its next request a few
        microseconds after it has our answer, and the way through trio to a ready descriptor
        (yield, epoll, reschedule, resume) costs more Python than the request itself; blocking
        in the kernel instead costs a wake-up, which measured slower still (the reader on the
        other CPU: 6,400-6,700 files/s against 7,200-7,600 through trio). Yielding lets a reader
        on this same CPU run and send; on the other CPU, it is there within a few probes
        (8,800-9,700 files/s). Only while no request waits on anything (`scopes` is empty) and
        trio's run queue is empty (`TrioProbe`): the epoll_wait watches trio's own epoll beside
        the connection, and ends the wait as soon as trio has something (a prefetch's socket, a
        thread's result) to go through it. What waits at most that long: timers, and a task made
        runnable in the same scheduler pass as the reader (trio takes a pass's tasks out of the
        queue before running them); background work still gets its pass of the scheduler every
        CHECKPOINT_EVERY requests."""
        fd = self.fd if fd is None else fd
        quick = self._quick.get(fd)
        if quick is None:
            # One epoll per descriptor: each reader waits only for its own requests (a reader
            # woken by the other's would read nothing, and look again without yielding to it).
            quick = self._quick[fd] = select.epoll(2)
            quick.register(fd, select.EPOLLIN)
            if self._trio is None:
                self._trio = TrioProbe.of_current_run()
            if self._trio is not None:
                quick.register(self._trio.epoll_fd, select.EPOLLIN)
        trio_ = self._trio
        if trio_ is None:
            return False  # trio's internals are not what we know (logged once): always through trio
        if trio_.runq:
            return False  # tasks are ready to run: let them
        trio_fd = trio_.epoll_fd
        deadline = time.perf_counter() + self.config.quick_wait
        while True:
            os.sched_yield()
            events = quick.poll(0, 2)
            if events:
                for ready, _ in events:  # (no generator: this is every idle request's path)
                    if ready == trio_fd:
                        return False
                self.quick_waits += 1
                return True
            if time.perf_counter() >= deadline:
                return False

    # -- io_uring ----------------------------------------------------------------------------

    def _ring_submit(self) -> None:
        assert self.ring is not None
        try:
            self.ring.submit()
        except OSError as e:
            log.error("%s", e)

    async def _ring_reader(self) -> None:
        """The ring's completions, handled like `_reader` handles requests read from /dev/fuse:
        inline, until one has to wait; then a new ring reader takes over the rest and this task
        sees that request through (under a cancel scope an INTERRUPT can cancel)."""
        ring = self.ring
        assert ring is not None and self._nursery is not None
        backlog = self._ring_backlog
        scope = trio.CancelScope()
        request: Request | None = None
        with scope:
            while True:
                if not backlog:
                    backlog.extend(ring.completions())
                if not backlog:
                    self._ring_submit()  # runs the kernel's pending work for this thread, too
                    backlog.extend(ring.completions())
                    if not backlog:
                        if not self.scopes and self.config.quick_wait and self._quick_wait(ring.fd):
                            continue  # as over /dev/fuse: the next request without a pass through trio
                        await trio.lowlevel.wait_readable(ring.fd)
                        self._ring_submit()
                        continue
                waiting = None
                self._ring_batching = True
                try:
                    while backlog and waiting is None:
                        entry, result = backlog.popleft()
                        if result < 0:
                            if -result not in (errno.ENOTCONN, errno.ECANCELED, errno.ECONNABORTED):
                                log.warning("ring entry %d: %s", entry.index, os.strerror(-result))
                            continue
                        try:
                            data = ring.request(entry)
                        except ValueError as e:
                            # Answered, so the entry comes back and the request does not hang.
                            log.error("%s", e)
                            ring.commit(entry, abi.IN_HEADER.unpack_from(entry.header)[2], errno.EIO, b"")
                            continue
                        self._ring_pending[abi.IN_HEADER.unpack_from(data)[2]] = entry
                        self.requests += 1
                        self.ring_requests += 1
                        try:
                            waiting = self._handle(data)
                        except Exception as e:  # noqa: BLE001 - one request never ends the session
                            log.exception("request dispatch failed: %s", e)
                finally:
                    self._ring_batching = False
                    self._ring_submit()
                if waiting is not None:
                    request = waiting[0]
                    await self._hand_over(waiting, scope, self._ring_reader)
                    return
                await trio.lowlevel.checkpoint()
        if request is not None and scope.cancelled_caught:
            self.on_interrupted(request)
            self.error(request.unique, errno.EINTR)

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
                await self._reader()
        finally:
            self.closed = True
            self._notify_send.close()
            if self.splicer is not None:
                self.splicer.close()
            for quick in self._quick.values():
                quick.close()
            if self.ring is not None:
                self.ring.close()

    async def _reader(self) -> None:
        """Read and answer requests until one has to wait: then a new reader task takes over and
        this one sees that request through. The reader that finds the connection ended ends the
        session (every request still waiting, and the notifier, are cancelled).

        Each reader runs under a cancel scope of its own, which becomes the waiting request's:
        an INTERRUPT of that request cancels it (EINTR). Requests answered without waiting need
        no scope (no INTERRUPT can reach them), so they cost none."""
        scope = trio.CancelScope()
        request: Request | None = None
        fd, buffers, view = self.fd, self._buffers, self._view
        with scope:
            while True:
                # The next request is usually queued already: read here, without a coroutine.
                try:
                    n = os.readv(fd, buffers)
                except OSError as e:
                    data = await self._read(e)  # waits for one, or sorts the error out
                    if data is None:
                        break
                else:
                    data = bytes(view[:n])
                    if self._due():
                        await trio.lowlevel.checkpoint()
                self.requests += 1
                try:
                    waiting = self._handle(data)
                except Exception as e:  # noqa: BLE001 - one request never ends the session
                    log.exception("request dispatch failed: %s", e)
                    continue
                if waiting is not None:
                    request = waiting[0]
                    await self._hand_over(waiting, scope, self._reader)
                    return
            self.closed = True
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
        ring = self._open_ring(n) if granted & abi.OVER_IO_URING and self.ring is None else None
        if ring is None:
            granted &= ~abi.OVER_IO_URING
        if self.config.splice and self.splicer is None and ring is None:
            try:
                self.splicer = Splicer(self.fd, n.max_pages * PAGE)
            except OSError as e:
                log.warning("READ replies are written, not spliced: %s", e.strerror)
            else:
                # Requests no larger than the pipe takes (pipe-max-size, 1 MiB by default, bounds
                # it without CAP_SYS_RESOURCE): a READ that cannot be spliced costs two copies.
                fits = self.splicer.max_size // PAGE
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
            self.ring = ring
            ring.register_all()
            assert self._nursery is not None
            self._nursery.start_soon(self._ring_reader)
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
