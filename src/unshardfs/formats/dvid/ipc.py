"""Where the record batches of an Arrow IPC file or stream lie, from its framing alone.

pyarrow decodes a record batch once we hand it that batch's bytes, but its
readers want the whole file (or a seekable handle) to find them. For range
reads we locate batches ourselves from the two framing structures the Arrow
format defines (Arrow columnar format, "IPC File Format" and "Encapsulated
message format"; schemas in File.fbs and Message.fbs):

- the IPC *file* footer lists every record batch as a `Block` struct
  {offset: int64, metaDataLength: int32, bodyLength: int64} (24 bytes), in
  `Footer.recordBatches` (table field 3);
- an IPC *stream* is a sequence of messages, each `0xFFFFFFFF`, an int32
  metadata length, the `Message` flatbuffer (whose `bodyLength`, field 3,
  gives the body size), then the body.

Only these few flatbuffer fields are read: a table's field is found through
its vtable (int32 back-offset at the table start; u16 slots after two u16
sizes).
"""

from __future__ import annotations

import struct

FILE_MAGIC = b"ARROW1"
CONTINUATION = 0xFFFFFFFF


class IpcError(ValueError):
    pass


def _u32(buf: bytes, pos: int) -> int:
    if pos < 0 or pos + 4 > len(buf):
        raise IpcError("flatbuffer offset out of range")
    value: int = struct.unpack_from("<I", buf, pos)[0]
    return value


def _field(buf: bytes, table: int, index: int) -> int | None:
    """Absolute position of field `index` of the table at `table`, or None if absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    if vtable < 0 or vtable + 4 > len(buf):
        raise IpcError("flatbuffer vtable out of range")
    vtable_size = struct.unpack_from("<H", buf, vtable)[0]
    slot = 4 + 2 * index
    if slot + 2 > vtable_size:
        return None
    offset = struct.unpack_from("<H", buf, vtable + slot)[0]
    return table + offset if offset else None


def footer_batches(footer: bytes) -> list[tuple[int, int]]:
    """(offset, length) of each record batch message, from an IPC file footer flatbuffer."""
    try:
        root = _u32(footer, 0)
        at = _field(footer, root, 3)
        if at is None:
            return []
        vector = at + _u32(footer, at)
        count = _u32(footer, vector)
        if vector + 4 + 24 * count > len(footer):
            raise IpcError("footer record batch list runs past the footer")
        out = []
        for i in range(count):
            offset, meta_len, body_len = struct.unpack_from("<qi4xq", footer, vector + 4 + 24 * i)
            if offset < 0 or meta_len <= 0 or body_len < 0:
                raise IpcError(f"record batch block {i} is invalid")
            out.append((offset, meta_len + body_len))
        return out
    except struct.error as e:
        raise IpcError(f"truncated footer: {e}") from e


def message_prefix(head: bytes) -> tuple[int, int] | None:
    """(prefix length, metadata length) of a message starting with `head` (>= 8 bytes); None at end of stream."""
    if len(head) < 8:
        raise IpcError("truncated message prefix")
    first, second = struct.unpack_from("<Ii", head, 0)
    if first == CONTINUATION:
        prefix, meta_len = 8, second
    else:  # pre-1.0 streams: no continuation marker
        prefix, meta_len = 4, struct.unpack_from("<i", head, 0)[0]
    if meta_len == 0:
        return None
    if meta_len < 0:
        raise IpcError(f"negative message metadata length {meta_len}")
    return prefix, meta_len


RECORD_BATCH = 3  # MessageHeader union tag of a RecordBatch


def message_header(metadata: bytes) -> tuple[int, int]:
    """(`Message.header_type`, `Message.bodyLength`) of a message's flatbuffer metadata."""
    try:
        root = _u32(metadata, 0)
        at_type = _field(metadata, root, 1)
        at_body = _field(metadata, root, 3)
        header_type = 0 if at_type is None else metadata[at_type]
        length = 0 if at_body is None else struct.unpack_from("<q", metadata, at_body)[0]
    except (struct.error, IndexError) as e:
        raise IpcError(f"truncated message metadata: {e}") from e
    if length < 0:
        raise IpcError(f"negative message body length {length}")
    return header_type, length
