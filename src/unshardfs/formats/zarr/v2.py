"""Zarr v2 metadata for the `--view zarr2` view, derived from v3 metadata.

Only arrays whose (unsharded) codec chain has an exact v2 equivalent are
shown: the chunk bytes are served unchanged (apart from a trailing crc32c,
verified and cut off), so the v2 metadata must describe exactly the same
encoding. Anything else raises `Unsupported` with the reason.

Two v3 forms have v2 forms beside the plain ones: variable-length UTF-8
strings (`string` with the `vlen-utf8` codec) are v2's object arrays
(`|O`) whose first filter is numcodecs' `vlen-utf8`, which writes the same
bytes; and numcodecs' `delta` before `bytes` is v2's `delta` filter, with
the byte order the `bytes` codec gives (v2 decodes its filter output as the
array's data type, so the two must agree). Delta after a transpose is not
expressed: the v3 codec flattens the transposed chunk in an order v2 does
not reproduce.
"""

from __future__ import annotations

import math
import string
import struct
import sys
from typing import Any

from unshardfs.formats.zarr.metadata import ArrayMeta, codec_config, codec_name
from unshardfs.formats.zarr.sharding import Unsharded, Unsupported, transpose_order

# v3 data type -> (numpy kind + itemsize); endianness comes from the bytes codec.
DTYPES = {
    "bool": "b1", "int8": "i1", "int16": "i2", "int32": "i4", "int64": "i8",
    "uint8": "u1", "uint16": "u2", "uint32": "u4", "uint64": "u8",
    "float16": "f2", "float32": "f4", "float64": "f8", "complex64": "c8", "complex128": "c16",
}
BLOSC_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
# v3 data types v2 holds as Python objects: the v3 codec that serialises them, which v2 names as the
# object codec (its first filter) with the same encoding.
OBJECT_TYPES = {"string": "vlen-utf8"}
# numpy's spellings of a data type a numcodecs codec's configuration may hold, as `DTYPES` values.
NUMPY_KINDS = {f"{order}{code}": code for code in DTYPES.values() for order in ("", "<", ">", "|", "=")}


