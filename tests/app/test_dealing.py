"""How planning deals shards into tasks: by their bytes where finding them told them (a listing, a
probe), so that small shards make few tasks and each worker thread still gets one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

from unshardfs.app.opened import OpenedSource, OpenOptions
from unshardfs.app.planner import (TASK_MAX_BYTES, TASK_SHARDS_MAX, Survey, Surveyed, TaskWork, deal, shard_cuts,
                                   survey)
from unshardfs.core.runtime import ShardScope
from unshardfs.testing.latency import LatencySource
from unshardfs.testing.memory import MemorySource
from unshardfs.testing.precomputed import Scale, sharding, write_volume

MiB, GiB = 1 << 20, 1 << 30


def tasks_of(cuts: list[int], count: int) -> list[int]:
    """The number of shards in each task."""
    return [end - start for start, end in zip(cuts, [*cuts[1:], count])]


def test_small_shards_make_one_task_per_worker_thread():
    """16 shards of 1 MiB: a task's fixed cost would dominate tasks of one shard, so each worker
    thread gets one task of equal bytes (and one thread, one task)."""
    assert tasks_of(shard_cuts([MiB] * 16, 4), 16) == [4, 4, 4, 4]
    assert tasks_of(shard_cuts([MiB] * 16, 2), 16) == [8, 8]
    assert tasks_of(shard_cuts([MiB] * 16, 1), 16) == [16]
    assert tasks_of(shard_cuts([MiB] * 3, 8), 3) == [1, 1, 1]  # never more tasks than shards
    assert tasks_of(shard_cuts([MiB] * 64, 1), 64) == [16] * 4  # nor more than TASK_SHARDS_MAX shards a task


def test_big_shards_make_bounded_tasks_of_about_equal_bytes():
    """Whole-brain shards of 1 GiB: tasks of TASK_MAX_BYTES (16 shards); shards of mixed sizes: each
    task about the same bytes, in listing order."""
    cuts = shard_cuts([GiB] * 93_000, 32)
    assert set(tasks_of(cuts, 93_000)) == {15, 16} and len(cuts) == -(-93_000 * GiB // TASK_MAX_BYTES)
    sizes = [100 * MiB, MiB, MiB, MiB, 100 * MiB, MiB]
    assert tasks_of(shard_cuts(sizes, 2), 6) == [3, 3]
    assert tasks_of(shard_cuts([0, 0, 0, 0], 2), 4) == [2, 2]  # (empty shards: by their number)
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(1, 64 * MiB, 1000)]
    cuts = shard_cuts(sizes, 8)
    per_task = [sum(sizes[a:b]) for a, b in zip(cuts, [*cuts[1:], len(sizes)])]
    assert all(n <= TASK_SHARDS_MAX for n in tasks_of(cuts, len(sizes)))
    assert max(per_task) < 2 * sum(sizes) / len(per_task) + 64 * MiB


def test_a_few_small_files_go_with_the_last_task_of_shards():
    found = Survey([("d", None), ("info", 300)], [("d", "d", i) for i in range(4)], [MiB] * 4)
    works = deal(found, 2, named="precomputed", cuts=[0, 2])
    assert works == [TaskWork(groups=works[0].groups, format="precomputed"),
                     TaskWork(("d",), ("info",), works[1].groups, "precomputed")]
    # Many files keep tasks of their own.
    many = Survey([(f"f{i}", 10) for i in range(300)], found.shards, found.sizes)
    assert [len(w.files) for w in deal(many, 2, cuts=[0, 2]) if not w.groups] == [300]


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dealing")
    return write_volume(root, [Scale((64, 64, 32), (8, 8, 8), sharding(minishard=1, shard=2))])["sharded"]


def _survey(source: LatencySource) -> Survey:
    async def main() -> Survey:
        session = await OpenedSource.over(source, None, OpenOptions(versions=False))
        scope = ShardScope(planning=True)
        session.runtime.shard_scope = scope
        async with session.running():
            found = await survey(session.tree, scope, True)
        await session.aclose()
        return found
    return trio.run(main)


@pytest.mark.parametrize("listable", [True, False], ids=["listed", "probed"])
def test_planning_knows_each_shards_bytes(precomputed, listable):
    """The sizes come from the listing of a store that lists, from the probes of one that cannot,
    at no request more; tasks are then dealt by them."""
    files = MemorySource.from_directory(precomputed)
    source = LatencySource(files, 0, listable=listable)
    found = _survey(source)
    shards = sorted(precomputed.glob("1_1_1/*.shard"))
    assert [(w, s) for w, _, s in found.shards] == [("1_1_1", int(p.stem, 16)) for p in shards]
    assert found.sizes == [p.stat().st_size for p in shards]
    assert not any(r.kind == "read" and r.path.endswith(".shard") for r in source.log)  # (nothing read for it)
    planned = Surveyed(found, [], "precomputed").plan(threads=2)
    assert [w.shards for w in planned.works] == [2, 2]


def test_zarr_shards_are_sized_by_their_listing(tmp_path):
    import zarr

    arr = zarr.create_array(str(tmp_path / "vol.zarr"), shape=(64, 64, 64), chunks=(16, 16, 16), shards=(32, 32, 32),
                            dtype="uint8", compressors=None, zarr_format=3)
    arr[...] = 1
    found = _survey(LatencySource(MemorySource.from_directory(tmp_path / "vol.zarr"), 0, listable=True))
    shards = sorted(p for p in (tmp_path / "vol.zarr").rglob("*") if p.is_file() and p.name != "zarr.json")
    assert len(found.shards) == len(shards) == 8
    assert found.sizes == [p.stat().st_size for p in shards]
