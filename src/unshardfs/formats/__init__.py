"""Formats turn a byte source into a virtual tree. They are plug-ins: see `registry`."""

from .registry import Dataset, FormatPlugin, open_dataset, plugins, register_format, split_format

__all__ = ["Dataset", "FormatPlugin", "open_dataset", "plugins", "register_format", "split_format"]
