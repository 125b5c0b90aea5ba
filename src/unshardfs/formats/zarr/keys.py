"""Chunk keys: how a chunk's grid index is spelled as a path, both ways.

The same code names the source's shards (the array's own chunk key
encoding), the unsharded v3 view's chunk files (the same encoding), and the
v2 view's files (no "c" prefix).
"""

from __future__ import annotations

from dataclasses import dataclass


def parse_index(text: str) -> int | None:
    """A canonical non-negative decimal (no sign, no leading zeros)."""
    if not text.isascii() or not text.isdigit() or (len(text) > 1 and text[0] == "0"):
        return None
    return int(text)


@dataclass(frozen=True)
class KeyLayout:
    lead: str | None  # "c" for v3's default encoding, None for v2 keys
    separator: str  # "/" (nested directories) or "." (flat names)
    ndim: int

    @property
    def nested(self) -> bool:
        return self.separator == "/" and self.ndim > 0

    def parts(self, index: tuple[int, ...]) -> list[str]:
        if self.ndim == 0:
            return [self.lead or "0"]
        digits = [str(i) for i in index]
        if self.separator == "/":
            return ([self.lead] if self.lead else []) + digits
        return [self.separator.join(([self.lead] if self.lead else []) + digits)]

    def key(self, index: tuple[int, ...]) -> str:
        return "/".join(self.parts(index))

    def parse_flat(self, name: str) -> tuple[int, ...] | None:
        """The index of a non-nested chunk file name, or None."""
        if self.ndim == 0:
            return () if name == (self.lead or "0") else None
        fields = name.split(self.separator)
        if self.lead:
            if fields[0] != self.lead:
                return None
            fields = fields[1:]
        if len(fields) != self.ndim:
            return None
        index = [parse_index(f) for f in fields]
        return tuple(i for i in index if i is not None) if None not in index else None

    def claims(self, name: str) -> bool:
        """Whether a top-level name of the array directory belongs to the chunk keys."""
        if self.ndim == 0:
            return name == (self.lead or "0")
        if self.lead:
            return name == self.lead or name.startswith(self.lead + self.separator)
        return name[:1].isdigit()
