"""Writes the versioned scenario's Zarr v3 sharded array into an Icechunk repository (run by
.venv-icechunk/bin/python, as its own process: the icechunk package pins its own zarr-python).

    icechunk_volume.py ROOT VOXELS.npy SHARD CHUNK

The array is the repository's root node (so a mount's root is the array, as for the plain and OCDBT
copies): the voxels of VOXELS.npy, chunks of CHUNK voxels a side in shards of SHARD, no compression,
one commit on branch main.
"""

from __future__ import annotations

import sys

import icechunk
import numpy as np
import zarr


def main(root: str, voxels: str, shard: int, chunk: int) -> None:
    data = np.load(voxels)
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(root))
    session = repo.writable_session("main")
    array = zarr.create_array(store=session.store, shape=data.shape, chunks=(chunk,) * data.ndim,
                              shards=(shard,) * data.ndim, dtype=data.dtype, fill_value=0, compressors=None)
    array[...] = data
    session.commit("the volume")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
