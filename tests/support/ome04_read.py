"""Read OME-Zarr images as a 0.4-era tool does (ome-zarr-py 0.11 on zarr-python 2), run in its own venv.

Usage: python ome04_read.py ROOT OUT IMAGE [IMAGE ...]
For each IMAGE (a group path under ROOT) the reader's pyramid levels are saved
as OUT/<IMAGE with '/' as '__'>__<level>.npy, and the node specs it found are
printed as JSON, so the test can compare them with the source arrays.
"""

import json
import sys
from pathlib import Path

import numpy as np
from ome_zarr.io import parse_url
from ome_zarr.reader import Reader

root, out = Path(sys.argv[1]), Path(sys.argv[2])
found = {}
for image in sys.argv[3:]:
    location = parse_url(str(root / image))
    if location is None:
        raise SystemExit(f"{image}: ome-zarr found no zarr there")
    node = list(Reader(location)())[0]
    found[image] = {"specs": [type(s).__name__ for s in node.specs], "levels": len(node.data)}
    for i, level in enumerate(node.data):
        np.save(out / f"{image.replace('/', '__')}__{i}.npy", np.asarray(level))
print(json.dumps(found))
