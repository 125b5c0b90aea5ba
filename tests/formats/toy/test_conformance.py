"""A test-only format (tests/support/toyformat) passes the shared format conformance suite.

It is registered only as a third-party package would be: a `*.dist-info` directory on the
daemon's PYTHONPATH whose entry point names its plug-in class. Nothing in `src/` knows it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from tests.support.toyformat.plugin import HEADER, MARKER
from tests.support.toyformat.writer import write_toy
from unshardfs.testing.format_conformance import Damaged, FormatCase, FormatConformance, InProcessConformance
from unshardfs.testing.mounts import force_unmount, run_cli

REPO = Path(__file__).resolve().parents[3]
INHERITED = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # before `registered` runs
SHARDS = 4
CHUNK = 700
# Sparse ids (and none in shard 3: an absent shard); shard 1 holds 8 chunks.
KEYS = [0, 1, 4, 5, 8, 9, 12, 13, 17, 21, 26, 30, 33, 37, 41, 45, 10**12 + 1, 2**64 - 3]


def site(root: Path, with_toy: bool) -> str:
    """PYTHONPATH for the CLI subprocesses: the repository, and the toy's dist-info directory if asked."""
    return os.pathsep.join(([str(root)] if with_toy else []) + [str(REPO)] + INHERITED)


@pytest.fixture(scope="module", autouse=True)
def registered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Install the toy format's entry point, as `pip install` of a package declaring it would."""
    root = tmp_path_factory.mktemp("site-packages")
    info = root / "unshardfs_toy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: unshardfs-toy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[unshardfs.formats]\ntoy = tests.support.toyformat.plugin:ToyFormat\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", site(root, True))
        yield root


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> FormatCase:
    rng = np.random.default_rng(3)
    # Compressible chunks: gzip payloads shorter than the chunk, so offsets differ from ids * size.
    chunks = {k: bytes(rng.integers(0, 4, CHUNK, dtype=np.uint8)) for k in KEYS}
    paths = write_toy(tmp_path_factory.mktemp("toy"), chunks, SHARDS)

    def damage(root: Path) -> Damaged:
        """Shard 1's entry count made huge: its index would run far past the end of the file."""
        shard = root / "1.toyshard"
        with open(shard, "r+b") as f:
            f.write((1 << 40).to_bytes(HEADER, "little"))
        return Damaged(shard, frozenset(str(k) for k in KEYS if k % SHARDS == 1))

    return FormatCase(paths["sharded"], paths["plain"], damage, [str(k) for k in KEYS if k % SHARDS == 1],
                      json_files=(MARKER,), absent=["2", "3", "7", str(2**64 - 1)])


class TestToyConformance(FormatConformance):
    pass


def test_found_only_through_its_entry_point(case: FormatCase, registered: Path, tmp_path: Path) -> None:
    """Without the dist-info on the path no format claims the dataset; with it, `inspect` (whose
    inventory is format-neutral) summarises it."""
    env = {**os.environ, "PYTHONPATH": site(registered, False)}
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        refused = run_cli("mount", str(case.sharded), str(mnt), env=env)
    finally:
        force_unmount(mnt)  # should it mount after all
    assert refused.returncode == 1 and "has neither" in refused.stderr, refused.stderr
    inspected = run_cli("inspect", "--json", "-q", str(case.sharded))
    assert inspected.returncode == 0, inspected.stderr
    assert '"toy chunks"' in inspected.stdout and f'"chunks": {len(KEYS)}' in inspected.stdout, inspected.stdout


class TestToyInProcess(InProcessConformance):
    """The same checks over the node API, without a mount (the quick tier's): registered in this
    process through the public API, as a plug-in's own tests would."""

    @pytest.fixture(autouse=True)
    def in_this_process(self) -> Iterator[None]:
        from unshardfs.core import registry
        from tests.support.toyformat.plugin import ToyFormat

        registry.load_plugins()
        plugin = registry.register_format(ToyFormat)
        try:
            yield
        finally:
            registry.unregister_format(plugin.name)
