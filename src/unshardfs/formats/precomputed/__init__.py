"""Neuroglancer precomputed datasets with `neuroglancer_uint64_sharded_v1` sharding."""
