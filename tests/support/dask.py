"""A Dask cluster started by Dask's own commands (as a batch system starts one), for tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def dask_cluster(scheduler_file: Path, workers: int, *worker_args: str,
                 env: dict[str, str] | None = None) -> Iterator[Any]:
    """A `distributed.Client` of a scheduler and `dask worker *worker_args` processes, once `workers`
    workers joined; every process is stopped on the way out, even on failure."""
    import distributed

    dask = str(Path(sys.executable).parent / "dask")
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL,
                             "env": {**os.environ, "DASK_LOGGING__DISTRIBUTED": "error", **(env or {})}}
    started = [subprocess.Popen([dask, "scheduler", "--scheduler-file", str(scheduler_file), "--host", "127.0.0.1",
                                 "--port", "0", "--no-dashboard"], **quiet)]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists():
            assert started[0].poll() is None and time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.1)
        started.append(subprocess.Popen([dask, "worker", "--scheduler-file", str(scheduler_file), *worker_args,
                                         "--no-dashboard"], **quiet))
        with distributed.Client(scheduler_file=str(scheduler_file), timeout="30s") as client:
            client.wait_for_workers(workers, timeout=60)
            yield client
    finally:
        for proc in reversed(started):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
