"""Zarr v3 sharded arrays written by zarr-python 3 and TensorStore, mounted
through FUSE: the v3 view equals an unsharded write of the same data file for
file, reads back through zarr-python 3 and TensorStore, and the v2 view reads
back through zarr-python 2 (its own venv) equal to the original arrays."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from unshardfs.testing.trees import assert_same_tree, unstamped, walk_files
from unshardfs.testing.zarr import (
    BYTES_BE,
    BYTES_LE,
    CRC,
    DEBIAN_ZARR_PYTHON,
    ZCase,
    codec,
    consolidate,
    read_with_zarr2,
    sharding,
    write_case,
    write_group,
)

GZ = codec("gzip", level=1)
ZSTD = codec("zstd", level=3, checksum=False)
BLOSC = codec("blosc", cname="lz4", clevel=5, shuffle="shuffle", typesize=4, blocksize=0)
REVERSE3 = codec("transpose", order=[2, 1, 0])

CASES = {
    # index at the end with crc32c, gzip, edge shards (100 % 40, 70 % 28), attributes and dimension names
    "zarr_u16_gzip": ZCase((100, 70), "uint16", (40, 28), [sharding((10, 7), [BYTES_LE, GZ])], (10, 7),
                           [BYTES_LE, GZ], fill_value=3, attributes={"units": "nm"}, dimension_names=["y", "x"]),
    # transpose before sharding: the inner chunk shape is given in transposed order; index at start, no crc32c
    "zarr_f32_transpose": ZCase((20, 30, 40), "float32", (8, 10, 16),
                                [REVERSE3, sharding((8, 5, 4), [BYTES_LE, ZSTD], (BYTES_LE,), "start")],
                                (4, 5, 8), [REVERSE3, BYTES_LE, ZSTD], fill_value="NaN"),
    # blosc then crc32c inside, '.' separator
    "zarr_i32_blosc_crc": ZCase((30, 50), "int32", (10, 25), [sharding((5, 5), [BYTES_LE, BLOSC, CRC])], (5, 5),
                                [BYTES_LE, BLOSC, CRC], key_encoding=codec("default", separator=".")),
    # nested sharding, flattened to the innermost chunks
    "zarr_u8_nested": ZCase((64, 48), "uint8", (32, 24), [sharding((16, 12), [sharding((8, 6), [BYTES_LE, GZ])])],
                            (8, 6), [BYTES_LE, GZ]),
    # TensorStore: 3-D, index at start, gzip
    "ts_u8_start": ZCase((50, 40, 30), "uint8", (20, 20, 10),
                         [sharding((10, 10, 5), [BYTES_LE, GZ], (BYTES_LE, CRC), "start")], (10, 10, 5),
                         [BYTES_LE, GZ], writer="tensorstore"),
    # TensorStore: big-endian data and index, v2 key encoding
    "ts_i16_bigendian_v2keys": ZCase((45, 33), "int16", (15, 11), [sharding((5, 11), [BYTES_BE, GZ], (BYTES_BE,))],
                                     (5, 11), [BYTES_BE, GZ], writer="tensorstore",
                                     key_encoding=codec("v2", separator=".")),
    # TensorStore: transpose before sharding (inner chunk shape in transposed order), Fortran order in v2
    "ts_u16_transpose": ZCase((40, 30), "uint16", (16, 16),
                              [codec("transpose", order=[1, 0]), sharding((8, 4), [BYTES_LE, ZSTD])],
                              (4, 8), [codec("transpose", order=[1, 0]), BYTES_LE, ZSTD], writer="tensorstore"),
    # TensorStore: 1-D, raw chunks, v2 keys with '/' separator
    "ts_u64_1d_raw": ZCase((1000,), "uint64", (256,), [sharding((32,), [BYTES_LE])], (32,), [BYTES_LE],
                           writer="tensorstore", key_encoding=codec("v2", separator="/")),
}
# Stored under a subgroup to exercise the hierarchy.
SUBGROUP = "sub"


def case_path(name: str) -> str:
    return f"{SUBGROUP}/{name}" if name.startswith("ts_") else name


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("zarrstore")
    data = {}
    for variant in ("sharded", "plain"):
        write_group(root / variant, {"description": "unshardfs test store"})
        write_group(root / variant / SUBGROUP)
    for i, (name, case) in enumerate(sorted(CASES.items())):
        path = case_path(name)
        parent, _, leaf = path.rpartition("/")
        data[name] = write_case(root / parent if parent else root, leaf, case, seed=i) if not parent else None
        if parent:
            # write_case writes <root>/<variant>/<name>; nest by writing into a staging root and moving.
            stage = root / "stage"
            data[name] = write_case(stage, leaf, case, seed=i)
            for variant in ("sharded", "plain"):
                os.rename(stage / variant / leaf, root / variant / parent / leaf)
    # An unsharded array passes through (v3) or is renamed (v2).
    unsharded = ZCase((12, 9), "float64", (4, 3), [BYTES_LE, GZ], (4, 3), [BYTES_LE, GZ], holes=False)
    stage = root / "stage"
    data["unsharded"] = write_case(stage, "unsharded", unsharded, seed=99)
    for variant in ("sharded", "plain"):
        os.rename(stage / "plain" / "unsharded", root / variant / "unsharded") if variant == "plain" else \
            os.rename(stage / "sharded" / "unsharded", root / variant / "unsharded")
    for variant in ("sharded", "plain"):
        consolidate(root / variant)
    return root, data


def test_missing_shards_and_empty_chunks_exist(store):
    """The data really has missing shards and empty inner chunks (else the tests below prove less)."""
    root, _ = store
    sharded = walk_files(root / "sharded" / "zarr_u16_gzip")
    assert "c/0/0" not in sharded and "c/1/0" in sharded
    index = np.frombuffer((root / "sharded/zarr_u16_gzip/c/2/0").read_bytes()[-4 - 16 * 16:-4], "<u8")
    assert (index == 2**64 - 1).any()


def test_v3_view_equals_unsharded_write(store, mount):
    root, _ = store
    m = mount(root / "sharded")
    json_files = tuple(rel for rel in walk_files(root / "plain") if rel.endswith("zarr.json"))
    compared = assert_same_tree(m.path, root / "plain", json_files, ignore_gzip_mtime=True)
    assert compared > 200
    # Every source shard object is gone from the view; the consolidated entries are rewritten too.
    consolidated = json.loads((m.path / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
    assert consolidated["zarr_u8_nested"]["chunk_grid"]["configuration"]["chunk_shape"] == [8, 6]


def test_v3_view_reads_back(store, mount):
    import tensorstore as ts
    import zarr

    root, data = store
    m = mount(root / "sharded")
    for name in CASES:
        path = m.path / case_path(name)
        got = zarr.open_array(str(path), mode="r")[...]
        np.testing.assert_array_equal(got, data[name], err_msg=name)
        assert zarr.open_array(str(path), mode="r").shards is None
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
        np.testing.assert_array_equal(ts.open(spec, read=True).result().read().result(), data[name], err_msg=name)


@pytest.mark.parametrize("python", [None, DEBIAN_ZARR_PYTHON], ids=["zarr-2.18", "debian-zarr-2.13"])
@pytest.mark.legacy
def test_v2_view_reads_back_with_zarr2(store, mount, tmp_path, python):
    """zarr 2.18 from its venv, and Debian's python3-zarr (numcodecs 0.11, which knows no zstd `checksum`)."""
    root, data = store
    m = mount(root / "sharded", "--view", "zarr2")
    assert not (m.path / "zarr.json").exists()
    assert json.loads((m.path / ".zgroup").read_text()) == {"zarr_format": 2}
    assert json.loads((m.path / ".zattrs").read_text()) == {"description": "unshardfs test store"}
    for name in [*CASES, "unsharded"]:
        got = read_with_zarr2(m.path / case_path(name), tmp_path / f"{name}.npy", python=python)
        np.testing.assert_array_equal(got, data[name], err_msg=name)
    # Through the consolidated metadata, as xarray and most v2 readers open stores.
    got = read_with_zarr2(f"{m.path}:zarr_f32_transpose", tmp_path / "cons.npy", consolidated=True, python=python)
    np.testing.assert_array_equal(got, data["zarr_f32_transpose"])
    zattrs = json.loads((m.path / "zarr_u16_gzip" / ".zattrs").read_text())
    assert zattrs == {"units": "nm", "_ARRAY_DIMENSIONS": ["y", "x"]}
    zarray = json.loads((m.path / "zarr_f32_transpose" / ".zarray").read_text())
    assert zarray["order"] == "F" and zarray["fill_value"] == "NaN" and zarray["chunks"] == [4, 5, 8]


