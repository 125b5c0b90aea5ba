"""Zarr v3 node metadata (`zarr.json`): just enough parsing to rewrite it.

The original JSON is kept and shallow-copied when rewritten, so every member we do
not interpret (attributes, extension members, storage transformers) reaches
the reader unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unshardfs.util.errors import ConfigError
from unshardfs.util.fields import as_ints, grid_shape

MAX_DIMS = 32  # zarr-python, TensorStore and numpy all stop at 32 dimensions or fewer


def codec_name(codec: object) -> str:
    if isinstance(codec, str):
        return codec
    if isinstance(codec, dict) and isinstance(name := codec.get("name"), str):
        return name
    raise ConfigError(f"malformed codec {codec!r}")


def codec_config(codec: object) -> dict[str, Any]:
    if isinstance(codec, dict):
        config = codec.get("configuration", {})
        if isinstance(config, dict):
            return config
    if isinstance(codec, str):
        return {}
    raise ConfigError(f"malformed codec configuration in {codec!r}")


@dataclass(frozen=True)
class KeyEncoding:
    """A `chunk_key_encoding`: how chunk grid indices become store keys."""

    name: str  # "default" or "v2"
    separator: str  # "/" or "."

    @classmethod
    def from_json(cls, value: object, where: str) -> "KeyEncoding":
        if value is None:
            return cls("default", "/")
        name, config = codec_name(value), codec_config(value)
        if name not in ("default", "v2"):
            raise ConfigError(f"{where}: unsupported chunk_key_encoding {name!r}")
        separator = config.get("separator", "/" if name == "default" else ".")
        if separator not in ("/", "."):
            raise ConfigError(f"{where}: chunk_key_encoding separator must be '/' or '.', got {separator!r}")
        return cls(name, separator)


@dataclass(frozen=True)
class ArrayMeta:
    raw: dict[str, Any]
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    data_type: object
    key_encoding: KeyEncoding
    codecs: list[Any]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunk_shape))

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> "ArrayMeta":
        shape = as_ints(raw.get("shape"), f"{where}: shape", lo=0, max_length=MAX_DIMS)
        grid = raw.get("chunk_grid")
        if not isinstance(grid, dict) or codec_name(grid) != "regular":
            raise ConfigError(f"{where}: only the 'regular' chunk_grid is supported, got {str(grid)[:80]}")
        chunk_shape = as_ints(codec_config(grid).get("chunk_shape"), f"{where}: chunk_shape", lo=1,
                              max_length=MAX_DIMS)
        if len(chunk_shape) != len(shape):
            raise ConfigError(f"{where}: chunk_shape {list(chunk_shape)} does not match shape {list(shape)}")
        grid_shape(shape, chunk_shape, where)
        codecs = raw.get("codecs")
        if not isinstance(codecs, list) or not codecs:
            raise ConfigError(f"{where}: codecs must be a non-empty list")
        for codec in codecs:
            codec_name(codec)
        return cls(raw, shape, chunk_shape, raw.get("data_type"),
                   KeyEncoding.from_json(raw.get("chunk_key_encoding"), where), codecs)

    def rewritten(self, chunk_shape: tuple[int, ...], codecs: list[Any]) -> dict[str, Any]:
        out = dict(self.raw)  # only top-level members are replaced: the rest is shared, not copied
        out["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}}
        out["codecs"] = codecs
        return out


def node_type(raw: object, where: str) -> str:
    """'array' or 'group' of a parsed zarr.json, after basic checks."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a JSON object")
    if raw.get("zarr_format") != 3:
        raise ConfigError(f"{where}: zarr_format must be 3, got {raw.get('zarr_format')!r}")
    kind = raw.get("node_type")
    if kind not in ("array", "group"):
        raise ConfigError(f"{where}: node_type must be 'array' or 'group', got {kind!r}")
    return str(kind)
