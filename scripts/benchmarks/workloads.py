"""What the benchmark does to a tree: read files (one or several processes), time, warm caches."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Callable


def read_files(paths: list[str], chunk: int = 1 << 20) -> int:
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while data := os.read(fd, chunk):
                total += len(data)
        finally:
            os.close(fd)
    return total


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _reader_proc(paths: list[str], queue: Any) -> None:
    queue.put(read_files(paths))


def in_processes(target: Callable[..., None], arglists: list[tuple[Any, ...]]) -> tuple[float, list[Any]]:
    """Run `target(*args, queue)` in one forked process per arglist, all at once: (seconds, what each put)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, queue)) for args in arglists]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - start
    return elapsed, [queue.get() for _ in procs]


def xargs_read(directory: Path, readers: int = 8, per_reader: int = 16) -> float:
    """Seconds for `find . -type f | xargs -P readers -n per_reader cat` in `directory`: readers'
    own pattern (directory order, each process the next few files of find's listing as the
    processes before it finish), not one tuned to the daemon."""
    import subprocess

    return timed(lambda: subprocess.run(f"find . -type f | xargs -P {readers} -n {per_reader} cat > /dev/null",
                                        shell=True, cwd=directory, check=True))


def parallel_read(paths: list[str], n: int) -> float:
    """Seconds for `n` processes to read `paths`, split round-robin."""
    return read_lists([paths[i::n] for i in range(n)])


def read_lists(lists: list[list[str]]) -> float:
    """Seconds for one process per list to read its files, in its order, all at once."""
    return in_processes(_reader_proc, [(paths,) for paths in lists])[0]


def _stat_proc(paths: list[str], queue: Any) -> None:
    for p in paths:
        os.stat(p)
    queue.put(len(paths))


def stat_lists(lists: list[list[str]]) -> float:
    """Seconds for one process per list to stat its paths (a lookup each), in its order, all at once."""
    return in_processes(_stat_proc, [(paths,) for paths in lists])[0]


def warm_page_cache(directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            p.read_bytes()


def rel_files(root: Path, sub: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / sub).iterdir())


def warmed_files(dataset: dict[str, Any], sub: str) -> list[str]:
    """A dataset's sharded and unsharded copies in the page cache; the files of `sub`, relative to its root."""
    warm_page_cache(dataset["sharded"])
    warm_page_cache(dataset["plain"])
    return rel_files(dataset["plain"], sub)
