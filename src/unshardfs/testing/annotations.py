"""Sharded Neuroglancer annotations, with their unsharded original, for the tests.

No installable writer produces sharded annotations, so Neuroglancer's own
`AnnotationWriter` writes the unsharded set (by_id, relationships and one
spatial level), a second spatial level of several cells is added with the
writer's own record encoding, and every index is repacked into shards with
TensorStore's `neuroglancer_uint64_sharded` kvstore (keys: 8-byte big-endian
ids, or the compressed Morton code of a spatial cell, computed with
Neuroglancer's reader's own function).
"""

from __future__ import annotations

import functools
import json
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np

KINDS = ("point", "line", "axis_aligned_bounding_box", "ellipsoid")
NAMES = ("x", "y", "z", "t")


def _writer(kind: str, rank: int) -> Any:
    import neuroglancer
    from neuroglancer.write_annotations import AnnotationWriter

    space = neuroglancer.CoordinateSpace(names=list(NAMES[:rank]), units=["nm"] * rank, scales=[4.0] * rank)
    properties = [neuroglancer.AnnotationPropertySpec(id="score", type="float32"),
                  neuroglancer.AnnotationPropertySpec(id="kind", type="uint8")]
    return AnnotationWriter(coordinate_space=space, annotation_type=kind, relationships=["segment", "partner"],
                            properties=properties)


def _add(writer: Any, kind: str, rank: int, rng: np.random.Generator, n: int) -> None:
    for i in range(n):
        a = rng.uniform(0, 100, rank)
        b = a + rng.uniform(1, 10, rank)
        extra = {"id": int(rng.integers(1, 1 << 62)) if i % 3 else i + 1, "score": float(rng.random()),
                 "kind": int(rng.integers(0, 4)), "segment": [int(rng.integers(1, 12))],
                 "partner": [int(s) for s in rng.integers(1, 1 << 40, size=int(rng.integers(0, 3)))]}
        if kind == "point":
            writer.add_point(a, **extra)
        elif kind == "line":
            writer.add_line(a, b, **extra)
        elif kind == "axis_aligned_bounding_box":
            writer.add_axis_aligned_bounding_box(a, b, **extra)
        else:
            writer.add_ellipsoid(a, b - a, **extra)


def _spatial_level(writer: Any, path: Path, info: dict[str, Any], grid: list[int]) -> None:
    """A level of several cells: each annotation in the cell of its first point."""
    lower, upper = np.asarray(info["lower_bound"]), np.asarray(info["upper_bound"])
    size = np.maximum((upper - lower) / np.asarray(grid), 1e-3)
    cells: dict[tuple[int, ...], list[Any]] = {}
    for annotation in writer.annotations:
        point = np.frombuffer(annotation.encoded[:4 * len(grid)], dtype="<f4")
        cell = tuple(int(c) for c in np.clip(((point - lower) // size).astype(int), 0, np.asarray(grid) - 1))
        cells.setdefault(cell, []).append(annotation)
    (path / "spatial1").mkdir()
    for cell, members in cells.items():
        with open(path / "spatial1" / "_".join(map(str, cell)), "wb") as f:
            writer._serialize_annotations(f, members)  # the writer's own multi-annotation encoding
    info["spatial"].append({"key": "spatial1", "grid_shape": grid, "chunk_size": size.tolist(),
                            "limit": max(len(a) for a in cells.values())})


def _pack(plain_dir: Path, sharded_dir: Path, spec: dict[str, Any], key_of: Callable[[str], bytes]) -> None:
    import tensorstore as ts

    store = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{sharded_dir}/",
                             "metadata": spec}).result()
    with ts.Transaction() as txn:
        for f in sorted(plain_dir.iterdir()):
            store.with_transaction(txn)[key_of(f.name)] = f.read_bytes()


def _cell_key(name: str, shape: list[int]) -> bytes:
    """A spatial cell's shard key: Neuroglancer's compressed Morton code of `i_j_k`, big-endian."""
    from neuroglancer.read_precomputed_annotations import _zorder_compressed

    return struct.pack(">Q", int(_zorder_compressed(np.array([int(c) for c in name.split("_")]), np.array(shape))))


def write_annotation_set(root: Path, kind: str, rank: int, spec: dict[str, Any], n: int = 60, seed: int = 0) -> dict[str, Path]:
    """`root/plain` (Neuroglancer's unsharded writer, plus a multi-cell spatial level) and
    `root/sharded` (every index repacked into shards with `spec`)."""
    writer = _writer(kind, rank)
    _add(writer, kind, rank, np.random.default_rng(seed), n)
    plain, sharded = root / "plain", root / "sharded"
    for path in (plain, sharded):
        shutil.rmtree(path, ignore_errors=True)
    writer.write(plain)
    info = json.loads((plain / "info").read_text())
    grid = [2, 3] + [2] * (rank - 2) if rank >= 2 else [3]
    _spatial_level(writer, plain, info, grid)
    (plain / "info").write_text(json.dumps(info))
    sharded.mkdir(parents=True)
    shown = json.loads(json.dumps(info))
    by_id = lambda name: struct.pack(">Q", int(name))  # noqa: E731 - one-line key encoders
    indexes = [(info["by_id"], shown["by_id"], by_id)]
    indexes += [(rel, shown["relationships"][i], by_id) for i, rel in enumerate(info["relationships"])]
    for i, level in enumerate(info["spatial"]):
        shape = level["grid_shape"]
        indexes.append((level, shown["spatial"][i], functools.partial(_cell_key, shape=shape)))
    for index, shown_index, key_of in indexes:
        _pack(plain / index["key"], sharded / index["key"], spec, key_of)
        shown_index["sharding"] = spec
    (sharded / "info").write_text(json.dumps(shown))
    return {"plain": plain, "sharded": sharded}
