"""Small JSON metadata files (`info`, `zarr.json`): read them (bounded), write them back."""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar, cast

from unshardfs.sources.base import ByteSource, ObjectStat, stat_and_head
from unshardfs.util.errors import ConfigError, SourceError
from unshardfs.util.fields import DEFAULT_LIMITS, check_size, load_json, off_loop, one_big_document
from unshardfs.util.limits import DataLimits
from unshardfs.util.maps import BoundedMap

T = TypeVar("T")

# A metadata file is asked for with its stat, its first HEAD_BYTES in the same request where the
# source can (`StatHead`): one round trip, not two, for a file no bigger (nearly all of them).
HEAD_BYTES = 64 << 10


def _as_read(parsed: object, st: ObjectStat) -> tuple[object, ObjectStat]:
    return parsed, st


async def read_json(source: ByteSource, path: str,
                    limits: DataLimits = DEFAULT_LIMITS) -> tuple[object, ObjectStat] | None:
    """The parsed file and its stat; None if it does not exist; ConfigError if unreadable or beyond
    `limits` (see `read_built`)."""
    return await read_built(source, path, limits, _as_read)


class Remembered:
    """What reading one version of a metadata file gave: the built value, or the error that
    reading it raised. Weighed in a metadata cache by the file's size (what it costs to hold)."""

    __slots__ = ("value", "error", "nbytes")

    def __init__(self, value: object, error: ConfigError | None, size: int) -> None:
        self.value = value
        self.error = error
        # The kept tree or node is larger than its JSON text: a rough factor, to bound memory.
        self.nbytes = 4 * size

    def outcome(self) -> object:
        if self.error is not None:
            # The traceback is dropped first: raised again and again, it would grow each time.
            raise self.error.with_traceback(None)
        return self.value


async def read_built(source: ByteSource, path: str, limits: DataLimits,
                     build: Callable[[object, ObjectStat], T], memo: BoundedMap[Any, Any] | None = None) -> T | None:
    """`build(parsed, stat)` of the file; None if it does not exist; ConfigError if unreadable or
    beyond `limits`.

    A large file is read, parsed and built off the event loop, and one at a
    time (so `build`, which turns the parsed tree into what is kept, must not
    touch the event loop): the loop keeps answering, and several big files at
    once cost the memory of one.

    With a `memo` (the mount's metadata cache), each version of the file (its size and mtime) is
    read and built once: listings and lookups that resolve a directory again -- every listing of
    a Zarr group resolves each child's zarr.json -- cost one stat, and a damaged or oversized
    file is not read again for every request that meets it. A failure to read the source is not
    remembered (it may pass).

    Where the source can (`StatHead`, over HTTP), the stat brings the file's first HEAD_BYTES
    with it: a file no bigger costs one request. A bigger one is read again whole, as one
    version (not pieced together from two).
    """
    st, head = await stat_and_head(source, path, HEAD_BYTES)
    if st is None or st.is_dir:
        return None
    # `build` is often a closure made per call: its code identifies what it builds.
    key = (id(source), path, getattr(build, "__code__", build), st.size, st.mtime_ns)
    if memo is not None:
        known = memo.get(key)
        if known is not None:
            return cast(T, known.outcome())  # what `build` returned for this key
    try:
        value = await _read_and_build(source, path, limits, build, st,
                                      head if head is not None and len(head) == st.size else None)
    except _Unreadable as e:
        raise ConfigError(str(e)) from e.__cause__
    except ConfigError as e:
        if memo is not None:
            memo[key] = Remembered(None, e, st.size)
        raise
    if memo is not None:
        memo[key] = Remembered(value, None, st.size)
    return value


class _Unreadable(Exception):
    """The source failed to give the file's bytes: not the file's fault, so not remembered."""


async def _read_and_build(source: ByteSource, path: str, limits: DataLimits, build: Callable[[object, ObjectStat], T],
                          st: ObjectStat, whole: bytes | None = None) -> T:
    """Read (unless `whole`, the file's bytes, came with its stat), parse and build."""
    check_size(st.size, path, limits)
    async with one_big_document(st.size):
        try:
            raw = whole if whole is not None else await source.read(path, 0, st.size)
        except SourceError as e:
            raise _Unreadable(f"cannot read {path}: {e}") from e
        held = [raw]  # handed over, so the bytes are freed once parsed, while the tree is built on
        del raw
        return await off_loop(st.size, _parse_and_build, held, path, limits, st, build)


def _parse_and_build(held: list[bytes], path: str, limits: DataLimits, st: ObjectStat,
                     build: Callable[[object, ObjectStat], T]) -> T:
    return build(load_json(held.pop(), path, limits), st)


def encode_json(obj: object, indent: int | None = None) -> bytes:
    if indent is None:
        return json.dumps(obj, separators=(",", ":")).encode()
    return json.dumps(obj, indent=indent).encode()
