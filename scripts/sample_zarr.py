"""Build the demo's Zarr sample: a group with a sharded 3-D array written by zarr-python 3.

Usage: sample_zarr.py DEST  ->  DEST/{sharded,plain}/em (+ group zarr.json, consolidated)
"""

import sys
from pathlib import Path


from unshardfs.testing.zarr import BYTES_LE, CRC, ZCase, codec, consolidate, sharding, write_case, write_group


def main(dest: Path) -> None:
    case = ZCase((128, 128, 64), "uint16", (64, 64, 32),
                 [sharding((16, 16, 16), [BYTES_LE, codec("zstd", level=3, checksum=False)], (BYTES_LE, CRC))],
                 (16, 16, 16), [BYTES_LE, codec("zstd", level=3, checksum=False)],
                 attributes={"description": "unshardfs demo"}, dimension_names=["z", "y", "x"])
    for variant in ("sharded", "plain"):
        write_group(dest / variant)
    write_case(dest, "em", case)
    for variant in ("sharded", "plain"):
        consolidate(dest / variant)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
