"""Property-based: the metadata parsers of every format fed hostile JSON.

Random JSON documents (hypothesis' recursive strategies, with the formats'
own vocabulary and integers at every boundary) and mutations of valid
metadata (a member replaced, deleted or retyped, anywhere in the tree) go
through each format's real entry point: a precomputed `info` with its mesh
and skeleton `info`s, a Zarr v3 root and child `zarr.json` (with sharding
codec configurations and consolidated metadata) in both views, a DVID
volume spec and its JSON and CSV chunk indexes. The outcome is a parsed
tree, a ConfigError or a DataError, never another exception; and no parse
allocates more than 64 MB (tracemalloc), whatever sizes the document declares.

Documents grown in depth and size (one member, anywhere, replaced by nesting
up to 100,000 deep, a string or number literal of megabytes, or a list of
millions of items) go through the same entry points: the same outcomes, the
same memory bound, and an error message stays one short line.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import tracemalloc
from pathlib import Path
from typing import Awaitable, Callable

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.profiles import examples
from unshardfs.core.runtime import Runtime
from unshardfs.formats.dvid.export import DvidExport
from unshardfs.formats.dvid.shard import parse_csv_index, parse_json_index
from unshardfs.formats.precomputed.dataset import PrecomputedDataset
from unshardfs.formats.zarr.hierarchy import ZarrHierarchy
from unshardfs.sources import LocalSource
from unshardfs.testing.dvid import info_for
from unshardfs.testing.precomputed import MESH_INFO, SKELETON_INFO, sharding
from unshardfs.util.errors import ConfigError, DataError

MAX_PEAK = 64 << 20
SETTINGS = settings(max_examples=examples(150), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# -- documents --------------------------------------------------------------------------

BOUNDARY_INTS = [0, 1, -1, 2, 3, 8, 24, 32, 63, 64, 65, 255, 2**16, 2**31 - 1, 2**31, 2**32, 2**40, 2**53 + 1,
                 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, 10**100]
VOCABULARY = ["neuroglancer_uint64_sharded_v1", "identity", "murmurhash3_x86_128", "raw", "gzip", "jpeg",
              "compressed_segmentation", "neuroglancer_multilod_draco", "neuroglancer_skeletons",
              "sharding_indexed", "bytes", "crc32c", "zstd", "blosc", "transpose", "start", "end", "C", "F",
              "little", "big", "default", "v2", "/", ".", "..", "", "regular", "rectilinear", "array", "group",
              "uint8", "uint64", "float32", "complex64", "bool", "0x7fc00000", "0xzz", "NaN", "Infinity", "c",
              "numcodecs.fixedscaleoffset", "a", "a/b", "../x", "scales", "sharding", "codecs", "configuration"]
leaves = (st.none() | st.booleans() | st.integers() | st.sampled_from(BOUNDARY_INTS)
          | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.sampled_from(VOCABULARY))
json_values = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10) | st.sampled_from(
        VOCABULARY), inner, max_size=6), max_leaves=40)


@st.composite
def mutated(draw: st.DrawFn, doc: object) -> object:
    """`doc` with one to three members, anywhere in it, replaced, deleted, or given another type."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        parent, key, node = None, None, doc
        while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)):
            parent, key = node, draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
            node = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "wrap"]))
        value = draw(json_values) if action == "replace" else [node]
        if parent is None:
            doc = value
        elif action == "delete":
            del parent[key]
        else:
            parent[key] = value
    return doc


def documents(valid: object) -> st.SearchStrategy:
    return json_values | mutated(valid) | st.just(valid)


# Stands in a document for a grown member, whose JSON text `encoded` puts in its place (json.dumps
# itself cannot write nesting 100,000 deep, and building the value first would cost what is tested).
GROWN = "\x00grown\x00"


