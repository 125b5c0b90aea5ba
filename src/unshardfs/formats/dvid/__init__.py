"""DVID `export-shards` output (Arrow shard files of label blocks), shown as unsharded precomputed."""

from .export import DvidExport, looks_like_export

__all__ = ["DvidExport", "looks_like_export"]
