"""Every answer to a Range request, checked against RFC 9110 in-process: the app serves one file of
a generated size (0 and 1 included) and each answer is held to what its status promises.

- 206: `Content-Range: bytes first-last/size` with 0 <= first <= last < size, a body of
  last - first + 1 bytes that are the file's bytes there (none for HEAD), Content-Length to match;
- 416: `Content-Range: bytes */size`;
- 200: the whole file, no Content-Range.

Beyond those invariants `expected` pins which of the three each request gets: a single byte range
is served when satisfiable, an unsatisfiable one is a 416, several ranges, other units and
malformed values get the whole file, and an If-Range that does not hold (another ETag, a weak
one, or a date) means the Range is ignored, however unsatisfiable.
"""

from __future__ import annotations

import re

import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support.profiles import examples
from unshardfs.http.app import TreeApp
from unshardfs.tree.nodes import DirNode, FileNode, Node

MTIME_NS = 1_700_000_000_123_456_789


class _File(FileNode):
    def __init__(self, data: bytes) -> None:
        super().__init__(len(data), MTIME_NS)
        self.data = data

    async def read(self, offset: int, size: int) -> bytes:
        return self.data[offset:offset + size]


class _Root(DirNode):
    def __init__(self, file: _File) -> None:
        super().__init__(MTIME_NS)
        self.file = file

    async def lookup(self, name: str) -> Node | None:
        return self.file if name == "f" else None


def answer(data: bytes, headers: dict[str, str], method: str) -> tuple[int, dict[str, str], bytes]:
    """The app's answer to `method /f` with `headers`: status, headers (lower-case names), body."""
    app = TreeApp(_Root(_File(data)), dict)
    messages: list[dict] = []

    async def send(message: dict) -> None:
        messages.append(message)

    scope = {"type": "http", "method": method, "path": "/f", "raw_path": b"/f", "query_string": b"",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]}
    trio.run(app, scope, None, send)
    start, *bodies = messages
    assert start["type"] == "http.response.start" and all(m["type"] == "http.response.body" for m in bodies)
    assert not bodies[-1].get("more_body", False)
    return (start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in bodies))


def tag_of(size: int) -> str:
    return f'"{size:x}-{MTIME_NS:x}"'


def expected(size: int, value: str | None, if_range: str | None) -> tuple[int, tuple[int, int] | None]:
    """(status, (first, last) of a 206) RFC 9110 asks of a server that serves single byte ranges."""
    if value is None or (if_range is not None and if_range.strip() != tag_of(size)):
        return 200, None
    single = re.fullmatch(r"bytes=(\d*)-(\d*)", value.strip(), re.IGNORECASE)
    if single is None or single.groups() == ("", ""):
        return 200, None
    first, last = single.groups()
    if not first:  # the last n bytes
        if int(last) == 0:
            return 416, None
        return (200, None) if size == 0 else (206, (max(0, size - int(last)), size - 1))
    if last and int(last) < int(first):
        return 416, None
    if int(first) >= size:
        return 416, None
    return 206, (int(first), min(int(last), size - 1) if last else size - 1)


def check(data: bytes, value: str | None, if_range: str | None, method: str) -> None:
    headers = {"Range": value} if value is not None else {}
    if if_range is not None:
        headers["If-Range"] = if_range
    status, got, body = answer(data, headers, method)
    size = len(data)
    want = b"" if method == "HEAD" else None
    if status == 206:
        match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", got.get("content-range", ""))
        assert match, got
        first, last, total = map(int, match.groups())
        assert 0 <= first <= last < size and total == size, got["content-range"]
        assert int(got["content-length"]) == last - first + 1
        assert body == (want if want is not None else data[first:last + 1])
    elif status == 416:
        assert got["content-range"] == f"bytes */{size}"
    else:
        assert status == 200 and "content-range" not in got, (status, got)
        assert int(got["content-length"]) == size and body == (want if want is not None else data)
    status_wanted, span = expected(size, value, if_range)
    assert status == status_wanted, (size, value, if_range, status)
    if span is not None:
        assert got["content-range"] == f"bytes {span[0]}-{span[1]}/{size}"


def _numbers(size: int) -> st.SearchStrategy[str]:
    near = st.integers(0, size + 3).map(str)
    return st.one_of(near, st.just("9" * 30), st.just("0" * 25 + "1"))


@st.composite
def range_values(draw: st.DrawFn, size: int) -> str | None:
    def spec() -> str:
        form = draw(st.sampled_from(["a-b", "a-", "-n"]))
        a, b = draw(_numbers(size)), draw(_numbers(size))
        return {"a-b": f"{a}-{b}", "a-": f"{a}-", "-n": f"-{b}"}[form]

    kind = draw(st.sampled_from(["none", "single", "single", "single", "several", "unit", "junk"]))
    if kind == "none":
        return None
    if kind == "single":
        return draw(st.sampled_from(["bytes", "Bytes", "BYTES"])) + "=" + spec()
    if kind == "several":
        return "bytes=" + ",".join(spec() for _ in range(draw(st.integers(2, 3))))
    if kind == "unit":
        return draw(st.sampled_from(["items", "bits", "byte"])) + "=" + spec()
    return draw(st.sampled_from(["", "bytes=", "bytes=-", "bytes=a-b", "bytes=1-2-3", "bytes = 0-1", "bytes=0 -1",
                                 "bytes=--1", "bytes=+1-2", "bytes=0x1-2", "=0-1", "bytes=\t0-1", "bytes=1-,"]))


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, str | None, str | None, str]:
    size = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, 64)))
    data = bytes(draw(st.integers(0, 255)) for _ in range(size)) if size < 8 else bytes(range(size))
    if_range = draw(st.sampled_from([None, None, "tag", "other", "weak", "date"]))
    if_range = {None: None, "tag": tag_of(size), "other": '"0-0"', "weak": "W/" + tag_of(size),
                "date": "Tue, 14 Nov 2023 22:13:20 GMT"}[if_range]
    return data, draw(range_values(size)), if_range, draw(st.sampled_from(["GET", "HEAD"]))


@settings(max_examples=examples(1500), deadline=None)
@given(requests())
@example((b"", "bytes=-5", None, "GET"))  # a suffix of nothing: never `206 bytes 0--1/0`
@example((b"", "bytes=0-", None, "GET"))
@example((b"", "bytes=-1", None, "HEAD"))
@example((b"x", "bytes=-1", None, "GET"))
@example((b"x", "bytes=0-0", None, "GET"))
@example((b"x", "bytes=1-", None, "GET"))
@example((b"abc", "bytes=5-", '"0-0"', "GET"))  # If-Range false: the Range is ignored, not a 416
def test_every_range_answer_keeps_its_promise(case):
    check(*case)
