"""DEST in object storage, unit by unit over a mock transport (`tests/support/mockstores.py`): paged
listings, repeated and oversized page tokens, 412s, stores that fail or lie. Every assertion is on
requests sent and errors raised; nothing waits on a clock but the millisecond backoff."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Iterator

import httpx
import pytest

from tests.support.mockstores import GCS_ENDPOINT, S3_ENDPOINT, MockGcs, MockS3, MockStore
from unshardfs.dest.base import Dest, WriteStopped
from unshardfs.dest.objects import open_objects
from unshardfs.sources import RemoteOptions
from unshardfs.sources.http import HttpOptions
from unshardfs.util.errors import ConfigError, DataError

FAST = RemoteOptions(http=HttpOptions(retries=2, backoff=0.001, backoff_max=0.002, timeout=5.0),
                     s3_endpoint=S3_ENDPOINT, gcs_endpoint=GCS_ENDPOINT)


@pytest.fixture(autouse=True)
def anonymous(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """No credentials from the machine: requests to the mocks are unsigned, and nothing else is asked."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "none.json"))


def opened(store: MockStore, prefix: str = "copy", probe: bool = False) -> Dest:
    scheme = "s3" if isinstance(store, MockS3) else "gs"
    return open_objects(f"{scheme}://{store.bucket}/{prefix}", FAST, probe=probe, transport=store.transport())


@pytest.fixture(params=["s3", "gs"])
def store(request: pytest.FixtureRequest) -> MockStore:
    return MockS3() if request.param == "s3" else MockGcs()


@pytest.fixture
def dest(store: MockStore) -> Iterator[Dest]:
    out = opened(store)
    yield out
    out.close()


def outage(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503, content=b"<Error><Code>SlowDown</Code></Error>")


# -- listings ----------------------------------------------------------------------------------------

def test_a_listing_follows_every_page(store: MockStore, dest: Dest) -> None:
    """Seven objects in pages of two: four listing requests, every name once."""
    for i in range(7):
        store.objects[f"copy/d/{i}"] = b"x"
    store.objects["copy/.unshardfs/plan.json"] = b"{}"
    store.objects["other/0"] = b"not below the prefix"
    assert sorted(dest.files.files()) == [(f"d/{i}", "") for i in range(7)]
    assert len(store.sent("GET")) == 4


def test_a_listing_by_directory_names_objects_and_sub_directories(store: MockStore, dest: Dest) -> None:
    for key in ("copy/t/a", "copy/t/b", "copy/t/sub/c", "copy/t/sub/d", "copy/t/z"):
        store.objects[key] = b"x"
    assert sorted(dest.records.names("t")) == ["a", "b", "sub", "z"]


@pytest.mark.parametrize("token", ["same", "x" * 5000])
def test_a_repeated_or_oversized_page_token_is_an_error_naming_the_listing(store: MockStore, dest: Dest,
                                                                           token: str) -> None:
    """The store names the same next page again and again (or a token of 5,000 characters): the
    listing ends with an error after at most two pages, never loops, never reads as empty."""
    for i in range(5):
        store.objects[f"copy/t/{i}"] = b"x"
    real = store.handle

    def lying(request: httpx.Request) -> httpx.Response:
        answer = real(request)
        if isinstance(store, MockS3):
            body = re.sub(rb"<NextContinuationToken>[^<]*<", f"<NextContinuationToken>{token}<".encode(),
                          answer.content)
            return httpx.Response(answer.status_code, content=body)
        doc = answer.json()
        if "nextPageToken" in doc:
            doc["nextPageToken"] = token
        return httpx.Response(answer.status_code, json=doc)

    store.fault = lying
    with pytest.raises(DataError, match="cannot be listed: listing .*(repeated page token|page token of 5000)"):
        dest.records.names("t")
    assert len(store.sent("GET")) <= 2
    with pytest.raises(DataError, match="cannot be listed"):
        list(dest.files.files())


