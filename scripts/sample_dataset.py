"""Build the demo's sample: an image and a segmentation with meshes and skeletons, all sharded.

Written by TensorStore (volumes) and CloudVolume (mesh/skeleton shards), the
same independent writers the tests use, plus the unsharded twin of each.
Usage: sample_dataset.py DEST  ->  DEST/{image,segmentation}/{sharded,plain}
"""

import json
import shutil
import sys
from pathlib import Path


from unshardfs.testing.precomputed import Scale, sharding, write_objects, write_volume


def main(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    write_volume(dest / "image", [
        Scale((256, 256, 64), (64, 64, 16), sharding(preshift=2, minishard=3, shard=2, index_enc="gzip",
                                                       data_enc="gzip")),
        Scale((128, 128, 32), (64, 64, 16), sharding(hash="identity", minishard=2, shard=0),
              resolution=(2, 2, 2)),
    ], "uint8")
    seg = dest / "segmentation"
    write_volume(seg, [
        Scale((128, 128, 64), (32, 32, 32), sharding(minishard=2, shard=2, data_enc="gzip"),
              encoding="compressed_segmentation", extra={"compressed_segmentation_block_size": [8, 8, 8]}),
    ], "uint64", volume_type="segmentation")
    for kind in ("mesh", "skeletons"):
        tmp = dest / f"_{kind}"
        objs = write_objects(tmp, kind, sharding(minishard=2, shard=1, index_enc="gzip", data_enc="gzip"), n=30)
        for variant in ("sharded", "plain"):
            target = seg / variant / kind
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(objs[variant] / kind, target)
            info_path = seg / variant / "info"
            info = json.loads(info_path.read_text())
            info[kind] = kind
            info_path.write_text(json.dumps(info))
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
