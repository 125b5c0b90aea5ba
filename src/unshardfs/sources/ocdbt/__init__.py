"""TensorStore's OCDBT databases as byte sources (`format` decodes, `source` reads)."""

from unshardfs.sources.ocdbt.source import OcdbtSource, OcdbtStore, VersionSpec, open_ocdbt

__all__ = ["OcdbtSource", "OcdbtStore", "VersionSpec", "open_ocdbt"]
