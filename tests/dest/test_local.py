"""DEST as a local directory, in-process: opened in one place (made, or required), records read back
without following links or blocking on what is planted there, temporaries of one task swept by it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from unshardfs.dest.atomic import is_temp
from unshardfs.dest.opener import dest_name, open_dest
from unshardfs.util.errors import ConfigError, DataError


def test_dest_is_made_for_an_export_and_required_for_a_check(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="DEST .*missing"):
        open_dest(str(tmp_path / "missing"), create=False)
    open_dest(str(tmp_path / "made" / "deep")).close()
    assert (tmp_path / "made" / "deep").is_dir()
    (tmp_path / "file").write_bytes(b"x")
    for create in (True, False):
        with pytest.raises(ConfigError, match="(is not a|Not a) directory"):
            open_dest(str(tmp_path / "file"), create=create)
    open_dest(f"file://{tmp_path / 'made'}", create=False).close()
    with pytest.raises(ConfigError, match="ftp:// is not supported as DEST"):
        open_dest("ftp://host/x")
    assert dest_name("rel/dir") == str(Path("rel/dir").absolute()) and dest_name("s3://b/p") == "s3://b/p"


def test_records_planted_as_links_or_fifos_are_errors_not_absences(tmp_path: Path) -> None:
    """A link where the ledger's directory goes, a FIFO where a record goes: reading them fails at
    once with an error naming the record (a FIFO is never opened to block); `exists` says so too,
    instead of 'absent'."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "plan.json").write_bytes(b"{}")
    root = tmp_path / "dest"
    root.mkdir()
    (root / ".unshardfs").symlink_to(outside)
    os.mkfifo(root / "fifo")
    dest = open_dest(str(root))
    try:
        for ask in (lambda: dest.records.read_small(".unshardfs/plan.json", 100),
                    lambda: dest.records.exists(".unshardfs/plan.json"),
                    lambda: dest.records.names(".unshardfs"),
                    lambda: list(dest.records.lines(".unshardfs/plan.json"))):
            with pytest.raises(DataError, match=r"\.unshardfs"):
                ask()
        with pytest.raises(DataError, match="fifo: is not a regular file"):
            dest.records.read_small("fifo", 100)
        assert dest.records.read_small("absent", 100) is None and not dest.records.exists("absent")
        assert list(dest.records.lines("absent")) == [] and dest.records.names("absent") == []
    finally:
        dest.close()


def test_a_task_sweeps_its_own_temporaries_and_a_resume_all(tmp_path: Path) -> None:
    dest = open_dest(str(tmp_path))
    try:
        dest.files.make_dir("d")
        for task in (1, 2):
            pending = dest.files.for_task(task).open_file("d/f")
            pending.add(b"x")  # left unfinished, as by a kill
        temps = sorted(name for name in os.listdir(tmp_path / "d") if is_temp(name))
        assert len(temps) == 2 and [is_temp(t, 1) for t in temps].count(True) == 1
        dest.files.for_task(1).sweep("d")
        assert [name for name in os.listdir(tmp_path / "d") if is_temp(name)] == [t for t in temps if is_temp(t, 2)]
        assert dest.files.clear() == 1 and os.listdir(tmp_path / "d") == []
    finally:
        dest.close()
