"""The demo's sample writer (`unshardfs.testing.samples`) is checked by an independent implementation:
TensorStore reads back what it wrote, sharded and unsharded, and a mount of the sharded samples is
the unsharded samples, file for file."""

from __future__ import annotations

import filecmp
import json
import os
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

from unshardfs.testing import samples
from unshardfs.testing.mounts import MountFn


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("samples")
    samples.write_samples(root)
    return root


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("variant", ["sharded", "plain"])
def test_tensorstore_reads_the_precomputed_sample(written: Path, variant: str) -> None:
    expected = samples.precomputed_volumes()
    for i, volume in enumerate(expected):
        store = ts.open({"driver": "neuroglancer_precomputed", "kvstore": f"file://{written}/precomputed/{variant}",
                         "scale_index": i}, open=True).result()
        assert store.domain.shape == volume.shape
        assert store.dtype == ts.uint8
        np.testing.assert_array_equal(store.read().result(), volume)
    info = json.loads((written / "precomputed" / variant / "info").read_text())
    assert [("sharding" in s) for s in info["scales"]] == [variant == "sharded"] * len(expected)


@pytest.mark.parametrize("variant", ["sharded", "plain"])
def test_tensorstore_reads_the_zarr_sample(written: Path, variant: str) -> None:
    store = ts.open({"driver": "zarr3", "kvstore": f"file://{written}/zarr/{variant}/{samples.ZARR_ARRAY}"},
                    open=True).result()
    volume = samples.zarr_volume()
    assert store.domain.shape == volume.shape
    np.testing.assert_array_equal(store.read().result(), volume)
    codecs = json.loads((written / "zarr" / variant / samples.ZARR_ARRAY / "zarr.json").read_text())["codecs"]
    assert [c["name"] for c in codecs][0] == ("sharding_indexed" if variant == "sharded" else "bytes")


def test_the_sharded_samples_exercise_what_they_claim(written: Path) -> None:
    """Both hashes, several shards and minishards, clipped edge chunks, and an inner chunk left out:
    the writer's options, not just its defaults, are what TensorStore checked above."""
    names = {p.name for p in (written / "precomputed" / "sharded" / "8_8_40").iterdir()}
    assert names == {"0.shard", "1.shard", "2.shard", "3.shard"}
    plain = written / "precomputed" / "plain" / "8_8_40"
    assert len(list(plain.iterdir())) == 4 * 3 * 3
    assert (plain / "192-200_128-160_32-48").stat().st_size == 8 * 32 * 16
    inner = written / "zarr" / "plain" / samples.ZARR_ARRAY / "c"
    assert not (inner / "0" / "0" / "0").exists()
    assert len([p for p in inner.rglob("*") if p.is_file()]) == 3 * 5 * 7 - 1
    identity = samples.ShardSpec("identity", minishard_bits=1, shard_bits=2)
    assert identity.place(0b1110) == (0b11, 0)
    murmur = samples.ShardSpec(minishard_bits=2, shard_bits=2)
    assert len({murmur.place(key) for key in range(64)}) > 8


def test_writing_twice_gives_the_same_bytes(written: Path, tmp_path: Path) -> None:
    samples.write_samples(tmp_path)
    assert tree(tmp_path) == tree(written)


def test_a_mount_of_the_sharded_samples_is_the_unsharded_samples(written: Path, mount: MountFn) -> None:
    for kind in ("precomputed", "zarr"):
        m = mount(written / kind / "sharded")
        plain = written / kind / "plain"
        shown = tree(m.path)
        assert shown.keys() == tree(plain).keys()
        mismatched = [name for name in shown if not filecmp.cmp(m.path / name, plain / name, shallow=False)]
        assert mismatched == []
        if kind == "precomputed":
            # Chunk id 0 hashes (murmurhash3_x86_128 of 0 >> 1) to shard 0: what the demo shows.
            assert os.getxattr(m.path / "8_8_40" / "0-64_0-64_0-16", "user.unshardfs.source") == b"8_8_40/0.shard"
