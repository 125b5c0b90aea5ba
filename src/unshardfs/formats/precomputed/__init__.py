"""Neuroglancer precomputed datasets with `neuroglancer_uint64_sharded_v1` sharding."""

from .dataset import build_tree

__all__ = ["build_tree"]
