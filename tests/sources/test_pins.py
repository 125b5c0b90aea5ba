"""Pins under hostile timing and servers: a packed store's files held to one version of the object their
bytes lie in (`unshardfs.sources.pins`), whatever changes between two first reads, however many objects
push a pin out of its table, and whatever a server answers in place of the version asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from unshardfs.sources.http import HttpOptions, HttpSource
from unshardfs.sources.pins import Pins
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.util.errors import StaleError

OLD, NEW = b"o" * 64, b"n" * 64


def test_two_first_reads_of_a_changing_object_never_both_take_their_version():
    """Two readers of one file make its pin's first read at once (over a store stand-in, its version
    learnt from each answer); the object is replaced between the two answers. The first answer's
    version is the pin's; the second, of the new object, is refused (StaleError, the pin retired), never
    taken as the file's too. A file looked up afterwards takes a pin of a new generation."""
    memory = MemorySource({"d/x": OLD})
    source = LatencySource(memory, latency=1.0)
    pins = Pins(source)
    pin = pins.pin("d/x")

    async def main() -> list[bytes | str]:
        got: list[bytes | str] = []

        async def read(at: float) -> None:
            await trio.sleep(at)
            try:
                got.append(await pins.read(pin, 0, 64, "x"))
            except StaleError:
                got.append("stale")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, 0.0)  # answered at 1.0: the old object
            nursery.start_soon(read, 0.5)  # answered at 1.5: the new one
            await trio.sleep(1.2)
            memory.put("d/x", NEW)
        return got

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == [OLD, "stale"]
    fresh = pins.pin("d/x")
    assert fresh != pin and fresh.version is None


def test_a_pin_pushed_out_of_its_table_still_holds_its_file():
    """Pins are bounded: past the bound the one used longest ago is forgotten, and retired (a file
    looked up afterwards takes a pin of a new generation, which compares unequal, so nothing cached
    under the old one is served under it). A file holding the forgotten pin still reads its version,
    and a change of the object fails it."""
    memory = MemorySource({"a": OLD, "b": OLD})
    pins = Pins(memory, size=1)
    held = pins.pin("a")

    async def main() -> None:
        assert await pins.read(held, 0, 64, "a") == OLD
        pins.pin("b")  # pushes `a` out
        again = pins.pin("a")
        assert again != held and again.generation != held.generation
        assert await pins.read(held, 0, 64, "a") == OLD  # the forgotten pin still reads its version
        memory.put("a", NEW)
        with pytest.raises(StaleError):
            await pins.read(held, 0, 64, "a")
        assert await pins.read(again, 0, 64, "a") == NEW  # the new pin learns the new version

    trio.run(main)


@pytest.mark.parametrize("ignores_if_match", [False, True])
def test_a_server_answering_another_object_is_stale(tmp_path: Path, ignores_if_match: bool):
    """Over HTTP a pin learns its version from its first read's own answer (no HEAD). The object is then
    replaced on the server: a later read through the pin is refused whether the server honours If-Match
    (412) or ignores it and answers from the new object (its ETag names another object)."""
    (tmp_path / "x").write_bytes(OLD)
    with DatasetServer(tmp_path) as server:
        server.faults.no_if_match = ignores_if_match

        async def main() -> None:
            source = HttpSource(server.url, HttpOptions(retries=0))
            try:
                pins = Pins(source)
                pin = pins.pin("x")
                assert await pins.read(pin, 0, 32, "x") == OLD[:32]
                assert [r.method for r in server.requests()] == ["GET"]  # the version came with the bytes
                fresh = tmp_path / "x.new"
                fresh.write_bytes(NEW)
                fresh.replace(tmp_path / "x")
                with pytest.raises(StaleError):
                    await pins.read(pin, 32, 32, "x")
                assert await pins.read(pins.pin("x"), 0, 64, "x") == NEW
            finally:
                await source.aclose()

        trio.run(main)