def test_v2_chunks_are_the_unsharded_chunks(store, mount):
    """v2 chunk files hold the unsharded writer's chunk bytes (a trailing crc32c verified and cut off)."""
    root, _ = store
    m = mount(root / "sharded", "--view", "zarr2")
    compared = 0
    for name, case in CASES.items():
        plain = root / "plain" / case_path(name)
        lead = "c/" if case.key_encoding["name"] == "default" and case.key_encoding["configuration"]["separator"] == "/" \
            else ("c." if case.key_encoding["name"] == "default" else "")
        strip = 4 if case.plain_codecs[-1] == CRC else 0
        want = {rel.removeprefix(lead): p for rel, p in walk_files(plain).items() if rel != "zarr.json"}
        got = {rel: p for rel, p in walk_files(m.path / case_path(name)).items() if not rel.startswith(".z")}
        assert sorted(got) == sorted(want), name
        for rel, p in want.items():
            stored = p.read_bytes()
            assert unstamped(got[rel].read_bytes()) == unstamped(stored[:-strip] if strip else stored), (name, rel)
            compared += 1
    assert compared > 200


def test_v2_view_refuses_what_v2_cannot_express(tmp_path, mount):
    import zarr

    root = tmp_path / "store"
    write_group(root)
    # A transpose that is neither C nor F order has no v2 equivalent.
    odd = ZCase((6, 6, 10), "uint8", (6, 6, 10), [codec("transpose", order=[1, 0, 2]),
                                                     sharding((3, 2, 5), [BYTES_LE])],
                (2, 3, 5), [codec("transpose", order=[1, 0, 2]), BYTES_LE], holes=False)
    write_case(tmp_path / "w", "odd", odd)
    os.rename(tmp_path / "w" / "sharded" / "odd", root / "odd")
    ok = ZCase((8,), "uint8", (8,), [sharding((4,), [BYTES_LE])], (4,), [BYTES_LE], holes=False)
    data = write_case(tmp_path / "w", "ok", ok)
    os.rename(tmp_path / "w" / "sharded" / "ok", root / "ok")
    m = mount(root, "--view", "zarr2")
    assert sorted(os.listdir(m.path)) == [".zgroup", "ok"]
    assert not (m.path / "odd").exists()
    np.testing.assert_array_equal(read_with_zarr2(m.path / "ok", tmp_path / "ok.npy"), data)
    assert "odd/zarr.json" in m.log_text() and "neither C nor F" in m.log_text()
    # The v3 view shows it unsharded (any transpose is fine there).
    m3 = mount(root)
    np.testing.assert_array_equal(zarr.open_array(str(m3.path / "odd"), mode="r")[...],
                                  zarr.open_array(str(root / "odd"), mode="r")[...])


