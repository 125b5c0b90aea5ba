"""One toolkit for reading untrusted JSON metadata (`info`, `zarr.json`, DVID specs).

Every format parses its metadata through `Fields`, so each member is checked
the same way and every complaint names its place (`info: scales[2].size`).
Errors are `MetadataError` (a `ConfigError`: reported before serving); the
few callers that parse metadata while serving turn them into `DataError`.
"""

from __future__ import annotations

import builtins
import json
import math
from typing import Any, Iterator

from ..errors import ConfigError

# A metadata file larger than this is not metadata (an `info` of a large
# dataset is a few KiB; consolidated Zarr metadata of thousands of arrays a
# few MiB).
MAX_METADATA_BYTES = 64 << 20
# Integers in metadata become grid sizes and byte offsets: beyond 2**63 they
# overflow numpy's int64 and the format's own arithmetic.
INT_LIMIT = (1 << 63) - 1
# Voxel sizes, chunk sizes and offsets: a chunk's end plus the offset stays
# inside int64, where chunk names are computed (numpy wraps silently).
VOXEL_LIMIT = 1 << 61

_MISSING: Any = object()


class MetadataError(ConfigError):
    """A metadata member is missing or has the wrong type or range."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python; JSON true is not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value: object, where: str, lo: int = -INT_LIMIT, hi: int = INT_LIMIT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:  # JSON true is no number
        raise MetadataError(where, f"must be an integer in [{lo}, {hi}], got {_short(value)}")
    return value


def as_ints(value: object, where: str, length: int | None = None, lo: int = -INT_LIMIT,
            hi: int = INT_LIMIT, max_length: int = 64) -> tuple[int, ...]:
    """A list of integers in [lo, hi] (of exactly `length` items when given)."""
    if (not isinstance(value, list) or (length is not None and len(value) != length)
            or len(value) > max_length or not all(_is_int(v) and lo <= v <= hi for v in value)):
        count = f"{length} " if length is not None else ""
        raise MetadataError(where, f"must be a list of {count}integers in [{lo}, {hi}], got {_short(value)}")
    return tuple(value)


def as_str(value: object, where: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or (choices is not None and value not in choices):
        wanted = f"one of {list(choices)}" if choices is not None else "a string"
        raise MetadataError(where, f"must be {wanted}, got {_short(value)}")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
            raise MetadataError(self.at(name), f"must be a list (of at most {max_length:,} items), got "
                                f"{_short(value)}")
        return value

    def objects(self, name: builtins.str, default: Any = _MISSING) -> Iterator["Fields"]:
        """Each item of a list member, as `Fields` (every item must be an object)."""
        for i, item in enumerate(self.list(name, default)):
            yield Fields(item, f"{self.at(name)}[{i}]")


def grid_shape(shape: tuple[int, ...], chunk: tuple[int, ...], where: str,
               max_cells: int = INT_LIMIT) -> tuple[int, ...]:
    """ceil(shape / chunk) per dimension; the cell count must stay below `max_cells`
    (ids and linear indexes of cells are uint64/int64 throughout)."""
    grid = tuple(-(-s // c) for s, c in zip(shape, chunk))
    if math.prod(grid) > max_cells:
        raise MetadataError(where, f"a grid of {' x '.join(map(str, grid))} chunks is beyond what can be addressed")
    return grid


def load_json(raw: bytes, where: str) -> object:
    """Parse untrusted JSON: bounded size, any parser failure (incl. absurd nesting) a `MetadataError`."""
    if len(raw) > MAX_METADATA_BYTES:
        raise MetadataError(where, f"{len(raw):,} bytes is too large for a metadata file")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MetadataError(where, f"is not valid JSON: {e}") from None
    except RecursionError:
        raise MetadataError(where, "is nested too deeply") from None
    except ValueError as e:  # e.g. integers with too many digits
        raise MetadataError(where, f"is not valid JSON: {e}") from None
