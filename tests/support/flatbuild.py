"""A small FlatBuffers encoder for the tests: Icechunk objects crafted field by field (a manifest with
compressed virtual locations, repo info objects with indexes that point nowhere), which no writer the tests
can run produces. Tables are written before what they point to (every offset points forward, as our
reader requires), each followed by its vtable.

    body = encode(Table({0: Struct(id12), 1: Vector([Table({...}), ...]), 3: U8(1)}))
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Union


@dataclass
class U8:
    value: int


@dataclass
class U32:
    value: int


@dataclass
class I32:
    value: int


@dataclass
class U64:
    value: int


@dataclass
class Struct:
    """Inline bytes (a FlatBuffers struct: an id, a pair of integers)."""

    data: bytes


@dataclass
class Bytes:
    """A vector of bytes (`[uint8]`)."""

    data: bytes


@dataclass
class Text:
    value: str


@dataclass
class Vector:
    """A vector of tables, strings, structs (all `Struct`) or 32-bit unsigned integers (ints)."""

    items: list["Table | Text | Struct | int"]


@dataclass
class Table:
    fields: dict[int, "Field"] = field(default_factory=dict)


Field = Union[U8, U32, I32, U64, Struct, Bytes, Text, Vector, Table]


class _Out:
    def __init__(self) -> None:
        self.data = bytearray()

    def pos(self) -> int:
        return len(self.data)

    def put(self, raw: bytes) -> int:
        at = len(self.data)
        self.data += raw
        return at

    def patch(self, at: int, target: int) -> None:
        struct.pack_into("<I", self.data, at, target - at)


def encode(root: Table) -> bytes:
    out = _Out()
    out.put(b"\0\0\0\0")
    out.patch(0, _table(out, root))
    return bytes(out.data)


def _table(out: _Out, table: Table) -> int:
    start = out.put(b"\0\0\0\0")  # the soffset to the vtable, patched below
    slots: dict[int, int] = {}
    later: list[tuple[int, Field]] = []
    for slot, value in sorted(table.fields.items()):
        slots[slot] = out.pos() - start
        if isinstance(value, U8):
            out.put(struct.pack("<B", value.value))
        elif isinstance(value, U32):
            out.put(struct.pack("<I", value.value))
        elif isinstance(value, I32):
            out.put(struct.pack("<i", value.value))
        elif isinstance(value, U64):
            out.put(struct.pack("<Q", value.value))
        elif isinstance(value, Struct):
            out.put(value.data)
        else:
            later.append((out.put(b"\0\0\0\0"), value))
    size = out.pos() - start
    count = max(slots, default=-1) + 1
    vtable = out.put(struct.pack(f"<HH{count}H", 4 + 2 * count, size, *(slots.get(i, 0) for i in range(count))))
    struct.pack_into("<i", out.data, start, start - vtable)
    for at, value in later:
        out.patch(at, _child(out, value))
    return start


def _child(out: _Out, value: Field) -> int:
    if isinstance(value, Table):
        return _table(out, value)
    if isinstance(value, Text):
        raw = value.value.encode()
        return out.put(struct.pack("<I", len(raw)) + raw + b"\0")
    if isinstance(value, Bytes):
        return out.put(struct.pack("<I", len(value.data)) + value.data)
    assert isinstance(value, Vector)
    items = value.items
    if all(isinstance(i, int) for i in items):
        return out.put(struct.pack(f"<I{len(items)}I", len(items), *items))  # type: ignore[arg-type]
    if all(isinstance(i, Struct) for i in items):
        return out.put(struct.pack("<I", len(items)) + b"".join(i.data for i in items))  # type: ignore[union-attr]
    start = out.put(struct.pack("<I", len(items)) + b"\0\0\0\0" * len(items))
    for n, item in enumerate(items):
        assert isinstance(item, (Table, Text))
        out.patch(start + 4 + 4 * n, _child(out, item))
    return start
