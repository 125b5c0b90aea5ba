"""The plan of a split check or export: tasks of bounded size made once by the client, each reading
only its own shards and listing nothing."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from unshardfs.app.opened import OpenOptions
from unshardfs.app.planner import (TASK_SHARDS_MAX, Survey, TaskWork, deal, parse_tasks, plan_tasks,
                                   shards_per_task, task_lines)
from unshardfs.app.split import Part, run_part
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.mounts import run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.testing.trees import exported_files, walk_files
from unshardfs.util.errors import ConfigError

SHARDED, PLAIN = "1_1_1", "2_2_2"


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    """4,096 chunk files in 256 shards, 64 unsharded chunk files and the info."""
    root = tmp_path_factory.mktemp("planner")
    return write_volume(root, [Scale((128, 128, 64), (8, 8, 4), sharding(minishard=1, shard=8)),
                               Scale((32, 32, 32), (8, 8, 8), None, resolution=(2, 2, 2))], "uint8")


def shard_numbers(directory: Path) -> set[int]:
    return {int(p.name.removesuffix(".shard"), 16) for p in directory.glob("*.shard")}


def test_every_shard_is_in_exactly_one_bounded_task_and_few_files_go_with_the_last(volume):
    sharded = volume["sharded"]
    planned = plan_tasks(str(sharded), OpenOptions(versions=False), threads=4)
    assert planned.shards == len(shard_numbers(sharded / SHARDED)) > 200
    chunk_tasks = [w for w in planned.works if w.groups]
    # Each shard in one task, none twice, none left out; at most TASK_SHARDS_MAX to a task.
    dealt = Counter((g.dir, g.store, s) for w in chunk_tasks for g in w.groups for s in g.shards)
    assert set(dealt.values()) == {1}
    assert {s for _, _, s in dealt} == shard_numbers(sharded / SHARDED)
    assert {d for d, _, _ in dealt} == {SHARDED}
    assert all(w.shards <= TASK_SHARDS_MAX for w in chunk_tasks) and len(chunk_tasks) >= planned.shards / TASK_SHARDS_MAX
    # Files with no shard (the info, the unsharded scale) and the directories: few and small here,
    # so they go with the last task of shards.
    assert [w for w in planned.works if w.files or w.dirs] == [planned.works[-1]]
    files = [f for w in planned.works for f in w.files]
    assert sorted(files) == sorted(rel for rel in walk_files(volume["plain"]) if not rel.startswith(SHARDED + "/"))
    assert sorted(d for w in planned.works for d in w.dirs) == [SHARDED, PLAIN]
    # --parts sets how many tasks the shards are dealt into.
    assert len([w for w in plan_tasks(str(sharded), OpenOptions(versions=False), 4, parts=3).works if w.groups]) == 3


def test_dealing_bounds_every_task():
    found = Survey()
    found.entries = [("d", None)] + [(f"d/f{i}", 10) for i in range(25)] + [("big", 500), ("e", None)]
    found.shards = [("s", "s", i) for i in range(10)] + [("t/u", "t/u", (i, 0)) for i in range(7)]
    works = deal(found, per_task=4, files=10, size=100)
    files = [w for w in works if not w.groups]
    assert [len(w.dirs) + len(w.files) for w in files] == [10, 10, 6, 2]
    assert files[-1] == TaskWork(("e",), ("big",))  # a file beyond the byte bound: no other file with it
    chunks = [w for w in works if w.groups]
    assert [w.shards for w in chunks] == [4, 4, 4, 4, 1]
    # A task spanning two directories holds a group of each, in listing order.
    assert [(g.dir, g.shards) for g in chunks[2].groups] == [("s", (8, 9)), ("t/u", ((0, 0), (1, 0)))]
    assert deal(Survey(), per_task=4) == [TaskWork()]  # an empty tree: one empty task


def test_the_task_list_round_trips_and_refuses_what_is_not_ours():
    found = Survey([("a", None), ("a/b", 3)], [("z/c", "z", (1, 2)), ("z/c", "z", (1, 3)), ("", ".", 7)])
    works = deal(found, per_task=2)
    assert parse_tasks(list(task_lines(works)), "tasks", len(works)) == works
    with pytest.raises(ConfigError):
        parse_tasks(list(task_lines(works)), "tasks", len(works) - 1)
    for bad in ({"task": 0, "files": ["../up"]}, {"task": 0, "files": ["/abs"]}, {"task": 0, "dirs": ["a//b"]},
                {"task": 1}, {"task": 0, "groups": [{"dir": "x", "store": "x", "shards": [True]}]},
                {"task": 0, "groups": [{"dir": "x", "store": "x", "shards": []}]}, [0]):
        with pytest.raises(ConfigError):
            parse_tasks([json.dumps(bad).encode()], "tasks", 1)


@pytest.mark.slow
def test_a_task_reads_only_its_own_shards(volume):
    """Over plain HTTP (which cannot list): planning probes the shard names once; a task then asks
    only for its own shards (their indexes and chunks), and checks exactly their chunk files."""
    with DatasetServer(volume["sharded"].parent) as server:
        url = f"{server.url}/sharded"
        planned = plan_tasks(url, OpenOptions(versions=False), threads=4)
        chunk_tasks = [(i, w) for i, w in enumerate(planned.works) if w.groups]
        names = {int(p.name.removesuffix(".shard"), 16): p.name for p in (volume["sharded"] / SHARDED).glob("*.shard")}
        files = 0
        for i, work in chunk_tasks:
            server.reset_log()
            result = run_part(Part(url, OpenOptions(versions=False), i, work))
            assert not result.problems and not result.summary.failures
            touched = {e.path.rpartition("/")[2] for e in server.log if e.path.endswith(".shard")}
            assert touched == {names[s] for g in work.groups for s in g.shards}
            files += result.summary.files - len(work.files)  # (the files with no shard go with a task of shards)
        # Between them, every chunk file once.
        assert files == len([rel for rel in walk_files(volume["plain"]) if rel.startswith(SHARDED + "/")])


@pytest.mark.slow
def test_listings_are_not_repeated_per_task(volume, tmp_path):
    """Over a listable store (the GCS JSON API): an export in 32 tasks lists what one in one task
    lists (planning lists each directory; no task lists anything), and equals the plain tree."""
    with DatasetServer(volume["sharded"].parent, gcs_bucket="bkt", page_size=50) as server:
        lists = {}
        for parts in (1, 32):
            dest = tmp_path / f"out{parts}"
            server.reset_log()
            result = run_cli("export", "-q", "--parts", str(parts), "gs://bkt/sharded", str(dest),
                             "--gcs-endpoint", server.url, timeout=300)
            assert result.returncode == 0, result.stderr
            lists[parts] = sum("/storage/v1/b/bkt/o?" in e.path or e.path.endswith("/storage/v1/b/bkt/o")
                               for e in server.log)
            tasks = json.loads((dest / ".unshardfs" / "plan.json").read_text())["tasks"]
            assert tasks >= parts
            reference = exported_files(volume["plain"])
            copy = exported_files(dest)
            assert sorted(copy) == sorted(reference)
            assert all(copy[r].read_bytes() == reference[r].read_bytes() for r in reference if r != "info")
        assert 0 < lists[32] == lists[1], lists


def test_resume_runs_the_recorded_tasks(volume, tmp_path):
    """A resume takes the task list DEST holds, whatever the tree holds meanwhile; a DEST whose task
    list was garbled is refused with one line."""
    src = tmp_path / "src"
    shutil.copytree(volume["sharded"], src)
    dest = tmp_path / "out"
    assert run_cli("export", "-q", str(src), str(dest)).returncode == 0
    listed = (dest / ".unshardfs" / "tasks.jsonl").read_bytes()
    task_files = sorted((dest / ".unshardfs" / "tasks").glob("*.jsonl"))
    task_files[-1].unlink()  # the last task (shards) unfinished
    (dest / ".unshardfs" / "manifest.jsonl").unlink()
    again = run_cli("export", "-q", "--resume", str(src), str(dest))
    assert again.returncode == 0, again.stderr
    assert (dest / ".unshardfs" / "tasks.jsonl").read_bytes() == listed
    assert "0 written" not in again.stdout and "already complete" in again.stdout
    # A task list naming shards the store cannot have: those are skipped with one line each, and
    # the task stays unfinished.
    lines = listed.decode().splitlines()
    last = json.loads(lines[-1])
    last["groups"][0]["shards"] = [[1, 2], "x", 10**30]
    (dest / ".unshardfs" / "tasks.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")
    task_files[-1].unlink()
    planted = run_cli("export", "-q", "--resume", str(src), str(dest))
    assert planted.returncode == 1 and "Traceback" not in planted.stderr, planted.stderr
    assert sorted(planted.stderr.strip().splitlines()) == [
        f"not exported: listing {SHARDED}: the task names shard {bad}, which this store cannot have; skipped"
        for bad in ("'x'", "(1, 2)", str(10**30))], planted.stderr
    (dest / ".unshardfs" / "tasks.jsonl").write_text('{"task": 0, "files": ["../../etc/passwd"]}\n')
    refused = run_cli("export", "-q", "--resume", str(src), str(dest))
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "is not an unshardfs task" in refused.stderr
