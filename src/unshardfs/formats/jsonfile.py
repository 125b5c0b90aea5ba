"""Small JSON metadata files (`info`, `zarr.json`): read them (bounded), write them back."""

from __future__ import annotations

import json

from ..core.fields import MAX_METADATA_BYTES, MetadataError, load_json
from ..errors import ConfigError, SourceError
from ..sources.base import ByteSource, ObjectStat


async def read_json(source: ByteSource, key: str) -> tuple[object, ObjectStat] | None:
    """The parsed file and its stat; None if it does not exist; ConfigError if unreadable."""
    st = await source.stat(key)
    if st is None or st.is_dir:
        return None
    if st.size > MAX_METADATA_BYTES:
        raise MetadataError(key, f"{st.size:,} bytes is too large for a metadata file")
    try:
        raw = await source.read(key, 0, st.size)
    except SourceError as e:
        raise ConfigError(f"cannot read {key}: {e}") from e
    return load_json(raw, key), st


def encode_json(obj: object, indent: int | None = None) -> bytes:
    if indent is None:
        return json.dumps(obj, separators=(",", ":")).encode()
    return json.dumps(obj, indent=indent).encode()
