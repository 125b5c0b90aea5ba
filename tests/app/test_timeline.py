"""An export task's timeline: what it waited for and what it asked of the store, pinned per task in
process over a store with a latency under trio's MockClock and at a test HTTP server; the run's
statistics (`export --stats`)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import trio
import trio.testing

from unshardfs.app.opened import OpenedSource, OpenOptions
from unshardfs.app.planner import TaskWork, deal, survey, task_lines
from unshardfs.app.split import Part, PartResult, run_part, run_task
from unshardfs.app.timeline import WAITS, RunPhases, TaskTimeline, settle_idle, summary
from unshardfs.core.runtime import ShardScope
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.testing.mounts import run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.testing.trees import exported_files
from unshardfs.dest.ledger import Ledger, Plan
from unshardfs.dest.opener import open_dest

LATENCY = 0.1
SHARDS_PER_TASK = 2


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """256 chunk files in 4 shards of 2 minishards each, and the info."""
    root = tmp_path_factory.mktemp("timeline")
    return write_volume(root, [Scale((64, 64, 32), (8, 8, 8), sharding(minishard=1, shard=2))])


@pytest.fixture(scope="module")
def files(volume: dict[str, Path]) -> MemorySource:
    return MemorySource.from_directory(volume["sharded"])


@pytest.fixture(scope="module")
def works(files: MemorySource) -> list[TaskWork]:
    """The plan: two tasks of two shards, the info and the directory with the last."""
    async def plan() -> list[TaskWork]:
        session = await OpenedSource.over(LatencySource(files, 0), None, OpenOptions(versions=False))
        scope = ShardScope(planning=True)
        session.runtime.shard_scope = scope
        async with session.running():
            found = await survey(session.tree, scope, True)
        await session.aclose()
        return deal(found, SHARDS_PER_TASK, named=session.dataset.format)
    return trio.run(plan)


def _dest(where: Path, works: list[TaskWork]) -> str:
    out = open_dest(str(where))
    try:
        Ledger(out.records).start(Plan("memory", {}, len(works)), task_lines(works))
    finally:
        out.close()
    return str(where)


def _consistent(t: TaskTimeline) -> None:
    """Every part of the wall time is there, none negative, and they add up to it."""
    parts = [getattr(t, kind) for kind in (*WAITS, "work")]
    assert all(p >= 0 for p in parts) and t.idle >= 0 and t.cpu >= 0
    assert sum(parts) == pytest.approx(t.wall, abs=1e-6)


def test_a_task_waits_on_the_store_a_known_number_of_round_trips(files, works, tmp_path):
    """Each task opens SOURCE (its info: one request), then reads its shards' indexes (their first
    bytes with their stat: one round trip; their minishard indexes: one) and their chunks (one):
    requests and round trips are pinned, and the timeline states them and where the waits went."""
    dest = _dest(tmp_path / "out", works)
    results: list[tuple[PartResult, LatencySource]] = []
    for part, work in enumerate(works):
        source = LatencySource(files, LATENCY)
        job = Part("memory", OpenOptions(versions=False), part, work, dest, 4, False)
        result = trio.run(functools.partial(run_task, job, source=source),
                          clock=trio.testing.MockClock(autojump_threshold=0))
        assert result.complete and not result.summary.failures
        results.append((result, source))
    # Each task: the info with its stat, the root's stat (which an HTTP source answers without a
    # request), its shards' first bytes, their minishard indexes, their chunks.
    for result, source in results:
        assert dict(source.counts()) == {"stat": 1, "head": 1 + SHARDS_PER_TASK, "read": 3 * SHARDS_PER_TASK}
        assert source.round_trips() == 5
    for result, source in results:
        t = result.timeline
        assert t is not None and t.task == result.part
        assert (t.requests, t.round_trips) == (len(source.log), source.round_trips())
        assert (t.files, t.bytes) == (result.summary.files, result.summary.bytes)
        _consistent(t)
        assert t.open == pytest.approx(2 * LATENCY)  # waits on trio's mock clock are whole round trips
    shards = [r.timeline for r, _ in results if r.timeline is not None]
    assert all(t.indexes + t.data == pytest.approx(3 * LATENCY) for t in shards)
    assert sum(r.summary.files for r, _ in results) == len(exported_files(tmp_path / "out"))


def test_requests_and_round_trips_per_task_are_those_the_server_saw(volume, works, tmp_path):
    """Over HTTP, each task's timeline counts exactly the requests the server logged for it, and
    their chain: the info (one request, with its stat), its shards' first bytes, their minishard
    indexes, their chunks."""
    dest = _dest(tmp_path / "out", works)
    with DatasetServer(volume["sharded"].parent) as server:
        server.faults.delay = 0.05
        url = f"{server.url}/sharded"
        for part, work in enumerate(works):
            server.reset_log()
            result = run_part(Part(url, OpenOptions(versions=False), part, work, dest, 4, False))
            t = result.timeline
            assert result.complete and t is not None
            assert (t.requests, t.round_trips) == (len(server.requests()), server.round_trips())
            assert t.round_trips == 4, server.requests()
            _consistent(t)


def test_idle_is_the_wait_of_each_worker_before_each_task():
    """A worker's first task waited since the tasks were submitted; each later one since the task
    before it on that worker ended. The summary sums, takes medians and names the slowest task."""
    def task(n: int, worker: str, started: float, wall: float, data: float) -> TaskTimeline:
        t = TaskTimeline(n, worker, started, wall)
        t.settle({"data": data, "open": 0.1})
        return t
    tasks = [task(0, "a", 10.5, 1.0, 0.5), task(1, "b", 10.2, 3.0, 2.0), task(2, "a", 11.75, 1.0, 0.25)]
    settle_idle(tasks, submitted=10.0)
    assert [t.idle for t in tasks] == pytest.approx([0.5, 0.2, 0.25])
    stats = summary(RunPhases(), tasks)
    assert stats["tasks"]["count"] == 3 and stats["tasks"]["slowest"]["task"] == 1
    assert stats["tasks"]["sum"]["data"] == pytest.approx(2.75) and stats["tasks"]["median"]["wall"] == 1.0
    assert stats["tasks"]["sum"]["work"] == pytest.approx(5.0 - 2.75 - 0.3)
    assert [t["task"] for t in stats["per_task"]] == [0, 1, 2]


def test_export_stats_state_every_task_and_the_run(volume, tmp_path):
    """`export --stats FILE`: the run's phases, and one timeline per task run, consistent with what
    was exported; with --resume, tasks already complete run no more."""
    dest, stats_file = tmp_path / "out", tmp_path / "stats.json"
    result = run_cli("export", "-q", "--no-fsync", "--stats", str(stats_file), str(volume["sharded"]), str(dest))
    assert result.returncode == 0, result.stderr
    stats = json.loads(stats_file.read_text())
    tasks = json.loads((dest / ".unshardfs" / "plan.json").read_text())["tasks"]
    assert stats["tasks"]["count"] == len(stats["per_task"]) == tasks
    assert sum(t["files"] for t in stats["per_task"]) == len(exported_files(dest))
    for doc in stats["per_task"]:
        t = TaskTimeline(**doc)
        assert sum(getattr(t, k) for k in (*WAITS, "work")) == pytest.approx(t.wall, abs=1e-3)
        assert t.requests > 0 and t.round_trips is None  # (a local source: backing reads, no round trips)
    run = stats["run"]
    assert set(run) >= {"client_start", "connect", "plan", "ledger", "tasks", "manifest", "total"}
    assert 0 < run["plan"] + run["tasks"] <= run["total"] and run["plan_requests"] > 0
    # Standard output: the summary line, then (with -) the statistics.
    again = run_cli("export", "-q", "--resume", "--stats", "-", str(volume["sharded"]), str(dest))
    assert again.returncode == 0, again.stderr
    head, _, body = again.stdout.partition("\n")
    assert head.startswith("exported ") and json.loads(body)["tasks"]["count"] == 0
