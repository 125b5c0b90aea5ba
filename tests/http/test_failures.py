"""What a handler raises is an answer of the app's, in-process: a bug is a 500, and a cancellation
that is not the request's own is a bug like any other, not the end of the server."""

from __future__ import annotations

import trio

from tests.support.cancellation import foreign_cancellation
from unshardfs.http.app import TreeApp
from unshardfs.tree.nodes import DirNode, Node

MTIME_NS = 1_700_000_000_123_456_789


class _HandsOnACancellation(DirNode):
    """Its lookup raises a cancellation of a scope it has left (as work shared by several
    requests would, handing its runner's cancellation to those waiting on it)."""

    async def lookup(self, name: str) -> Node | None:
        raise await foreign_cancellation()


async def _get(app: TreeApp, path: str) -> int:
    messages: list[dict] = []

    async def send(message: dict) -> None:
        messages.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": []}
    await app(scope, None, send)
    return int(messages[0]["status"])


def test_a_cancellation_not_the_request_s_own_is_a_500():
    app = TreeApp(_HandsOnACancellation(MTIME_NS), dict)

    async def main() -> list[int]:
        return [await _get(app, "/a"), await _get(app, "/b")]

    assert trio.run(main) == [500, 500]
    assert app.counters["errors"] == 2


def test_the_request_s_own_cancellation_goes_through():
    class Slow(DirNode):
        async def lookup(self, name: str) -> Node | None:
            await trio.sleep_forever()
            return None

    app = TreeApp(Slow(MTIME_NS), dict)

    async def main() -> bool:
        with trio.move_on_after(0.01) as scope:
            await _get(app, "/a")
        return scope.cancelled_caught

    assert trio.run(main) and app.counters["errors"] == 0
