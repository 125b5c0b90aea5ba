"""WKW datasets written by the reference library (`wkw`), with their voxels and an unsharded twin.

Each layer's voxels are a numpy array per mag (x, y, z, channel) over the
files it writes; the `wkw` package writes them file by file (whole files, as
its LZ4 writer requires; a raw file is the same either way), leaving some
files of the bounding box unwritten (absent chunks). The twin is written by
TensorStore's `neuroglancer_precomputed` driver over exactly the regions of
the files that exist, with `store_data_equal_to_fill_value` so it stores the
all-zero blocks WKW stores too: the twin then has exactly the chunk files
the mount must show.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

wkw = pytest.importorskip("wkw")  # no wheel for Linux on aarch64 and others (see pyproject.toml)

BLOCK = 8  # voxels per block edge (webKnossos writes 32; small keeps the tests fast)
FILE = 2  # blocks per file edge
SPAN = BLOCK * FILE
BLOCK_TYPES = {"raw": wkw.Header.BLOCK_TYPE_RAW, "lz4": wkw.Header.BLOCK_TYPE_LZ4,
               "lz4hc": wkw.Header.BLOCK_TYPE_LZ4HC}


@dataclass
class LayerSpec:
    name: str
    category: str  # color | segmentation
    dtype: str
    channels: int
    block_type: str
    top_left: tuple[int, int, int]
    extent: tuple[int, int, int]
    mags: tuple[tuple[int, int, int], ...] = ((1, 1, 1), (2, 2, 1))
    skip_file: tuple[int, int, int] | None = (1, 0, 0)  # a file of mag 1 left unwritten (absent chunks)
    largest_segment_id: int | None = None


@dataclass
class MagData:
    mag: tuple[int, int, int]
    key: str  # the scale key (the mag's directory name)
    voxels: np.ndarray  # x, y, z, channel over [offset, offset + size): what the view shows
    offset: tuple[int, int, int]  # block-aligned voxel offset of the view
    files: list[tuple[int, int, int]]  # the .wkw files written

    @property
    def size(self) -> tuple[int, int, int]:
        return self.voxels.shape[:3]  # type: ignore[return-value]


@dataclass
class WkwData:
    root: Path
    twin: Path
    voxel_size: tuple[float, float, float]
    layers: dict[str, list[MagData]] = field(default_factory=dict)


def mag_name(mag: tuple[int, int, int]) -> str:
    return str(mag[0]) if len(set(mag)) == 1 else "-".join(map(str, mag))


def _values(rng: np.random.Generator, spec: LayerSpec, shape: tuple[int, ...]) -> np.ndarray:
    dtype = np.dtype(spec.dtype)
    if spec.category == "segmentation":
        # Few labels in runs, with ids beyond 32 bits for uint64.
        ids = rng.integers(1, 6, size=shape, dtype=np.int64)
        base = (1 << 40) if dtype.itemsize == 8 else 1000 % (1 << (8 * dtype.itemsize))
        return (ids + base).astype(dtype)
    if dtype.kind == "f":
        return rng.random(shape, dtype=np.float32).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def write_layer(root: Path, spec: LayerSpec, rng: np.random.Generator) -> list[MagData]:
    out = []
    for mag in spec.mags:
        lo = np.array(spec.top_left) // mag
        hi = -(-(np.array(spec.top_left) + spec.extent) // mag)
        offset = lo - lo % BLOCK
        first, last = offset // SPAN, (hi - 1) // SPAN
        size = hi - offset
        voxels = np.zeros(tuple(size) + (spec.channels,), dtype=spec.dtype)
        inside = tuple(slice(int(a - o), int(b - o)) for a, b, o in zip(lo, hi, offset))
        voxels[inside] = _values(rng, spec, tuple(int(b - a) for a, b in zip(lo, hi)) + (spec.channels,))
        header = wkw.Header(np.dtype(spec.dtype).type, num_channels=spec.channels, block_len=BLOCK, file_len=FILE,
                            block_type=BLOCK_TYPES[spec.block_type])
        files = []
        with wkw.Dataset.create(str(root / spec.name / mag_name(mag)), header) as ds:
            for fz in range(first[2], last[2] + 1):
                for fy in range(first[1], last[1] + 1):
                    for fx in range(first[0], last[0] + 1):
                        f = (fx, fy, fz)
                        if mag == (1, 1, 1) and f == spec.skip_file:
                            voxels[_file_region(f, offset, size)] = 0  # never written: absent, read as 0
                            continue
                        cube = np.zeros((SPAN, SPAN, SPAN, spec.channels), dtype=spec.dtype)
                        region = _file_region(f, offset, size)
                        dst = tuple(slice(s.start + o - c * SPAN, s.stop + o - c * SPAN)
                                    for s, o, c in zip(region, offset, f))
                        cube[dst] = voxels[region]
                        ds.write(tuple(c * SPAN for c in f), np.ascontiguousarray(cube.transpose(3, 0, 1, 2)))
                        files.append(f)
        out.append(MagData(mag, mag_name(mag), voxels, tuple(int(v) for v in offset), files))  # type: ignore[arg-type]
    return out


def _file_region(f: tuple[int, int, int], offset: np.ndarray, size: np.ndarray) -> tuple[slice, ...]:
    """The part of the view's array (indexes from `offset`) that file `f` covers."""
    return tuple(slice(max(c * SPAN - o, 0), min((c + 1) * SPAN - o, s)) for c, o, s in zip(f, offset, size))


