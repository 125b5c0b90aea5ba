"""Bytes objects filled in place (`util/rawbytes.py`): what is written through the view is what the
object holds, and the object behaves as any other bytes object of those bytes."""

from __future__ import annotations

import gc
import platform

import pytest

from unshardfs.util.rawbytes import fresh_bytes


@pytest.mark.skipif(platform.python_implementation() != "CPython", reason="CPython's layout only")
@pytest.mark.parametrize("size", [2, 33, 4096, (1 << 20) + 3, 32 << 20])
def test_an_object_filled_through_its_view_holds_what_was_written(size: int) -> None:
    made = fresh_bytes(size)
    assert made is not None
    body, view = made
    assert len(view) == size and not view.readonly and view.format == "B"
    want = (bytes(range(251)) * (size // 251 + 1))[:size]
    view[:size // 2] = want[:size // 2]
    view[size // 2:] = want[size // 2:]
    assert type(body) is bytes and len(body) == size
    assert body == want and hash(body) == hash(want) and body[1:] == want[1:]
    assert {body: 1}[want] == 1


@pytest.mark.skipif(platform.python_implementation() != "CPython", reason="CPython's layout only")
def test_each_object_is_new_and_the_view_keeps_it_alive() -> None:
    first, second = fresh_bytes(64), fresh_bytes(64)
    assert first is not None and second is not None and first[0] is not second[0]
    view = first[1]
    del first
    gc.collect()
    view[:] = b"x" * 64  # into the object the view keeps, not freed memory
    assert bytes(view) == b"x" * 64


def test_too_small_for_a_new_object() -> None:
    """Objects of 0 and 1 bytes may be shared by the interpreter: never made to be written."""
    assert fresh_bytes(0) is None and fresh_bytes(1) is None
