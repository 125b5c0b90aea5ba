"""Running the parts of a `check` or `export` on a Dask distributed cluster (`--scheduler`).

Dask already runs the field's clusters (dask-jobqueue on SLURM, Kubernetes,
Coiled): we only submit parts (`split.Part`) and gather their small results.
A worker lost mid-part is Dask's to handle (the part runs again elsewhere);
an export part run again keeps the files its journal holds and DEST still
matches, and writes the rest (see `dest.ledger`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from unshardfs.app.split import Part, PartResult, run_part
from unshardfs.sources import RemoteOptions
from unshardfs.dest.opener import is_object_url, open_dest
from unshardfs.tools.walk import WalkSummary
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
        client = Client(cluster)
        client.started_here = True  # type: ignore[attr-defined]  # closed with the client
        return client
    try:
        return Client(address, timeout="10s")
    except (OSError, TimeoutError, ValueError) as e:
        raise ConfigError(f"cannot reach the Dask scheduler at {address}: {e}") from None


def scheduler_address(given: str) -> str:
    """`--scheduler`'s value; `env` takes the conventional DASK_SCHEDULER_ADDRESS (what dask-jobqueue
    and the Dask Kubernetes operator set for the jobs they start)."""
    if given != "env":
        return given
    address = os.environ.get("DASK_SCHEDULER_ADDRESS", "")
    if not address:
        raise ConfigError("--scheduler env: DASK_SCHEDULER_ADDRESS is not set")
    return address


def open_client(scheduler: str, debug: bool, quiet: bool) -> Any:
    """The client for `--scheduler` (an address, local:N or env), Dask's logging set from -q/--debug."""
    return connect(scheduler_address(scheduler), dask_log_level(debug, quiet))


def _silence_teardown() -> None:
    import logging

    logging.getLogger("distributed").setLevel(logging.CRITICAL)


def close_client(client: Any) -> None:
    """Close the client, and the local cluster if `connect` started one for it."""
    cluster = getattr(client, "cluster", None)
    if cluster is not None and getattr(client, "started_here", False):
        # Our own workers are torn down with the work done: a heartbeat that meets the closing
        # scheduler is logged by them as an error, and says nothing about the run.
        try:
            client.run(_silence_teardown)
        except Exception:  # a worker already gone: nothing of its own left to say
            pass
        _silence_teardown()
    client.close()
    if cluster is not None and getattr(client, "started_here", False):
        cluster.close()


def warm_up() -> None:
    """On a worker: import what a task runs and load the format plug-ins (unpickling this function
    imported this module, and with it the task's code)."""
    from unshardfs.core.registry import load_plugins

    load_plugins()


def warm_workers(client: Any) -> list[Any]:
    """`warm_up` started on every worker now, so that their first tasks do not wait for the imports
    while the client plans meanwhile. The futures: keep them until the tasks are submitted (a future
    dropped before its task ran may cancel it)."""
    return [client.submit(warm_up, workers=[worker], allow_other_workers=False, pure=False)
            for worker in client.nthreads()]


def worker_threads(client: Any) -> int:
    """The cluster's worker threads now (what a plan's task sizes are chosen for)."""
    return max(1, int(sum(client.nthreads().values())))


def _reaches(dest: str, remote: RemoteOptions) -> str | None:
    """On a worker: None if it can open DEST (an object store prefix), else why not."""
    try:
        open_dest(dest, remote).close()
    except ConfigError as e:
        return str(e)
    return None


