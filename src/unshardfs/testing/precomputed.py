"""Datasets written by independent implementations, each with an unsharded twin.

TensorStore writes volumes; CloudVolume assembles skeleton and mesh shards.
Every builder writes the sharded dataset and the same data unsharded, so a
test can compare the mount with what an unsharded writer really produces.
"""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts


def sharding(hash: str = "murmurhash3_x86_128", preshift: int = 0, minishard: int = 2, shard: int = 2,
             index_enc: str = "raw", data_enc: str = "raw") -> dict[str, Any]:
    return {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": preshift, "hash": hash,
            "minishard_bits": minishard, "shard_bits": shard,
            "minishard_index_encoding": index_enc, "data_encoding": data_enc}


@dataclass
class Scale:
    size: tuple[int, int, int]
    chunk: tuple[int, int, int]
    sharding: dict[str, Any] | None
    encoding: str = "raw"
    voxel_offset: tuple[int, int, int] = (0, 0, 0)
    resolution: tuple[float, float, float] = (1.0, 1.0, 1.0)
    # Fraction of the volume (along x) that is written; the rest stays absent.
    fill: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict[str, Any])


def _scale_metadata(scale: Scale, sharded: bool) -> dict[str, Any]:
    meta = {"size": list(scale.size), "chunk_size": list(scale.chunk), "encoding": scale.encoding,
            "voxel_offset": list(scale.voxel_offset), "resolution": list(scale.resolution), **scale.extra}
    if sharded and scale.sharding is not None:
        meta["sharding"] = scale.sharding
    return meta


