"""Small JSON metadata files (`info`, `zarr.json`): read them (bounded), write them back."""

from __future__ import annotations

import json

from ..core.fields import DEFAULT_LIMITS, MetadataError, check_size, load_json, off_loop
from ..core.limits import Limits
from ..errors import ConfigError, SourceError
from ..sources.base import ByteSource, ObjectStat


async def read_json(source: ByteSource, key: str,
                    limits: Limits = DEFAULT_LIMITS) -> tuple[object, ObjectStat] | None:
    """The parsed file and its stat; None if it does not exist; ConfigError if unreadable or beyond
    `limits` (a large file is read and parsed off the event loop, one at a time)."""
    st = await source.stat(key)
    if st is None or st.is_dir:
        return None
    check_size(st.size, key, limits)
    try:
        raw = await source.read(key, 0, st.size)
    except SourceError as e:
        raise ConfigError(f"cannot read {key}: {e}") from e
    return await off_loop(len(raw), load_json, raw, key, limits), st


def encode_json(obj: object, indent: int | None = None) -> bytes:
    if indent is None:
        return json.dumps(obj, separators=(",", ":")).encode()
    return json.dumps(obj, indent=indent).encode()
