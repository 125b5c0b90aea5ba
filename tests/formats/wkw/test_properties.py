"""datasource-properties.json in the schemas webknossos-libs has written, and what is refused."""

from __future__ import annotations

import copy

import pytest

from unshardfs.formats.wkw.properties import Mag, has_wkw_layers, parse_mag, parse_properties
from unshardfs.util.fields import MetadataError

BOX = {"topLeft": [1, 2, 3], "width": 10, "height": 20, "depth": 30}


def layer(**extra) -> dict:
    return {"name": "color", "category": "color", "dataFormat": "wkw", "boundingBox": copy.deepcopy(BOX),
            "elementClass": "uint8", **extra}


def test_mags_in_every_spelling():
    assert parse_mag(2, "m") == (2, 2, 2) and parse_mag("2-2-1", "m") == (2, 2, 1) and parse_mag("4", "m") == (4, 4, 4)
    assert parse_mag([1, 2, 4], "m") == (1, 2, 4)
    for bad in (0, "2-2", "x", [1, 2], [0, 1, 1], True, None, 1 << 30):
        with pytest.raises(MetadataError):
            parse_mag(bad, "m")


def test_old_schema():
    """wkwResolutions with `resolution` (int or list), scale as a list, largestSegmentId -1 = unknown."""
    raw = {"scale": [11.24, 11.24, 28], "dataLayers": [
        layer(wkwResolutions=[{"resolution": 2, "cubeLength": 1024}, {"resolution": [1, 1, 1], "cubeLength": 1024}]),
        layer(name="seg", category="segmentation", largestSegmentId=-1, wkwResolutions=[{"resolution": 1}])]}
    voxel, layers = parse_properties(raw)
    assert voxel == (11.24, 11.24, 28.0)
    assert [m.factors for m in layers[0].mags] == [(1, 1, 1), (2, 2, 2)]  # finest first
    assert layers[0].top_left == (1, 2, 3) and layers[0].extent == (10, 20, 30)
    assert layers[1].largest_segment_id is None


def test_new_schema():
    """mags with `mag` and `path`, scale as {factor, unit}; non-WKW layers are not ours."""
    raw = {"scale": {"factor": [4, 4, 40], "unit": "nanometer"}, "dataLayers": [
        layer(name="seg", category="segmentation", largestSegmentId=123,
              mags=[{"mag": [2, 2, 1], "path": "./seg/2-2-1"}, {"mag": [1, 1, 1], "path": "gs://elsewhere/seg/1"}]),
        {"name": "zarr-layer", "category": "color", "dataFormat": "zarr3", "boundingBox": BOX, "mags": []}]}
    voxel, layers = parse_properties(raw)
    assert voxel == (4.0, 4.0, 40.0) and [lyr.name for lyr in layers] == ["seg"]
    assert layers[0].mags == (Mag((1, 1, 1), None), Mag((2, 2, 1), "seg/2-2-1"))  # remote paths are not read
    assert layers[0].largest_segment_id == 123 and Mag((2, 2, 1)).name == "2-2-1" and Mag((2, 2, 2)).name == "2"
    assert has_wkw_layers(raw) and not has_wkw_layers({"dataLayers": [raw["dataLayers"][1]]})


@pytest.mark.parametrize("change,where", [
    (lambda r: r["dataLayers"][0].update(name="../x"), "dataLayers[0].name"),
    (lambda r: r["dataLayers"][0].update(category="mesh"), "dataLayers[0].category"),
    (lambda r: r["dataLayers"][0]["boundingBox"].update(topLeft=[-1, 0, 0]), "boundingBox.topLeft"),
    (lambda r: r["dataLayers"][0].update(wkwResolutions=[]), "dataLayers[0].mags"),
    (lambda r: r.update(scale=[1, 0, 1]), "scale"),
    (lambda r: r.update(scale={"factor": "big"}), "scale.factor"),
    (lambda r: r["dataLayers"].append(copy.deepcopy(r["dataLayers"][0])), "same name"),
])
def test_refused(change, where):
    raw = {"scale": [1, 1, 1], "dataLayers": [layer(wkwResolutions=[{"resolution": 1}])]}
    change(raw)
    with pytest.raises(MetadataError, match=where.replace("[", r"\[").replace("]", r"\]")):
        parse_properties(raw)
