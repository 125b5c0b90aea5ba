"""Comparing a mounted (or exported) tree with the unsharded reference, file by file."""

from __future__ import annotations

import json
from pathlib import Path


def walk_files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def exported_files(root: Path) -> dict[str, Path]:
    """An export's files under their final names: its ledger directory and temporaries aside."""
    return {rel: p for rel, p in walk_files(root).items()
            if not rel.startswith(".unshardfs/") and ".unshardfs-tmp-" not in p.name}


def unstamped(data: bytes) -> bytes:
    """`data` with a gzip member's MTIME zeroed: writers stamp the current time
    there, so two writes of the same chunk a second apart differ only in it."""
    if data[:3] == b"\x1f\x8b\x08" and len(data) >= 18:
        return data[:4] + bytes(4) + data[8:]
    return data


def assert_same_tree(mounted: Path, reference: Path, json_files: tuple[str, ...] = (),
                     ignore_gzip_mtime: bool = False) -> int:
    """Same file names and same bytes; `json_files` are compared as parsed JSON. An export's own
    records (its `.unshardfs` directory) are not part of the tree.

    Returns the number of files compared, so callers can check they compared
    something at all.
    """
    got, want = exported_files(mounted), exported_files(reference)
    assert sorted(got) == sorted(want), (
        f"missing: {sorted(set(want) - set(got))[:10]} extra: {sorted(set(got) - set(want))[:10]}")
    for rel, path in want.items():
        assert_same_file(got[rel], path, rel, json_files, ignore_gzip_mtime)
    return len(want)


def assert_same_file(got: Path, want: Path, rel: str, json_files: tuple[str, ...] = (),
                     ignore_gzip_mtime: bool = False) -> None:
    """`got` (read by path: a lookup, never a listing) holds what `want` does; `rel` names it."""
    if rel in json_files or rel.endswith("/info") or rel == "info":
        assert json.loads(got.read_bytes()) == json.loads(want.read_bytes()), rel
    elif ignore_gzip_mtime:
        assert unstamped(got.read_bytes()) == unstamped(want.read_bytes()), rel
    else:
        assert got.stat().st_size == want.stat().st_size, rel
        assert got.read_bytes() == want.read_bytes(), rel
