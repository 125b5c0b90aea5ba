"""Metadata documents beyond the limits: what a parse would build is counted before it is built.

Nesting hundreds (or 100,000) deep in any member, a 4 MB string, a number of
thousands of digits, millions of values, 50,000 scales: each is a one-line
error naming the file (from the parser, `inspect` and `mount`), the daemon's
peak memory stays near its baseline, and an error never repeats more than a
few hundred characters of what the document holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.memory import MiB, peak_rss
from unshardfs.testing.mounts import UNSHARDFS, force_unmount, run_cli
from unshardfs.util.errors import ConfigError, DataError, quote
from unshardfs.util.fields import MetadataError, ShallowEdit, load_json
from unshardfs.util.limits import DataLimits

ONE_LINE = 1000  # what any message may be at most (MESSAGE_LIMIT plus escapes)

INFO = {"@type": "neuroglancer_multiscale_volume", "type": "image", "data_type": "uint8", "num_channels": 1,
        "scales": [{"key": "1_1_1", "size": [64, 64, 32], "chunk_sizes": [[16, 16, 8]], "encoding": "raw",
                    "resolution": [1, 1, 1], "voxel_offset": [0, 0, 0]}]}
SHARDED = {"@type": "neuroglancer_uint64_sharded_v1", "hash": "identity", "preshift_bits": 0, "minishard_bits": 0,
           "shard_bits": 0, "minishard_index_encoding": "raw", "data_encoding": "raw"}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def with_member(doc: dict, name: str, raw_value: bytes) -> bytes:
    """`doc` with one more member whose JSON text is `raw_value` (built as bytes: json.dumps
    itself cannot write a tree 100,000 deep)."""
    return json.dumps(doc).encode()[:-1] + b', "' + name.encode() + b'": ' + raw_value + b"}"


HOSTILE = {
    "nested 600 deep in an unused member": with_member(INFO, "extra", nested(600)),
    "nested 100,000 deep": with_member(INFO, "extra", nested(100_000)),
    "objects nested 150 deep": with_member(INFO, "extra", b'{"a":' * 150 + b"1" + b"}" * 150),
    "a 4 MB string": with_member(INFO, "extra", json.dumps("x" * (4 << 20)).encode()),
    "a 5,000 digit integer": with_member(INFO, "extra", b"9" * 5000),
    "a 200 digit float": with_member(INFO, "extra", b"1." + b"5" * 200),
    "3,000,000 empty lists": with_member(INFO, "extra", b"[" + b",".join([b"[]"] * 3_000_000) + b"]"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_document_is_one_short_line(case):
    with pytest.raises(MetadataError) as caught:
        load_json(HOSTILE[case], "a/zarr.json")
    text = str(caught.value)
    assert text.startswith("a/zarr.json: ") and "\n" not in text and len(text) < ONE_LINE, text[:2000]


def test_limits_are_options_and_say_so():
    """The caps a user may need raised are options, and the error names them; consolidated
    metadata of 20,000 arrays (about 700,000 values) is within the defaults."""
    array = {"zarr_format": 3, "node_type": "array", "shape": [100, 64, 30], "data_type": "float32",
             "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [16, 32, 10]}},
             "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}}, "fill_value": 0,
             "dimension_names": ["z", "y", "x"], "attributes": {"units": "nm", "note": "n" * 100},
             "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]}
    group = {"zarr_format": 3, "node_type": "group",
             "consolidated_metadata": {"kind": "inline", "metadata": {f"a{i}": array for i in range(20_000)}}}
    parsed = load_json(json.dumps(group).encode(), "zarr.json")
    assert len(parsed["consolidated_metadata"]["metadata"]) == 20_000  # type: ignore[index]
    doc = json.dumps({"a": list(range(2000))}).encode()
    load_json(doc, "zarr.json")
    with pytest.raises(MetadataError, match="--max-metadata-values"):
        load_json(doc, "zarr.json", DataLimits(metadata_values=1000))
    with pytest.raises(MetadataError, match="--max-metadata-size"):
        load_json(doc, "zarr.json", DataLimits(metadata_bytes=1000))


def test_errors_quote_little_of_untrusted_text():
    """However a call site builds its message, an error is one line of a few hundred characters."""
    huge = "v" * (4 << 20) + "\n"
    for error in (ConfigError(f"{huge}!r"), DataError(huge, huge), MetadataError(huge, huge)):
        assert len(str(error)) < ONE_LINE and "\n" not in str(error)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    for value in (deep, {str(i): i for i in range(1_000_000)}, huge, 10**5000):
        assert len(quote(value)) <= 210


def test_zarr_member_of_a_megabyte_is_a_short_error(tmp_path):
    """A 900 KB codec name (below the string limit, so parsed) in a zarr.json: the error quotes
    a few hundred characters of it."""
    meta = {"zarr_format": 3, "node_type": "array", "shape": [4], "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}},
            "codecs": [{"name": "c" * 900_000}]}
    (tmp_path / "zarr.json").write_text(json.dumps(meta))
    result = run_cli("inspect", str(tmp_path), "--view", "zarr2")
    assert result.returncode == 1 and len(result.stderr) < ONE_LINE, result.stderr[:2000]


def test_shallow_edit_shares_what_it_does_not_change():
    raw = {"scales": [{"key": "a", "sharding": {"x": 1}, "big": [1, 2]}, {"key": "b"}], "other": {"deep": [1]}}
    shown = ShallowEdit(raw)
    del shown.at("scales", 0)["sharding"]
    shown.at("scales", 0)["key"] = "z"
    assert raw["scales"][0] == {"key": "a", "sharding": {"x": 1}, "big": [1, 2]}  # the original is untouched
    assert shown.root == {"scales": [{"key": "z", "big": [1, 2]}, {"key": "b"}], "other": {"deep": [1]}}
    assert shown.root["other"] is raw["other"] and shown.root["scales"][1] is raw["scales"][1]
    assert shown.root["scales"][0]["big"] is raw["scales"][0]["big"]


# -- through the command line ------------------------------------------------------------


@pytest.mark.parametrize("depth", [600, 100_000])
def test_inspect_prints_one_line_for_deep_nesting(tmp_path, depth):
    (tmp_path / "info").write_bytes(with_member(INFO, "unused", nested(depth)))
    result = run_cli("inspect", str(tmp_path))
    assert result.returncode == 1, result.stdout
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert "info: is nested" in result.stderr


def test_mount_error_names_the_file_not_the_mountpoint(tmp_path):
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    (src / "info").write_bytes(with_member(INFO, "unused", nested(600)))
    try:
        result = run_cli("mount", str(src), str(mnt), "--log-file", str(tmp_path / "log"))
    finally:
        force_unmount(mnt)
    assert result.returncode != 0
    assert "info: is nested" in result.stderr and "cannot mount on" not in result.stderr, result.stderr[-3000:]


# Runs the CLI and, however it ends, writes its own peak resident set last on stderr: that of
# this process image only (a child's ru_maxrss also counts the test process it was forked from).
_REPORTING_PEAK = """
import re, runpy, sys
sys.argv[0] = "unshardfs"
try:
    runpy.run_module("unshardfs", run_name="__main__", alter_sys=True)
