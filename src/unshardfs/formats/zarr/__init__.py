"""Zarr v3 stores whose arrays use the `sharding_indexed` codec, shown unsharded (v3 or v2)."""
