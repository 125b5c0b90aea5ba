"""`serve`'s request parsing, in-process: byte ranges (RFC 9110, single ranges only) and paths
(segment by segment, never a name outside the tree), with the status of every refusal."""

from __future__ import annotations

import pytest

from unshardfs.http.app import HttpError, parse_range, split_path


@pytest.mark.parametrize("value, want", [
    (None, None), ("", None),
    ("bytes=0-99", (0, 100)), ("bytes=10-", (10, 1000)), ("bytes=-100", (900, 1000)),
    ("bytes=990-5000", (990, 1000)),  # clipped at the end
    ("bytes=-5000", (0, 1000)),  # a suffix longer than the file: all of it
    ("bytes=0-1,5-6", None), ("items=0-1", None), ("bytes=x-y", None), ("bytes=-", None),  # whole file
])
def test_ranges(value, want):
    assert parse_range(value, 1000) == want


@pytest.mark.parametrize("value, reason", [
    ("bytes=1000-", "range not satisfiable"), ("bytes=5-4", "range not satisfiable"),
    ("bytes=-0", "empty suffix range"),
])
def test_unsatisfiable_ranges_are_416_with_the_size(value, reason):
    with pytest.raises(HttpError) as e:
        parse_range(value, 1000)
    assert (e.value.status, str(e.value), e.value.headers) == (416, reason, {"Content-Range": "bytes */1000"})


@pytest.mark.parametrize("raw, want", [
    (b"/", ([], True)), (b"/a/b", (["a", "b"], False)), (b"/a/b/", (["a", "b"], True)),
    (b"//a//b", (["a", "b"], False)), (b"/a%20b/c?x=1", (["a b", "c"], False)),
    (b"/%2561", (["%61"], False)),  # decoded once, not twice
])
def test_paths(raw, want):
    assert split_path(raw) == want


@pytest.mark.parametrize("raw", [b"/..", b"/a/../../etc", b"/a%2Fb", b"/a%00b", b"/%ff", b"/."])
def test_names_outside_the_tree_are_404(raw):
    with pytest.raises(HttpError) as e:
        split_path(raw)
    assert e.value.status == 404


def test_json_content_types_come_from_the_formats(monkeypatch):
    from unshardfs.core import registry
    from unshardfs.http.app import content_type

    for name in ("info", "provenance", "zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata", "x.json"):
        assert content_type(name) == "application/json", name
    for name in ("0-64_0-64_0-64", "c", "info.bak", "manifest"):
        assert content_type(name) == "application/octet-stream", name

    class Declares(registry.FormatPlugin):
        name, description, marker = "declares", "test", "nothing"
        json_names = ("manifest",)

        async def detect(self, source, options):
            return False

        async def open(self, runtime, options):
            raise NotImplementedError

    monkeypatch.setattr(registry, "_PLUGINS", dict(registry._PLUGINS))  # both restored after the test
    monkeypatch.setattr(registry, "_json_names", registry._json_names)
    registry.register_format(Declares)
    assert content_type("manifest") == "application/json"
