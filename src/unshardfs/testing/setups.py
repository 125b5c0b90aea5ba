"""The ways a mount can be served, for suites that must hold on every one of them.

A `FuseSetup` names one: the kernel engine over /dev/fuse (the default),
the kernel engine over io_uring, the kernel engine with passthrough, and
the pyfuse3 engine. `mounting_with` is the body of a `mount` fixture that
mounts with a setup's options, skips the test where the machine cannot
offer the setup (no root, no pyfuse3, a kernel without the feature), and
checks through the daemon's stats that the kernel granted it, so a suite
never passes on a fallback it did not mean to test.

FUSE over io_uring also needs the `fuse` module's `enable_uring`
parameter. `module_parameter` sets it for as long as a test holds it and
restores it after; holders in different processes (pytest-xdist workers)
take turns through a lock file, so one test's restore never pulls the
parameter from under another's mount.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from unshardfs.testing.mounts import Mount, MountFn, mounting

ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")


@contextlib.contextmanager
def module_parameter(path: Path, value: str) -> Iterator[str]:
    """`value` written to the kernel module parameter `path` while the context is held (yielding
    the value it had), then restored. One holder at a time across processes, whatever the
    parameter: an exclusive flock on a lock file beside the other temporary files."""
    lock = Path(tempfile.gettempdir()) / f"unshardfs-param-{path.parent.parent.name}-{path.name}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        before = path.read_text().strip()
        path.write_text(value)
        try:
            yield before
        finally:
            path.write_text(before)
    finally:
        os.close(fd)  # releases the lock


@dataclass(frozen=True)
class FuseSetup:
    """One way of serving a mount: the options that ask for it and the feature that shows it granted."""

    name: str
    options: tuple[str, ...] = ()
    feature: str | None = None  # a key of the daemon's stats["fuse"]["features"] that must be true
    engine: str = "kernel"

    def unavailable(self) -> str | None:
        """Why this machine cannot offer the setup at all, or None."""
        if self.engine == "pyfuse3" and importlib.util.find_spec("pyfuse3") is None:
            return "the pyfuse3 engine is not installed (pip install 'unshardfs[pyfuse3]')"
        if self.feature == "io_uring" and (os.geteuid() != 0 or not ENABLE_URING.exists()):
            return "FUSE over io_uring needs root and a fuse module with enable_uring (Linux 6.14 or later)"
        if self.feature == "passthrough" and os.geteuid() != 0:
            return "FUSE passthrough needs CAP_SYS_ADMIN (root)"
        return None

    @contextlib.contextmanager
    def prepared(self) -> Iterator[None]:
        """What the kernel must allow during the test (io_uring: `enable_uring` set)."""
        if self.feature == "io_uring":
            with module_parameter(ENABLE_URING, "Y"):
                yield
        else:
            yield

    def check(self, mount: Mount) -> None:
        """Skip the test unless the daemon serving `mount` runs as this setup asks."""
        features = mount.stats()["fuse"]["features"]
        if self.engine == "pyfuse3":
            assert features["protocol"] == "libfuse", features
        if self.feature is not None and not features.get(self.feature):
            pytest.skip(f"{self.name}: the kernel does not grant {self.feature} (protocol {features['protocol']})")


DEFAULT = FuseSetup("kernel")
SETUPS = (
    DEFAULT,
    FuseSetup("kernel-uring", ("--fuse-transport", "uring"), "io_uring"),
    FuseSetup("kernel-passthrough", ("--fuse-passthrough",), "passthrough"),
    FuseSetup("pyfuse3", ("--fuse-engine", "pyfuse3"), engine="pyfuse3"),
)


def mounting_with(setup: FuseSetup, tmp_path: Path) -> Iterator[MountFn]:
    """The body of a `mount` fixture whose mounts are served as `setup` says (see `mounting`)."""
    why = setup.unavailable()
    if why is not None:
        pytest.skip(why)
    with setup.prepared():
        for inner in mounting(tmp_path):

            def mount(source: Path | str, *options: str) -> Mount:
                m = inner(source, *options, *setup.options)
                setup.check(m)
                return m

            yield mount
