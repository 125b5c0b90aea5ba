"""TensorStore's OCDBT databases as byte sources (`format` decodes, `source` reads)."""

from unshardfs.sources.ocdbt.source import OcdbtOptions, OcdbtSource, OcdbtStore, VersionSpec, open_ocdbt

__all__ = ["OcdbtOptions", "OcdbtSource", "OcdbtStore", "VersionSpec", "open_ocdbt"]
