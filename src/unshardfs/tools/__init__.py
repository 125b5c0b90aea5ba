"""Offline tools over a source: export, check, inspect (no FUSE involved)."""
