"""A tiny test-only format built on the sharded-read core, to show that a format needs no edit
outside its own package but its registration (an `unshardfs.formats` entry point).

A toy dataset is a directory with a `toy.json` marker {"chunk_size": N, "shards": S, "encoding":
"raw"|"gzip"} and shard files `<n>.toyshard` (chunk k lives in shard k % S). A shard is a
little-endian u64 entry count, that many (id, offset, length) u64 triples (offsets from the start
of the file), then the payloads. Every chunk decodes to exactly N bytes. Unsharded, each chunk is
a file named by its decimal id, and `toy.json` keeps only its chunk size.
"""
