"""unshardfs: show sharded volumetric datasets in their unsharded layout through FUSE."""

__version__ = "0.1.0"