def test_an_object_of_an_absurd_size_in_a_listing_is_an_error(store: MockStore, dest: Dest) -> None:
    store.objects["copy/a"] = b"x"
    real = store.handle

    def absurd(request: httpx.Request) -> httpx.Response:
        answer = real(request)
        if isinstance(store, MockS3):
            return httpx.Response(200, content=answer.content.replace(b"<Size>1<", b"<Size>99999999999999999999<"))
        doc = answer.json()
        for item in doc["items"]:
            item["size"] = "-5"
        return httpx.Response(200, json=doc)

    store.fault = absurd
    with pytest.raises(DataError, match="cannot be listed"):
        list(dest.files.files())


# -- absent is absent, an outage is an error ------------------------------------------------------------

def test_exists_answers_false_only_for_an_object_that_is_not_there(store: MockStore, dest: Dest) -> None:
    store.objects["copy/.unshardfs/manifest.jsonl"] = b"{}\n"
    assert dest.records.exists(".unshardfs/manifest.jsonl")
    assert not dest.records.exists(".unshardfs/plan.json")


def test_an_outage_is_never_read_as_no_such_object(store: MockStore, dest: Dest) -> None:
    """A store answering 503 to everything (each request tried three times): whether a record exists,
    its bytes, its lines and a directory's names are errors naming the record, not 'absent'."""
    store.objects["copy/.unshardfs/manifest.jsonl"] = b"{}\n"
    store.fault = outage
    for ask in (lambda: dest.records.exists(".unshardfs/manifest.jsonl"),
                lambda: dest.records.read_small(".unshardfs/plan.json", 100),
                lambda: list(dest.records.lines(".unshardfs/tasks.jsonl")),
                lambda: dest.records.names(".unshardfs/tasks")):
        sent = len(store.requests)
        with pytest.raises(DataError, match=r"\.unshardfs/.*HTTP 503 SlowDown \(after 3 attempts\)"):
            ask()
        assert len(store.requests) - sent == 3
    found = dest.files.measure("a")
    assert found.problem is not None and "HTTP 503" in found.problem


def test_a_connection_that_fails_is_an_error_too(store: MockStore, dest: Dest) -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    store.fault = refused
    with pytest.raises(DataError, match="ConnectError"):
        dest.records.exists("x")


def test_a_store_that_recovers_answers_after_its_retries(store: MockStore, dest: Dest) -> None:
    store.objects["copy/r"] = b"record"
    failures = iter([outage, outage])

    def twice(request: httpx.Request) -> httpx.Response | None:
        fault = next(failures, None)
        return fault(request) if fault is not None else None

    store.fault = twice
    assert dest.records.read_small("r", 100) == b"record"
    assert len(store.requests) == 3


def test_a_missing_bucket_or_no_permission_is_one_line_before_anything_runs() -> None:
    for status, why in ((404, "does not exist"), (403, "no permission to list it")):
        store = MockS3()
        store.fault = lambda request, status=status: MockS3.error(status, "Nope")
        with pytest.raises(ConfigError, match=why):
            opened(store, probe=True)
        assert len(store.requests) == 1


# -- conditional writes -------------------------------------------------------------------------------

def test_a_file_is_created_only_where_none_is(store: MockStore, dest: Dest) -> None:
    assert dest.files.write("a/b", [b"new ", b"bytes"]) is True
    assert store.objects["copy/a/b"] == b"new bytes"
    put = store.sent("PUT" if isinstance(store, MockS3) else "POST")[0]
    if isinstance(store, MockS3):
        assert put.headers["if-none-match"] == "*"
    else:
        assert "ifGenerationMatch=0" in str(put.url)


def test_a_412_over_the_same_bytes_keeps_them(store: MockStore, dest: Dest) -> None:
    """The object is there already with these very bytes (a run killed after its PUT): the 412 is
    answered by a HEAD, and the file counts as found, not written; nothing is rewritten."""
    store.objects["copy/a"] = b"same"
    assert dest.files.write("a", [b"same"]) is False
    writes = [r for r in store.requests if r.method in ("PUT", "POST")]
    assert len(writes) == 1 and store.objects["copy/a"] == b"same"


