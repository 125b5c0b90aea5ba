"""Small JSON metadata files (`info`, `zarr.json`): read them, write them back."""

from __future__ import annotations

import json

from ..errors import ConfigError, SourceError
from ..sources.base import ByteSource, ObjectStat


async def read_json(source: ByteSource, key: str) -> tuple[object, ObjectStat] | None:
    """The parsed file and its stat; None if it does not exist; ConfigError if unreadable."""
    st = await source.stat(key)
    if st is None or st.is_dir:
        return None
    try:
        raw = await source.read(key, 0, st.size)
    except SourceError as e:
        raise ConfigError(f"cannot read {key}: {e}") from e
    try:
        return json.loads(raw), st
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key} is not valid JSON: {e}") from e


def encode_json(obj: object, indent: int | None = None) -> bytes:
    if indent is None:
        return json.dumps(obj, separators=(",", ":")).encode()
    return json.dumps(obj, indent=indent).encode()
