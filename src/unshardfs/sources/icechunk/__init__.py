"""Icechunk repositories as byte sources (`format` decodes, `source` reads)."""

from unshardfs.sources.icechunk.source import IcechunkOptions, IcechunkSource, IcechunkStore, RefSpec, open_icechunk

__all__ = ["IcechunkOptions", "IcechunkSource", "IcechunkStore", "RefSpec", "open_icechunk"]
