"""Unit tests of the Zarr metadata logic: unsharding codec chains, chunk keys, v2 mapping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.profiles import examples
from unshardfs.formats.zarr.keys import KeyLayout
from unshardfs.formats.zarr.metadata import ArrayMeta
from unshardfs.formats.zarr.sharding import Unsupported, unshard
from unshardfs.formats.zarr.v2 import array_v2, fill_value
from unshardfs.testing.zarr import BYTES_LE, CRC, codec, sharding
from unshardfs.util.errors import ConfigError

GZ = codec("gzip", level=1)


def meta(shape, chunks, codecs, data_type="uint8", **extra) -> ArrayMeta:
    raw = {"zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": data_type,
           "chunk_grid": codec("regular", chunk_shape=list(chunks)), "codecs": codecs, "fill_value": 0, **extra}
    return ArrayMeta.from_json(raw, "test")


def test_transposes_compose_across_nested_levels():
    # Level 0 sees the shard (8, 12, 16) transposed to (16, 12, 8); level 1 transposes again.
    inner = sharding((3, 2, 4), [codec("transpose", order=[0, 2, 1]), BYTES_LE, GZ])
    codecs = [codec("transpose", order=[2, 1, 0]),
              sharding((8, 6, 4), [codec("transpose", order=[1, 0, 2]), inner])]
    flat = unshard(meta((8, 12, 16), (8, 12, 16), codecs), "t")
    # Level 1 order, as array dims: [2,1,0] then [1,0,2] -> [1,2,0]; chunk (3,2,4) there -> array (4,3,2).
    assert flat.chunk_shape == (4, 3, 2)
    assert [c["name"] for c in flat.codecs] == ["transpose", "transpose", "transpose", "bytes", "gzip"]
    assert [lvl.counts for lvl in flat.levels] == [(2, 2, 2), (2, 4, 1)]
    assert flat.levels[1].perm == (1, 2, 0)


@pytest.mark.parametrize("codecs, reason", [
    ([sharding((2,), [BYTES_LE]), GZ], "encode whole shards"),
    ([codec("numcodecs.delta", dtype="<u1"), sharding((2,), [BYTES_LE])], "array->array codec"),
    ([sharding((3,), [BYTES_LE])], "does not evenly divide"),
    ([sharding((2,), [BYTES_LE], index_codecs=(BYTES_LE, GZ))], "index_codecs"),
    ([sharding((2,), [BYTES_LE], location="middle")], "index_location"),
])
def test_unsupported_chains_say_why(codecs, reason):
    with pytest.raises(Unsupported, match=reason):
        unshard(meta((8,), (4,), codecs), "t")


def test_unsharded_array_is_left_as_is():
    flat = unshard(meta((8,), (4,), [BYTES_LE, GZ]), "t")
    assert flat.levels == () and flat.chunk_shape == (4,)


def test_metadata_validation():
    with pytest.raises(ConfigError, match="does not match"):
        meta((8, 8), (4,), [BYTES_LE])
    with pytest.raises(ConfigError, match="chunk_key_encoding"):
        meta((8,), (4,), [BYTES_LE], chunk_key_encoding=codec("weird"))


@pytest.mark.parametrize("lead, sep, ndim, index, key", [
    ("c", "/", 3, (1, 20, 3), "c/1/20/3"), ("c", ".", 2, (0, 7), "c.0.7"), (None, ".", 2, (4, 5), "4.5"),
    (None, "/", 1, (9,), "9"), ("c", "/", 0, (), "c"), (None, ".", 0, (), "0"),
])
def test_key_layouts(lead, sep, ndim, index, key):
    layout = KeyLayout(lead, sep, ndim)
    assert layout.key(index) == key
    if not layout.nested:
        assert layout.parse_flat(key) == index
    assert layout.claims(key.split("/")[0])


def test_key_parsing_is_canonical():
    layout = KeyLayout("c", ".", 2)
    assert layout.parse_flat("c.01.2") is None and layout.parse_flat("c.1") is None
    assert layout.parse_flat("c.+1.2") is None and layout.parse_flat("d.1.2") is None


@pytest.mark.parametrize("data_type, value, want", [
    ("float32", "0x7fc00000", "NaN"), ("float64", "Infinity", "Infinity"), ("float32", "0x3f800000", 1.0),
    ("float16", float("-inf"), "-Infinity"), ("bool", True, True), ("int16", -3, -3),
    ("complex64", [1.0, "NaN"], [1.0, "NaN"]),
])
def test_v2_fill_values(data_type, value, want):
    assert fill_value(data_type, value, "t") == want


def test_v2_mapping():
    m = meta((10, 20), (10, 20), [sharding((5, 10), [codec("bytes", endian="big"), codec("zstd", level=2), CRC])],
             data_type="uint32", dimension_names=["y", None], attributes={"a": 1})
    zarray, zattrs, checksum = array_v2(m, unshard(m, "t"), ".", "t")
    assert zarray["dtype"] == ">u4" and zarray["chunks"] == [5, 10] and zarray["order"] == "C"
    # No `checksum: false`: numcodecs < 0.13 refuses keys it does not know.
    assert zarray["compressor"] == {"id": "zstd", "level": 2} and checksum
    with_checksum = meta((4,), (4,), [BYTES_LE, codec("zstd", level=1, checksum=True)])
    assert array_v2(with_checksum, unshard(with_checksum, "t"), ".", "t")[0]["compressor"] == {
        "id": "zstd", "level": 1, "checksum": True}
    assert zattrs == {"a": 1}  # dimension names with a null are not xarray's
    two = meta((4,), (4,), [BYTES_LE, GZ, codec("zstd")])
    with pytest.raises(Unsupported, match="more than one v2 compressor"):
        array_v2(two, unshard(two, "t"), ".", "t")
    odd = meta((4,), (4,), [BYTES_LE], data_type="r16")
    with pytest.raises(Unsupported, match="data type 'r16'"):
        array_v2(odd, unshard(odd, "t"), ".", "t")


def test_v2_strings_are_object_arrays():
    """`string` with vlen-utf8 is v2's `|O` with numcodecs' vlen-utf8 (the same bytes) as its object codec."""
    text = meta((4,), (4,), [sharding((2,), [codec("vlen-utf8"), codec("zstd", level=0)])], data_type="string",
                fill_value="")
    zarray, _, checksum = array_v2(text, unshard(text, "t"), "/", "t")
    assert (zarray["dtype"], zarray["filters"], zarray["compressor"]) == ("|O", [{"id": "vlen-utf8"}],
                                                                           {"id": "zstd", "level": 0})
    assert zarray["fill_value"] == "" and not checksum
    for codecs, reason in [([BYTES_LE], "needs vlen-utf8"), ([codec("vlen-bytes")], "needs vlen-utf8")]:
        other = meta((4,), (4,), codecs, data_type="string", fill_value="")
        with pytest.raises(Unsupported, match=reason):
            array_v2(other, unshard(other, "t"), ".", "t")
    number = meta((4,), (4,), [codec("vlen-utf8")], data_type="string", fill_value=0)
    with pytest.raises(Unsupported, match="fill_value 0"):
        array_v2(number, unshard(number, "t"), ".", "t")


@pytest.mark.parametrize("config, endian, want", [
    ({"dtype": "int32"}, "little", ("<i4", {"id": "delta", "dtype": "<i4"})),
    ({"dtype": "<u2"}, "big", (">u2", {"id": "delta", "dtype": ">u2"})),  # bytes decides the byte order
    ({"dtype": ">i8", "astype": "<i2"}, "big", (">i8", {"id": "delta", "dtype": ">i8", "astype": ">i2"})),
    ({"dtype": "|u1"}, "little", ("|u1", {"id": "delta", "dtype": "|u1"})),
])
def test_v2_delta_is_a_filter(config, endian, want):
    data_type = {"i4": "int32", "u2": "uint16", "i8": "int64", "u1": "uint8"}[want[0][1:]]
    m = meta((8,), (8,), [codec("numcodecs.delta", **config), codec("bytes", endian=endian)], data_type=data_type)
    zarray, _, _ = array_v2(m, unshard(m, "t"), ".", "t")
    assert (zarray["dtype"], zarray["filters"]) == (want[0], [want[1]])


@pytest.mark.parametrize("codecs, reason", [
    ([codec("numcodecs.delta", dtype="int16"), BYTES_LE], "not the array's data type int32"),
    ([codec("numcodecs.delta", dtype="int32", astype="|S4"), BYTES_LE], "astype"),
    ([codec("transpose", order=[1, 0]), codec("numcodecs.delta", dtype="int32"), BYTES_LE], "after a transpose"),
    ([codec("numcodecs.delta", dtype="int32"), codec("transpose", order=[1, 0]), BYTES_LE], "has no v2 equivalent"),
])
def test_v2_delta_that_v2_cannot_express(codecs, reason):
    m = meta((4, 4), (4, 4), codecs, data_type="int32")
    with pytest.raises(Unsupported, match=reason):
        array_v2(m, unshard(m, "t"), ".", "t")


@settings(max_examples=examples(200), deadline=None)
@given(grid=st.lists(st.integers(1, 9), min_size=1, max_size=4), data=st.data())
def test_chunk_ids_are_numpys_c_order(grid, data):
    """`id_of`/`index_of` (plain arithmetic, per chunk) agree with numpy's ravel/unravel, errors included."""
    import math
    from types import SimpleNamespace

    import numpy as np

    from unshardfs.formats.zarr.store import ZarrStore

    shape = tuple(grid)
    store = SimpleNamespace(grid=shape, _count=math.prod(shape),
                            _id_strides=tuple(math.prod(shape[d + 1:]) for d in range(len(shape))))
    store.in_bounds = lambda index: ZarrStore.in_bounds(store, index)  # type: ignore[arg-type]
    chunk_id = data.draw(st.integers(-2, store._count + 2))
    if 0 <= chunk_id < store._count:
        index = ZarrStore.index_of(store, chunk_id)  # type: ignore[arg-type]
        assert index == tuple(int(i) for i in np.unravel_index(chunk_id, shape))
        assert ZarrStore.id_of(store, index) == chunk_id  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError):
            ZarrStore.index_of(store, chunk_id)  # type: ignore[arg-type]
    bad = data.draw(st.tuples(*(st.integers(-1, g) for g in shape)))
    if not all(0 <= i < g for i, g in zip(bad, shape)):
        with pytest.raises(ValueError):
            ZarrStore.id_of(store, bad)  # type: ignore[arg-type]
