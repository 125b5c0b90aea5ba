"""The kernel engine served in this process, the kernel's side played by the other end of a
SOCK_SEQPACKET pair (message boundaries kept, like /dev/fuse): tests that count what a request
costs (tasks, thread hops, objects, splices, Python calls) without a mount."""

from __future__ import annotations

import socket
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable

import trio

from unshardfs.app.opened import OpenedSource
from unshardfs.fuse import abi
from unshardfs.fuse.kernel import KernelHandlers
from unshardfs.fuse.ops import Bridge
from unshardfs.fuse.server import Connection


class Kernel:
    """The kernel's end: one request at a time, its reply awaited."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.unique = 100

    async def ask(self, opcode: int, nodeid: int, body: bytes) -> tuple[int, bytes]:
        self.unique += 1
        self.sock.send(abi.IN_HEADER.pack(abi.IN_HEADER.size + len(body), opcode, self.unique, nodeid,
                                          0, 0, 0, 0, 0) + body)
        await trio.lowlevel.wait_readable(self.sock)
        reply = self.sock.recv(1 << 20)
        length, error, unique = abi.OUT_HEADER.unpack_from(reply)
        assert (length, unique) == (len(reply), self.unique)
        return -error, reply[abi.OUT_HEADER.size:]

    async def lookup(self, parent: int, name: str) -> int:
        error, entry = await self.ask(abi.Op.LOOKUP, parent, name.encode() + b"\0")
        assert error == 0, (name, error)
        return int(abi.ENTRY_OUT.unpack_from(entry)[0])

    async def read(self, ino: int, size: int) -> bytes:
        error, data = await self.ask(abi.Op.READ, ino, abi.READ_IN.pack(0, 0, size, 0, 0, 0, 0))
        assert error == 0, (ino, error)
        return data


@asynccontextmanager
async def served(sharded: Path, configure: Callable[[Connection], None] | None = None
                 ) -> AsyncIterator[tuple[Kernel, Connection]]:
    """The dataset at `sharded` opened and served by a kernel-engine session for the body of the
    `async with`; `configure(session)` runs before the session is attached. Everything is closed
    after, even on failure."""
    source = await OpenedSource.open(str(sharded))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    theirs.setblocking(False)
    try:
        async with source.running():
            binding = KernelHandlers(Bridge(source.tree))
            session = Connection(ours.fileno(), binding)
            if configure is not None:
                configure(session)
            binding.attach(session)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.serve)
                yield Kernel(theirs), session
                nursery.cancel_scope.cancel()
    finally:
        await source.aclose()
        ours.close()
        theirs.close()
