"""First read through a local HTTP server (Python's threaded http.server with Range), against a bare
httpx client on the same server and the same mount over local shards; requests per chunk."""

from __future__ import annotations

import multiprocessing
import sys
import time
from typing import Any

from ..context import KEY, Context
from ..mounts import mounted
from ..workloads import parallel_read, rel_files, warm_page_cache


def _bare_client(base: str, shards: list[str], n: int, queue: Any) -> None:
    import httpx
    import trio

    async def main() -> float:
        limiter = trio.CapacityLimiter(8)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8)) as client:
            async def one(i: int) -> None:
                async with limiter:
                    at = (i // len(shards)) * 16384
                    await client.get(f"{base}/{shards[i % len(shards)]}", headers={"Range": f"bytes={at}-{at + 16383}"})
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            return n / (time.perf_counter() - start)
    queue.put(trio.run(main))


def run(ctx: Context) -> None:
    small, work, row = ctx.datasets["small"], ctx.work, ctx.report.row
    from unshardfs.testing.http_servers import DatasetServer

    key = KEY
    files = rel_files(small["plain"], key)
    warm_page_cache(small["sharded"])

    def first_read(source: str) -> float:
        with mounted("unshardfs", source, work) as m:
            return len(files) / parallel_read([str(m / f) for f in files], 8)

    local = max(first_read(str(small["sharded"])) for _ in range(2))
    shards = sorted(p.name for p in (small["sharded"] / key).glob("*.shard"))
    with DatasetServer(small["sharded"]) as server:
        remote = 0.0
        for _ in range(2):
            server.reset_log()
            remote = max(remote, first_read(server.url))
            requests = len(server.requests())
        # What the server itself sustains: the same number of 16 KiB ranged GETs from a bare
        # httpx client (8 in flight), in a process of its own like the daemon.
        fork = multiprocessing.get_context("fork")  # (not `ctx`: that is the benchmark's)
        queue = fork.Queue()
        proc = fork.Process(target=_bare_client, args=(f"{server.url}/{key}", shards, len(files), queue))
        proc.start()
        bare = queue.get()
        proc.join()
    row("first read over HTTP, 8 readers", remote, "files/s", "bare httpx client, same server", bare)
    row("first read over HTTP, 8 readers", remote, "files/s", "same, local shards", local)
    per_chunk = requests / len(files)
    # The small scale has 8 shards of 64 minishards: a HEAD and a shard index per shard, each
    # minishard index once, then one GET per chunk is the least any ranged reader can do.
    least = (8 * 2 + 8 * 64 + len(files)) / len(files)
    row("HTTP requests per chunk (first read)", per_chunk, "req", "HEAD + indexes + 1 per chunk", least)
    print(f"http: {requests} requests for {len(files)} chunks of {key}", file=sys.stderr)
