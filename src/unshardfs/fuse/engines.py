"""The two FUSE engines behind one interface: mount, serve until unmounted, stop, close.

- `kernel` (default): our own protocol session (`unshardfs.fuse.server`) on a
  /dev/fuse connection we mount ourselves. It asks the kernel for no-open,
  parallel directory operations, 64 background requests, ~1 MiB requests (spliced READ replies),
  READDIRPLUS_AUTO and AUTO_INVAL_DATA, each as far as the kernel's protocol
  version offers them; with `passthrough`, FUSE passthrough instead of no-open.
- `pyfuse3`: pyfuse3 over libfuse, the binding named in the design brief. pyfuse3 is an optional
  dependency (`unshardfs[pyfuse3]`, built with a C compiler against libfuse3): it is imported only
  when this engine is chosen, and `require` says how to get it when it is missing.

Both serve the same operations layer (`unshardfs.fuse.ops.Bridge`).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import trio

from unshardfs.fuse.ops import Bridge
from unshardfs.util.errors import ConfigError

if TYPE_CHECKING:
    from unshardfs.fuse.mount import Mounted
    from unshardfs.fuse.server import Negotiated

log = logging.getLogger(__name__)

ENGINES = ("kernel", "pyfuse3")
TRANSPORTS = ("dev", "uring")
# Read-ahead in requests: a 2 MiB chunk read from its start is asked for in one window, as two
# full requests sent together, so the second is moved while the reader copies the first.
READAHEAD_REQUESTS = 2
PYFUSE3_MISSING = ("the pyfuse3 engine needs the pyfuse3 package: pip install 'unshardfs[pyfuse3]' "
                   "(and libfuse3-dev to build it)")


def require(name: str) -> None:
    """Check that engine `name` can run here; ConfigError with a one-line remedy if it cannot.

    Called before a mount detaches, so the user sees the reason on the terminal."""
    if name not in ENGINES:
        raise ConfigError(f"unknown FUSE engine {name!r} (choose from {', '.join(ENGINES)})")
    if name == "pyfuse3":
        _import_pyfuse3()


def _import_pyfuse3() -> ModuleType:
    try:
        import pyfuse3
    except ImportError as e:
        # Installed but unloadable (built against a libfuse3 that is gone): the reason is added.
        absent = isinstance(e, ModuleNotFoundError) and e.name == "pyfuse3"
        detail = "" if absent else f"; importing it failed: {e}"
        raise ConfigError(PYFUSE3_MISSING + detail) from None
    return pyfuse3


class Engine(Protocol):
    def mount(self) -> None:
        """Mount (ConfigError with a one-line reason when impossible)."""

    async def run(self) -> None:
        """Serve until the file system is unmounted or `stop` is called."""

    def stop(self) -> None:
        """Unmount and make `run` return (from a signal handler task)."""

    def close(self) -> None:
        """Release what `mount` took (after `run`)."""


class KernelEngine:
    def __init__(self, ops: Bridge, mountpoint: str, fsname: str, options: list[str]) -> None:
        from unshardfs.fuse.kernel import KernelHandlers
        from unshardfs.fuse.mount import MountSpec

        self.ops = ops
        self.spec = MountSpec(mountpoint, fsname, options=[o for o in options if o != "debug"])
        self.binding = KernelHandlers(ops)
        self.mounted: Mounted | None = None
        self.readahead = False
        self.target = mountpoint
        self.cancel = trio.CancelScope()

    def mount(self) -> None:
        from unshardfs.fuse.mount import mount

        self.target = os.path.realpath(self.spec.mountpoint)  # before mounting: after, a stat would hang
        self.mounted = mount(self.spec)

    async def run(self) -> None:
        from unshardfs.fuse.server import Connection, InitConfig, may_register_backing_files

        assert self.mounted is not None
        options = self.ops.options
        passthrough = options.passthrough and may_register_backing_files()
        if options.passthrough and not passthrough:
            log.warning("passthrough needs CAP_SYS_ADMIN (root): every file is read through the daemon")
        session = Connection(self.mounted.fd, self.binding,
                             InitConfig(quick_wait=options.quick_wait, passthrough=passthrough,
                                        transport=options.transport),
                             on_init=self._initialised)
        self.binding.attach(session)
        with self.cancel:
            await session.serve()

    def _initialised(self, negotiated: Negotiated) -> None:
        from unshardfs.fuse.mount import set_readahead

        self.binding.negotiated(negotiated)
        if os.geteuid() == 0:
            # ~1 MiB requests are negotiated, but the kernel's read-ahead decides how big buffered
            # reads get; INIT has just capped it at the value it offered (128 KiB), so raise it now.
            kib = READAHEAD_REQUESTS * negotiated.max_pages * 4
            self.readahead = set_readahead(self.target, kib)
            self.ops.features["read_ahead_kib"] = kib if self.readahead else None

    def stop(self) -> None:
        from unshardfs.fuse.mount import unmount

        try:
            unmount(self.spec.mountpoint, lazy=True)
        except OSError as e:
            log.warning("unmount %s: %s", self.spec.mountpoint, e.strerror)
        self.cancel.cancel()

    def close(self) -> None:
        """Close the connection; a mount still there (the session failed) is detached first,
        so no dead mount is left behind."""
        from unshardfs.fuse.mount import unmount

        if self.mounted is None:
            return
        mounted, self.mounted = self.mounted, None
        try:
            unmount(self.spec.mountpoint, lazy=True)
        except OSError:
            pass
        mounted.close()


class Pyfuse3Engine:
    def __init__(self, ops: Bridge, mountpoint: str, fsname: str, options: list[str]) -> None:
        pyfuse3 = _import_pyfuse3()
        from unshardfs.fuse.pyfuse3_engine import Pyfuse3Operations

        self.pyfuse3 = pyfuse3
        self.adapter = Pyfuse3Operations(ops)
        self.mountpoint = mountpoint
        self.options = set(pyfuse3.default_options) | {"ro", f"fsname={fsname}", "subtype=unshardfs", *options}
        if ops.options.passthrough:
            log.warning("the pyfuse3 engine has no passthrough: every file is read through the daemon")
        if ops.options.transport != "dev":
            log.warning("the pyfuse3 engine reads /dev/fuse through libfuse: --fuse-transport is ignored")
        self.mounted = False

    def mount(self) -> None:
        try:
            self.pyfuse3.init(self.adapter, self.mountpoint, self.options)
        except RuntimeError as e:
            raise ConfigError(f"cannot mount on {self.mountpoint}: {e}") from e
        self.mounted = True

    async def run(self) -> None:
        await self.pyfuse3.main()

    def stop(self) -> None:
        self.pyfuse3.terminate()

    def close(self) -> None:
        if self.mounted:
            self.mounted = False
            self.pyfuse3.close(unmount=True)


def open_engine(name: str, ops: Bridge, mountpoint: str, fsname: str, options: list[str]) -> Engine:
    require(name)
    if name == "kernel":
        return KernelEngine(ops, mountpoint, fsname, options)
    return Pyfuse3Engine(ops, mountpoint, fsname, options)