def _float_fill(value: object, size: int, where: str) -> object:
    if isinstance(value, str) and value.startswith("0x"):
        # The value's bit pattern, which must be hex digits of at most its size.
        digits = value[2:]
        if not 0 < len(digits) <= 2 * size or any(c not in string.hexdigits for c in digits):
            raise Unsupported(f"{where}: fill_value {value[:40]!r} is not a {size}-byte hex pattern")
        fmt = {2: "<e", 4: "<f", 8: "<d"}[size]
        value = struct.unpack(fmt, int(digits, 16).to_bytes(size, "little"))[0]
    if isinstance(value, str):
        if value in ("NaN", "Infinity", "-Infinity"):
            return value
        raise Unsupported(f"{where}: fill_value {value[:40]!r}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        raise Unsupported(f"{where}: fill_value {str(value)[:40]} is beyond any float")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    raise Unsupported(f"{where}: fill_value {value!r}")


def fill_value(data_type: str, value: object, where: str) -> object:
    if data_type in OBJECT_TYPES:
        if value is not None and not isinstance(value, str):
            raise Unsupported(f"{where}: fill_value {value!r:.40} for {data_type}")
        return value  # v2 keeps an object array's fill value as it is
    kind, size = DTYPES[data_type][0], int(DTYPES[data_type][1:])
    if kind == "b":
        return bool(value)
    if kind in "iu":
        if not isinstance(value, int) or isinstance(value, bool):
            raise Unsupported(f"{where}: fill_value {value!r} for {data_type}")
        return value
    if kind == "f":
        return _float_fill(value, size, where)
    if not isinstance(value, list) or len(value) != 2:
        raise Unsupported(f"{where}: complex fill_value {value!r}")
    return [_float_fill(v, size // 2, where) for v in value]


def _compressor(codec: object, where: str) -> dict[str, Any]:
    name, config = codec_name(codec), codec_config(codec)
    if name == "gzip":
        return {"id": "gzip", "level": config.get("level", 5)}
    if name == "zstd":
        # numcodecs < 0.13 (Debian's python3-numcodecs 0.11) refuses a `checksum` key it does not know; a
        # read-only view needs it only when true (the frames say whether they carry a checksum).
        zstd = {"id": "zstd", "level": config.get("level", 0)}
        return {**zstd, "checksum": True} if config.get("checksum", False) else zstd
    if name == "blosc":
        shuffle = config.get("shuffle", "noshuffle")
        if not isinstance(shuffle, str) or shuffle not in BLOSC_SHUFFLE:
            raise Unsupported(f"{where}: blosc shuffle {str(shuffle)[:40]}")
        return {"id": "blosc", "cname": config.get("cname", "lz4"), "clevel": config.get("clevel", 5),
                "shuffle": BLOSC_SHUFFLE[shuffle], "blocksize": config.get("blocksize", 0)}
    if name.startswith("numcodecs."):
        return {"id": name.removeprefix("numcodecs."), **config}
    raise Unsupported(f"{where}: codec {name!r} has no v2 equivalent")


def _numpy_code(value: object) -> str | None:
    """A data type as a numcodecs configuration spells it (`int32`, `<i4`), as a `DTYPES` value."""
    if not isinstance(value, str):
        return None
    return DTYPES.get(value) or NUMPY_KINDS.get(value)


def _delta(codec: object, data_type: str, byte_order: str, where: str) -> dict[str, Any]:
    """numcodecs' `delta` of a v3 chain as the v2 filter that decodes the same bytes: its `dtype` the
    array's (v2 reads the filter's output as the array's data type), its `astype` in the byte order the
    `bytes` codec writes."""
    config = codec_config(codec)
    code = DTYPES[data_type]
    if _numpy_code(config.get("dtype")) != code:
        raise Unsupported(f"{where}: numcodecs.delta dtype {str(config.get('dtype'))[:40]!r} is not the array's "
                          f"data type {data_type}")
    astype = config.get("astype", config.get("dtype"))
    stored = _numpy_code(astype)
    if stored is None or stored[0] not in "iuf":
        raise Unsupported(f"{where}: numcodecs.delta astype {str(astype)[:40]!r}")
    order = "|" if stored[1:] == "1" else byte_order
    out = {"id": "delta", "dtype": ("|" if code[1:] == "1" else byte_order) + code}
    if stored != code:
        out["astype"] = order + stored
    return out


def array_v2(meta: ArrayMeta, flat: Unsharded, separator: str, where: str) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(.zarray, .zattrs, whether chunks end in a crc32c to verify and cut off)."""
    data_type = meta.data_type
    if not isinstance(data_type, str) or (data_type not in DTYPES and data_type not in OBJECT_TYPES):
        raise Unsupported(f"{where}: data type {str(data_type)[:40]!r} has no v2 equivalent here")
    ndim = meta.ndim
    order = tuple(range(ndim))
    codecs = list(flat.codecs)
    names = [codec_name(c) for c in codecs]
    while names and names[0] == "transpose":
        step = transpose_order(codecs[0], ndim)
        order = tuple(order[o] for o in step)
        codecs, names = codecs[1:], names[1:]
    if order == tuple(range(ndim)):
        memory_order = "C"
    elif order == tuple(reversed(range(ndim))):
        memory_order = "F"
    else:
        raise Unsupported(f"{where}: transpose order {list(order)} is neither C nor F order")
    deltas: list[object] = []
    while names and names[0] == "numcodecs.delta":
        if memory_order != "C":
            raise Unsupported(f"{where}: numcodecs.delta after a transpose has no v2 equivalent")
        deltas.append(codecs[0])
        codecs, names = codecs[1:], names[1:]
    filters: list[dict[str, Any]] | None = None
    if data_type in OBJECT_TYPES:
        serializer = OBJECT_TYPES[data_type]
        if deltas or not names or names[0] != serializer:
            raise Unsupported(f"{where}: codec chain {names} of a {data_type} array has no v2 equivalent "
                              f"(needs {serializer}, ...)")
        dtype = "|O"
        filters = [{"id": serializer}]
    else:
        if not names or names[0] != "bytes":
            raise Unsupported(f"{where}: codec chain {names} has no v2 equivalent (needs transpose?, bytes, ...)")
        endian = codec_config(codecs[0]).get("endian", "little")
        size = DTYPES[data_type][1:]
        byte_order = "|" if size in ("1",) else ("<" if endian == "little" else ">")
        dtype = byte_order + DTYPES[data_type]
        if deltas:
            filters = [_delta(d, data_type, "<" if endian == "little" else ">", where) for d in deltas]
    codecs, names = codecs[1:], names[1:]
    checksum = bool(names) and names[-1] == "crc32c"
    if checksum:
        codecs, names = codecs[:-1], names[:-1]
    if len(codecs) > 1:
        raise Unsupported(f"{where}: codecs {names} would need more than one v2 compressor")
    compressor = _compressor(codecs[0], where) if codecs else None
    zarray = {
        "zarr_format": 2,
        "shape": list(meta.shape),
        "chunks": list(flat.chunk_shape),
        "dtype": dtype,
        "compressor": compressor,
        "fill_value": fill_value(data_type, meta.raw.get("fill_value"), where),
        "order": memory_order,
        "filters": filters,
        "dimension_separator": separator,
    }
    return zarray, attrs_v2(meta.raw), checksum


# OME objects that carry their own `version` in OME-Zarr 0.4 (in 0.5 it moved to `ome.version`).
OME_VERSIONED = ("plate", "well", "image-label")


def ome_attributes(attrs: dict[str, Any]) -> dict[str, Any] | None:
    """The `ome` object of OME-Zarr 0.5 attributes, or None when there is none."""
    ome = attrs.get("ome")
    return ome if isinstance(ome, dict) else None


def ome_v04(attrs: dict[str, Any]) -> dict[str, Any]:
    """OME-Zarr 0.5 group attributes as OME-Zarr 0.4 `.zattrs`.

    0.5 differs from 0.4 only in where the metadata lives (under `ome`) and
    where its version is (one `ome.version` instead of one per object): the
    objects are raised to the top level (winning over same-named plain
    attributes, as 0.5 is preferred) and every object 0.4 versions gets
    `"version": "0.4"`, which 0.4 readers need to pick their parser.
    """
    ome = ome_attributes(attrs)
    if ome is None:
        return attrs
    out = {k: v for k, v in attrs.items() if k != "ome"}
    # Shared with `attrs`, not copied: what is changed below is replaced by new objects.
    out.update({k: v for k, v in ome.items() if k != "version"})
    multiscales = out.get("multiscales")
    if isinstance(multiscales, list):
        out["multiscales"] = [dict(m, version="0.4") if isinstance(m, dict) else m for m in multiscales]
    for key in OME_VERSIONED:
        if isinstance(out.get(key), dict):
            out[key] = dict(out[key], version="0.4")
    return out


def attrs_v2(raw: dict[str, Any]) -> dict[str, Any]:
    """v3 attributes (OME-Zarr 0.5 metadata as 0.4), plus xarray's `_ARRAY_DIMENSIONS` from
    `dimension_names`."""
    given = raw.get("attributes")
    attrs = ome_v04(dict(given)) if isinstance(given, dict) else {}
    names = raw.get("dimension_names")
    if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
        attrs.setdefault("_ARRAY_DIMENSIONS", names)
    return attrs