@st.composite
def grown(draw: st.DrawFn, doc: object) -> tuple[object, bytes]:
    """`doc` with one member or item, anywhere in it, replaced by something deep or large; the
    document (with GROWN in that place) and the JSON text that replaces GROWN."""
    kind = draw(st.sampled_from(["deep", "deep objects", "string", "number", "many"]))
    if kind == "deep":
        depth = draw(st.sampled_from([99, 100, 101, 300, 600, 5000, 100_000]))
        text = b"[" * depth + b"]" * depth
    elif kind == "deep objects":
        depth = draw(st.sampled_from([50, 101, 400, 2000]))
        text = b'{"a":' * depth + b"0" + b"}" * depth
    elif kind == "string":
        text = json.dumps("s" * draw(st.sampled_from([200, 1 << 20, (1 << 20) + 1, 4 << 20]))).encode()
    elif kind == "number":
        text = b"9" * draw(st.sampled_from([19, 100, 101, 5000, 100_000]))
    else:
        text = b"[" + b",".join([b"0"] * draw(st.sampled_from([1000, 900_000, 1_100_000, 3_000_000]))) + b"]"
    doc = copy.deepcopy(doc)
    parent, key, node = None, None, doc
    while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)):
        parent, key = node, draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        node = parent[key]
    if parent is None:
        return GROWN, text
    if isinstance(parent, dict) and draw(st.booleans()):
        key = "unused"  # a member no parser reads
    parent[key] = GROWN
    return doc, text


def encoded(doc: object, text: bytes = b"") -> bytes:
    """JSON of `doc` (NaN and Infinity too: Python's json reads them back); GROWN replaced by `text`."""
    return json.dumps(doc).encode().replace(json.dumps(GROWN).encode(), text)


# -- running a parser ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced():
    tracemalloc.start()
    yield
    tracemalloc.stop()


def outcome(files: dict[str, bytes], parse: Callable[[Runtime], Awaitable[object]]) -> str:
    """Write `files` into a fresh source directory and parse it: 'parsed', 'config' or 'data'
    (anything else propagates and fails the test); the parse's allocation peak is bounded."""
    root = Path(tempfile.mkdtemp(prefix="meta"))
    try:
        for key, data in files.items():
            (root / key).parent.mkdir(parents=True, exist_ok=True)
            (root / key).write_bytes(data)
        runtime = Runtime(LocalSource(str(root)))
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        try:
            trio.run(parse, runtime)
            result = "parsed"
        except (ConfigError, DataError) as e:
            result = "config" if isinstance(e, ConfigError) else "data"
            assert len(str(e)) < 1000 and "\n" not in str(e), str(e)[:2000]
        peak = tracemalloc.get_traced_memory()[1] - before
        assert peak < MAX_PEAK, f"parsing allocated {peak:,} bytes"
        return result
    finally:
        shutil.rmtree(root)


# -- Neuroglancer precomputed -------------------------------------------------------------

SHARDING = sharding(minishard=3, shard=2, index_enc="gzip", data_enc="gzip")
INFO = {"@type": "neuroglancer_multiscale_volume", "type": "segmentation", "data_type": "uint64",
        "num_channels": 1, "mesh": "mesh", "skeletons": "skeletons", "segment_properties": "props",
        "scales": [{"key": "8_8_8", "size": [1000, 900, 80], "chunk_sizes": [[64, 64, 16]], "encoding": "raw",
                    "resolution": [8, 8, 8], "voxel_offset": [10, -20, 0], "sharding": SHARDING},
                   {"key": "16_16_16", "size": [500, 450, 40], "chunk_sizes": [[64, 64, 16]],
                    "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8],
                    "resolution": [16, 16, 16], "voxel_offset": [0, 0, 0]}]}
MESH = {**MESH_INFO, "sharding": SHARDING}
SKELETONS = {**SKELETON_INFO, "sharding": SHARDING}


async def precomputed(runtime: Runtime) -> object:
    return await PrecomputedDataset(runtime).build()


def test_valid_metadata_parses(traced):
    """The documents the properties mutate are valid to begin with."""
    assert outcome({"info": encoded(INFO), "mesh/info": encoded(MESH), "skeletons/info": encoded(SKELETONS)},
                   precomputed) == "parsed"
    for view in ("zarr3", "zarr2"):
        assert outcome({"zarr.json": encoded(GROUP), "a/zarr.json": encoded(ARRAY)}, zarr_parser(view)) == "parsed"
        assert outcome({"zarr.json": encoded(ARRAY)}, zarr_parser(view)) == "parsed"
    assert outcome({"info": encoded(SPEC), "s0/0_0_0.arrow": b""}, dvid) == "parsed"
    assert parse_json_index(encoded(JSON_INDEX), "index") and parse_csv_index(CSV_INDEX, "index")