finally:
    status = open("/proc/self/status").read()
    sys.stderr.write("\\nVmHWM " + re.search(r"VmHWM:\\s+(\\d+) kB", status)[1] + "\\n")
"""


def _max_rss_mib(args: list[str], timeout: float = 120) -> tuple[float, int | None, str]:
    """Run the CLI with `args` (a mount meant to fail); its peak resident set (MiB), exit status
    (None if it was still running at `timeout` and was killed: it mounted) and stderr."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([UNSHARDFS[0], "-c", _REPORTING_PEAK, *args], stdout=subprocess.DEVNULL,
                                stderr=err)
        peak, killed = 0.0, False
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            with contextlib.suppress(OSError, AssertionError):  # the running image's, if it is killed
                peak = max(peak, peak_rss(proc.pid) / MiB)
            if time.monotonic() > deadline and not killed:
                killed = True
                proc.kill()
            time.sleep(0.05)
        err.seek(0)
        stderr = err.read(1 << 20).decode(errors="replace")
    reported = re.search(r"\nVmHWM (\d+)\n$", stderr)
    if reported:
        peak = max(peak, int(reported[1]) / 1024)
        stderr = stderr[:reported.start()] + "\n"
    return peak, (None if killed else proc.returncode), stderr


def big_infos() -> dict[str, bytes]:
    """16 MB `info` files with 50,000 scales: sharded ones (too many values to parse at all),
    and small unsharded ones (parsed, then refused for their count)."""
    sharded = [dict(INFO["scales"][0], key=f"s{i}", sharding=SHARDED, pad="p" * 20) for i in range(50_000)]
    plain = [dict(INFO["scales"][0], key=f"s{i}" + "k" * 200) for i in range(50_000)]
    return {"sharded": json.dumps(dict(INFO, scales=sharded)).encode(),
            "plain": json.dumps(dict(INFO, scales=plain)).encode()}


@pytest.mark.parametrize("kind", ["sharded", "plain"])
def test_info_with_50000_scales_bounded_memory(tmp_path, kind):
    """The mount refuses it in one line, and its peak memory stays within 50 MiB of a mount that
    fails on a tiny info (on the code before these limits: ~700 MB)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    tiny, big = tmp_path / "tiny", tmp_path / "big"
    tiny.mkdir()
    big.mkdir()
    (tiny / "info").write_text(json.dumps(dict(INFO, scales=5)))
    raw = big_infos()[kind]
    assert len(raw) > 16 << 20
    (big / "info").write_bytes(raw)
    try:
        base, base_status, _ = _max_rss_mib(["mount", str(tiny), str(mnt), "--foreground"])
        peak, status, stderr = _max_rss_mib(["mount", str(big), str(mnt), "--foreground"])
    finally:
        force_unmount(mnt)
    assert base_status not in (0, None) and status not in (0, None), f"exit {status}, peak {peak:.0f} MiB"
    assert "info" in stderr and "Traceback" not in stderr and len(stderr) < ONE_LINE, stderr[-3000:]
    assert peak - base < 50, f"peak {peak:.0f} MiB against a baseline of {base:.0f} MiB"
