"""Writes a WKW dataset with webknossos-libs (run by .venv-webknossos/bin/python, as its own
program: webknossos pins versions the project's venv must not take).

Usage: webknossos_writer.py DEST ARRAYS.npz. DEST gets a dataset of a three-channel LZ4HC color
layer (mag 1, and mag 2-2-1 from webknossos' own downsampling) and a raw uint32 segmentation;
ARRAYS.npz every mag as webknossos reads it back (x, y, z, channel) with its bounding box.
"""

from __future__ import annotations

import sys

import numpy as np


def main(dest: str, arrays: str) -> None:
    import webknossos as wk
    from cluster_tools import get_executor

    rng = np.random.default_rng(7)
    ds = wk.Dataset(dest, voxel_size=(11.2, 11.2, 25.0))
    color = ds.add_layer("color", wk.COLOR_CATEGORY, dtype_per_channel="uint8", num_channels=3, data_format="wkw")
    mag = color.add_mag(1, chunk_shape=8, shard_shape=16, compress=True)
    mag.write(rng.integers(0, 255, (3, 40, 30, 20), dtype=np.uint8), absolute_offset=(5, 8, 16), allow_resize=True)
    with get_executor("sequential") as executor:
        color.downsample(coarsest_mag=wk.Mag("2-2-1"), executor=executor)
    seg = ds.add_layer("segmentation", wk.SEGMENTATION_CATEGORY, dtype_per_channel="uint32", data_format="wkw",
                       largest_segment_id=76)
    seg.add_mag(1, chunk_shape=8, shard_shape=16, compress=False).write(
        rng.integers(0, 77, (1, 20, 21, 9), dtype=np.uint32), absolute_offset=(16, 0, 3), allow_resize=True)
    out = {}
    for layer in ds.layers.values():
        for m in layer.mags.values():
            box = m.bounding_box  # in mag-1 voxels
            key = f"{layer.name}/{m.mag.to_layer_name()}"
            out[key] = np.moveaxis(m.read(), 0, -1)
            out[key + ":topleft"] = np.array(box.topleft.to_list()) // np.array(m.mag.to_list())
    np.savez(arrays, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
