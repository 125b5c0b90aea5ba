"""Zip archives of dataset directories, for the tests and scripts/bench.

`zip_tree` packs a directory the way RFC-9 (Zipped OME-Zarr) recommends:
members STORED, the root `zarr.json` first, ZIP64 allowed, and an archive
comment `{"ome": {"version": ..., "zipFile": {...}}}` when the root is an
OME-Zarr group. Python's `zipfile` writes it, an independent writer from
ngff-zarr's and zarr-python's. `write_stored` writes many small members
directly, for archives of millions of entries.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterable

# zipfile's record layouts (module-level names typeshed's stubs do not declare).
_zipfile: Any = zipfile


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


def write_stored(dst: Path, members: Iterable[tuple[bytes, bytes]], comment: bytes = b"") -> Path:
    """`members` (name, content) as STORED members of the archive `dst`, written directly and quickly
    (a million small members in seconds, where `zipfile` takes minutes); ZIP64 end records when the
    count or the sizes need them. Names are taken as UTF-8."""
    local, central = struct.Struct(_zipfile.structFileHeader), struct.Struct(_zipfile.structCentralDir)
    directory = bytearray()
    count = offset = 0
    tmp = dst.with_name(dst.name + ".tmp")
    with open(tmp, "wb") as f:
        for name, content in members:
            crc = zlib.crc32(content)
            if offset > 0xFFFFFFFE or len(content) > 0xFFFFFFFE:
                raise ValueError("write_stored writes members below 4 GiB offsets and sizes only")
            f.write(local.pack(b"PK\x03\x04", 20, 0, 0x800, 0, 0, 0x21, crc, len(content), len(content), len(name), 0))
            f.write(name)
            f.write(content)
            directory += central.pack(b"PK\x01\x02", 45, 3, 20, 0, 0x800, 0, 0, 0x21, crc, len(content),
                                      len(content), len(name), 0, 0, 0, 0, 0, offset) + name
            offset += local.size + len(name) + len(content)
            count += 1
        f.write(directory)
        end = offset + len(directory)
        if count > 0xFFFE or end > 0xFFFFFFFE:
            f.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(directory), offset))
            f.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1))
            f.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, len(comment)))
        else:
            f.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(directory), offset, len(comment)))
        f.write(comment)
    os.replace(tmp, dst)
    return dst
