"""Small JSON metadata files (`info`, `zarr.json`): read them (bounded), write them back."""

from __future__ import annotations

import json
from typing import Callable, TypeVar

from ..core.fields import DEFAULT_LIMITS, check_size, load_json, off_loop, one_big_document
from ..core.limits import Limits
from ..errors import ConfigError, SourceError
from ..sources.base import ByteSource, ObjectStat

T = TypeVar("T")


def _as_read(parsed: object, st: ObjectStat) -> tuple[object, ObjectStat]:
    return parsed, st


async def read_json(source: ByteSource, path: str,
                    limits: Limits = DEFAULT_LIMITS) -> tuple[object, ObjectStat] | None:
    """The parsed file and its stat; None if it does not exist; ConfigError if unreadable or beyond
    `limits` (see `read_built`)."""
    return await read_built(source, path, limits, _as_read)


async def read_built(source: ByteSource, path: str, limits: Limits,
                     build: Callable[[object, ObjectStat], T]) -> T | None:
    """`build(parsed, stat)` of the file; None if it does not exist; ConfigError if unreadable or
    beyond `limits`.

    A large file is read, parsed and built off the event loop, and one at a
    time (so `build`, which turns the parsed tree into what is kept, must not
    touch the event loop): the loop keeps answering, and several big files at
    once cost the memory of one.
    """
    st = await source.stat(path)
    if st is None or st.is_dir:
        return None
    check_size(st.size, path, limits)
    async with one_big_document(st.size):
        try:
            raw = await source.read(path, 0, st.size)
        except SourceError as e:
            raise ConfigError(f"cannot read {path}: {e}") from e
        held = [raw]  # handed over, so the bytes are freed once parsed, while the tree is built on
        del raw
        return await off_loop(st.size, _parse_and_build, held, path, limits, st, build)


def _parse_and_build(held: list[bytes], path: str, limits: Limits, st: ObjectStat,
                     build: Callable[[object, ObjectStat], T]) -> T:
    return build(load_json(held.pop(), path, limits), st)


def encode_json(obj: object, indent: int | None = None) -> bytes:
    if indent is None:
        return json.dumps(obj, separators=(",", ":")).encode()
    return json.dumps(obj, indent=indent).encode()
