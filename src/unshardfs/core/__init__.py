"""The sharded-read core: blobs, chunk tables, the coalescing fetcher, read-ahead, caches and the format plug-in registry."""
