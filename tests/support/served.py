"""`unshardfs serve` from the tests: started on a free port, always stopped (SIGTERM, then kill)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from unshardfs.testing.mounts import UNSHARDFS


@contextlib.contextmanager
def served(source: str, *options: str, timeout: float = 60, log: Path | None = None) -> Iterator[str]:
    """The base URL of a server for `source`; on exit it must stop cleanly on SIGTERM.

    Its log goes to `log` (a file: a pipe nobody drains would stall a chatty server).
    """
    log = log or Path(tempfile.mkstemp(prefix="unshardfs-serve-", suffix=".log")[1])
    with open(log, "w") as err:
        proc = subprocess.Popen([*UNSHARDFS, "serve", source, "--port", "0", *options], stdout=subprocess.PIPE,
                                stderr=err, text=True)
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise AssertionError(f"serve exited: {proc.wait()} {log.read_text()}")
            found = re.search(r"serving .* on (http://\S+)", line)
            url = found.group(1) if found else None
            if time.monotonic() > deadline:
                raise AssertionError("serve did not start")
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
