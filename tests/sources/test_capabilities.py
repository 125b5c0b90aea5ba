"""A source's optional capabilities are typed Protocols (`sources.base`), decided once: what
each source has, what a layer over it passes on, and options that are not shared state."""

from __future__ import annotations

import dataclasses
import os

import pytest
import trio

from unshardfs.core.fetch import FetchPolicy, Fetcher
from unshardfs.sources import CountingSource
from unshardfs.sources.base import CachedRange, ReadNow, StatTail, stat_and_tail
from unshardfs.sources.http import HttpOptions, HttpSource
from unshardfs.sources.local import LocalSource
from unshardfs.testing.memory import MemorySource


def test_each_source_has_the_capabilities_it_defines(tmp_path):
    local = LocalSource(str(tmp_path))
    http = HttpSource("http://127.0.0.1:1/x", HttpOptions(retries=0))
    memory = MemorySource({"a": b"0123456789"})
    try:
        assert isinstance(local, ReadNow) and isinstance(local, CachedRange) and not isinstance(local, StatTail)
        assert isinstance(http, StatTail) and not isinstance(http, ReadNow) and not isinstance(http, CachedRange)
        assert not isinstance(memory, (ReadNow, CachedRange, StatTail))
    finally:
        local.close()


def test_a_layer_passes_on_what_the_source_below_can_do_and_answers_none_for_the_rest(tmp_path):
    (tmp_path / "a").write_bytes(b"0123456789")
    local = CountingSource(LocalSource(str(tmp_path)))
    memory = CountingSource(MemorySource({"a": b"0123456789"}))

    async def main() -> None:
        st = await local.stat("a")
        assert st is not None
        assert bytes(local.read_now("a", 2, 3, st.version) or b"") == b"234"
        assert local.counters.reads == 1  # counted as the read it replaces
        found = local.cached_range("a", 0, 4, st.version)  # None where not all page-cached
        assert found is None or os.pread(found.fd, found.size, found.offset) == b"0123"
        assert local.counters.reads == 1 + (found is not None)
        assert memory.read_now("a", 2, 3) is None and memory.cached_range("a", 0, 4) is None
        # No StatTail below: the stat alone, and the tail read as usual.
        got = await stat_and_tail(memory, "a", 4)
        assert got[0] is not None and got[0].size == 10 and got[1] is None
        assert memory.counters.reads == 0

    trio.run(main)
    local.inner.close()  # type: ignore[attr-defined]


def test_the_fetcher_decides_its_source_s_capabilities_once():
    from unshardfs.core.blob import Blob
    from unshardfs.sources.base import ObjectStat

    source = MemorySource({"a": b"x"})
    fetcher = Fetcher(source)
    asked: list[tuple[object, ...]] = []
    # A capability that appears after construction is not seen: no read pays for the question.
    source.read_now = lambda *args: asked.append(args) or b"x"  # type: ignore[attr-defined]
    assert isinstance(source, ReadNow)
    blob = Blob.of("a", ObjectStat(1, 0, False, ("v",)))
    assert fetcher.read_now(blob, 0, 1) is None and asked == []
    assert fetcher.counters.reads == 0


def test_a_local_source_s_fetcher_does_not_change_the_policy_it_was_given(tmp_path):
    policy = FetchPolicy(read_ahead=True)
    fetcher = Fetcher(LocalSource(str(tmp_path)), policy)
    assert fetcher.policy.read_ahead is False  # nothing to hide locally
    assert policy.read_ahead is True  # the next session opened with these options reads ahead again
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.read_ahead = False  # type: ignore[misc]
