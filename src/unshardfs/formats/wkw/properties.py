"""`datasource-properties.json`: the layers of a webKnossos dataset, in every schema it has had.

What is read (webknossos-libs' `dataset/properties.py`, old and new):

- `scale`: the voxel size, `[x, y, z]` (older) or `{"factor": [x, y, z], "unit": ...}` (newer);
- `dataLayers[]`: `name`, `category` (`color` | `segmentation`), `dataFormat` (only `wkw` layers
  are shown), `boundingBox` `{topLeft, width, height, depth}` in mag-1 voxels, `elementClass`,
  `numChannels` (optional), `largestSegmentId` (optional, may be null);
- the mags: `wkwResolutions[]` with `resolution` (older) or `mag` (newer), or `mags[]` with `mag`
  and an optional `path`; a mag is an int, `[x, y, z]` or `"x-y-z"`.

Only what the view needs is kept; the data type and channels come from the
headers (`elementClass` names them too, but `uint24` means three uint8
channels and older files omit `numChannels`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from unshardfs.util.fields import VOXEL_LIMIT, Fields, MetadataError, as_int, as_ints, as_str

PROPERTIES = "datasource-properties.json"
MAX_MAGS = 64
Vec3 = tuple[int, int, int]
_MAG_NAME = re.compile(r"^(\d{1,9})(?:-(\d{1,9})-(\d{1,9}))?$")


@dataclass(frozen=True)
class Mag:
    factors: Vec3
    path: str | None = None  # relative to the dataset root, when the properties give one

    @property
    def name(self) -> str:
        """The directory name webKnossos writes: `2` when isotropic, else `2-2-1`."""
        x, y, z = self.factors
        return str(x) if x == y == z else f"{x}-{y}-{z}"

    @property
    def long_name(self) -> str:
        return "-".join(map(str, self.factors))


@dataclass(frozen=True)
class Layer:
    name: str
    category: str  # color | segmentation
    top_left: Vec3 | None  # mag-1 voxels; None when the bounding box is to be found from the files
    extent: Vec3 | None
    mags: tuple[Mag, ...]
    largest_segment_id: int | None = None


def parse_mag(value: object, where: str) -> Vec3:
    if isinstance(value, str):
        m = _MAG_NAME.match(value)
        if m is None:
            raise MetadataError(where, f"must be a mag like 2 or 2-2-1, got {value!r}")
        x, y, z = (int(g) if g else int(m.group(1)) for g in m.groups())
    elif isinstance(value, list):
        x, y, z = as_ints(value, where, 3, lo=1, hi=1 << 20)
    else:
        x = y = z = as_int(value, where, lo=1, hi=1 << 20)
    if min(x, y, z) < 1:
        raise MetadataError(where, "mag factors must be at least 1")
    return x, y, z


def _relative_path(value: object, where: str) -> str | None:
    """A mag's `path` if it names a directory inside the dataset (remote or absolute paths are not read)."""
    path = as_str(value, where)
    if "://" in path or path.startswith("/"):
        return None
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return "/".join(parts)


def _mags(layer: Fields) -> tuple[Mag, ...]:
    if layer.has("wkwResolutions"):
        items = list(layer.objects("wkwResolutions"))
    else:
        items = list(layer.objects("mags"))
    if not items or len(items) > MAX_MAGS:
        raise MetadataError(layer.at("mags"), f"needs 1 to {MAX_MAGS} mags, got {len(items)}")
    mags: dict[Vec3, Mag] = {}
    for item in items:
        key = "resolution" if item.has("resolution") else "mag"
        factors = parse_mag(item.get(key), item.at(key))
        path = _relative_path(item.get("path"), item.at("path")) if item.get("path") is not None else None
        mags.setdefault(factors, Mag(factors, path))
    return finest_first(mags.values())


def finest_first(mags: Iterable[Mag]) -> tuple[Mag, ...]:
    """Mags in the order of precomputed scales: finest (smallest voxel volume) first."""
    return tuple(sorted(mags, key=lambda m: (m.factors[0] * m.factors[1] * m.factors[2], m.factors)))


def voxel_size(props: Fields) -> tuple[float, float, float]:
    scale = props.get("scale")
    where = props.at("scale")
    if isinstance(scale, dict):
        scale, where = scale.get("factor"), f"{where}.factor"
    if (not isinstance(scale, list) or len(scale) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e12 for v in scale)):
        raise MetadataError(where, f"must be three positive numbers, got {scale!r}"[:200])
    return float(scale[0]), float(scale[1]), float(scale[2])


def parse_layer(layer: Fields) -> Layer | None:
    """The layer, or None when it is not stored as WKW (a Zarr or N5 layer of the same dataset)."""
    name = layer.str("name")
    if not name or "/" in name or name in (".", ".."):
        raise MetadataError(layer.at("name"), f"must be a plain directory name, got {name!r}")
    if layer.get("dataFormat", "wkw") != "wkw":
        return None
    category = layer.str("category", ("color", "segmentation"))
    box = layer.obj("boundingBox")
    top_left = box.ints("topLeft", 3, lo=0, hi=VOXEL_LIMIT)
    extent = (box.int("width", lo=0, hi=VOXEL_LIMIT), box.int("height", lo=0, hi=VOXEL_LIMIT),
              box.int("depth", lo=0, hi=VOXEL_LIMIT))
    largest = layer.get("largestSegmentId")
    if largest is not None:
        largest = as_int(largest, layer.at("largestSegmentId"), lo=-1, hi=(1 << 64) - 1)
        if largest < 0:
            largest = None  # webknossos-libs writes -1 for "unknown"
    return Layer(name, category, (top_left[0], top_left[1], top_left[2]), extent, _mags(layer),
                 largest if category == "segmentation" else None)


def parse_properties(raw: object) -> tuple[tuple[float, float, float], list[Layer]]:
    """(voxel size, the WKW layers); MetadataError when the file is not one webKnossos wrote."""
    props = Fields(raw, PROPERTIES)
    layers = [parse_layer(item) for item in props.objects("dataLayers")]
    shown = [layer for layer in layers if layer is not None]
    names = [layer.name for layer in shown]
    if len(set(names)) != len(names):
        raise MetadataError(props.at("dataLayers"), "two layers have the same name")
    return voxel_size(props), shown


def has_wkw_layers(raw: object) -> bool:
    """Whether a properties file lists any WKW layer (detection: no validation yet)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("dataLayers"), list):
        return False
    return any(isinstance(layer, dict) and layer.get("dataFormat", "wkw") == "wkw" for layer in raw["dataLayers"])
