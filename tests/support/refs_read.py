"""Read arrays through kerchunk references with nothing of unshardfs: run by the interpreter of a venv
that does not have it (zarr-python 2 or 3, xarray; fsspec's `reference` filesystem).

    python refs_read.py REFS OUT.npz MODE NAME... [--options JSON]

MODE: `zarr` (zarr.open_group over the references) or `xarray` (xarray's zarr engine). `--options`:
the reference filesystem's keyword arguments besides `fo` (remote_protocol, remote_options).
Writes every named array to OUT.npz; exits 3 if unshardfs can be imported here.
"""

import json
import sys

import fsspec
import numpy as np
import zarr


def main() -> None:
    args = sys.argv[1:]
    options = {}
    if "--options" in args:
        at = args.index("--options")
        options = json.loads(args[at + 1])
        del args[at:at + 2]
    refs, out, mode, *names = args
    try:
        import unshardfs  # noqa: F401
    except ImportError:
        pass
    else:
        sys.exit(3)
    arrays = {}
    if mode == "xarray":
        import xarray as xr

        # Values as stored: xarray would read a Zarr v2 fill_value as missing (NaN) otherwise.
        ds = xr.open_dataset("reference://", engine="zarr", consolidated=False, mask_and_scale=False,
                             backend_kwargs={"storage_options": {"fo": refs, **options}})
        for name in names:
            arrays[name] = ds[name].values
            arrays[name + ".dims"] = np.array(ds[name].dims)
    elif zarr.__version__.startswith("2."):
        group = zarr.open_group(fsspec.get_mapper("reference://", fo=refs, **options), mode="r")
        for name in names:
            arrays[name] = group[name][...]
    else:
        group = zarr.open_group("reference://", mode="r", storage_options={"fo": refs, **options})
        for name in names:
            arrays[name] = group[name][...]
    np.savez(out, **arrays)
    print(zarr.__version__)


if __name__ == "__main__":
    main()
