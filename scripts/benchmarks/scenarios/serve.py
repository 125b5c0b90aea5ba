"""`unshardfs serve`: small-chunk GETs per second from N concurrent clients, against `python -m
http.server` over a FUSE mount of the same shards and a static server on the unsharded copy."""

from __future__ import annotations

import contextlib
import http.client
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from ..context import KEY, Context
from ..mounts import PY, UNSHARDFS, mounted
from ..workloads import in_processes, warmed_files

CLIENTS = (1, 8, 32)
PROCESSES = 4  # client processes, so the load generator is not one GIL


def _client(url: str, paths: list[str], threads: int, queue: Any) -> None:
    import threading

    parts = urlsplit(url)
    done = [0]
    lock = threading.Lock()

    def work(mine: list[str]) -> None:
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)  # keep-alive
        for p in mine:
            conn.request("GET", p)
            response = conn.getresponse()
            response.read()
            assert response.status == 200, (p, response.status)
        conn.close()
        with lock:
            done[0] += len(mine)

    workers = [threading.Thread(target=work, args=(paths[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    queue.put(done[0])


def rate(url: str, paths: list[str], clients: int) -> float:
    """GETs per second with `clients` connections spread over up to PROCESSES processes."""
    procs_n = min(PROCESSES, clients)
    per = [clients // procs_n + (i < clients % procs_n) for i in range(procs_n)]
    elapsed, done = in_processes(_client, [(url, paths[i::procs_n], per[i]) for i in range(procs_n)])
    return float(sum(done) / elapsed)


@contextlib.contextmanager
def _process(args: list[str], pattern: str) -> Iterator[str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            found = re.search(pattern, line)
            if found:
                yield found.group(1)
                break
        else:
            raise RuntimeError(f"{args[:3]} did not start")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def static_server(directory: Path, port: int) -> contextlib.AbstractContextManager[str]:
    # -u: unbuffered, so its "Serving HTTP on" line reaches us at once
    return _process([PY, "-u", "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(directory)],
                    r"Serving HTTP on \S+ port (\d+)")


def run(ctx: Context) -> None:
    small = ctx.datasets["small"]
    paths = ["/" + f for f in warmed_files(small, KEY)]
    with _process([*UNSHARDFS, "serve", str(small["sharded"]), "--port", "0"], r"serving .* on (http://\S+)") as url:
        rate(url, paths, 8)  # warm the caches: the figures are for serving, not for first reads
        ours = {n: rate(url, paths, n) for n in CLIENTS}
    with mounted("unshardfs", small["sharded"], ctx.work) as m, static_server(m, 18731) as port:
        fuse = {n: rate(f"http://127.0.0.1:{port}", paths, n) for n in CLIENTS}
    with static_server(small["plain"], 18732) as port:
        static = {n: rate(f"http://127.0.0.1:{port}", paths, n) for n in CLIENTS}
    for n in CLIENTS:
        metric = f"serve: 16 KiB GETs, {n} clients"
        ctx.report.row(metric, ours[n], "GET/s", "python -m http.server over the mount", fuse[n])
        ctx.report.row(metric, ours[n], "GET/s", "python -m http.server, unsharded copy", static[n])
    print(f"serve: {len(paths)} chunks per round", file=sys.stderr)
