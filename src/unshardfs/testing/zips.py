"""Zip archives of dataset directories, for the tests and scripts/bench.

`zip_tree` packs a directory the way RFC-9 (Zipped OME-Zarr) recommends:
members STORED, the root `zarr.json` first, ZIP64 allowed, and an archive
comment `{"ome": {"version": ..., "zipFile": {...}}}` when the root is an
OME-Zarr group. Python's `zipfile` writes it, an independent writer from
ngff-zarr's and zarr-python's.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any


def _members(src: Path) -> list[Path]:
    """Files and directories under `src`, the root `zarr.json` first, the rest sorted."""
    paths = sorted(src.rglob("*"))
    first = [p for p in paths if p == src / "zarr.json"]
    return first + [p for p in paths if p not in first]


def ome_comment(src: Path) -> bytes:
    """The RFC-9 archive comment for an OME-Zarr 0.5 root, or b"" for anything else."""
    try:
        ome = json.loads((src / "zarr.json").read_bytes()).get("attributes", {}).get("ome")
    except (OSError, ValueError):
        return b""
    if not isinstance(ome, dict):
        return b""
    return json.dumps({"ome": {"version": ome.get("version", "0.5"),
                               "zipFile": {"centralDirectory": {"jsonFirst": True}}}}).encode()


def zip_tree(src: Path, dst: Path, method: int = zipfile.ZIP_STORED, comment: bytes | None = None,
             directories: bool = True, under: str = "") -> Path:
    """`src`'s tree as the archive `dst` (members under `under`, e.g. "seg/"), written atomically."""
    tmp = dst.with_name(dst.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", method, allowZip64=True) as z:
        for path in _members(src):
            rel = under + path.relative_to(src).as_posix()
            if path.is_dir():
                if directories:
                    z.writestr(zipfile.ZipInfo(rel + "/"), b"")
            else:
                z.write(path, rel)
        z.comment = ome_comment(src) if comment is None else comment
    os.replace(tmp, dst)
    return dst


def unzip(archive: Path, dst: Path) -> Path:
    """The archive's members as a directory (the unzipped twin)."""
    with zipfile.ZipFile(archive) as z:
        z.extractall(dst)
    return dst
