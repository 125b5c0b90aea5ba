"""Formats turn a byte source into a virtual tree."""
