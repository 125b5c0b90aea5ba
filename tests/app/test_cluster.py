"""check and export as tasks on a Dask cluster (a scheduler and 2 worker processes, started as `dask` commands)."""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from tests.formats.precomputed.test_damaged import DAMAGES, SCALE_KEY, damage_delete
from tests.support.dask import dask_cluster
from tests.support.tmpfs import remount, small_tmpfs
from unshardfs.testing.http_servers import DatasetServer
from unshardfs.testing.mounts import UNSHARDFS, run_cli
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.testing.trees import exported_files

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A scheduler and 2 worker processes under a nanny (restarted if killed), started with Dask's
    own commands as a batch system starts them: every server socket lives in those processes."""
    where = tmp_path_factory.mktemp("dask")
    scheduler_file = where / "scheduler.json"
    with dask_cluster(scheduler_file, 2, "--nworkers", "2", "--nthreads", "1") as client:
        yield client.scheduler.address, client


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    spec = sharding(minishard=1, shard=2, data_enc="gzip")
    return write_volume(root, [Scale((64, 64, 32), (16, 16, 8), spec, fill=0.75),
                               Scale((32, 32, 16), (16, 16, 8), None, resolution=(2, 2, 2))], "uint16")


@pytest.mark.parametrize("damage", [None] + [d for d in DAMAGES if d is not damage_delete],
                         ids=lambda f: "intact" if f is None else f.__name__.removeprefix("damage_"))
def test_check_on_the_cluster_finds_what_one_process_finds(cluster, volume, tmp_path, damage):
    address, _ = cluster
    src = tmp_path / "src"
    shutil.copytree(volume["sharded"], src)
    if damage is not None:
        damage(sorted((src / SCALE_KEY).glob("*.shard"))[0])
    serial = run_cli("check", "-q", str(src))
    spread = run_cli("check", "-q", "--scheduler", address, "--parts", "5", str(src), timeout=180)
    assert spread.returncode == serial.returncode == (0 if damage is None else 1), spread.stdout + spread.stderr
    assert sorted(line for line in spread.stdout.splitlines() if line.startswith("damaged:")) == \
        sorted(line for line in serial.stdout.splitlines() if line.startswith("damaged:"))
    # The same files and bytes, whatever the split (backing reads differ: every part reads the indexes).
    assert serial.stdout.splitlines()[-1].split(" read through")[0] == spread.stdout.splitlines()[-1].split(" read through")[0]


def test_export_on_the_cluster_equals_the_single_process_export(cluster, volume, tmp_path):
    address, _ = cluster
    single, spread = tmp_path / "single", tmp_path / "spread"
    assert run_cli("export", "-q", str(volume["sharded"]), str(single)).returncode == 0
    result = run_cli("export", "-q", "--scheduler", address, str(volume["sharded"]), str(spread), timeout=180)
    assert result.returncode == 0, result.stderr
    a, b = exported_files(single), exported_files(spread)
    assert sorted(a) == sorted(b) and all(a[r].read_bytes() == b[r].read_bytes() for r in a)
    assert all(a[r].stat().st_mtime_ns == b[r].stat().st_mtime_ns for r in a)
    assert f"exported {len(a):,} files ({len(a):,} written" in result.stdout


def _run_export(address: str, source: str | Path, dest: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen([*UNSHARDFS, "export", "-q", "--scheduler", address, *options, str(source), str(dest)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_files(proc: subprocess.Popen, where: Path, count: int) -> None:
    deadline = time.monotonic() + 120
    while len(os.listdir(where)) < count if where.exists() else True:
        assert proc.poll() is None and time.monotonic() < deadline, "export finished before the kill"
        time.sleep(0.02)


def _export_killing(address: str, source: str | Path, dest: Path, parts: int, files: int,
                    kill: Callable[[subprocess.Popen], None]) -> tuple[int, str, str]:
    """Run an export on the cluster; once `files` chunk files are in place, `kill` something; let
    the export finish (a client killed ends it). (status, stdout, stderr)."""
    proc = _run_export(address, source, dest, "--parts", str(parts))
    try:
        _wait_for_files(proc, dest / "1_1_1", files)
        kill(proc)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def _kill_a_worker(client: distributed.Client) -> Callable[[subprocess.Popen], None]:
    return lambda _: os.kill(sorted(client.run(os.getpid).values())[0], signal.SIGKILL)


def _assert_verified_copy(dest: Path, reference: dict[str, Path], address: str) -> None:
    """The copy equals the reference, nothing twice in the manifest, and check --manifest (on the
    cluster) agrees; no temporary is left."""
    final = exported_files(dest)
    assert sorted(final) == sorted(reference)
    assert all(final[r].read_bytes() == reference[r].read_bytes() for r in reference if r != "info")
    assert not list(dest.rglob("*.unshardfs-tmp-*"))
    manifest = dest / ".unshardfs" / "manifest.jsonl"
    paths = [json.loads(line)["path"] for line in manifest.read_text().splitlines()[1:]]
    assert len(paths) == len(set(paths)) and sorted(paths) == sorted(reference)
    checked = run_cli("check", "--manifest", str(manifest), "--scheduler", address, str(dest), timeout=180)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"matches its manifest: {len(reference):,} files checked" in checked.stdout


@pytest.mark.slow
def test_a_worker_killed_during_export(cluster, tmp_path):
    address, client = cluster
    paths = write_volume(tmp_path / "many", [Scale((40, 40, 40), (2, 2, 2), sharding(minishard=3, shard=3))], "uint8")
    dest = tmp_path / "out"
    status, _, err = _export_killing(address, paths["sharded"], dest, 8, 500, _kill_a_worker(client))
    assert status == 0, err[-3000:]
    _assert_verified_copy(dest, exported_files(paths["plain"]), address)


@pytest.mark.slow
def test_workers_killed_at_random_lose_and_duplicate_nothing(cluster, tmp_path):
    """Workers killed at random moments while tasks run (their nannies restart them): whatever
    finished lands once, what was cut short is done again, and a --resume (needed only if one task
    lost its workers more often than Dask retries) finishes the copy."""
    address, client = cluster
    paths = write_volume(tmp_path / "vol", [Scale((40, 40, 40), (2, 2, 2), sharding(minishard=3, shard=3))], "uint8")
    reference = exported_files(paths["plain"])
    dest = tmp_path / "out"
    chooser = random.Random(37)
    kills: list[int] = []

    def kill_at_random(proc: subprocess.Popen) -> None:
        while len(kills) < 3 and proc.poll() is None:
            kills.append(chooser.choice(sorted(client.run(os.getpid).values())))
            os.kill(kills[-1], signal.SIGKILL)
            time.sleep(chooser.uniform(0.3, 1.2))
    status, out, err = _export_killing(address, paths["sharded"], dest, 16, 200, kill_at_random)
    assert kills and "Traceback" not in err, err[-3000:]
    if status != 0:
        assert "tasks complete (run again with --resume)" in out, out + err[-3000:]
        again = run_cli("export", "-q", "--resume", "--scheduler", address, str(paths["sharded"]), str(dest),
                        timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    _assert_verified_copy(dest, reference, address)


@pytest.mark.slow
def test_the_client_killed_then_resumed(cluster, tmp_path):
    """The client dies mid-run (its tasks may still be running on the workers): --resume with a new
    client redoes only unfinished tasks and the copy verifies."""
    address, _ = cluster
    paths = write_volume(tmp_path / "vol", [Scale((40, 40, 40), (2, 2, 2), sharding(minishard=3, shard=3))], "uint8")
    reference = exported_files(paths["plain"])
    dest = tmp_path / "out"
    _export_killing(address, paths["sharded"], dest, 16, 1000, lambda proc: proc.send_signal(signal.SIGKILL))
    partial = exported_files(dest)
    assert all(partial[r].read_bytes() == reference[r].read_bytes() for r in partial if r != "info")
    resumed = run_cli("export", "-q", "--resume", "--scheduler", address, str(paths["sharded"]), str(dest),
                      timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-3000:]
    assert "already complete" in resumed.stdout and " 0 already complete" not in resumed.stdout
    _assert_verified_copy(dest, reference, address)


def test_unreachable_scheduler_is_one_line_before_any_work(volume, tmp_path):
    start = time.monotonic()
    result = run_cli("export", "--scheduler", "tcp://127.0.0.1:9", str(volume["sharded"]), str(tmp_path / "out"))
    assert result.returncode == 1 and time.monotonic() - start < 40
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the Dask scheduler" in lines[0], result.stderr
    assert not (tmp_path / "out" / SCALE_KEY).exists()


def test_local_cluster_shorthand_is_quiet_with_q(volume, tmp_path):
    # Another cluster's dashboard on distributed's default HTTP port makes it warn (through the
    # warnings module, not its log): hold that port, unless someone already does.
    holder = socket.socket()
    try:
        holder.bind(("", 8787))
        holder.listen()
    except OSError:
        pass
    try:
        _check_quiet(volume, tmp_path)
    finally:
        holder.close()


def _check_quiet(volume, tmp_path) -> None:
    result = run_cli("check", "-q", "--scheduler", "local:2", str(volume["sharded"]), timeout=180)
    assert result.returncode == 0 and "intact:" in result.stdout, result.stdout + result.stderr
    # -q: none of distributed's INFO lines (scheduler, nannies, workers starting and closing), from this
    # process or the worker processes.
    assert result.stderr == "", result.stderr
    exported = run_cli("export", "-q", "--scheduler", "local:2", str(volume["sharded"]), str(tmp_path / "out"),
                       timeout=180)
    assert exported.returncode == 0 and exported.stderr == "", exported.stderr
    # --debug shows them (the test above can fail).
    debug = run_cli("check", "-q", "--debug", "--scheduler", "local:1", str(volume["sharded"]), timeout=180)
    assert debug.returncode == 0 and "INFO" in debug.stderr and "distributed.scheduler" in debug.stderr


def test_scheduler_env_takes_the_conventional_variable(cluster, volume, tmp_path):
    address, _ = cluster
    env = dict(os.environ, DASK_SCHEDULER_ADDRESS=address)
    result = run_cli("check", "-q", "--scheduler", "env", str(volume["sharded"]), timeout=180, env=env)
    assert result.returncode == 0 and "intact:" in result.stdout, result.stdout + result.stderr
    unset = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    refused = run_cli("check", "-q", "--scheduler", "env", str(volume["sharded"]), env=unset)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == ["unshardfs: --scheduler env: DASK_SCHEDULER_ADDRESS is not set"]


@pytest.mark.slow
def test_the_progress_bar_follows_the_whole_cluster(cluster, tmp_path):
    """On a terminal the bar counts tasks and shows the files and bytes of every worker with the rate."""
    address, _ = cluster
    paths = write_volume(tmp_path / "vol", [Scale((40, 40, 40), (2, 2, 2), sharding(minishard=3, shard=3))], "uint8")
    files = len(exported_files(paths["plain"]))
    size = sum(p.stat().st_size for p in exported_files(paths["plain"]).values())
    command = " ".join([*UNSHARDFS, "export", "--scheduler", address, "--parts", "4", str(paths["sharded"]),
                        str(tmp_path / "out")])
    typescript = tmp_path / "typescript"
    subprocess.run(["script", "-qec", f"stty cols 200 rows 40; {command}", str(typescript)], capture_output=True,
                   timeout=180, check=True)
    lines = typescript.read_bytes().decode(errors="replace").replace("\r", "\n").splitlines()
    bars = [line for line in lines if "task/s" in line or "s/task" in line]
    tasks = json.loads((tmp_path / "out" / ".unshardfs" / "plan.json").read_text())["tasks"]
    assert tasks == 4  # the shards dealt into 4 tasks (the info goes with the last)
    assert bars and f"{tasks}/{tasks}" in bars[-1], bars[-3:]
    assert f"files={files:,}" in bars[-1] and "rate=" in bars[-1] and "MiB/s" in bars[-1], bars[-1]
    assert f"bytes={size / 2**20:,.1f}MiB" in bars[-1], (size, bars[-1])


@pytest.fixture(scope="module")
def slow_store(tmp_path_factory):
    """4,096 chunks in 8 shards behind a store answering every request after 20 ms, and the shard
    ranges a single process reads to export them."""
    root = tmp_path_factory.mktemp("slow")
    paths = write_volume(root / "vol", [Scale((32, 32, 32), (2, 2, 2), sharding(minishard=3, shard=3))], "uint8")
    with DatasetServer(paths["sharded"].parent) as server:
        assert run_cli("export", "-q", "--parts", "1", f"{server.url}/sharded", str(root / "one")).returncode == 0
        alone = _shard_reads(server)
        server.faults.delay = 0.02
        yield server, paths, alone


def _shard_reads(server: DatasetServer) -> collections.Counter:
    return collections.Counter((e.path, e.range) for e in server.log if e.method == "GET" and e.path.endswith(".shard"))


def _bytes_asked(reads: collections.Counter) -> int:
    total = 0
    for (_, asked), times in reads.items():
        first, last = asked.removeprefix("bytes=").split("-")
        total += (int(last) - int(first) + 1) * times
    return total


@pytest.mark.slow
def test_tasks_on_the_cluster_read_the_shards_once_between_them(cluster, slow_store, tmp_path):
    """Eight tasks over the slow store send exactly the shard reads one process sends: each shard's
    indexes and chunks are read by the one task that owns it, coalesced as a mount reads them."""
    address, _ = cluster
    server, paths, alone = slow_store
    server.reset_log()
    result = run_cli("export", "-q", "--scheduler", address, "--parts", "8", f"{server.url}/sharded",
                     str(tmp_path / "out"), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    # The same shard bytes as one process asks for (each task only its own shards; were every task
    # to read every shard, eight times as many), in as few requests (how reads are batched depends
    # on timing, within a few).
    reads = _shard_reads(server)
    assert set(path for path, _ in reads) == set(path for path, _ in alone)
    assert 0.9 * _bytes_asked(alone) <= _bytes_asked(reads) <= 1.1 * _bytes_asked(alone)
    assert len(reads) <= 1.25 * len(alone) and len(reads) < len(exported_files(paths["plain"])) / 20


@pytest.mark.slow
def test_a_worker_killed_while_reading_a_slow_store(cluster, slow_store, tmp_path):
    address, client = cluster
    server, paths, alone = slow_store
    server.reset_log()
    dest = tmp_path / "out"
    status, out, err = _export_killing(address, f"{server.url}/sharded", dest, 8, 500, _kill_a_worker(client))
    assert status == 0, out + err[-3000:]
    _assert_verified_copy(dest, exported_files(paths["plain"]), address)
    # What the lost task had read is read again (the files it had written are not), nothing else.
    assert _bytes_asked(alone) <= _bytes_asked(_shard_reads(server)) < 2 * _bytes_asked(alone)


@pytest.mark.slow
def test_a_full_dest_stops_the_cluster_with_one_line(cluster, volume, tmp_path):
    """The first task to find DEST full ends the run (the others are cancelled) with one line; what
    is under a final name is whole; --resume after room is made finishes and verifies."""
    address, _ = cluster
    reference = exported_files(volume["plain"])
    with small_tmpfs(tmp_path / "disk", "192k") as disk:
        dest = disk / "out"
        full = run_cli("export", "-q", "--scheduler", address, "--parts", "8", str(volume["sharded"]), str(dest),
                       timeout=180)
        assert full.returncode == 1
        lines = full.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("unshardfs: export stopped: cannot write ") and \
            lines[0].endswith(": No space left on device (ENOSPC)"), full.stderr
        landed = exported_files(dest)
        assert len(landed) < len(reference)
        assert all(path.read_bytes() == reference[rel].read_bytes() for rel, path in landed.items() if rel != "info")
        remount(disk, "size=16m")
        resumed = run_cli("export", "-q", "--resume", "--scheduler", address, str(volume["sharded"]), str(dest),
                          timeout=180)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        _assert_verified_copy(dest, reference, address)
