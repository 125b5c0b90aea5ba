"""Icechunk repositories for the tests: written by the `icechunk` package (the reference) in its own venv,
with icechunk's own reads of every version dumped beside them; and the framing of snapshot and manifest
objects, to craft hostile ones from real ones."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zstandard

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-icechunk" / "bin" / "python"
WRITER = Path(__file__).with_name("icechunk_writer.py")
needs_icechunk = pytest.mark.skipif(not PYTHON.exists(), reason="needs .venv-icechunk (scripts/setup makes it)")

MAGIC = "ICE🧊CHUNK".encode()
HEADER = len(MAGIC) + 24 + 3


def _run(*args: str) -> None:
    result = subprocess.run([str(PYTHON), "-P", str(WRITER), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (f"icechunk writer {args[0]} exited {result.returncode}:\n"
                                    f"{result.stdout[-1500:]}{result.stderr[-3000:]}")


@dataclass
class Written:
    """A repository the icechunk package wrote (`root`), the directory its virtual references point into
    (`external`), and icechunk's reads of every version (`dump`)."""

    root: Path
    external: Path
    dump: Path

    @property
    def versions(self) -> dict[str, str]:
        """Version directory name (`branch.main`, `tag.v1`, a snapshot id) -> snapshot id."""
        found: dict[str, str] = json.loads((self.dump / "versions.json").read_text())
        return found

    def keys(self, version: str) -> dict[str, bytes]:
        """Every key of `version` and its bytes, as icechunk's Zarr store serves them."""
        raw = json.loads((self.dump / version / "keys.json").read_text())
        return {key: bytes.fromhex(value) for key, value in raw.items()}

    def arrays(self, version: str) -> dict[str, np.ndarray]:
        """Every array of `version` (by path), as zarr-python reads it through icechunk."""
        return {p.stem.replace(".", "/"): np.load(p) for p in (self.dump / version).glob("*.npy")}


def write_repo(base: Path) -> Written:
    """A repository of several commits, a branch and a tag (see icechunk_writer.py), and the dumps."""
    written = Written(base / "repo", base / "external", base / "dump")
    written.dump.mkdir(parents=True)
    _run("write", str(written.root), str(written.external))
    _run("dump", str(written.root), str(written.dump), str(written.external))
    return written


def body_of(data: bytes) -> bytes:
    """The FlatBuffers body of a snapshot or manifest object (its header checked by the tests' caller)."""
    assert data[:len(MAGIC)] == MAGIC
    body = data[HEADER:]
    return zstandard.ZstdDecompressor().decompressobj().decompress(body) if data[HEADER - 1] == 1 else body


def reframe(data: bytes, body: bytes | None = None, *, version: int | None = None, file_type: int | None = None,
            compression: int | None = None, magic: bytes = MAGIC) -> bytes:
    """`data` (a snapshot or manifest object) with its header fields and/or body replaced; the body is
    compressed as the (new) compression byte says."""
    head = bytearray(data[:HEADER])
    head[:len(MAGIC)] = magic
    if version is not None:
        head[HEADER - 3] = version
    if file_type is not None:
        head[HEADER - 2] = file_type
    if compression is not None:
        head[HEADER - 1] = compression
    plain = body if body is not None else body_of(data)
    coded = zstandard.ZstdCompressor().compress(plain) if head[HEADER - 1] == 1 else plain
    return bytes(head) + coded


def write_checksummed(root: Path, url: str, etag: str, last_modified: int, local: Path) -> None:
    """A repository of virtual references with checksums into the object at `url` and the file `local`
    (see `checksums` in icechunk_writer.py).

    icechunk 1.x drops the port of an http:// location it stores, so the writer is given a host name of
    the same length as `url`'s host and port, which is then put in its place in the manifests (a string
    of the same length: every FlatBuffers offset stays)."""
    scheme, _, rest = url.partition("://")
    netloc, _, path = rest.partition("/")
    stand_in = "h" * len(netloc)
    _run("checksums", str(root), f"{scheme}://{stand_in}/{path}", etag, str(last_modified), str(local))
    for manifest in (root / "manifests").iterdir():
        data = manifest.read_bytes()
        body = body_of(data)
        needle = f"{scheme}://{stand_in}/".encode()
        if needle in body:
            manifest.write_bytes(reframe(data, body.replace(needle, f"{scheme}://{netloc}/".encode())))
