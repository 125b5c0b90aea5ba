"""`unshardfs serve` from the tests: started on a free port, always stopped (SIGTERM, then kill)."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import resource
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

from unshardfs.testing.mounts import UNSHARDFS


@contextlib.contextmanager
def served(source: str, *options: str, timeout: float = 60, log: Path | None = None) -> Iterator[str]:
    """The base URL of a server for `source`; on exit it must stop cleanly on SIGTERM.

    Its log goes to `log` (a file: a pipe nobody drains would stall a chatty server).
    """
    with serving(source, *options, timeout=timeout, log=log) as (url, _):
        yield url


@contextlib.contextmanager
def serving(source: str, *options: str, timeout: float = 60, log: Path | None = None,
            files_limit: tuple[int, int] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`served`, also giving the server's process; `files_limit` sets its RLIMIT_NOFILE (soft, hard)."""
    if log is None:
        fd, name = tempfile.mkstemp(prefix="unshardfs-serve-", suffix=".log")
        os.close(fd)
        log = Path(name)

    def limit() -> None:
        if files_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, files_limit)

    with open(log, "w") as err:
        proc = subprocess.Popen([*UNSHARDFS, "serve", source, "--port", "0", *options], stdout=subprocess.PIPE,
                                stderr=err, text=True, preexec_fn=limit if files_limit else None)
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
        yield url, proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def get_body(url: str, path: str, timeout: float = 30) -> tuple[int, bytes]:
    """GET `path` from the server at `url`: its status and whole body."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()
