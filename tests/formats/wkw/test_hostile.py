"""Hostile WKW files through a real mount: a jump table running past the end of its file,
decreasing jump-table offsets, an LZ4 block that would decode to far more than a block, a block
range longer than any LZ4 encoding of a block, file headers with absurd dimensions or an unknown
block type, and mag headers (`header.wkw`) that are absurd. Each answers EIO (or a one-line error at
mount), local to its block or file, within seconds and with the daemon's memory bounded, while the
other blocks read exactly and SIGTERM still unmounts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.formats.wkw.datasets import BLOCK, LayerSpec, write_dataset
from tests.support.bombs import Bad, assert_contained, peak_rss_mib
from unshardfs.testing.mounts import run_cli

pytestmark = pytest.mark.timeout(180)

FILES = 7  # along x; file i gets damage i (the last stays intact)
BLOCK_BYTES = BLOCK ** 3 * 2  # uint16
SPEC = LayerSpec("em", "color", "uint16", 1, "lz4", (0, 0, 0), (2 * BLOCK * FILES, 2 * BLOCK, 2 * BLOCK),
                 mags=((1, 1, 1),), skip_file=None)
GROWTH_MIB = 64
BASELINE_MIB = 200  # a daemon serving a small dataset stays near 90 MiB


def local(n: int) -> tuple[int, int, int]:
    """Block n's position in a file of 2^3 blocks (Morton order, x the lowest bit)."""
    return n & 1, (n >> 1) & 1, (n >> 2) & 1


def name(file_x: int, n: int) -> str:
    x, y, z = local(n)
    x += 2 * file_x
    return "_".join(f"{c * BLOCK}-{(c + 1) * BLOCK}" for c in (x, y, z))


def blocks_of(path: Path) -> tuple[bytes, list[bytes]]:
    raw = path.read_bytes()
    header = raw[:16]
    ends = struct.unpack("<8Q", raw[16:80])
    starts = (struct.unpack("<Q", header[8:16])[0],) + ends[:-1]
    return header, [raw[s:e] for s, e in zip(starts, ends)]


def rebuild(path: Path, header: bytes, blocks: list[bytes]) -> None:
    """A well-formed LZ4 file holding `blocks`, as a writer would lay it out."""
    ends, at = [], 16 + 8 * len(blocks)
    for b in blocks:
        at += len(b)
        ends.append(at)
    path.write_bytes(header[:8] + struct.pack("<Q", 16 + 8 * len(blocks)) + struct.pack(f"<{len(blocks)}Q", *ends)
                     + b"".join(blocks))


def lz4_overrun() -> bytes:
    """One LZ4 sequence: a literal, then a match of offset 1 whose length bytes add up to ~255 kB."""
    return bytes([0x1F, 0x41, 0x01, 0x00]) + b"\xff" * 1000 + b"\x00"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hostile-wkw")
    data = write_dataset(root / "wkw", root / "twin", [SPEC])
    return data


def plant(root: Path) -> dict[str, Bad]:
    mag = root / "em" / "1" / "z0" / "y0"
    bad: dict[str, Bad] = {}
    # 0: the jump table runs past the end of the file.
    path = mag / "x0.wkw"
    path.write_bytes(path.read_bytes()[:16 + 8 * 3])
    bad.update({f"em/1/{name(0, n)}": Bad() for n in range(8)})
    # 1: offsets decreasing (entries 0 and 1 swapped): block 1's range ends before it starts,
    # blocks 0 and 2 now span two LZ4 blocks each.
    path = mag / "x1.wkw"
    raw = bytearray(path.read_bytes())
    raw[16:24], raw[24:32] = raw[24:32], raw[16:24]
    path.write_bytes(bytes(raw))
    bad.update({f"em/1/{name(1, 0)}": Bad(BLOCK_BYTES), f"em/1/{name(1, 1)}": Bad(),
                f"em/1/{name(1, 2)}": Bad(BLOCK_BYTES)})
    # 2: block 3 is an LZ4 block that would decode to ~255 kB (the block is 1 KiB).
    path = mag / "x2.wkw"
    header, blocks = blocks_of(path)
    blocks[3] = lz4_overrun()
    rebuild(path, header, blocks)
    bad[f"em/1/{name(2, 3)}"] = Bad(BLOCK_BYTES)
    # 3: block 5's range is 64 MiB: longer than any LZ4 encoding of 1 KiB (never fetched).
    path = mag / "x3.wkw"
    header, blocks = blocks_of(path)
    blocks[5] = bytes(64 << 20)
    rebuild(path, header, blocks)
    bad[f"em/1/{name(3, 5)}"] = Bad(BLOCK_BYTES)
    # 4: absurd dimensions in the file's header (2^15 blocks of 2^15 voxels per edge).
    path = mag / "x4.wkw"
    raw = bytearray(path.read_bytes())
    raw[4] = 0xFF
    path.write_bytes(bytes(raw))
    bad.update({f"em/1/{name(4, n)}": Bad() for n in range(8)})
    # 5: an unknown block type.
    path = mag / "x5.wkw"
    raw = bytearray(path.read_bytes())
    raw[5] = 9
    path.write_bytes(bytes(raw))
    bad.update({f"em/1/{name(5, n)}": Bad() for n in range(8)})
    return bad


