"""The ceiling daemon (`ceilingfs.c`): built with gcc against libfuse 3, mounted like the others.

A minimal libfuse low-level daemon serving the same files from memory with
the options unshardfs's kernel engine negotiates (see the C source): what a
FUSE daemon that does no work per request reaches on this kernel, the
ceiling of the sequential and first-read rows. `options_like(stats)` gives it
the request size and read-ahead the unshardfs mount beside it negotiated.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "ceilingfs.c"
PAGE = 4096
LIBFUSE_MAX_PAGES = 256  # libfuse 3's FUSE_MAX_MAX_PAGES: its request buffer holds no more

_built: dict[Path, Path] = {}


class CeilingUnavailable(RuntimeError):
    """The ceiling daemon could not be built (the message is one line)."""


def binary(workdir: Path) -> Path:
    """ceilingfs compiled into `workdir` (once per run)."""
    if workdir in _built:
        return _built[workdir]
    if shutil.which("gcc") is None:
        raise CeilingUnavailable("the ceiling daemon needs gcc (apt-get install gcc libfuse3-dev)")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
    if flags.returncode or shutil.which("pkg-config") is None:
        raise CeilingUnavailable("the ceiling daemon needs libfuse 3's headers (apt-get install libfuse3-dev)")
    out = workdir / "ceilingfs"
    done = subprocess.run(["gcc", "-O2", "-Wall", "-o", str(out), str(SOURCE), *flags.stdout.split()],
                          capture_output=True, text=True)
    if done.returncode:
        first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:200])
        raise CeilingUnavailable(f"the ceiling daemon did not build: {first}")
    _built[workdir] = out
    return out


def libfuse_pages() -> int:
    """The largest READ libfuse splices through its pipe here: it wants room for 3 pages more
    than the reply in the pipe, and grows the pipe only up to fs.pipe-max-size (without
    CAP_SYS_RESOURCE); a larger READ it answers through a buffer, two copies instead of one."""
    r, w = os.pipe()
    try:
        try:
            size = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 16 << 20)  # what this process may have
        except OSError:
            size = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    finally:
        os.close(r)
        os.close(w)
    return min(LIBFUSE_MAX_PAGES, (size - 16 - 3 * PAGE) // PAGE)


def options_like(features: dict[str, Any]) -> tuple[list[str], int | None]:
    """(ceilingfs options, read-ahead in KiB) matching an unshardfs mount's negotiated `features`
    (its `unshardfs stats` fuse.features): the same request size where libfuse can splice it."""
    pages = min(int(features.get("request_kib", 128)) // 4, libfuse_pages())
    return ["--max-pages", str(pages)], features.get("read_ahead_kib")