def test_root_array_and_prefix(tmp_path, mount):
    """A store whose root is itself an array, named with Neuroglancer's zarr3:// prefix."""
    import zarr

    case = CASES["zarr_u8_nested"]
    data = write_case(tmp_path, "arr", case)
    m = mount(f"zarr3://{tmp_path / 'sharded' / 'arr'}")
    np.testing.assert_array_equal(zarr.open_array(str(m.path), mode="r")[...], data)
    assert_same_tree(m.path, tmp_path / "plain" / "arr", ("zarr.json",), ignore_gzip_mtime=True)
    m2 = mount(f"zarr://{tmp_path / 'sharded' / 'arr'}", "--view", "zarr2")
    assert sorted(os.listdir(m2.path))[:1] == [".zarray"]
    np.testing.assert_array_equal(read_with_zarr2(m2.path, tmp_path / "a.npy"), data)


def test_nested_lookup_without_listing(store, mount):
    """A reader that opens chunk paths directly (no listing) gets them; absent ones do not exist."""
    root, _ = store
    m = mount(root / "sharded")
    plain = root / "plain" / "zarr_u16_gzip"
    assert unstamped((m.path / "zarr_u16_gzip/c/5/3").read_bytes()) == unstamped((plain / "c/5/3").read_bytes())
    assert not (m.path / "zarr_u16_gzip/c/0/0").exists()  # missing shard
    assert not (m.path / "zarr_u16_gzip/c/10/0").exists()  # beyond the grid
    assert not (m.path / "zarr_u16_gzip/c/05/3").exists()  # not a canonical key
    assert not (m.path / "zarr_u16_gzip/c/5/10").exists()
    assert os.getxattr(m.path / "zarr_u16_gzip/c/5/3", "user.unshardfs.source") == b"zarr_u16_gzip/c/1/0"


def test_export_writes_the_unsharded_store(store, tmp_path):
    from unshardfs.testing.mounts import run_cli

    root, _ = store
    result = run_cli("export", "-q", str(root / "sharded"), str(tmp_path / "out"), timeout=300)
    assert result.returncode == 0, result.stderr
    json_files = tuple(rel for rel in walk_files(root / "plain") if rel.endswith("zarr.json"))
    assert assert_same_tree(tmp_path / "out", root / "plain", json_files, ignore_gzip_mtime=True) > 200