def random_volume(shape: tuple[int, ...], dtype: str, seed: int, labels: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if labels:
        # Blocky labels compress like real segmentation.
        coarse = rng.integers(1, 2**40 if dtype == "uint64" else 2**20, size=[max(1, s // 4) for s in shape])
        vol = np.kron(coarse, np.ones((4, 4, 4, 1)[:len(shape)], dtype=np.int64))
        pad = [(0, s - v) for s, v in zip(shape, vol.shape)]
        return np.pad(vol, pad, mode="edge")[tuple(slice(0, s) for s in shape)].astype(dtype)
    if dtype == "float32":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(0, min(info.max, 2**31), size=shape).astype(dtype)


def write_volume(root: Path, scales: list[Scale], data_type: str = "uint8", num_channels: int = 1,
                 volume_type: str = "image", seed: int = 0, blocky: bool | None = None) -> dict[str, Path]:
    """Write the volume sharded (`root/sharded`) and unsharded (`root/plain`) with TensorStore.

    `blocky` data (default for segmentations) compresses well; plain random
    data does not, which changes where payloads land in a shard.
    """
    paths = {}
    blocky = volume_type == "segmentation" if blocky is None else blocky
    arrays = [random_volume((*s.size, num_channels), data_type, seed + i, blocky)
              for i, s in enumerate(scales)]
    for variant in ("sharded", "plain"):
        path = root / variant
        if path.exists():
            shutil.rmtree(path)
        for i, (scale, data) in enumerate(zip(scales, arrays)):
            spec = {"driver": "neuroglancer_precomputed", "kvstore": f"file://{path}",
                    "scale_metadata": _scale_metadata(scale, variant == "sharded")}
            if i == 0:
                spec["multiscale_metadata"] = {"type": volume_type, "data_type": data_type,
                                               "num_channels": num_channels}
            store = ts.open(spec, create=True, open=i > 0).result()
            x_end = int(round(scale.size[0] * scale.fill))
            if x_end:
                store[ts.d[:].translate_to[0]][:x_end].write(data[:x_end]).result()
        paths[variant] = path
    return paths


def read_all(path: Path, scale_index: int = 0) -> np.ndarray:
    store = ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"file://{path}",
                     "scale_index": scale_index}, read=True).result()
    return store.read().result()


# -- skeletons and meshes via CloudVolume's shard assembly -------------------

def _shard_files(spec: dict[str, Any], data: dict[int, bytes], data_offset: dict[int, int] | None = None) -> dict[str, bytes]:
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification, synthesize_shard_files

    sspec = ShardingSpecification.from_dict(dict(spec))
    files: dict[str, bytes] = synthesize_shard_files(sspec, data, data_offset)
    return files


def random_skeletons(n: int, seed: int) -> dict[int, bytes]:
    from cloudvolume import Skeleton

    rng = np.random.default_rng(seed)
    out = {}
    for segid in sorted(set(int(v) for v in rng.integers(1, 2**48, size=n))):
        nv = int(rng.integers(2, 60))
        verts = rng.random((nv, 3)).astype(np.float32) * 1000
        edges = np.stack([np.arange(nv - 1), np.arange(1, nv)], axis=1).astype(np.uint32)
        skel = Skeleton(verts, edges, radii=rng.random(nv).astype(np.float32), segid=segid)
        out[segid] = skel.to_precomputed()
    return out


SKELETON_INFO = {"@type": "neuroglancer_skeletons", "transform": [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
                 "vertex_attributes": [{"id": "radius", "data_type": "float32", "num_components": 1}]}

MESH_INFO = {"@type": "neuroglancer_multilod_draco", "vertex_quantization_bits": 10,
             "transform": [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0], "lod_scale_multiplier": 1.0}


def random_multilod_meshes(n: int, seed: int) -> dict[int, tuple[bytes, bytes]]:
    """segid -> (fragment data, manifest): real Draco fragments, CloudVolume manifests."""
    import DracoPy
    from cloudvolume.datasource.precomputed.mesh.multilod import MultiLevelPrecomputedMeshManifest

    rng = np.random.default_rng(seed)
    out = {}
    for segid in sorted(set(int(v) for v in rng.integers(1, 2**40, size=n))):
        num_lods = int(rng.integers(1, 3))
        positions, offsets, fragments = [], [], []
        # CloudVolume's manifest writer needs the same fragment count in every LOD.
        count = int(rng.integers(1, 4))
        for lod in range(num_lods):
            pos = np.array(sorted({(int(x), 0, 0) for x in range(count)}), dtype=np.uint32)
            sizes = []
            for _ in range(len(pos)):
                pts = rng.integers(0, 1023, size=(12, 3)).astype(np.float32)
                faces = rng.integers(0, 12, size=(10, 3)).astype(np.uint32)
                blob = DracoPy.encode(pts, faces, quantization_bits=10, quantization_range=1023,
                                      quantization_origin=[0, 0, 0])
                fragments.append(blob)
                sizes.append(len(blob))
            positions.append(pos)
            offsets.append(np.array(sizes, dtype=np.uint32))
        manifest = MultiLevelPrecomputedMeshManifest(
            segment_id=segid, chunk_shape=[64, 64, 64], grid_origin=[0, 0, 0], num_lods=num_lods,
            lod_scales=[2.0**i for i in range(num_lods)], vertex_offsets=[[0, 0, 0]] * num_lods,
            num_fragments_per_lod=[len(p) for p in positions], fragment_positions=positions,
            fragment_offsets=np.concatenate(offsets),  # CloudVolume wants them flat
        ).to_binary()
        out[segid] = (b"".join(fragments), manifest)
    return out


def write_objects(root: Path, kind: str, spec: dict[str, Any], seed: int = 0, n: int = 40) -> dict[str, Path]:
    """Sharded and unsharded skeleton ('skeletons') or multi-LOD mesh ('mesh') directories.

    Both live in a segmentation dataset whose info names them, the way
    CloudVolume/Igneous lay them out.
    """
    paths = {}
    gz = spec.get("data_encoding") == "gzip"
    if kind == "skeletons":
        items = random_skeletons(n, seed)
        info: dict[str, object] = dict(SKELETON_INFO)
        plain_files = {str(k): v for k, v in items.items()}
        sharded_payload = {k: (gzip.compress(v) if gz else v) for k, v in items.items()}
        offsets = None
    else:
        meshes = random_multilod_meshes(n, seed)
        info = dict(MESH_INFO)
        plain_files = {}
        for k, (frags, manifest) in meshes.items():
            plain_files[str(k)] = frags
            plain_files[f"{k}.index"] = manifest
        # Only the manifest is encoded; CloudVolume indexes the trailing manifest
        # bytes via data_offset (its size), the fragments sit just before it.
        enc = {k: (frags, gzip.compress(manifest) if gz else manifest) for k, (frags, manifest) in meshes.items()}
        sharded_payload = {k: f + m for k, (f, m) in enc.items()}
        offsets = {k: len(m) for k, (f, m) in enc.items()}
    raw_spec = dict(spec, data_encoding="raw")  # payloads above are already encoded
    for variant in ("sharded", "plain"):
        base = root / variant
        if base.exists():
            shutil.rmtree(base)
        obj_dir = base / kind
        obj_dir.mkdir(parents=True)
        top = {"@type": "neuroglancer_multiscale_volume", "type": "segmentation", "data_type": "uint64",
               "num_channels": 1, kind: kind,
               "scales": [{"key": "8_8_8", "size": [64, 64, 64], "resolution": [8, 8, 8], "voxel_offset": [0, 0, 0],
                           "chunk_sizes": [[64, 64, 64]], "encoding": "raw"}]}
        (base / "info").write_text(json.dumps(top))
        (base / "provenance").write_text(json.dumps({"description": "test", "owners": []}))
        if variant == "sharded":
            (obj_dir / "info").write_text(json.dumps({**info, "sharding": spec}))
            for name, blob in _shard_files(raw_spec, sharded_payload, offsets).items():
                (obj_dir / name).write_bytes(blob)
        else:
            (obj_dir / "info").write_text(json.dumps(info))
            for name, blob in plain_files.items():
                (obj_dir / name).write_bytes(blob)
        paths[variant] = base
    return paths
