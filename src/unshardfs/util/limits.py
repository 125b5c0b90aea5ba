"""Bounds on what untrusted metadata and indexes can make the daemon allocate or fetch.

Every size a header or index declares is checked against these before
anything is read or allocated; a file beyond them fails with a one-line
DataError naming the bound (and the option that raises it).
"""

from __future__ import annotations

from dataclasses import dataclass

from unshardfs.util.errors import DataError

# Fixed bounds on the shape of a metadata document (no real metadata comes
# near them; each exists because something deeper or longer costs out of
# proportion): nesting depth (every walk over the tree, including Python's own
# json encoder, recurses per level), one string, one number literal (Python
# parses integer digits in quadratic time and refuses beyond 4,300).
METADATA_DEPTH = 100
METADATA_STRING = 1 << 20
METADATA_NUMBER = 100
# Levels of a pyramid (`scales`) and of annotation indexes (`spatial`,
# `relationships`): real datasets have a few dozen; each level shown costs a
# directory's state, so a list of 50,000 is refused rather than built.
METADATA_LEVELS = 1024

MiB = 1 << 20


@dataclass(frozen=True)
class DataLimits:
    # One index structure (a shard index, a Zarr shard index, a DVID chunk
    # index) read and decoded in one piece.
    index_bytes: int = 256 * MiB
    # A chunk payload whose decoded size the format does not fix (meshes,
    # skeletons, annotation records, non-raw volume encodings beyond the
    # geometry's bound).
    payload_bytes: int = 256 * MiB
    # One metadata document (`info`, `zarr.json`, a DVID spec or JSON index): its
    # bytes, and the values its parse would build (every member of an object and
    # element of a list counts; a parsed value costs ~50-100 bytes of Python
    # objects, so 1,000,000 values stay below ~100 MB).
    metadata_bytes: int = 64 * MiB
    metadata_values: int = 1_000_000

    def check_index(self, size: int, where: str, cache: int | None = None) -> None:
        """DataError for an index beyond the limit, or beyond `cache` (the budget of the
        cache that must hold it: a larger one would be read again on every use)."""
        limit = self.index_bytes if cache is None else min(self.index_bytes, cache)
        if size > limit:
            bound = "--max-index-size" if limit == self.index_bytes else "the size of the cache that holds it"
            raise DataError(where, f"index of {size:,} bytes exceeds the {limit / MiB:g} MiB limit ({bound})")
