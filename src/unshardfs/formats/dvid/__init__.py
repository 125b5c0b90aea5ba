"""DVID `export-shards` output (Arrow shard files of label blocks), shown as unsharded precomputed."""
