"""Scenarios: each a function of a Context, registered in SCENARIOS under the name `--only` takes."""

from __future__ import annotations

from typing import Callable

from ..context import Context
from . import (calls, decode, engines, exportscale, fsspecreads, http, listing, local, remote, scaleout, sequential,
               serve, versioned, zipped)

SCENARIOS: dict[str, Callable[[Context], None]] = {
    "local": local.run,  # small-file reads: warm, first, parallel, backing reads
    "calls": calls.run,  # the daemon's Python calls per first read (a tracked count, no timing)
    "listing": listing.run,  # ls -f / find / ls -l of 10^6 chunks, memory, mount time
    "sequential": sequential.run,  # 2 MiB raw chunks
    "decode": decode.run,  # DVID label blocks
    "http": http.run,  # first read through a local HTTP server
    "serve": serve.run,  # unshardfs serve against http.server over the mount and on the unsharded copy
    "scale-out": scaleout.run,  # check/export: one process, --jobs, Dask LocalCluster of 1 and 2 workers
    "export-scale": exportscale.run,  # export with 1, 2, 4, 8 Dask workers / --jobs, at 100 ms and local
    "remote": remote.run,  # object-store latency (20 / 100 ms): cp -r, readers, ls -lR, viewer, meshes
    "remote-readers": remote.run_readers,  # of those the 8 readers alone, and lookups of a seg+gzip volume
    "engines": engines.run,  # every figure above that FUSE caps, on the kernel engine and on pyfuse3
    "zipped": zipped.run,  # cp -r through a mount of a zip vs of the unzipped shards, local and at 20 ms
    "versioned": versioned.run,  # first chunk and cp -r through OCDBT and Icechunk vs plain shards, at 20 ms
    "fsspec": fsspecreads.run,  # first reads through the unshard fsspec filesystem vs a fresh mount and TensorStore
}
