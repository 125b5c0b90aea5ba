"""Zarr v3 arrays written by zarr-python 3 and TensorStore, each with an unsharded twin.

A case is the metadata of a sharded array and the codec chain an unsharded
writer would use; both arrays get the same data from the same writer, so a
test can compare the mount's chunk files with real unsharded chunk files.
Data has holes (regions equal to the fill value) so that inner chunks are
empty and whole shards are missing, as in real sparse volumes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# zarr-python 2 lives in a venv of its own (scripts/setup makes it at the
# repository root); UNSHARDFS_ZARR2_PYTHON points elsewhere.
ZARR2_PYTHON = Path(os.environ.get("UNSHARDFS_ZARR2_PYTHON")
                    or Path(__file__).resolve().parents[3] / ".venv-zarr2" / "bin" / "python")
# Debian's packaged zarr 2.13 with numcodecs 0.11 (apt-get install python3-zarr; scripts/setup does), run by
# the system Python: the oldest v2 reader people have, which knows fewer codec parameters.
DEBIAN_ZARR_PYTHON = Path(os.environ.get("UNSHARDFS_DEBIAN_ZARR_PYTHON") or "/usr/bin/python3")


def codec(name: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "configuration": config} if config else {"name": name}


BYTES_LE = codec("bytes", endian="little")
BYTES_BE = codec("bytes", endian="big")
CRC = codec("crc32c")


def sharding(chunk_shape: Sequence[int], codecs: Sequence[dict[str, Any]],
             index_codecs: Sequence[dict[str, Any]] = (BYTES_LE, CRC), location: str = "end") -> dict[str, Any]:
    return codec("sharding_indexed", chunk_shape=list(chunk_shape), codecs=list(codecs),
                 index_codecs=list(index_codecs), index_location=location)


@dataclass
class ZCase:
    shape: tuple[int, ...]
    dtype: str
    shard_shape: tuple[int, ...]
    codecs: list[Any]  # of the sharded array
    plain_chunks: tuple[int, ...]  # inner chunk shape in array order
    plain_codecs: list[Any]  # what an unsharded writer uses
    writer: str = "zarr"  # or "tensorstore"
    fill_value: object = 0
    key_encoding: dict[str, Any] = field(default_factory=lambda: codec("default", separator="/"))
    attributes: dict[str, Any] = field(default_factory=dict[str, Any])
    dimension_names: list[Any] | None = None
    holes: bool = True

    def metadata(self, sharded: bool) -> dict[str, Any]:
        meta = {
            "zarr_format": 3, "node_type": "array", "shape": list(self.shape), "data_type": self.dtype,
            "chunk_grid": codec("regular", chunk_shape=list(self.shard_shape if sharded else self.plain_chunks)),
            "chunk_key_encoding": self.key_encoding, "fill_value": self.fill_value,
            "codecs": self.codecs if sharded else self.plain_codecs, "attributes": self.attributes,
        }
        if self.dimension_names is not None:
            meta["dimension_names"] = self.dimension_names
        return meta


def case_data(case: ZCase, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(case.dtype)
    if dt.kind == "f":
        data = rng.standard_normal(case.shape).astype(dt)
    elif dt.kind == "b":
        data = rng.integers(0, 2, size=case.shape).astype(bool)
    else:
        info = np.iinfo(dt)
        data = rng.integers(max(info.min, -1000), min(info.max, 2**31 - 1), size=case.shape, endpoint=True).astype(dt)
    if case.holes and data.ndim:
        fill = np.nan if case.fill_value == "NaN" else case.fill_value
        # The first shard along axis 0 empty (a missing shard), and one inner
        # chunk-sized corner of the last shard (an empty index entry).
        data[tuple(slice(0, s) for s in case.shard_shape[:1])] = fill
        data[tuple(slice(s - min(s, c), s) if i == 0 else slice(0, c)
                   for i, (s, c) in enumerate(zip(case.shape, case.plain_chunks)))] = fill
    return data


class _Epoch:
    """Stands in for the `time` module inside `gzip`: gzip stamps the current
    time into every member, so two writes of the same data a second apart
    (and any crc32c over them) would differ."""

    @staticmethod
    def time() -> float:
        return 0.0


def _write_zarr(path: Path, meta: dict[str, Any], data: np.ndarray) -> None:
    import gzip
    from unittest import mock

    import zarr

    path.mkdir(parents=True)
    (path / "zarr.json").write_text(json.dumps(meta))
    array = zarr.open_array(str(path), mode="r+")
    with mock.patch.object(gzip, "time", _Epoch):
        array[...] = data


def _write_tensorstore(path: Path, meta: dict[str, Any], data: np.ndarray) -> None:
    import tensorstore as ts

    members = {k: v for k, v in meta.items() if k not in ("zarr_format", "node_type")}
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}, "metadata": members},
                    create=True, delete_existing=True).result()
    store[...] = data


def write_case(root: Path, name: str, case: ZCase, seed: int = 0) -> np.ndarray:
    """Write `root/sharded/<name>` and `root/plain/<name>`; returns the data."""
    data = case_data(case, seed)
    for variant in ("sharded", "plain"):
        path = root / variant / name
        if path.exists():
            shutil.rmtree(path)
        write = _write_zarr if case.writer == "zarr" else _write_tensorstore
        write(path, case.metadata(variant == "sharded"), data)
    return data


def write_group(path: Path, attributes: dict[str, Any] | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group",
                                                "attributes": attributes or {}}))


def consolidate(path: Path) -> None:
    import warnings

    import zarr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))


def read_with_zarr2(path: Path, out: Path, consolidated: bool = False, python: Path | None = None) -> np.ndarray:
    """Read an array (or `group:array`) through zarr-python 2 in its own venv (or `python`'s)."""
    script = (
        "import sys, zarr, numpy as np\n"
        "path, out, cons = sys.argv[1], sys.argv[2], sys.argv[3] == '1'\n"
        "if ':' in path:\n"
        "    root, name = path.split(':')\n"
        "    g = zarr.open_consolidated(root, mode='r') if cons else zarr.open_group(root, mode='r')\n"
        "    a = g[name]\n"
        "else:\n"
        "    a = zarr.open_array(path, mode='r')\n"
        "assert zarr.__version__.startswith('2.'), zarr.__version__\n"
        "np.save(out, a[...])\n"
    )
    result = subprocess.run([str(python or ZARR2_PYTHON), "-c", script, str(path), str(out), "1" if consolidated else "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    array: np.ndarray = np.load(out)
    return array


__all__ = ["BYTES_BE", "BYTES_LE", "CRC", "DEBIAN_ZARR_PYTHON", "ZARR2_PYTHON", "ZCase", "codec", "consolidate", "read_with_zarr2",
           "sharding", "write_case", "write_group"]
