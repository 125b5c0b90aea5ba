"""The daemon's Python work per first read, counted: a tracked figure, not a test.

Each Python call is ~0.3-1 us of a daemon that is one Python thread, so first reads against
ratarmount move with this number; but a count of calls punishes a refactor that splits a
function and rewards inlining, so it is watched here (`--json` keeps it beside the timings)
rather than pinned by a test. The tests pin what does not depend on how the code is split:
backing reads, batches, tasks started, yields and thread hops (tests/core/test_hot_path.py,
tests/fuse/test_first_read.py).

The kernel engine is served in this process, the kernel's side played by the other end of a
socket pair (`unshardfs.testing.kernel`); every chunk of the small dataset is looked up and
read once (which reads and caches every index), then counted while each is looked up and read
again: every call of a function of the unshardfs package (but the harness's), a coroutine
resumed counting as a call. Every request here finds the connection empty (the kernel's side, in this very thread,
sends the next one only after the answer), so part of each chunk's calls are the connection's
waiting for it, which a serial reader on a mount, whose next request is queued or comes within
the quick wait, mostly does not cost: `waiting` counts those (the connection's own functions),
`own work` the rest.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType

from ..context import KEY, Context

CALLS = "python calls per first read (LOOKUP + READ), indexes cached"
# The connection's functions that run because the request queue was empty (see the docstring).
WAITING = ("DevTransport.next", "QuickWait.__call__", "Connection.serve", "Connection._reader")


if sys.version_info >= (3, 11):
    def _qualname(code: CodeType) -> str:
        return code.co_qualname
else:  # the class of a method is not known: its name alone
    def _qualname(code: CodeType) -> str:
        return code.co_name


def run(ctx: Context) -> None:
    small = ctx.datasets["small"]
    per_chunk = count_calls(Path(small["sharded"]), sorted(os.listdir(Path(small["plain"]) / KEY)))
    total = sum(per_chunk.values())
    waiting = sum(per_chunk.get(name, 0.0) for name in WAITING)
    ctx.report.fact(CALLS, round(total, 2))
    ctx.report.fact(CALLS + ", own work (not waiting for the next request)", round(total - waiting, 2))
    ctx.report.fact(CALLS + ", top functions", {name: round(n, 2) for name, n in per_chunk.most_common(15)})


def count_calls(sharded: Path, names: list[str]) -> Counter[str]:
    """Calls per chunk of each function of the unshardfs package (by qualified name)."""
    import trio

    import unshardfs
    from unshardfs.fuse.ops import ROOT
    from unshardfs.testing.kernel import served

    package = os.path.dirname(unshardfs.__file__)
    harness = os.path.join(package, "testing", "")  # the kernel's side: not the daemon's work
    calls: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(package) and not code.co_filename.startswith(harness):
            calls[_qualname(code)] += 1

    async def main() -> None:
        async with served(sharded) as (kernel, _):
            directory = await kernel.lookup(ROOT, KEY)
            for name in names:  # reads every index (and every chunk) once
                await kernel.read(await kernel.lookup(directory, name), 1 << 14)
            sys.setprofile(profile)
            try:
                for name in names:
                    await kernel.read(await kernel.lookup(directory, name), 1 << 14)
            finally:
                sys.setprofile(None)

    trio.run(main)
    return Counter({name: n / len(names) for name, n in calls.items()})