def test_a_412_over_other_bytes_replaces_exactly_that_object(store: MockStore, dest: Dest) -> None:
    store.objects["copy/a"] = b"stale bytes"
    if isinstance(store, MockGcs):
        store.generations["copy/a"] = 7
    assert dest.files.write("a", [b"fresh"]) is True
    assert store.objects["copy/a"] == b"fresh"
    replace = [r for r in store.requests if r.method in ("PUT", "POST")][-1]
    if isinstance(store, MockS3):
        assert replace.headers["if-match"] == f'"{hashlib.md5(b"stale bytes").hexdigest()}"'
    else:
        assert "ifGenerationMatch=7" in str(replace.url)


def test_records_are_replaced_whatever_is_there(store: MockStore, dest: Dest) -> None:
    store.objects["copy/.unshardfs/plan.json"] = b"old"
    dest.records.replace(".unshardfs/plan.json", [b"new"])
    assert store.objects["copy/.unshardfs/plan.json"] == b"new"
    put = [r for r in store.requests if r.method in ("PUT", "POST")][0]
    assert "if-none-match" not in put.headers and "ifGenerationMatch" not in str(put.url)


def test_a_store_that_lies_about_what_it_stored_stops_the_run(store: MockStore, dest: Dest) -> None:
    """The store answers a PUT with another body's checksum: the run stops with one line naming the
    file; the lie is never counted as written."""
    real = store.handle

    def lying(request: httpx.Request) -> httpx.Response:
        answer = real(request)
        if request.method == "PUT":
            return httpx.Response(200, headers={"etag": '"0123"', "x-amz-checksum-crc32c": "AAAAAA=="})
        if request.method == "POST":
            doc = answer.json()
            doc["size"] = "1"
            return httpx.Response(200, json=doc)
        return answer

    store.fault = lying
    with pytest.raises(WriteStopped, match="cannot write a: .*(crc32c|holds 1 bytes)"):
        dest.files.write("a", [b"some bytes"])


def test_a_refused_write_stops_the_run_and_an_unsafe_name_fails_alone(store: MockStore, dest: Dest) -> None:
    store.fault = lambda request: (MockS3.error(403, "AccessDenied") if request.method in ("PUT", "POST")
                                   else None)
    with pytest.raises(WriteStopped, match="cannot write a: .*HTTP 403"):
        dest.files.write("a", [b"x"])
    sent = len(store.requests)
    with pytest.raises(DataError, match="not requested"):
        dest.files.write("a/../../escape", [b"x"])
    with pytest.raises(DataError, match="not requested"):
        dest.files.open_file("k" * 2000)
    assert len(store.requests) == sent


def test_a_record_bigger_than_its_limit_is_refused_unread(store: MockStore, dest: Dest) -> None:
    store.objects["copy/.unshardfs/plan.json"] = b"x" * 5000
    with pytest.raises(DataError, match="plan.json: cannot be read: .*more than 100 bytes"):
        dest.records.read_small(".unshardfs/plan.json", 100)


def test_a_record_s_lines_come_cut_at_the_line_limit(store: MockStore, dest: Dest) -> None:
    from unshardfs.dest.base import LINE_LIMIT

    store.objects["copy/r"] = b"short\n" + b"y" * (2 * LINE_LIMIT + 10) + b"\nlast"
    lines = list(dest.records.lines("r"))
    assert lines[0] == b"short\n" and all(len(line) <= LINE_LIMIT for line in lines)
    assert b"".join(lines) == store.objects["copy/r"] and lines[-1] == b"last"


def test_a_journal_is_stored_as_segments_and_read_back_in_order(store: MockStore, dest: Dest) -> None:
    journal = dest.records.journal(".unshardfs/tasks/000001.journal")
    assert not journal.rerun
    journal.append(b'{"a": 1}\n')
    journal.append(b'{"b": 2}\n')
    journal.close()
    again = dest.records.journal(".unshardfs/tasks/000001.journal")
    assert again.rerun
    again.append(b'{"c": 3}\n')
    again.close()
    # Each run's segments in order (two runs of one second may come in either order).
    lines = list(dest.records.journal_lines(".unshardfs/tasks/000001.journal"))
    assert sorted(lines) == [b'{"a": 1}\n', b'{"b": 2}\n', b'{"c": 3}\n']
    assert lines.index(b'{"a": 1}\n') + 1 == lines.index(b'{"b": 2}\n')
    dest.records.drop_journal(".unshardfs/tasks/000001.journal")
    assert not [k for k in store.objects if ".journal" in k]

