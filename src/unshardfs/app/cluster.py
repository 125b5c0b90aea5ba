"""Running the parts of a `check` or `export` on a Dask distributed cluster (`--scheduler`).

Dask already runs the field's clusters (dask-jobqueue on SLURM, Kubernetes,
Coiled): we only submit parts (`split.Part`) and gather their small results.
A worker lost mid-part is Dask's to handle (the part runs again elsewhere);
an export part run twice skips the files already complete.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

from unshardfs.app.split import Part, PartResult, run_part
from unshardfs.tools.walk import Dest
from unshardfs.util.errors import ConfigError


def dask_log_level(debug: bool, quiet: bool) -> str:
    """How much of Dask's own logging reaches the terminal: its INFO lines (workers starting,
    nannies, ports) only with --debug; -q leaves errors alone."""
    return "info" if debug else "error" if quiet else "warning"


def quiet_dask(level: str) -> None:
    """Set Dask distributed's log level here and in every worker process a LocalCluster starts.

    distributed installs its own stderr handler at import (level from its
    config, INFO by default), in this process and again in each worker
    process: the environment reaches both, set before the import.
    """
    import logging
    import warnings

    os.environ["DASK_LOGGING__DISTRIBUTED"] = level
    if level != "info":
        # e.g. "Port 8787 is already in use ... Hosting the HTTP server on port N instead":
        # a warning through the warnings module, not the log.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"distributed(\..*)?$")
    if "dask" in sys.modules:  # already imported (a test, or a library): refresh its config
        import dask

        dask.config.refresh()
    logging.getLogger("distributed").setLevel(level.upper())


def connect(address: str, log_level: str = "warning") -> Any:
    """A Dask client: `local:N` starts a LocalCluster of N worker processes; else a scheduler address."""
    quiet_dask(log_level)
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise ConfigError("--scheduler needs Dask distributed: pip install 'unshardfs[dask]'") from None
    if address.startswith("local:"):
        count = address.removeprefix("local:")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--scheduler {address}: expected local:N with N >= 1 worker processes")
        cluster = LocalCluster(n_workers=int(count), threads_per_worker=1, processes=True, dashboard_address=None)
        return Client(cluster)
    try:
        return Client(address, timeout="10s")
    except (OSError, TimeoutError, ValueError) as e:
        raise ConfigError(f"cannot reach the Dask scheduler at {address}: {e}") from None


def default_parts(client: Any) -> int:
    """Four parts per worker thread: long-running tasks, with room to even out slow ones."""
    return max(1, 4 * sum(client.nthreads().values()))


def check_dest_visible(client: Any, dest: Path) -> None:
    """Refuse a DEST some worker cannot see (export writes there from every worker)."""
    Dest.open(dest).close()  # made if missing; a DEST that is not a directory is a one-line error
    marker = dest / f".unshardfs-probe-{uuid.uuid4().hex}"
    marker.write_text("probe")
    try:
        seen = client.run(os.path.exists, str(marker))
    finally:
        marker.unlink(missing_ok=True)
    blind = sorted(worker for worker, ok in seen.items() if not ok)
    if not seen or blind:
        raise ConfigError(f"{dest} is not visible to every Dask worker ({', '.join(blind) or 'no workers'}): "
                          "export needs a DEST on a file system all workers share")


def run_parts(client: Any, jobs: list[Part], done: Callable[[], None]) -> list[PartResult]:
    """Every part's result, in part order; `done` is called as each part completes."""
    from distributed import as_completed

    futures = client.map(run_part, jobs, pure=False, retries=2)
    for _ in as_completed(futures):
        done()
    return client.gather(futures)
