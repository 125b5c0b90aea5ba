"""Sharded OME-Zarr 0.5 written by two independent writers (ome-zarr-py and ngff-zarr), for the tests.

Each writer returns the arrays it wrote, by path inside the store, so a test
can compare what a legacy reader gets through the zarr2 view level by level.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _image(shape: tuple[int, ...], seed: int, dtype: str = "uint16") -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 4000, size=shape).astype(dtype)


def arrays(store: Path) -> dict[str, np.ndarray]:
    """Every array of a store, by its path from the store's parent directory."""
    import zarr

    group = zarr.open_group(str(store), mode="r")
    return {f"{store.name}/{path}": np.asarray(node[...])
            for path, node in group.members(max_depth=None) if isinstance(node, zarr.Array)}


def write_ome_zarr_py(root: Path) -> dict[str, np.ndarray]:
    """An image (3 levels, sharded), a label image under labels/, and a 1-well plate, by ome-zarr-py."""
    import zarr
    from ome_zarr.format import FormatV05
    from ome_zarr.writer import write_image, write_labels, write_plate_metadata, write_well_metadata

    fmt = FormatV05()
    image = _image((2, 32, 64, 64), 1)  # c, z, y, x
    group = zarr.open_group(str(root / "image.ome.zarr"), mode="w", zarr_format=3)
    options = {"chunks": (1, 8, 16, 16), "shards": (1, 16, 32, 32)}
    write_image(image, group, scale_factors=[2, 4], axes="czyx", fmt=fmt, storage_options=options)
    labels = (image[0] // 1000).astype("uint8")
    write_labels(labels, group, name="cells", axes="zyx", fmt=fmt, scale_factors=[2, 4],
                 storage_options={"chunks": (8, 16, 16), "shards": (16, 32, 32)},
                 label_metadata={"colors": [{"label-value": 1, "rgba": [255, 0, 0, 255]}]})
    plate = zarr.open_group(str(root / "plate.ome.zarr"), mode="w", zarr_format=3)
    write_plate_metadata(plate, ["A"], ["1"], ["A/1"], fmt=fmt, field_count=1, name="plate")
    well = plate.require_group("A").require_group("1")
    write_well_metadata(well, ["0"], fmt=fmt)
    field = well.require_group("0")
    write_image(_image((16, 32, 32), 2), field, scale_factors=[2], axes="zyx", fmt=fmt,
                storage_options={"chunks": (8, 16, 16), "shards": (16, 32, 32)})
    return {**arrays(root / "image.ome.zarr"), **arrays(root / "plate.ome.zarr")}


def write_ngff_zarr(root: Path) -> dict[str, np.ndarray]:
    """A 3-level multiscale image, sharded (chunks_per_shard=2), by ngff-zarr with version 0.5."""
    import ngff_zarr

    image = ngff_zarr.to_ngff_image(_image((32, 64, 64), 3), dims=["z", "y", "x"],
                                    scale={"z": 2.0, "y": 0.5, "x": 0.5})
    multiscales = ngff_zarr.to_multiscales(image, scale_factors=[2, 4], chunks=16)
    store = root / "ngff.ome.zarr"
    ngff_zarr.to_ngff_zarr(str(store), multiscales, version="0.5", chunks_per_shard=2)
    return arrays(store)
