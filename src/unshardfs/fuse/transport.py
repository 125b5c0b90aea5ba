"""The FUSE wire: how requests come in and answers go out, apart from what is done with them.

A session (`server.Connection`) runs one request loop over a `Transport`:
`/dev/fuse` itself (`DevTransport`: a request per `readv`, replies written
with `writev` or spliced from a file) or, where the kernel grants
FUSE_OVER_IO_URING, the ring (`RingTransport`: requests arrive in ring
entries in batches, and replies are committed to the entry they came in
and submitted together at the end of a batch). FORGET, INTERRUPT and INIT
keep coming through /dev/fuse, so with a ring both run. The device also
carries what is not a reply: backing ids registered for passthrough, and
notifications (written from a worker thread, see `DevTransport`).

The quick wait (`QuickWait`) is how a transport looks for the next request
itself for a moment before it waits through trio.
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
from typing import Any, Protocol

import trio

from unshardfs.fuse import abi
from unshardfs.fuse.splice import SpliceFailed, Splicer
from unshardfs.fuse.uring import Entry, Ring
from unshardfs.util.triofast import TrioProbe

log = logging.getLogger(__name__)

# Requests handled back to back before the reading task passes the scheduler on purpose (a
# request that had to wait for the connection passed it anyway); small, so background work
# (read-ahead, prefetches) waits at most this many inline answers.
CHECKPOINT_EVERY = 8


class Transport(Protocol):
    """Where the request loop takes requests from. Only one task reads at a time: the loop hands
    the transport over to a new reading task when a request has to wait."""

    # Set with each request taken: pass the scheduler before answering it (see CHECKPOINT_EVERY).
    due: bool

    def take(self) -> bytes | None:
        """A request there now (as /dev/fuse gives it: header, then arguments), without waiting;
        None when none is."""

    async def next(self, spin: bool) -> bytes | None:
        """The next request, waited for (with `spin`, looked for with the quick wait first); None
        once the connection has ended."""

    def flush(self) -> None:
        """Send the replies held back while requests were answered in a batch (before the reading
        task waits on anything)."""


class QuickWait:
    """Looks for the next request on a descriptor (/dev/fuse; the ring's descriptor for its
    completions, which the kernel posts as the sched_yield returns) for up to `seconds`, giving the
    CPU away in between (sched_yield, then a zero-timeout epoll_wait).

    A serial reader (a first read: LOOKUP, READ, next file) sends its next request a few
    microseconds after it has our answer, and the way through trio to a ready descriptor (yield,
    epoll, reschedule, resume) costs more Python than the request itself; blocking in the kernel
    instead costs a wake-up, which measured slower still (the reader on the other CPU: 6,400-6,700
    files/s against 7,200-7,600 through trio). Yielding lets a reader on this same CPU run and send;
    on the other CPU, it is there within a few probes (8,800-9,700 files/s). Only while no request
    waits on anything (the caller's `spin`) and trio's run queue is empty (`TrioProbe`): the
    epoll_wait watches trio's own epoll beside the connection, and ends the wait as soon as trio has
    something (a prefetch's socket, a thread's result) to go through it. What waits at most that
    long: timers, and a task made runnable in the same scheduler pass as the reader (trio takes a
    pass's tasks out of the queue before running them); background work still gets its pass of the
    scheduler every CHECKPOINT_EVERY requests.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.waits = 0  # requests that came within a wait
        self._epolls: dict[int, select.epoll] = {}  # per descriptor: it and trio's epoll, made on first use
        self._trio: TrioProbe | None = None

    def __call__(self, fd: int) -> bool:
        """Whether a request came on `fd` within the wait (never waits if `seconds` is 0)."""
        if not self.seconds:
            return False
        quick = self._epolls.get(fd)
        if quick is None:
            # One epoll per descriptor: each reader waits only for its own requests (a reader
            # woken by the other's would read nothing, and look again without yielding to it).
            quick = self._epolls[fd] = select.epoll(2)
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
        deadline = time.perf_counter() + self.seconds
        while True:
            os.sched_yield()
            events = quick.poll(0, 2)
            if events:
                for ready, _ in events:  # (no generator: this is every idle request's path)
                    if ready == trio_fd:
                        return False
                self.waits += 1
                return True
            if time.perf_counter() >= deadline:
                return False

    def close(self) -> None:
        for quick in self._epolls.values():
            quick.close()
        self._epolls = {}


class DevTransport:
    """/dev/fuse: requests read one per `readv` into one buffer; replies written with `writev` or
    spliced (`splice_reply`); backing ids registered on it; notifications written to it."""

    def __init__(self, fd: int, quick: QuickWait) -> None:
        self.fd = fd
        self.quick = quick
        self._buffers = [bytearray(abi.READ_BUFFER)]
        self._view = memoryview(self._buffers[0])
        self.splicer: Splicer | None = None  # set up at INIT, sized for the negotiated requests
        self.ended = False  # the kernel ended the connection (ENODEV)
        self.due = False
        self.checkpoints = 0  # passes through the scheduler made only for pacing (`due`)
        self._unscheduled = 0  # requests read without waiting since the scheduler last ran
        self._error: OSError | None = None  # what `take`'s readv raised, for `next` to sort out

    # -- requests -----------------------------------------------------------------------------

    def take(self) -> bytes | None:
        # The next request is usually queued already: one readv, and what it raised is for `next`.
        try:
            n = os.readv(self.fd, self._buffers)
        except OSError as e:
            self._error = e
            return None
        self._count()
        return bytes(self._view[:n])

    async def next(self, spin: bool) -> bytes | None:
        error, self._error = self._error, None
        waited = False
        while True:
            try:
                if error is not None:
                    raise error
                n = os.readv(self.fd, self._buffers)
            except BlockingIOError:
                error = None
                if spin and not waited and self.quick(self.fd):
                    continue  # read now, as one read without waiting (`_count` counts it)
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
                    self.ended = True
                    return None
                raise
            if waited:  # it passed the scheduler while it waited
                self._unscheduled = 0
                self.due = False
            else:
                self._count()
            return bytes(self._view[:n])

    def _count(self) -> None:
        """Count a request read without waiting: every CHECKPOINT_EVERY-th is `due`.

        Requests answered inline do not yield by themselves, and while they keep coming, the
        work they started (read-ahead plans, prefetches whose bytes arrived, signal handlers)
        must still run between them: a request that found the connection empty passed the
        scheduler while it waited, and of those read without waiting every CHECKPOINT_EVERY-th
        passes it. (Every one did before; each pass is a few microseconds of Python, and a
        serial reader's requests, a first read's LOOKUP and READ, mostly arrive while the
        previous answer is being written.)"""
        self._unscheduled += 1
        if self._unscheduled < CHECKPOINT_EVERY:
            self.due = False
            return
        self._unscheduled = 0
        self.checkpoints += 1
        self.due = True

    def flush(self) -> None:
        """Nothing: every reply was written when it was made."""

    # -- replies ------------------------------------------------------------------------------

    def write(self, unique: int, error: int, payload: Any = b"") -> None:
        """One reply: header and payload in a single writev. A reply to a request the kernel gave
        up on (interrupted, aborted) fails with ENOENT: that is expected, not an error."""
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
                self.ended = True
            else:  # a malformed reply: the request would wait forever, so say so loudly
                log.error("reply to request %d refused by the kernel: %s (%d bytes)", unique, e.strerror,
                          sum(len(b) for b in buffers))
            raise

    def splice_reply(self, unique: int, fd: int, offset: int, size: int) -> bool:
        """Answer a READ with `size` bytes of `fd` at `offset`, moved by the kernel (see `splice`).
        False: nothing was sent (the file had fewer bytes, or the pipe failed), and the request
        must be answered some other way."""
        if self.splicer is None:
            return False
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
                self.ended = True
                return True
            log.warning("spliced reply to request %d refused: %s; answering it otherwise", unique, e.strerror)
            return False

    def write_notification(self, message: bytes) -> None:
        """One notification (blocking: the kernel may hold it until pages it waits for are
        unlocked; the caller writes from a worker thread)."""
        os.write(self.fd, message)

    # -- backing files (FUSE_PASSTHROUGH) ----------------------------------------------------------

    def backing_open(self, fd: int) -> int:
        """Register the open file `fd` as a backing file of this connection: its backing id, for
        OPEN replies with FOPEN_PASSTHROUGH, until `backing_close`. OSError if the kernel refuses
        it (EPERM without CAP_SYS_ADMIN, ELOOP for a file on a stacked file system, ENOTTY where
        the descriptor is no FUSE device)."""
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

    def close(self) -> None:
        if self.splicer is not None:
            self.splicer.close()


class RingTransport:
    """FUSE over io_uring: requests taken from the ring's completions, a batch at a time; each
    answered in the entry it came in (`commit`), and a batch's commits submitted together."""

    def __init__(self, ring: Ring, quick: QuickWait) -> None:
        self.ring = ring
        self.quick = quick
        self.requests = 0  # requests that came through the ring
        self.due = False  # never in a batch: the scheduler runs between batches (`next`)
        self._backlog: collections.deque[tuple[Entry, int]] = collections.deque()
        self._pending: dict[int, Entry] = {}  # unique -> the ring entry the request came in
        self._batching = False  # commits are submitted together when the batch ends (`flush`)
        self._batched = False  # a batch was answered since the scheduler last ran

    def submit(self) -> None:
        try:
            self.ring.submit()
        except OSError as e:
            log.error("%s", e)

    # -- requests -----------------------------------------------------------------------------

    def take(self) -> bytes | None:
        ring, backlog = self.ring, self._backlog
        while backlog:
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
                ring.commit(entry, abi.unique_of(entry.header), errno.EIO, b"")
                continue
            self._pending[abi.unique_of(data)] = entry
            self.requests += 1
            self._batching = True
            return data
        self.flush()
        return None

    async def next(self, spin: bool) -> bytes | None:
        ring, backlog = self.ring, self._backlog
        while True:
            if self._batched:  # between batches, the scheduler runs
                self._batched = False
                await trio.lowlevel.checkpoint()
            backlog.extend(ring.completions())
            if not backlog:
                self.submit()  # runs the kernel's pending work for this thread, too
                backlog.extend(ring.completions())
            if backlog:
                data = self.take()
                if data is not None:
                    return data
                continue
            if spin and self.quick(ring.fd):
                continue  # as over /dev/fuse: the next request without a pass through trio
            await trio.lowlevel.wait_readable(ring.fd)
            self.submit()

    def flush(self) -> None:
        if self._batching:
            self._batching = False
            self._batched = True
            self.submit()

    # -- replies ------------------------------------------------------------------------------

    def commit(self, unique: int, error: int, payload: Any) -> bool:
        """The reply to `unique` committed to its entry (submitted now, or with the batch it is
        answered in); False if it did not come through the ring."""
        entry = self._pending.pop(unique, None)
        if entry is None:
            return False
        if not self.ring.commit(entry, unique, error, payload):
            log.error("reply to request %d does not fit the ring entry", unique)
            self.ring.commit(entry, unique, errno.EIO, b"")
        if not self._batching:
            self.submit()
        return True

    def commit_from(self, unique: int, fd: int, offset: int, size: int) -> bool:
        """A READ answered with `size` bytes of `fd` at `offset`, read straight into the entry's
        buffer (one copy, as a spliced reply's); False: nothing was sent, answer it otherwise."""
        entry = self._pending.get(unique)
        if entry is None or not self.ring.commit_from(entry, unique, fd, offset, size):
            return False
        del self._pending[unique]
        if not self._batching:
            self.submit()
        return True

    def close(self) -> None:
        self.ring.close()
