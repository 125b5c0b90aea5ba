"""Layout variants: the obsolete .index/.data shards, nested scale keys, extra
files that must pass through, and containment of the source."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.testing.trees import assert_same_tree

MINISHARD_BITS = 2


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    spec = sharding(minishard=MINISHARD_BITS, shard=3, index_enc="gzip", data_enc="gzip")
    return write_volume(root, [Scale((48, 40, 20), (8, 8, 8), spec, fill=0.7)], "uint32")


def test_obsolete_index_data_layout(volume, tmp_path, mount):
    src = tmp_path / "obsolete"
    shutil.copytree(volume["sharded"], src)
    shards = sorted((src / "1_1_1").glob("*.shard"))
    assert len(shards) > 1
    for shard in shards:
        blob = shard.read_bytes()
        cut = 16 << MINISHARD_BITS
        shard.with_suffix(".index").write_bytes(blob[:cut])
        shard.with_suffix(".data").write_bytes(blob[cut:])
        shard.unlink()
    m = mount(src)
    assert assert_same_tree(m.path, volume["plain"]) > 10
    # An .index without its .data is damage, not an absent shard.
    victim = sorted((src / "1_1_1").glob("*.data"))[0]
    victim.unlink()
    m2 = mount(src)
    failed = 0
    for name in os.listdir(volume["plain"] / "1_1_1"):
        try:
            assert (m2.path / "1_1_1" / name).read_bytes() == (volume["plain"] / "1_1_1" / name).read_bytes()
        except OSError:
            failed += 1
    assert failed > 0


def test_nested_and_dotted_scale_keys(volume, tmp_path, mount):
    src, ref = tmp_path / "src", tmp_path / "ref"
    for base, variant in ((src, "sharded"), (ref, "plain")):
        shutil.copytree(volume[variant], base)
        (base / "deep" / "er").mkdir(parents=True)
        os.rename(base / "1_1_1", base / "deep" / "er" / "s0")
        info = json.loads((base / "info").read_text())
        info["scales"][0]["key"] = "deep/./x/../er/s0"
        (base / "info").write_text(json.dumps(info))
    m = mount(src)
    assert assert_same_tree(m.path, ref) > 10


def test_extra_files_pass_through(volume, tmp_path, mount):
    src, ref = tmp_path / "src", tmp_path / "ref"
    for base, variant in ((src, "sharded"), (ref, "plain")):
        shutil.copytree(volume[variant], base)
        (base / "provenance").write_text('{"sources": []}')
        (base / "segment_properties").mkdir()
        (base / "segment_properties" / "info").write_text('{"@type": "neuroglancer_segment_properties"}')
        (base / "1_1_1" / "README").write_text("notes kept next to the chunks")
        (base / "1_1_1" / "sub").mkdir()
        (base / "1_1_1" / "sub" / "x").write_bytes(b"\x00\x01")
    m = mount(src)
    assert assert_same_tree(m.path, ref) > 10
    assert (m.path / "1_1_1" / "README").read_text() == "notes kept next to the chunks"


def test_symlinks_cannot_escape_the_source(volume, tmp_path, mount):
    """Links out are there but refused: shown as files that read EIO, never the outside's bytes or
    names (a link to a directory outside is not one: nothing below it is reachable)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    src = tmp_path / "src"
    shutil.copytree(volume["sharded"], src)
    os.symlink(secret, src / "leak")
    os.symlink("/etc", src / "etc")
    (src / "inside").write_text("ok")
    os.symlink("inside", src / "alias")
    m = mount(src)
    names = os.listdir(m.path)
    assert "leak" in names and "etc" in names
    for name in ("leak", "etc"):
        assert (m.path / name).is_file() and not (m.path / name).is_dir()
        with pytest.raises(OSError) as caught:
            (m.path / name).read_bytes()
        assert caught.value.errno == errno.EIO
    assert not (m.path / "etc" / "passwd").exists()
    assert (m.path / "alias").read_text() == "ok"
