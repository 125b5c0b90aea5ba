"""FUSE over io_uring (experimental): requests fetched and answered through ring entries.

The kernel's protocol (Linux 6.14 and later, the `fuse` module's
`enable_uring`, FUSE_OVER_IO_URING granted at INIT): after INIT the server
registers ring entries with IORING_OP_URING_CMD commands on the /dev/fuse
descriptor (FUSE_IO_URING_CMD_REGISTER), at least one for every possible
CPU's queue; each entry is two buffers, a header (the request's
`fuse_in_header`, its per-opcode struct, and the entry's own in/out record)
and a payload buffer as large as the largest request or reply. Once every
queue has an entry the kernel stops queueing requests on /dev/fuse (FORGET
and INTERRUPT still come there) and completes an entry's command when it
has put a request in its buffers. The answer goes back in the same buffers,
with FUSE_IO_URING_CMD_COMMIT_AND_FETCH, which also hands the entry back
for the next request: one system call per request instead of a read and a
write.

Python has no io_uring: the ring is set up with the raw system calls
(io_uring_setup, io_uring_enter) and its memory mapped, through ctypes and
mmap; submission entries are 128 bytes (IORING_SETUP_SQE128), whose last 80
bytes carry the FUSE command. Everything here runs on the session's trio
loop: the ring's descriptor is readable while completions wait.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Union

from unshardfs.fuse import abi

log = logging.getLogger(__name__)

# x86-64 and arm64 system call numbers (the same on both since io_uring came).
SYS_IO_URING_SETUP = 425
SYS_IO_URING_ENTER = 426

IORING_SETUP_SQE128 = 1 << 10
IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_ENTER_GETEVENTS = 1 << 0
IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_OP_URING_CMD = 46

FUSE_IO_URING_CMD_REGISTER = 1
FUSE_IO_URING_CMD_COMMIT_AND_FETCH = 2

# struct io_uring_params: sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features,
# wq_fd, resv[3]; io_sqring_offsets (head, tail, ring_mask, ring_entries, flags, dropped, array,
# resv1, user_addr); io_cqring_offsets (head, tail, ring_mask, ring_entries, overflow, cqes, flags,
# resv1, user_addr)
PARAMS = struct.Struct("<7I3I" + "7IIQ" + "7IIQ")
SQE_SIZE = 128
CQE = struct.Struct("<QiI")  # user_data, res, flags
# The head of an SQE for IORING_OP_URING_CMD: opcode, flags, ioprio, fd, cmd_op, pad, addr, len,
# uring_cmd_flags, user_data; the command area starts at byte 48.
SQE_HEAD = struct.Struct("<BBHiIIQIIQ")
SQE_CMD_AT = 48
# struct fuse_uring_cmd_req: flags, commit_id, qid, padding[6]
CMD_REQ = struct.Struct("<QQH6x")
# struct fuse_uring_req_header: in_out[128], op_in[128], then fuse_uring_ent_in_out
# (flags, commit_id, payload_sz, padding, reserved)
HEADER_SIZE = 128 + 128 + 32
OP_IN_AT = 128
ENT_IN_OUT_AT = 256
ENT_IN_OUT = struct.Struct("<QQIIQ")
IOVEC = struct.Struct("<QQ")

# A reply's payload: one buffer, or several sent back to back.
Buffer = Union[bytes, bytearray, memoryview]
Payload = Union[Buffer, list[Buffer]]

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class UringUnavailable(Exception):
    """No ring could be set up here (io_uring disabled, too old a kernel, out of memory)."""


def possible_cpus(path: str = "/sys/devices/system/cpu/possible") -> int:
    """How many queues the kernel makes (one per possible CPU: "0-3" or "0,2-5")."""
    try:
        with open(path) as f:
            text = f.read().strip()
        highest = max(int(part.split("-")[-1]) for part in text.split(","))
        return highest + 1
    except (OSError, ValueError):
        return os.cpu_count() or 1


def _address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


@dataclass
class Entry:
    """One ring entry: its queue, its two buffers (and the iovec pair naming them)."""

    index: int
    qid: int
    header: mmap.mmap
    payload: mmap.mmap
    iovecs: mmap.mmap


class Ring:
    """An io_uring instance and the FUSE ring entries registered through it."""

    def __init__(self, fuse_fd: int, queues: int, per_queue: int, payload_size: int) -> None:
        self.fuse_fd = fuse_fd
        self.payload_size = payload_size
        wanted = 1
        while wanted < queues * per_queue:
            wanted <<= 1
        params = bytearray(PARAMS.size)
        struct.pack_into("<I", params, 8, IORING_SETUP_SQE128)
        raw = (ctypes.c_char * len(params)).from_buffer(params)
        fd = _syscall(SYS_IO_URING_SETUP, ctypes.c_uint(wanted), raw)
        if fd < 0:
            err = ctypes.get_errno()
            raise UringUnavailable(f"io_uring_setup: {os.strerror(err)}")
        self.fd = fd
        self._maps: list[mmap.mmap] = []
        try:
            # The sizes and features, then offsets into the ring mapping (the masks' values are read
            # from it below).
            (sq_entries, cq_entries, _flags, _cpu, _idle, features, _wq_fd, _resv0, _resv1, _resv2,
             self._sq_head, self._sq_tail, sq_mask_at, _sq_n, _sq_flags, _dropped, sq_array, _r1, _ua1,
             self._cq_head, self._cq_tail, cq_mask_at, _cq_n, _overflow, cqes, _cq_flags, _r2, _ua2,
             ) = PARAMS.unpack(bytes(params))
            if not features & IORING_FEAT_SINGLE_MMAP:
                raise UringUnavailable("io_uring without a single ring mapping (kernel before 5.4)")
            size = max(sq_array + sq_entries * 4, cqes + cq_entries * CQE.size)
            self.rings = self._map(fd, size, IORING_OFF_SQ_RING)
            self.sqes = self._map(fd, sq_entries * SQE_SIZE, IORING_OFF_SQES)
        except BaseException:
            self.close()
            raise
        self._sq_mask = struct.unpack_from("<I", self.rings, sq_mask_at)[0]
        self._cq_mask = struct.unpack_from("<I", self.rings, cq_mask_at)[0]
        self._sq_array = sq_array
        self._cqes = cqes
        self.sq_entries = sq_entries
        # The SQ array maps slot i to SQE i once and for all.
        for i in range(sq_entries):
            struct.pack_into("<I", self.rings, sq_array + 4 * i, i)
        self._pending = 0  # SQEs written, not yet submitted
        self.entries: list[Entry] = []
        for qid in range(queues):
            for _ in range(per_queue):
                self.entries.append(self._entry(len(self.entries), qid))

    def _map(self, fd: int, size: int, offset: int) -> mmap.mmap:
        m = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self._maps.append(m)
        return m

    def _entry(self, index: int, qid: int) -> Entry:
        header = mmap.mmap(-1, HEADER_SIZE)
        payload = mmap.mmap(-1, self.payload_size)
        iovecs = mmap.mmap(-1, 2 * IOVEC.size)
        IOVEC.pack_into(iovecs, 0, _address(header), HEADER_SIZE)
        IOVEC.pack_into(iovecs, IOVEC.size, _address(payload), self.payload_size)
        self._maps += [header, payload, iovecs]
        return Entry(index, qid, header, payload, iovecs)

    # -- submission ------------------------------------------------------------------------

    def _queue(self, entry: Entry, cmd_op: int, commit_id: int) -> None:
        tail = struct.unpack_from("<I", self.rings, self._sq_tail)[0]
        head = struct.unpack_from("<I", self.rings, self._sq_head)[0]
        if tail - head >= self.sq_entries:
            self.submit()
            head = struct.unpack_from("<I", self.rings, self._sq_head)[0]
        at = (tail & self._sq_mask) * SQE_SIZE
        self.sqes[at:at + SQE_SIZE] = bytes(SQE_SIZE)
        SQE_HEAD.pack_into(self.sqes, at, IORING_OP_URING_CMD, 0, 0, self.fuse_fd, cmd_op, 0,
                           _address(entry.iovecs), 2, 0, entry.index)
        CMD_REQ.pack_into(self.sqes, at + SQE_CMD_AT, 0, commit_id, entry.qid)
        struct.pack_into("<I", self.rings, self._sq_tail, (tail + 1) & 0xFFFFFFFF)
        self._pending += 1

    def register_all(self) -> None:
        for entry in self.entries:
            self._queue(entry, FUSE_IO_URING_CMD_REGISTER, 0)
        self.submit()

    def commit(self, entry: Entry, unique: int, error: int, payload: Payload) -> bool:
        """Write the answer to request `unique` into `entry`'s buffers and hand the entry back
        (COMMIT_AND_FETCH). False if the payload does not fit (nothing was written)."""
        parts: list[Buffer] = payload if isinstance(payload, list) else [payload]
        size = 0
        for part in parts:
            size += memoryview(part).nbytes
        if size > self.payload_size:
            return False
        at = 0
        buffer = entry.payload
        for part in parts:
            n = memoryview(part).nbytes
            buffer[at:at + n] = part
            at += n
        abi.OUT_HEADER.pack_into(entry.header, 0, abi.OUT_HEADER.size + size, -error, unique)
        ENT_IN_OUT.pack_into(entry.header, ENT_IN_OUT_AT, 0, unique, size, 0, 0)
        self._queue(entry, FUSE_IO_URING_CMD_COMMIT_AND_FETCH, unique)
        return True

    def commit_from(self, entry: Entry, unique: int, fd: int, offset: int, size: int) -> bool:
        """`commit` of exactly `size` bytes of `fd` at `offset`, read into the entry's payload
        buffer; False (nothing committed) if fewer are there (the file shrank) or they do not fit."""
        if size > self.payload_size:
            return False
        try:
            got = os.preadv(fd, [memoryview(entry.payload)[:size]], offset)
        except OSError:
            return False
        if got != size:
            return False
        abi.OUT_HEADER.pack_into(entry.header, 0, abi.OUT_HEADER.size + size, 0, unique)
        ENT_IN_OUT.pack_into(entry.header, ENT_IN_OUT_AT, 0, unique, size, 0, 0)
        self._queue(entry, FUSE_IO_URING_CMD_COMMIT_AND_FETCH, unique)
        return True

    def submit(self, wait: bool = False) -> None:
        """Submit what is queued (and run the kernel's pending completions for this thread)."""
        n, self._pending = self._pending, 0
        result = _syscall(SYS_IO_URING_ENTER, ctypes.c_uint(self.fd), ctypes.c_uint(n),
                          ctypes.c_uint(0), ctypes.c_uint(IORING_ENTER_GETEVENTS), None, ctypes.c_size_t(0))
        if result < 0:
            err = ctypes.get_errno()
            if err not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")
            self._pending += n

    # -- completion ------------------------------------------------------------------------

    def completions(self) -> list[tuple[Entry, int]]:
        """Every completion waiting: (entry, result); result 0: a request is in the entry."""
        rings = self.rings
        head = struct.unpack_from("<I", rings, self._cq_head)[0]
        tail = struct.unpack_from("<I", rings, self._cq_tail)[0]
        done = []
        while head != tail:
            user_data, res, _flags = CQE.unpack_from(rings, self._cqes + (head & self._cq_mask) * CQE.size)
            if user_data < len(self.entries):
                done.append((self.entries[user_data], res))
            head = (head + 1) & 0xFFFFFFFF
        struct.pack_into("<I", rings, self._cq_head, head)
        return done

    @staticmethod
    def request(entry: Entry) -> bytes:
        """The request in `entry`, as /dev/fuse would have given it (header, per-opcode struct,
        the rest of its arguments)."""
        header = entry.header
        length, *_ = abi.IN_HEADER.unpack_from(header, 0)
        _flags, _commit_id, payload_size, _padding, _reserved = ENT_IN_OUT.unpack_from(header, ENT_IN_OUT_AT)
        op_size = length - abi.IN_HEADER.size - payload_size
        if not 0 <= op_size <= 128 or payload_size > len(entry.payload):
            raise ValueError(f"malformed ring request: length {length}, payload {payload_size}")
        return (header[:abi.IN_HEADER.size] + header[OP_IN_AT:OP_IN_AT + op_size]
                + entry.payload[:payload_size])

    def close(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # an address taken by ctypes is still alive: the mapping goes with it
                pass
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