def properties(spec_layers: list[LayerSpec], voxel_size: tuple[float, float, float], old_schema: bool) -> dict:
    layers = []
    for spec in spec_layers:
        layer: dict = {"name": spec.name, "category": spec.category, "dataFormat": "wkw",
                       "boundingBox": {"topLeft": list(spec.top_left), "width": spec.extent[0],
                                       "height": spec.extent[1], "depth": spec.extent[2]},
                       "elementClass": "uint24" if spec.channels == 3 and spec.dtype == "uint8" else spec.dtype}
        if old_schema:  # webknossos-libs before mags: wkwResolutions with resolution (an int when isotropic)
            layer["wkwResolutions"] = [{"resolution": m[0] if len(set(m)) == 1 else list(m), "cubeLength": SPAN}
                                       for m in spec.mags]
        else:
            layer["numChannels"] = spec.channels
            layer["mags"] = [{"mag": list(m), "path": f"./{spec.name}/{mag_name(m)}"} for m in spec.mags]
        if spec.category == "segmentation":
            layer["largestSegmentId"] = spec.largest_segment_id
        layers.append(layer)
    scale = list(voxel_size) if old_schema else {"factor": list(voxel_size), "unit": "nanometer"}
    return {"id": {"name": "test", "team": ""}, "scale": scale, "dataLayers": layers}


def write_twin(twin: Path, spec: LayerSpec, mags: list[MagData], voxel_size: tuple[float, float, float]) -> None:
    """TensorStore writes each scale over the regions of the WKW files that exist."""
    for i, m in enumerate(mags):
        resolution = [v * f for v, f in zip(voxel_size, m.mag)]
        store = ts.open({
            "driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(twin / spec.name)},
            "create": True, "open": i > 0, "store_data_equal_to_fill_value": True,
            "multiscale_metadata": {"type": "segmentation" if spec.category == "segmentation" else "image",
                                    "data_type": spec.dtype, "num_channels": spec.channels},
            "scale_metadata": {"key": m.key, "size": list(m.size), "voxel_offset": list(m.offset),
                               "resolution": resolution, "chunk_size": [BLOCK] * 3, "encoding": "raw"},
        }).result()
        for f in m.files:
            region = _file_region(f, np.array(m.offset), np.array(m.size))
            if any(s.stop <= s.start for s in region):
                continue
            target = tuple(slice(s.start + o, s.stop + o) for s, o in zip(region, m.offset))
            store[target].write(m.voxels[region]).result()
    info_path = twin / spec.name / "info"
    info = json.loads(info_path.read_text())
    if spec.largest_segment_id is not None:
        info["largest_segment_id"] = spec.largest_segment_id
    info_path.write_text(json.dumps(info))


def write_dataset(root: Path, twin: Path, specs: list[LayerSpec], old_schema: bool = False,
                  voxel_size: tuple[float, float, float] = (11.24, 11.24, 25.0), seed: int = 0) -> WkwData:
    rng = np.random.default_rng(seed)
    data = WkwData(root, twin, voxel_size)
    for spec in specs:
        data.layers[spec.name] = write_layer(root, spec, rng)
        write_twin(twin, spec, data.layers[spec.name], voxel_size)
    props = json.dumps(properties(specs, voxel_size, old_schema), indent=2)
    (root / "datasource-properties.json").write_text(props)
    (twin / "datasource-properties.json").write_text(props)  # passed through unchanged
    return data


# Bounding boxes that start off the block grid and end inside their last file.
MIXED = [
    LayerSpec("color", "color", "uint8", 3, "raw", (5, 8, 16), (40, 27, 20), skip_file=(1, 0, 2)),
    LayerSpec("segmentation", "segmentation", "uint64", 1, "lz4hc", (16, 0, 3), (30, 33, 18),
              mags=((1, 1, 1), (2, 2, 2)), largest_segment_id=(1 << 40) + 5),
]
OLD = [
    LayerSpec("em", "color", "uint16", 1, "lz4", (0, 0, 0), (24, 20, 17), skip_file=(0, 1, 0)),
    LayerSpec("seg32", "segmentation", "uint32", 1, "raw", (8, 8, 8), (20, 20, 20), mags=((1, 1, 1),),
              largest_segment_id=1005),
    LayerSpec("small", "color", "uint8", 1, "lz4", (3, 3, 3), (10, 9, 8), mags=((1, 1, 1),), skip_file=None),
]


def copy_dataset(data: WkwData, dest: Path) -> Path:
    shutil.copytree(data.root, dest)
    return dest
