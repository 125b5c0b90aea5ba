"""Utilities: errors, log-once, bounded maps, limits, metadata fields, bounded decompression, Linux calls."""
