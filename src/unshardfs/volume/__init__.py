"""The volume model shared by formats shown as Neuroglancer precomputed: grids, Morton codes, sharding."""
