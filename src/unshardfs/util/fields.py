"""One toolkit for reading untrusted JSON metadata (`info`, `zarr.json`, DVID specs).

Every format parses its metadata through `Fields`, so each member is checked
the same way and every complaint names its place (`info: scales[2].size`).
Errors are `MetadataError` (a `ConfigError`: reported before serving); the
few callers that parse metadata while serving turn them into `DataError`.

Every document is parsed by `load_json` (through `formats/jsonfile.read_json`
for files), which checks what the parse would build (bytes, values, depth,
string and number lengths; `DataLimits` and the METADATA_* bounds) before
building any of it. Parsed trees are edited through `ShallowEdit`, never
deep-copied.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import math
import re
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

import numpy as np
import trio
from trio.lowlevel import RunVar

from unshardfs.util.errors import ConfigError, Located, quote
from unshardfs.util.limits import METADATA_DEPTH, METADATA_NUMBER, METADATA_STRING, DataLimits, MiB

DEFAULT_LIMITS = DataLimits()
# Integers in metadata become grid sizes and byte offsets: beyond 2**63 they
# overflow numpy's int64 and the format's own arithmetic.
INT_LIMIT = (1 << 63) - 1
# Voxel sizes, chunk sizes and offsets: a chunk's end plus the offset stays
# inside int64, where chunk names are computed (numpy wraps silently).
VOXEL_LIMIT = 1 << 61

_MISSING: Any = object()


class MetadataError(Located, ConfigError):
    """A metadata member is missing or has the wrong type or range (or the document is beyond
    the metadata limits)."""


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python; JSON true is not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value: object, where: str, lo: int = -INT_LIMIT, hi: int = INT_LIMIT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:  # JSON true is no number
        raise MetadataError(where, f"must be an integer in [{lo}, {hi}], got {quote(value)}")
    return value


def as_ints(value: object, where: str, length: int | None = None, lo: int = -INT_LIMIT,
            hi: int = INT_LIMIT, max_length: int = 64) -> tuple[int, ...]:
    """A list of integers in [lo, hi] (of exactly `length` items when given)."""
    if (not isinstance(value, list) or (length is not None and len(value) != length)
            or len(value) > max_length or not all(_is_int(v) and lo <= v <= hi for v in value)):
        count = f"{length} " if length is not None else ""
        raise MetadataError(where, f"must be a list of {count}integers in [{lo}, {hi}], got {quote(value)}")
    return tuple(value)


def as_str(value: object, where: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or (choices is not None and value not in choices):
        wanted = f"one of {list(choices)}" if choices is not None else "a string"
        raise MetadataError(where, f"must be {wanted}, got {quote(value)}")
    return value


class Fields:
    """A JSON object under parse: typed accessors that raise `MetadataError` naming the member."""

    __slots__ = ("raw", "where")

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, dict):
            raise MetadataError(where, f"must be a JSON object, got {type(raw).__name__}")
        self.raw: dict[str, Any] = raw
        self.where = where

    def at(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def has(self, name: str) -> bool:
        return name in self.raw

    def get(self, name: str, default: Any = None) -> Any:
        return self.raw.get(name, default)

    def _value(self, name: str, default: Any) -> Any:
        if name in self.raw:
            return self.raw[name]
        if default is _MISSING:
            raise MetadataError(self.at(name), "is required")
        return default

    def int(self, name: str, lo: int = -INT_LIMIT, hi: int = INT_LIMIT, default: Any = _MISSING) -> int:
        value = self._value(name, default)
        return value if value is default and default is not _MISSING else as_int(value, self.at(name), lo, hi)

    def ints(self, name: str, length: builtins.int | None = None, lo: builtins.int = -INT_LIMIT,
             hi: builtins.int = INT_LIMIT, default: Any = _MISSING) -> tuple[builtins.int, ...]:
        value = self._value(name, default)
        return as_ints(value, self.at(name), length, lo, hi)

    def str(self, name: builtins.str, choices: tuple[builtins.str, ...] | None = None,
            default: Any = _MISSING) -> builtins.str:
        value = self._value(name, default)
        return as_str(value, self.at(name), choices)

    def obj(self, name: builtins.str, default: Any = _MISSING) -> "Fields":
        return Fields(self._value(name, default), self.at(name))

    def list(self, name: builtins.str, default: Any = _MISSING, max_length: builtins.int = 1 << 20
             ) -> builtins.list[Any]:
        value = self._value(name, default)
        if not isinstance(value, list) or len(value) > max_length:
            got = f"{len(value):,} items" if isinstance(value, list) else quote(value)
            raise MetadataError(self.at(name), f"must be a list (of at most {max_length:,} items), got {got}")
        return value

    def objects(self, name: builtins.str, default: Any = _MISSING,
                max_length: builtins.int = 1 << 20) -> Iterator["Fields"]:
        """Each item of a list member, as `Fields` (every item must be an object)."""
        for i, item in enumerate(self.list(name, default, max_length)):
            yield Fields(item, f"{self.at(name)}[{i}]")


class ShallowEdit:
    """A copy of a parsed document to edit, sharing every part it does not change.

    A deep copy of an untrusted tree costs as much again as the parse (and
    recursed once per level); here only the containers on the way to an edit
    are copied, each once.
    """

    def __init__(self, raw: dict[str, Any]) -> None:
        self.root = dict(raw)
        self._copied = {id(self.root)}

    def at(self, *path: str | int) -> Any:
        """The container at `path` (members and list indexes), now a copy of its own to edit."""
        node: Any = self.root
        for key in path:
            child = node[key]
            if id(child) not in self._copied:
                child = dict(child) if isinstance(child, dict) else list(child)
                node[key] = child
                self._copied.add(id(child))
            node = child
        return node


def grid_shape(shape: tuple[int, ...], chunk: tuple[int, ...], where: str,
               max_cells: int = INT_LIMIT) -> tuple[int, ...]:
    """ceil(shape / chunk) per dimension; the cell count must stay below `max_cells`
    (ids and linear indexes of cells are uint64/int64 throughout)."""
    grid = tuple(-(-s // c) for s, c in zip(shape, chunk))
    if math.prod(grid) > max_cells:
        raise MetadataError(where, f"a grid of {' x '.join(map(str, grid))} chunks is beyond what can be addressed")
    return grid


# Structure of a JSON text without its strings: a string literal (escapes
# included) is replaced by `""`, so what remains are brackets, commas, colons,
# numbers and literals, and counting them counts what a parse would build.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_LONG_NUMBER = re.compile(rb"[-+0-9.eE]{%d,}" % (METADATA_NUMBER + 1))
# Brackets only, `{}` folded into `[]`: the nesting depth is the running count.
_FOLD = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_STEP = np.zeros(256, np.int8)
_STEP[ord("[")], _STEP[ord("]")] = 1, -1
_DEPTH_PIECE = 1 << 20
# What a window may end with: any bytes but quotes, and complete strings (possessive: no
# backtracking, so no state per item); it stops at a string the window cuts.
_SAFE_PREFIX = re.compile(rb'(?:[^"]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+')
_NUMBER_TAIL = re.compile(rb"[-+0-9.eE]*\Z")
_NUMBER_CHARS = frozenset(bytes([c]) for c in b"-+0123456789.eE")
_WINDOW = 1 << 20

# A document larger than this is parsed on a worker thread, and only one such
# document is read and parsed at a time per process, so several at once cannot
# multiply the memory they take.
OFF_LOOP_BYTES = 256 << 10
_big_documents: RunVar[trio.Lock] = RunVar("big_documents")

T = TypeVar("T")


def _max_depth(brackets: bytes, depth: int) -> tuple[int, int]:
    """The deepest nesting reached in a text of `[` and `]` entered at `depth` (or a bound of it
    when that is within METADATA_DEPTH), and the depth at its end; in pieces of bounded memory."""
    opens = brackets.count(b"[")
    if depth + opens <= METADATA_DEPTH:  # cannot go deeper than that: no need to follow it
        return depth + opens, depth + opens - (len(brackets) - opens)
    deepest = depth
    for start in range(0, len(brackets), _DEPTH_PIECE):
        steps = _STEP[np.frombuffer(brackets, np.uint8, min(_DEPTH_PIECE, len(brackets) - start), start)]
        running = np.cumsum(steps, dtype=np.int64) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return deepest, depth


def _pieces(raw: bytes) -> Iterator[tuple[bytes, int]]:
    """`raw` in pieces of about _WINDOW bytes that cut no string, each with its strings replaced
    by `""`, and the length of the longest string it held (re.sub over a whole document would
    first build a list of every piece between its strings: hundreds of MB for 16 MB)."""
    pos = 0
    while pos < len(raw):
        window = raw[pos:pos + _WINDOW]
        prefix = _SAFE_PREFIX.match(window)  # matches at least the empty string
        safe = prefix.end() if prefix else 0
        if safe == 0:  # a string longer than the window starts here
            whole = _STRING.match(raw, pos)
            if whole is None:
                yield raw[pos:], 0  # unterminated: what is left is no JSON, the parser says so
                return
            yield b'""', whole.end() - pos - 2
            pos = whole.end()
            continue
        yield _STRING.sub(b'""', window[:safe]), 0
        pos += safe


def shape_problem(raw: bytes, limits: DataLimits = DEFAULT_LIMITS) -> str | None:
    """What puts `raw` beyond the metadata limits (its bytes, the values a parse would build,
    nesting depth, string and number lengths), or None. Runs at C speed over the bytes, a window
    at a time, before a single Python object of the document exists."""
    if len(raw) > limits.metadata_bytes:
        return _too_large(len(raw), limits)
    values = depth = deepest = longest = 0
    number_tail = b""  # a number literal may run on into the next piece
    for bare, long_string in _pieces(raw):
        values += bare.count(b",") + bare.count(b"[") + bare.count(b"{")
        if values > limits.metadata_values:
            return (f"holds more than the {limits.metadata_values:,} JSON values allowed "
                    "(--max-metadata-values)")
        if _LONG_NUMBER.search(number_tail + bare[:METADATA_NUMBER + 1]) or _LONG_NUMBER.search(bare):
            return f"holds a number literal longer than {METADATA_NUMBER} characters"
        tail = _NUMBER_TAIL.search(bare[-METADATA_NUMBER - 1:]) if bare[-1:] in _NUMBER_CHARS else None
        number_tail = tail.group() if tail else b""
        reached, depth = _max_depth(bare.translate(_FOLD, _NOT_BRACKET), depth)
        deepest = max(deepest, reached)
        if deepest > METADATA_DEPTH:
            return f"is nested more than the {METADATA_DEPTH} levels allowed"
        longest = max(longest, long_string)
        if longest > METADATA_STRING:
            return f"holds a string of {longest:,} bytes, more than the {METADATA_STRING:,} allowed"
    return None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # For a document parsed off the loop, a Python-level hook (rather than the C
    # default) gives a thread switch per object, so a long parse on a worker
    # thread does not hold the event loop off.
    return dict(pairs)


def _parse(raw: bytes) -> tuple[str | None, object]:
    """(None, the parsed value) or (why it cannot be parsed, None): the parser's exceptions end
    here, so none keeps the document alive (a JSONDecodeError holds all of it)."""
    try:
        # Decoded here (as json.loads would) so that the bytes, when the caller handed over its
        # only reference, are freed before the parse builds the tree.
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        del raw
        return None, json.loads(text, object_pairs_hook=_object if len(text) > OFF_LOOP_BYTES else None)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"is not valid JSON: {str(e)[:200]}", None
    except RecursionError:
        return "is nested too deeply", None
    except MemoryError:
        return "is too large to parse", None
    except ValueError as e:  # e.g. integers with too many digits
        return f"is not valid JSON: {str(e)[:200]}", None


def load_json(raw: bytes, where: str, limits: DataLimits = DEFAULT_LIMITS) -> object:
    """Parse untrusted JSON within `limits` (see `shape_problem`); any failure, including the parser
    running out of stack or memory, is a one-line `MetadataError` naming `where`.

    The error is raised only once the document is let go (a traceback keeps its frames' locals
    alive until the garbage collector finds the cycle).
    """
    problem = shape_problem(raw, limits)
    parsed = None
    if problem is None:
        problem, parsed = _parse(raw)
    del raw
    if problem is not None:
        raise MetadataError(where, problem)
    return parsed


def _too_large(size: int, limits: DataLimits) -> str:
    return f"{size:,} bytes is more than the {limits.metadata_bytes / MiB:g} MiB allowed for a metadata file " \
           "(--max-metadata-size)"


def check_size(size: int, where: str, limits: DataLimits = DEFAULT_LIMITS) -> None:
    """MetadataError for a file too large to be read as metadata (before it is read)."""
    if size > limits.metadata_bytes:
        raise MetadataError(where, _too_large(size, limits))


async def off_loop(size: int, parse: Callable[..., T], *args: Any) -> T:
    """`parse(*args)` for a document of `size` bytes: directly if small, else on a worker thread,
    so the event loop keeps answering while it runs."""
    if size <= OFF_LOOP_BYTES:
        return parse(*args)
    return await trio.to_thread.run_sync(parse, *args)


@contextlib.asynccontextmanager
async def one_big_document(size: int) -> AsyncIterator[None]:
    """Held while a document of `size` bytes is read and parsed: big ones wait for each other."""
    if size <= OFF_LOOP_BYTES:
        yield
        return
    try:
        lock = _big_documents.get()
    except LookupError:
        lock = trio.Lock()
        _big_documents.set(lock)
    async with lock:
        yield
