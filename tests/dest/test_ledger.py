"""The ledger's records read back from DEST as the untrusted input they are (DEST is writable by
others): garbled, cut, nested, oversized or absurd records are one-line errors naming the record
(and the line), or are skipped where the ledger can do without them; never a traceback, never a
number taken beyond what it can mean."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from unshardfs.dest.base import LINE_LIMIT, Dest
from unshardfs.dest.ledger import MANIFEST_FORMAT, PLAN, FileRecord, Journal, Ledger, Plan, read_manifest, task_file
from unshardfs.dest.local import open_local
from unshardfs.util.errors import ConfigError, DataError

GOOD = {"path": "a/b", "size": 3, "crc32c": "0000abcd", "mtime_ns": 5, "source": "s.shard", "offset": 8,
        "length": 3}


@pytest.fixture
def dest(tmp_path: Path) -> Iterator[Dest]:
    out = open_local(tmp_path / "dest")
    Ledger(out.records).start(Plan("src", {}, 2))
    yield out
    out.close()


def put(dest: Dest, rel: str, data: bytes) -> None:
    (Path(dest.description) / rel).write_bytes(data)


def line(doc: object) -> bytes:
    return json.dumps(doc).encode() + b"\n"


@pytest.mark.parametrize("data, why", [
    (b"not json", "not an unshardfs export plan"),
    (b"[" * 200_000, "not an unshardfs export plan"),
    (b'["a list"]', "not an export plan of this version"),
    (line({"format": "unshardfs-export", "version": 1, "tasks": True, "source": "s", "formats": {}}), "bad fields"),
    (line({"format": "unshardfs-export", "version": 1, "tasks": 10**9, "source": "s", "formats": {}}), "bad fields"),
    (line({"format": "unshardfs-export", "version": 1, "tasks": -3, "source": "s", "formats": {}}), "bad fields"),
    (line({"format": "unshardfs-export", "version": 1, "tasks": 2, "source": 7, "formats": {}}), "bad fields"),
    (b" " * (2 << 20), "is bigger than 1,048,576 bytes"),
])
def test_a_plan_that_is_not_ours_is_one_line(dest: Dest, data: bytes, why: str) -> None:
    put(dest, PLAN, data)
    with pytest.raises(ConfigError, match=why) as caught:
        Ledger(dest.records).plan()
    assert str(caught.value).startswith(PLAN) and "\n" not in str(caught.value)


def test_a_plan_read_back_is_the_plan_written(dest: Dest) -> None:
    assert Ledger(dest.records).plan() == Plan("src", {}, 2)


def entry(*lines: bytes) -> bytes:
    return b"".join(lines)


@pytest.mark.parametrize("closing", [
    {"task": 0, "files": -1, "bytes": 3},
    {"task": 0, "files": 1, "bytes": 2**70},
    {"task": 0, "files": True, "bytes": 3},
    {"task": 1, "files": 1, "bytes": 3},  # another task's
    {"task": 0, "files": "1", "bytes": "3"},
    ["not", "an", "object"],
])
def test_a_closing_line_stating_absurd_totals_is_refused(dest: Dest, closing: object) -> None:
    put(dest, task_file(0), entry(line(GOOD), line(closing)))
    with pytest.raises(DataError, match="ledger entry unreadable or without its closing line"):
        Ledger(dest.records).task_totals(0)


def test_a_task_s_totals_come_from_its_closing_line(dest: Dest) -> None:
    put(dest, task_file(0), entry(line(GOOD), line({"task": 0, "files": 1, "bytes": 3})))
    assert Ledger(dest.records).task_totals(0) == (1, 3)


@pytest.mark.parametrize("bad, why", [
    (b"{not json\n", "line 2"),
    (b"[" * 50_000 + b"\n", "line 2: nested too deep"),
    (line({**GOOD, "path": "../../etc/passwd"}), "line 2: bad path"),
    (line({**GOOD, "size": -1}), "line 2: a/b: bad size"),
    (line({**GOOD, "size": 2**64}), "line 2: a/b: bad size"),
    (line({**GOOD, "offset": -8}), "line 2: a/b: bad offset or length"),
    (line({**GOOD, "length": None}), "line 2: a/b: bad offset or length"),
    (line({**GOOD, "mtime_ns": 10**30}), "line 2: a/b: bad mtime_ns"),
    (line({**GOOD, "source": ["x"]}), "line 2: a/b: bad source"),
    (line(17), "line 2: not an object"),
])
def test_a_garbled_ledger_entry_line_is_an_error_naming_it(dest: Dest, bad: bytes, why: str) -> None:
    """A ledger entry whose second line is garbled: gathering the manifest stops with a DataError
    naming the entry and the line (it was a JSONDecodeError or TypeError escaping)."""
    put(dest, task_file(0), entry(line(GOOD), bad, line({"task": 0, "files": 2, "bytes": 6})))
    put(dest, task_file(1), entry(line({"task": 1, "files": 0, "bytes": 0})))
    with pytest.raises(DataError, match=f"{task_file(0)}: {why}"):
        Ledger(dest.records).write_manifest(Plan("src", {}, 2))


def test_a_journal_s_garbled_lines_are_files_written_again(dest: Dest) -> None:
    """A journal cut by a kill, or tampered with: the lines that are no record are skipped (those
    files are simply written again), the others kept."""
    other = {**GOOD, "path": "c"}
    put(dest, task_file(0, "journal"), entry(line(GOOD), b'{"path": "x", "si', b"\n", line({**GOOD, "size": -4}),
                                             b"[" * 70_000 + b"\n", line(other), b"\xff\xfe\n"))
    journal = Journal.open(dest.records, 0)
    try:
        assert journal.rerun and sorted(journal.known) == ["a/b", "c"]
    finally:
        journal.close()


def test_a_manifest_round_trips(tmp_path: Path) -> None:
    records = [FileRecord("a/b", 3, 0xABCD, 5, "s.shard", 8, 3), FileRecord("c", 0, 0, -5)]
    path = tmp_path / "manifest.jsonl"
    path.write_bytes(line({"format": MANIFEST_FORMAT, "files": 2}) + b"".join(r.line().encode() for r in records))
    header, read = read_manifest(str(path))
    assert header["files"] == 2 and list(read) == records


@pytest.mark.parametrize("body, why", [
    (line({"format": "something else"}), "is not an unshardfs manifest"),
    (b"[[[[\n", "is not an unshardfs manifest"),
    (line({"format": MANIFEST_FORMAT}) + line({**GOOD, "size": 2**63}), "line 2: a/b: bad size"),
    (line({"format": MANIFEST_FORMAT}) + line(GOOD) + b"x" * (3 * LINE_LIMIT) + b"\n", "line 3"),
    (line({"format": MANIFEST_FORMAT}) + line({**GOOD, "path": "a//b"}), "line 2: bad path"),
])
def test_a_manifest_that_lies_is_one_line_naming_where(tmp_path: Path, body: bytes, why: str) -> None:
    path = tmp_path / "manifest.jsonl"
    path.write_bytes(body)
    with pytest.raises(ConfigError, match=why) as caught:
        _, records = read_manifest(str(path))
        list(records)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 1000