@SETTINGS
@given(info=documents(INFO), mesh=documents(MESH), skeletons=documents(SKELETONS))
def test_precomputed_info(traced, info, mesh, skeletons):
    outcome({"info": encoded(info), "mesh/info": encoded(mesh), "skeletons/info": encoded(skeletons)}, precomputed)


# -- Zarr v3 --------------------------------------------------------------------------------

INNER = {"name": "sharding_indexed", "configuration": {
    "chunk_shape": [5, 4, 2], "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                         {"name": "gzip", "configuration": {"level": 1}}, {"name": "crc32c"}],
    "index_codecs": [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}],
    "index_location": "start"}}
ARRAY = {"zarr_format": 3, "node_type": "array", "shape": [100, 64, 30], "data_type": "float32",
         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [16, 32, 10]}},
         "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
         "fill_value": "NaN", "dimension_names": ["z", "y", "x"], "attributes": {"units": "nm"},
         "codecs": [{"name": "transpose", "configuration": {"order": [2, 1, 0]}},
                    {"name": "sharding_indexed", "configuration": {
                        "chunk_shape": [10, 16, 8], "codecs": [INNER],
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                         {"name": "crc32c"}], "index_location": "end"}}]}
GROUP = {"zarr_format": 3, "node_type": "group",
         "attributes": {"ome": {"version": "0.5", "multiscales": [{"datasets": [{"path": "a"}]}]}},
         "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                   "metadata": {"a": ARRAY, "g": {"zarr_format": 3, "node_type": "group"}}}}


def zarr_parser(view: str) -> Callable[[Runtime], Awaitable[object]]:
    async def parse(runtime: Runtime) -> object:
        hierarchy = ZarrHierarchy(runtime, view)
        root = await hierarchy.build()
        # A child is resolved when first looked up: its own zarr.json, its rewritten metadata.
        return root, await hierarchy.resolve("a", await runtime.source.stat("a"))
    return parse


@SETTINGS
@given(root=documents(GROUP) | documents(ARRAY), child=documents(ARRAY), view=st.sampled_from(["zarr3", "zarr2"]))
def test_zarr_json(traced, root, child, view):
    outcome({"zarr.json": encoded(root), "a/zarr.json": encoded(child)}, zarr_parser(view))


# -- DVID export ------------------------------------------------------------------------------

SPEC = info_for([(200, 130, 70), (100, 65, 35)], sharding("identity", preshift=3, minishard=0, shard=2))
JSON_INDEX = {"0_0_0": 0, "64_0_0": 1, "0_64_0": 2}
CSV_INDEX = "# schema_size=512\nx,y,z,offset,size,batch_idx\n0,0,0,512,1024,0\n1,0,0,1536,1024,0\n"


async def dvid(runtime: Runtime) -> object:
    return await DvidExport(runtime).build()


@SETTINGS
@given(spec=documents(SPEC))
def test_dvid_spec(traced, spec):
    outcome({"info": encoded(spec), "s0/0_0_0.arrow": b""}, dvid)


def index_text(doc: object) -> str:
    """A CSV chunk index from a JSON document: a list of rows (lists) under the usual header."""
    rows = doc if isinstance(doc, list) else [doc]
    lines = [",".join(map(str, row)) if isinstance(row, list) else str(row) for row in rows]
    return "# schema_size=512\nx,y,z,offset,size,batch_idx\n" + "\n".join(lines) + "\n"


@SETTINGS
@given(mapping=documents(JSON_INDEX), rows=documents([[0, 0, 0, 512, 1024, 0], [1, 0, 0, 1536, 1024, 0]]),
       text=st.text(max_size=300))
def test_dvid_indexes(traced, mapping, rows, text):
    for parse, data in ((parse_json_index, encoded(mapping)), (parse_json_index, text.encode()),
                        (parse_csv_index, index_text(rows)), (parse_csv_index, text)):
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        try:
            parse(data, "index")  # type: ignore[operator]
        except DataError:
            pass
        assert tracemalloc.get_traced_memory()[1] - before < MAX_PEAK


def replaced(doc: object, path: tuple, value: object) -> object:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]  # type: ignore[index]
    node[path[-1]] = value  # type: ignore[index]
    return doc


