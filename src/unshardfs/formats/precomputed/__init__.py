"""Neuroglancer precomputed datasets with `neuroglancer_uint64_sharded_v1` sharding."""

from .dataset import PrecomputedDataset, ShardedPart, build_tree, open_dataset

__all__ = ["PrecomputedDataset", "ShardedPart", "build_tree", "open_dataset"]
