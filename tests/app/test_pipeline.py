"""SOURCE strings as Neuroglancer and TensorStore write them, parsed into (base, zip path, format)."""

from __future__ import annotations

import pytest

from unshardfs.app.pipeline import SourceSpec, parse_source, split_archive
from unshardfs.util.errors import ConfigError


@pytest.mark.parametrize("source, want", [
    ("gs://bucket/img.ozx|zip:|zarr3:", SourceSpec("gs://bucket/img.ozx", "", "zarr")),
    ("https://host/a.zip|zip:seg/|neuroglancer-precomputed:", SourceSpec("https://host/a.zip", "seg/", "precomputed")),
    ("file:///d/x.zarr.zip|zip:|zarr2:", SourceSpec("file:///d/x.zarr.zip", "", "zarr")),
    ("s3://b/x.ZIP", SourceSpec("s3://b/x.ZIP", "", None)),
    ("gs://b/img.ozx", SourceSpec("gs://b/img.ozx", "", None)),
    ("gs://b/img.ozx|zip:", SourceSpec("gs://b/img.ozx", "", None)),
    ("zarr3://gs://b/img.ozx|zip:", SourceSpec("gs://b/img.ozx", "", "zarr")),
    ("precomputed://gs://b/seg", SourceSpec("gs://b/seg", None, "precomputed")),
    ("gs://b/seg|neuroglancer-precomputed:", SourceSpec("gs://b/seg", None, "precomputed")),
    ("gs://b/data.bin|zip:a/b|zarr:", SourceSpec("gs://b/data.bin", "a/b", "zarr")),
    ("/data/seg", SourceSpec("/data/seg", None, None)),
])
def test_spellings(source, want):
    assert parse_source(source) == want


def test_local_directory_named_zip_is_a_directory(tmp_path):
    (tmp_path / "looks.zip").mkdir()
    assert parse_source(str(tmp_path / "looks.zip")).zip_path is None


@pytest.mark.parametrize("source, words", [
    ("gs://b/x|gzip:", "'gzip:' (gzip kvstore adapter) is not supported"),
    ("gs://b/x.ozx|zip:|n5:", "'n5:' (N5 format) is not supported"),
    ("gs://b/x.zip|zip:|zip:", "a zip inside a zip"),
    ("gs://b/x.zip|zarr3:|zip:", "must be the last part"),
    ("gs://b/x.zip|zip:|zarr3:a/b", "a path after the format"),
    ("precomputed://gs://b/x.zip|zip:|zarr3:", "names two formats"),
    ("gs://b/x|whatever", "is not NAME:"),
    ("|zip:", "no source"),
])
def test_unsupported(source, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        parse_source(source)
    assert "\n" not in str(info.value)


def test_split_archive(tmp_path):
    assert split_archive("gs://bucket/img.ozx") == ("gs://bucket", "img.ozx")
    assert split_archive("https://host/a/b.zip") == ("https://host/a", "b.zip")
    (tmp_path / "x.zip").write_bytes(b"")
    assert split_archive(f"file://{tmp_path}/x.zip") == (str(tmp_path), "x.zip")
    for bad, words in (("gs://bucket", "names no archive"), (str(tmp_path / "none.zip"), "does not exist"),
                       (str(tmp_path), "not a file")):
        with pytest.raises(ConfigError, match=words):
            split_archive(bad)
