"""The kernel protocol session without a kernel: requests written to one end of a SOCK_SEQPACKET
pair (message boundaries kept, like /dev/fuse), replies read from it."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time

import pytest
import trio
import trio.testing

from tests.support.cancellation import foreign_cancellation
from unshardfs.fuse import abi
from unshardfs.fuse.server import InitConfig, Request, Connection

ALL_FLAGS = 0xFFFFFFFF


class FakeFs:
    """Answers GETATTR inline, LOOKUP after a while (a task), READ with a bug."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.forgotten: list[int] = []

    def dispatch(self, request: Request):
        if request.opcode == abi.Op.GETATTR:
            return b"attr"
        if request.opcode == abi.Op.LOOKUP:
            return self.slow()
        if request.opcode == abi.Op.READ:
            raise ValueError("a bug in a handler")
        if request.opcode == abi.Op.FORGET:
            self.forgotten.append(request.nodeid)
            return None
        raise abi.FsError(errno.ENOSYS)

    async def slow(self) -> bytes:
        await trio.sleep(30)
        return b"late"

    def failed(self, request: Request, error: BaseException) -> int:
        return errno.EIO


def request(opcode: int, unique: int, body: bytes = b"", nodeid: int = 1) -> bytes:
    return abi.IN_HEADER.pack(abi.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 0, 0, 0) + body


def init_body(minor: int, flags: int = ALL_FLAGS) -> bytes:
    return abi.INIT_IN.pack(7, minor, 128 << 10, flags) + bytes(48)


async def exchange(messages: list[bytes], replies: int, fs: FakeFs | None = None,
                   config: InitConfig | None = None) -> tuple[list, Connection]:
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    kernel.setblocking(False)
    session = Connection(ours.fileno(), fs or FakeFs(), config or InitConfig())
    got = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.serve)
        for message in messages:
            await trio.lowlevel.wait_writable(kernel)
            kernel.send(message)
        with trio.fail_after(10):
            while len(got) < replies:
                await trio.lowlevel.wait_readable(kernel)
                data = kernel.recv(1 << 16)
                length, error, unique = abi.OUT_HEADER.unpack_from(data)
                assert length == len(data)
                got.append((unique, -error, data[abi.OUT_HEADER.size:]))
        nursery.cancel_scope.cancel()
    ours.close()
    kernel.close()
    return got, session


@pytest.mark.parametrize("minor, granted", [
    (40, ["async_read", "auto_inval_data", "readdirplus", "readdirplus_auto", "no_open", "parallel_dirops",
          "max_pages"]),
    (38, ["async_read", "auto_inval_data", "readdirplus", "readdirplus_auto", "no_open", "parallel_dirops",
          "max_pages"]),
    (26, ["async_read", "auto_inval_data", "readdirplus", "readdirplus_auto", "no_open", "parallel_dirops"]),
    (22, ["async_read", "auto_inval_data", "readdirplus", "readdirplus_auto"]),
])
def test_init_grants_what_the_protocol_version_has(minor, granted):
    (reply,), session = trio.run(exchange, [request(abi.Op.INIT, 1, init_body(minor))], 1)
    unique, error, body = reply
    assert (unique, error) == (1, 0)
    assert len(body) == (abi.INIT_OUT.size if minor >= 23 else abi.INIT_OUT_COMPAT_22)
    features = session.negotiated.describe()
    assert sorted(name for name in abi.FEATURE_NAMES.values() if features[name]) == sorted(granted)
    if minor >= 23:
        fields = abi.INIT_OUT.unpack(body)
        # 256 pages, or as many as the splice pipe holds (pipe-max-size bounds it without
        # CAP_SYS_RESOURCE: 254 pages with the default 1 MiB); a pipe under 32 pages bounds nothing.
        limit = abi.max_pages_limit()
        fits = session.splice_max // 4096
        pages = min(limit, fits) if fits >= 32 else limit
        assert fields[4] == InitConfig().max_background and fields[8] == (pages if minor >= 28 else 32)


def test_init_grants_only_what_the_kernel_offers():
    offered = abi.ASYNC_READ | abi.PARALLEL_DIROPS
    (reply,), session = trio.run(exchange, [request(abi.Op.INIT, 1, init_body(38, offered))], 1)
    assert abi.INIT_OUT.unpack(reply[2])[3] == offered