def test_hostile_files_fail_alone(dataset, tmp_path, mount):
    import shutil

    root = tmp_path / "wkw"
    shutil.copytree(dataset.root, root)
    bad = plant(root)
    m = mount(root)
    baseline = peak_rss_mib(m.path)
    assert baseline < BASELINE_MIB
    good = {f"em/1/{p.name}": p.read_bytes() for p in sorted((dataset.twin / "em" / "1").iterdir())
            if f"em/1/{p.name}" not in bad}
    assert len(good) == 5 + 7 + 7 + 8  # the intact blocks of files 1, 2, 3 and 6
    assert_contained(m, bad, good, GROWTH_MIB, baseline_mib=baseline)
    log = m.log_text()
    for f in ("x0.wkw", "x1.wkw", "x2.wkw", "x3.wkw", "x4.wkw", "x5.wkw"):
        assert f in log, f


@pytest.mark.parametrize("per_dim,block_type,message", [
    (0xFF, 2, "absurd dimensions"),
    (0x13, 7, "unknown block type 7"),
])
def test_absurd_mag_header_is_a_one_line_error(dataset, tmp_path, per_dim, block_type, message):
    import shutil

    root = tmp_path / "wkw"
    shutil.copytree(dataset.root, root)
    header = root / "em" / "1" / "header.wkw"
    raw = bytearray(header.read_bytes())
    raw[4], raw[5] = per_dim, block_type
    header.write_bytes(bytes(raw))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = run_cli("mount", str(root), str(mnt))
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_mag_header_declaring_huge_files(dataset, tmp_path, mount):
    """header.wkw with 2^8 blocks per file edge (2^24 blocks: a 128 MiB jump table, a 512 MiB
    decoded table per file): every file is refused before its jump table is read."""
    import shutil

    root = tmp_path / "wkw"
    shutil.copytree(dataset.root, root)
    for path in [root / "em" / "1" / "header.wkw", *sorted((root / "em" / "1").rglob("*.wkw"))]:
        raw = bytearray(path.read_bytes())
        raw[4] = 0x83
        path.write_bytes(bytes(raw))
    props = json.loads((root / "datasource-properties.json").read_text())
    m = mount(root)
    baseline = peak_rss_mib(m.path)
    assert baseline < BASELINE_MIB, "nothing a header declares is allocated at mount"
    info = json.loads((m.path / "em" / "info").read_text())
    assert info["scales"][0]["chunk_sizes"] == [[BLOCK] * 3] and props["dataLayers"][0]["name"] == "em"
    bad = {f"em/1/{name(0, n)}": Bad() for n in range(2)}
    assert_contained(m, bad, {"em/info": (m.path / "em" / "info").read_bytes()}, GROWTH_MIB, baseline_mib=baseline)


def test_header_parser_refuses_what_no_writer_writes():
    from unshardfs.formats.wkw.header import HeaderError, WkwHeader

    good = bytes(b"WKW\x01\x13\x02\x02\x02") + struct.pack("<Q", 80)
    h = WkwHeader.parse(good)
    assert (h.block_edge, h.file_edge, h.blocks, h.block_bytes, h.channels) == (8, 2, 8, 1024, 1)
    for bad, why in [(b"WKX" + good[3:], "not a WKW file"), (good[:3] + b"\x02" + good[4:], "version 2"),
                     (good[:6] + b"\x0b" + good[7:], "unknown voxel type"),
                     (good[:7] + b"\x03" + good[8:], "not a multiple"), (good[:7] + b"\x00" + good[8:], "not a multiple"),
                     (good[:10], "too short")]:
        with pytest.raises(HeaderError, match=why):
            WkwHeader.parse(bad)
    assert WkwHeader.parse(good[:6] + b"\x01\x03" + good[8:]).channels == 3  # three uint8 channels
    np.testing.assert_equal(WkwHeader.parse(good[:6] + b"\x0a\x08" + good[8:]).dtype, np.dtype("<i8"))