BLOSC = {"name": "blosc", "configuration": {"shuffle": []}}
# Members that once raised another exception (TypeError, ValueError, OverflowError) or made wrong
# chunk names (int64 wrap-around): each is a ConfigError now, but for an unknown data type, which
# precomputed only uses to bound chunk sizes.
FOUND = {
    "info data_type list": ({"info": replaced(INFO, ("data_type",), ["uint8"])}, precomputed),
    "info voxel_offset near 2^63": ({"info": replaced(INFO, ("scales", 0, "voxel_offset"), [2**63 - 5, 0, 0])},
                                    precomputed),
    "info chunk bytes beyond int64": ({"info": replaced(INFO, ("scales", 0, "chunk_sizes"), [[2**21] * 3])},
                                      precomputed),
    "zarr fill_value not hex": ({"zarr.json": replaced(ARRAY, ("fill_value",), "0xzz")}, zarr_parser("zarr2")),
    "zarr fill_value hex too long": ({"zarr.json": replaced(ARRAY, ("fill_value",), "0x" + "f" * 40)},
                                     zarr_parser("zarr2")),
    "zarr fill_value beyond float": ({"zarr.json": replaced(ARRAY, ("fill_value",), 10**400)}, zarr_parser("zarr2")),
    "zarr blosc shuffle list": ({"zarr.json": replaced(ARRAY, ("codecs", 1, "configuration", "codecs", 0,
                                                               "configuration", "codecs", 1), BLOSC)},
                                zarr_parser("zarr2")),
    "zarr transpose order mixed": ({"zarr.json": replaced(ARRAY, ("codecs", 0, "configuration", "order"),
                                                          [None, 1, 0])}, zarr_parser("zarr3")),
    "dvid voxel_offset near 2^63": ({"info": replaced(SPEC, ("scales", 0, "voxel_offset"), [0, 2**63 - 5, 0]),
                                     "s0/0_0_0.arrow": {}}, dvid),
}


@pytest.mark.parametrize("case", sorted(FOUND))
def test_found_members(traced, case):
    files, parse = FOUND[case]
    want = "parsed" if case == "info data_type list" else "config"
    assert outcome({key: encoded(doc) for key, doc in files.items()}, parse) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe{}", b"1" * 5000, b"{" * 10])
def test_unparseable_bytes(traced, raw):
    """Bytes that are not JSON at all (absurd nesting, not UTF-8, a 5000-digit integer): a ConfigError."""
    for files, parse in (({"info": raw}, precomputed), ({"zarr.json": raw}, zarr_parser("zarr2")),
                         ({"info": raw, "s0/0_0_0.arrow": b""}, dvid)):
        assert outcome(files, parse) == "config"


GROWN_SETTINGS = settings(SETTINGS, max_examples=examples(40))


@GROWN_SETTINGS
@given(info=grown(INFO), mesh=grown(MESH))
def test_precomputed_info_grown(traced, info, mesh):
    outcome({"info": encoded(*info), "mesh/info": encoded(*mesh), "skeletons/info": encoded(SKELETONS)},
            precomputed)


@GROWN_SETTINGS
@given(root=grown(GROUP) | grown(ARRAY), child=grown(ARRAY), view=st.sampled_from(["zarr3", "zarr2"]))
def test_zarr_json_grown(traced, root, child, view):
    outcome({"zarr.json": encoded(*root), "a/zarr.json": encoded(*child)}, zarr_parser(view))


@GROWN_SETTINGS
@given(spec=grown(SPEC), mapping=grown(JSON_INDEX))
def test_dvid_grown(traced, spec, mapping):
    outcome({"info": encoded(*spec), "s0/0_0_0.arrow": b""}, dvid)
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    with pytest.raises(DataError) as caught:  # a grown value is never a record number
        parse_json_index(encoded(*mapping), "index")
    assert len(str(caught.value)) < 1000
    assert tracemalloc.get_traced_memory()[1] - before < MAX_PEAK