def init_ext_body(minor: int, flags: int, flags2: int) -> bytes:
    """An INIT of a kernel from 7.36 on: flags2 right after the first four fields."""
    return abi.INIT_IN.pack(7, minor, 128 << 10, flags | abi.INIT_EXT) + abi.INIT_IN_FLAGS2.pack(flags2) + bytes(44)


@pytest.mark.parametrize("minor, asked, granted", [
    (40, True, True),
    (40, False, False),   # not asked for: no-open, as without passthrough
    (39, True, False),    # a kernel before 7.40 has none
])
def test_passthrough_is_granted_in_flags2_with_a_stack_depth(minor, asked, granted):
    body = init_ext_body(minor, ALL_FLAGS & ~abi.INIT_EXT, abi.PASSTHROUGH >> 32)
    (reply,), session = trio.run(exchange, [request(abi.Op.INIT, 1, body)], 1, None,
                                 InitConfig(passthrough=asked))
    fields = abi.INIT_OUT.unpack(reply[2])
    flags, flags2, stack_depth = fields[3], fields[10], fields[11]
    assert session.negotiated.describe()["passthrough"] is granted
    assert bool(flags2 << 32 & abi.PASSTHROUGH) is granted
    # flags2 counts only with INIT_EXT; a passthrough without a stack depth is ignored by the kernel
    assert bool(flags & abi.INIT_EXT) is granted
    assert stack_depth == (abi.PASSTHROUGH_STACK_DEPTH if granted else 0)


@pytest.mark.parametrize("text, limit", [("1024\n", 1024), ("32\n", 32), ("1000000\n", 0xFFFF),
                                         ("garbled\n", 256), ("", 256), (None, 256)])
def test_the_kernel_s_max_pages_limit_is_read_from_its_sysctl(tmp_path, text, limit):
    path = tmp_path / "max_pages_limit"
    if text is not None:
        path.write_text(text)
    assert abi.max_pages_limit(str(path)) == limit