def check_dest_visible(client: Any, dest: str, remote: RemoteOptions) -> None:
    """Refuse a DEST some worker cannot see (export writes there from every worker): a directory all
    workers share, or an object store prefix every worker reaches with its own credentials."""
    if is_object_url(dest):
        found = client.run(_reaches, dest, remote)
        blind = sorted(f"{worker}: {why}" for worker, why in found.items() if why is not None)
        if not found or blind:
            raise ConfigError(f"{dest} cannot be written by every Dask worker ({'; '.join(blind) or 'no workers'})")
        return
    open_dest(dest).close()  # made if missing; a DEST that is not a directory is a one-line error
    marker = Path(dest) / f".unshardfs-probe-{uuid.uuid4().hex}"
    marker.write_text("probe")
    try:
        seen = client.run(os.path.exists, str(marker))
    finally:
        marker.unlink(missing_ok=True)
    blind = sorted(worker for worker, ok in seen.items() if not ok)
    if not seen or blind:
        raise ConfigError(f"{dest} is not visible to every Dask worker ({', '.join(blind) or 'no workers'}): "
                          "export needs a DEST on a file system all workers share")


PROGRESS_TOPIC = "unshardfs-progress"
PROGRESS_SECONDS = 0.5  # how often a running part tells the client how far it got


def run_part_reporting(job: Part) -> PartResult:
    """`run_part` on a Dask worker, sending the client its running counts (files, bytes) as an event
    on PROGRESS_TOPIC at most every PROGRESS_SECONDS: the client's bar moves while parts run."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):  # not on a worker: nothing to tell
        return run_part(job)
    last = time.monotonic()

    def progress(summary: WalkSummary) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PROGRESS_SECONDS:
            last = now
            worker.log_event(PROGRESS_TOPIC, {"part": job.part, "files": summary.files, "bytes": summary.bytes})
    return run_part(job, progress, str(worker.address))


class Tally:
    """Files and bytes across the cluster: the latest running count of each part, then its result."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[int, tuple[int, int]] = {}
        self.files = self.bytes = 0  # of finished parts

    def event(self, event: Any) -> None:
        """A PROGRESS_TOPIC event (timestamp, message), as `Client.subscribe_topic` hands it over."""
        message = event[1] if isinstance(event, tuple) else event
        if isinstance(message, dict) and isinstance(message.get("part"), int):
            with self.lock:
                self.running[message["part"]] = (int(message.get("files", 0)), int(message.get("bytes", 0)))

    def finished(self, result: PartResult) -> None:
        with self.lock:
            self.running.pop(result.part, None)
            self.files += result.summary.files
            self.bytes += result.summary.bytes

    def totals(self) -> tuple[int, int]:
        with self.lock:
            return (self.files + sum(f for f, _ in self.running.values()),
                    self.bytes + sum(b for _, b in self.running.values()))


def run_parts(client: Any, jobs: list[Part], done: Callable[[PartResult], None],
              tally: Tally | None = None) -> list[PartResult]:
    """Every part's result as it completes (`done` is called with each; `tally`, if given, also
    follows the parts while they run).

    An export part that finds DEST full (`summary.stopped`) ends the run: the
    parts not yet finished are cancelled, and what they wrote stays journaled
    for `--resume`. A part that fails on every retry (its workers lost again
    and again) is reported as one failure line and leaves its task unfinished.
    """
    if tally is not None:
        client.subscribe_topic(PROGRESS_TOPIC, tally.event)
    try:
        return _gather(client, jobs, done, tally)
    finally:
        if tally is not None:
            client.unsubscribe_topic(PROGRESS_TOPIC)


def _gather(client: Any, jobs: list[Part], done: Callable[[PartResult], None], tally: Tally | None) -> list[PartResult]:
    from distributed import as_completed

    futures = client.map(run_part_reporting, jobs, pure=False, retries=2)
    which = {future.key: job for future, job in zip(futures, jobs)}
    results: list[PartResult] = []
    for future in as_completed(futures):
        job = which[future.key]
        try:
            result = future.result()
        except Exception as e:  # noqa: BLE001 - a lost part is a line in the report, not a traceback
            result = PartResult([], WalkSummary(failures=[f"task {job.part}: {type(e).__name__}: {e}"]), 0, job.part)
        results.append(result)
        if tally is not None:
            tally.finished(result)
        done(result)
        if result.summary.stopped is not None:
            client.cancel(futures)
            break
    return sorted(results, key=lambda r: r.part)