def test_backing_reads_per_chunk(store, mount):
    """Reading a shard's chunks costs one index read, then exactly one backing read per chunk."""
    root, _ = store
    m = mount(root / "sharded")

    def reads() -> int:
        return json.loads(os.getxattr(m.path, "user.unshardfs.stats"))["source"]["reads"]

    arr = m.path / "zarr_u16_gzip"
    (arr / "zarr.json").read_bytes()
    names = [f"c/{i}/{j}" for i in range(4, 8) for j in range(0, 4)]  # the 16 inner chunks of shard c/1/0
    before = reads()
    (arr / names[0]).read_bytes()
    assert reads() - before == 2  # the shard index, then the chunk
    before = reads()
    for name in names[1:]:
        (arr / name).read_bytes()
    assert reads() - before == len(names) - 1


def test_inspect_reports_every_sharded_array(store):
    """`inspect --json` on a Zarr store: one report per sharded array, chunk counts equal to the
    number of chunk files the unsharded writer produced."""
    from unshardfs.testing.mounts import run_cli

    root, _ = store
    result = run_cli("inspect", "--json", "-q", str(root / "sharded"), timeout=120)
    assert result.returncode == 0, result.stderr
    reports = {r["key"]: r for r in json.loads(result.stdout)}
    assert sorted(reports) == sorted(case_path(name) for name in CASES)
    for name in CASES:
        plain = [rel for rel in walk_files(root / "plain" / case_path(name)) if rel != "zarr.json"]
        report = reports[case_path(name)]
        assert report["chunks"] == len(plain), name
        assert 0 < report["shards_present"] < report["shards_expected"], name  # holes: a missing shard


ZARR2_VALUES = (
    "import json, sys, zarr\n"
    "assert zarr.__version__.startswith('2.'), zarr.__version__\n"
    "g = zarr.open_group(sys.argv[1], mode='r')\n"
    "print(json.dumps({name: g[name][...].tolist() for name in sys.argv[2:]}))\n"
)


@pytest.mark.legacy
@pytest.mark.filterwarnings("ignore:Numcodecs codecs are not in the Zarr version 3")
def test_v2_view_shows_strings_and_delta(tmp_path, mount):
    """Sharded vlen-utf8 strings and numcodecs.delta arrays (zarr-python 3) read back through the zarr2
    view with zarr-python 2 as zarr-python 3 reads the store; what v2 cannot express stays out, and
    `inspect` lists it with why."""
    import subprocess

    import zarr
    from zarr.codecs.numcodecs import Delta

    from unshardfs.testing.mounts import run_cli
    from unshardfs.testing.zarr import ZARR2_PYTHON

    root = tmp_path / "store.zarr"
    group = zarr.create_group(str(root))
    words = zarr.create_array(group.store, name="words", shape=(7,), chunks=(2,), shards=(4,), dtype=str)
    words[:] = ["a", "bb", "", "dddd", "é", "🚀", "x" * 300]
    grid = zarr.create_array(group.store, name="grid", shape=(3, 4), chunks=(1, 2), shards=(2, 4), dtype=str,
                             fill_value="")
    grid[:2] = [["p", "q", "r", "s"], ["t", "u", "v", "w"]]  # the last row never written: fill values
    deltas = zarr.create_array(group.store, name="delta", shape=(10,), chunks=(2,), shards=(4,), dtype=">u2",
                               filters=[Delta(dtype=">u2")], serializer=zarr.codecs.BytesCodec(endian="big"),
                               compressors=[zarr.codecs.GzipCodec()])
    deltas[:] = [1, 5, 3, 7, 9, 2, 65535, 0, 8, 8]
    odd = zarr.create_array(group.store, name="odd", shape=(2, 2, 2), chunks=(2, 2, 2), dtype="int32",
                            filters=[zarr.codecs.TransposeCodec(order=[1, 0, 2]), Delta(dtype="int32")],
                            compressors=None)
    odd[:] = np.arange(8).reshape(2, 2, 2)
    want = {name: zarr.open_array(str(root / name), mode="r")[...].tolist() for name in ("words", "grid", "delta")}
    m = mount(root, "--view", "zarr2")
    assert sorted(os.listdir(m.path)) == [".zgroup", "delta", "grid", "words"]
    out = subprocess.run([str(ZARR2_PYTHON), "-c", ZARR2_VALUES, str(m.path), *want], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == want
    assert "odd/zarr.json" in m.log_text() and "neither C nor F" in m.log_text()
    report = run_cli("inspect", "--json", "--view", "zarr2", str(root))
    assert report.returncode == 0, report.stderr
    left = [r for r in json.loads(report.stdout) if "reason" in r]
    assert left == [{"kind": "left out of the zarr2 view", "key": "odd",
                     "reason": "odd/zarr.json: transpose order [1, 0, 2] is neither C nor F order"}]
    text = run_cli("inspect", "-q", "--view", "zarr2", str(root)).stdout
    assert "3 sharded directories" in text and "odd/  (left out of the zarr2 view)" in text