@pytest.mark.parametrize("limit, splice, pages", [
    (1024, False, 1024),  # an administrator's raised limit, replies copied: all of it
    (64, True, 64),       # a limit under what the pipe holds: the limit
    (1024, True, None),   # spliced: no more than one reply the pipe holds
])
def test_requests_are_as_large_as_the_kernel_allows(monkeypatch, limit, splice, pages):
    monkeypatch.setattr(abi, "max_pages_limit", lambda: limit)
    (reply,), session = trio.run(exchange, [request(abi.Op.INIT, 1, init_body(40))], 1, None,
                                 InitConfig(splice=splice))
    got = abi.INIT_OUT.unpack(reply[2])[8]
    assert got == (pages if pages is not None else min(limit, session.splice_max // 4096))
    features = session.negotiated.describe()
    assert features["request_kib"] == got * 4 and features["request_kib_limit"] == limit * 4


def test_too_old_a_protocol_is_refused():
    (reply,), _ = trio.run(exchange, [request(abi.Op.INIT, 1, init_body(abi.MIN_MINOR - 1))], 1)
    assert reply[1] == errno.EPROTO


def test_write_ops_erofs_unknown_enosys_bugs_eio_and_the_loop_goes_on():
    writes = sorted(abi.WRITE_OPS)
    messages = [request(op, 100 + i) for i, op in enumerate(writes)]
    messages += [request(9999, 1), request(abi.Op.READ, 2, bytes(40)), request(abi.Op.STATX, 3),
                 request(abi.Op.FORGET, 4, struct.pack("<Q", 1), nodeid=77), request(abi.Op.GETATTR, 5)]
    fs = FakeFs()
    got, _ = trio.run(exchange, messages, len(writes) + 4, fs)
    answers = {unique: (error, body) for unique, error, body in got}
    assert all(answers[100 + i] == (errno.EROFS, b"") for i in range(len(writes)))
    assert answers[1][0] == errno.ENOSYS and answers[3][0] == errno.ENOSYS
    assert answers[2][0] == errno.EIO  # the handler's bug: EIO, and the session serves on
    assert answers[5] == (0, b"attr")
    assert 4 not in answers and fs.forgotten == [77]  # FORGET takes no reply


def test_interrupt_cancels_a_waiting_handler_with_eintr():
    messages = [request(abi.Op.LOOKUP, 10, b"name\0"), request(abi.Op.INTERRUPT, 11, struct.pack("<Q", 10)),
                request(abi.Op.GETATTR, 12)]
    fs = FakeFs()
    got, session = trio.run(exchange, messages, 2, fs)
    assert sorted((unique, error) for unique, error, _ in got) == [(10, errno.EINTR), (12, 0)]
    assert fs.counters["interrupted"] == 1 and not session.scopes


class StrayFs(FakeFs):
    """LOOKUP "stray" hands on a cancellation of a scope its task has left (as work shared by
    several requests would, handing its runner's cancellation to those waiting for it); LOOKUP
    "after" is answered once that has happened."""

    def __init__(self, grouped: bool) -> None:
        super().__init__()
        self.grouped = grouped
        self.strayed = trio.Event()

    def dispatch(self, request: Request):
        if request.opcode == abi.Op.LOOKUP:
            return self.stray() if request.body == b"stray\0" else self.after()
        return super().dispatch(request)

    async def stray(self) -> bytes:
        error = await foreign_cancellation(self.grouped)
        self.strayed.set()
        raise error

    async def after(self) -> bytes:
        await self.strayed.wait()
        await trio.sleep(0.01)
        return b"after"


@pytest.mark.parametrize("grouped", [False, True], ids=["bare", "in-a-group"])
def test_a_cancellation_not_the_request_s_own_is_eio_and_the_session_goes_on(grouped):
    messages = [request(abi.Op.LOOKUP, 10, b"stray\0"), request(abi.Op.LOOKUP, 12, b"after\0")]
    got, _ = trio.run(exchange, messages, 2, StrayFs(grouped))
    assert sorted((unique, error, body) for unique, error, body in got) == [(10, errno.EIO, b""), (12, 0, b"after")]


def test_unmount_ends_the_session(monkeypatch):
    """ENODEV from the device (unmounted) ends serve() normally."""
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = Connection(ours.fileno(), FakeFs())
    real = os.readv

    def readv(fd, buffers):
        if fd == ours.fileno():
            raise OSError(errno.ENODEV, "unmounted")
        return real(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)
    trio.run(session.serve)
    assert session.closed
    ours.close()
    kernel.close()


def test_a_notification_the_kernel_holds_does_not_stop_the_answers():
    """The kernel may hold a FUSE_NOTIFY_INVAL_INODE write until a READ we have not answered yet
    is answered (it waits for that READ's locked pages). Here the notification's write returns
    only once the GETATTR sent after it has been answered: were it written from the loop, the
    GETATTR would never be answered and the write would give up after its bound."""
    answered = threading.Event()
    outcome: list[str] = []

    def held(message: bytes) -> None:
        outcome.append("written" if answered.wait(5) else "held the loop")

    async def run() -> None:
        ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        kernel.setblocking(False)
        session = Connection(ours.fileno(), FakeFs())
        session.device.write_notification = held  # type: ignore[method-assign]  (the kernel holding it)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.serve)
                session.notify(abi.Notify.INVAL_INODE, abi.NOTIFY_INVAL_INODE.pack(5, 0, 0))
                await trio.sleep(0.05)  # the notifier has taken the message
                kernel.send(request(abi.Op.GETATTR, 7))
                with trio.fail_after(10):
                    await trio.lowlevel.wait_readable(kernel)
                    assert abi.OUT_HEADER.unpack_from(kernel.recv(1 << 16))[2] == 7
                answered.set()
                with trio.fail_after(10):
                    while not outcome:
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        finally:
            ours.close()
            kernel.close()

    trio.run(run)
    assert outcome == ["written"]


@pytest.mark.parametrize("pipe_max, pages, splice_max", [
    (1 << 20, 254, (1 << 20) - 8192),  # a user's pipe-max-size (1 MiB): the header and 254 pages
    (0, 256, (64 << 10) - 8192),       # every resize refused (a user over pipe-user-pages-soft)
])
def test_a_user_s_pipe_limit_bounds_the_requests(monkeypatch, pipe_max, pages, splice_max):
    """Without CAP_SYS_RESOURCE a pipe grows to pipe-max-size at most: requests are negotiated no
    larger than one spliced reply fits in, or left at 256 pages (copied) if the pipe stays small."""
    import fcntl

    from unshardfs.fuse import splice
    real = fcntl.fcntl

    def limited(fd, cmd, arg=0):
        if cmd == fcntl.F_SETPIPE_SZ and arg > pipe_max:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real(fd, cmd, arg)

    monkeypatch.setattr(splice.fcntl, "fcntl", limited)
    (reply,), session = trio.run(exchange, [request(abi.Op.INIT, 1, init_body(38))], 1)
    assert reply[:2] == (1, 0) and abi.INIT_OUT.unpack(reply[2])[8] == pages
    assert session.splice_max == splice_max


def test_requests_read_back_to_back_pass_the_scheduler_every_few():
    """A request read while more wait behind it is answered at once; the reading task passes the
    scheduler on purpose only every CHECKPOINT_EVERY-th such request (each pass costs several
    microseconds), so other tasks still run while a burst lasts. 64 GETATTRs sent at once: the
    first is awaited, the 63 after it are read back to back."""
    from unshardfs.fuse.transport import CHECKPOINT_EVERY

    ran_between: list[int] = []

    async def run() -> Connection:
        ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        kernel.setblocking(False)
        session = Connection(ours.fileno(), FakeFs())
        replies = 0
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.serve)
                await trio.sleep(0.01)  # the session waits for the connection

                async def other_task() -> None:
                    while True:
                        await trio.lowlevel.checkpoint()
                        ran_between.append(session.requests)

                nursery.start_soon(other_task)
                for unique in range(64):
                    kernel.send(request(abi.Op.GETATTR, 2 * unique))  # no yield between sends
                with trio.fail_after(10):
                    while replies < 64:
                        await trio.lowlevel.wait_readable(kernel)
                        kernel.recv(1 << 16)
                        replies += 1
                nursery.cancel_scope.cancel()
        finally:
            ours.close()
            kernel.close()
        return session

    session = trio.run(run)
    assert session.requests == 64
    assert session.device.checkpoints == 63 // CHECKPOINT_EVERY
    # The other task ran during the burst, not only after it.
    assert any(0 < n < 64 for n in ran_between)


# -- the quick wait (`transport.QuickWait`) ------------------------------------------------------------

def quick_session(wait: float) -> tuple[Connection, socket.socket, socket.socket]:
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    return Connection(ours.fileno(), FakeFs(), InitConfig(quick_wait=wait)), ours, kernel


def test_the_quick_wait_takes_a_request_that_comes():
    async def main() -> None:
        session, ours, kernel = quick_session(1.0)
        with ours, kernel:
            threading.Timer(0.01, kernel.send, (b"x",)).start()
            assert session.quick(ours.fileno())
            assert session.quick_waits == 1
    trio.run(main)


def test_the_quick_wait_gives_way_to_trio_at_once_when_its_io_is_ready():
    """A prefetch's socket that becomes ready ends the wait (trio's own epoll is watched): the
    loop goes through trio, which runs the prefetch, instead of holding it for the whole wait."""
    async def main() -> None:
        session, ours, kernel = quick_session(5.0)
        a, b = socket.socketpair()
        with ours, kernel, a, b:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.lowlevel.wait_readable, a)  # what a prefetch's socket does
                await trio.testing.wait_all_tasks_blocked()
                threading.Timer(0.01, b.send, (b"answer",)).start()
                start = time.perf_counter()
                assert not session.quick(ours.fileno())
                assert time.perf_counter() - start < 2.0  # not the 5 s wait
        assert session.quick_waits == 0
    trio.run(main)


def test_the_quick_wait_never_starts_while_trio_has_tasks_to_run():
    """Work ready to run (a read-ahead plan just spawned) goes first: no wait at all, not even
    with a request already queued."""
    async def main() -> None:
        session, ours, kernel = quick_session(5.0)
        with ours, kernel:
            kernel.send(b"x")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep, 0)  # runnable, not run yet
                assert not session.quick(ours.fileno())
        assert session.quick_waits == 0
    trio.run(main)


def test_without_a_request_the_quick_wait_ends_at_its_deadline():
    async def main() -> None:
        session, ours, kernel = quick_session(0.05)
        with ours, kernel:
            start = time.perf_counter()
            assert not session.quick(ours.fileno())
            assert 0.05 <= time.perf_counter() - start < 1.0
    trio.run(main)
