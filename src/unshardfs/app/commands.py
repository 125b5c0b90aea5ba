"""The offline commands behind `unshardfs inspect | check | export`."""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable

import trio
from tqdm import tqdm

from unshardfs.app.cluster import close_client
from unshardfs.app.opened import OpenedSource, OpenOptions
from unshardfs.app.pipeline import archive_lines
from unshardfs.app.options import open_options
from unshardfs.app.planner import (Planned, Surveyed, TaskWork, parse_tasks, plan_tasks, shards_per_task, survey_source,
                                   task_lines)
from unshardfs.app.split import Part, PartResult, run_part
from unshardfs.app.timeline import RunPhases, TaskTimeline, process_age, settle_idle, summary, summary_lines
from unshardfs.core.registry import changed_options
from unshardfs.dest.base import WriteStopped
from unshardfs.dest.opener import dest_name, open_dest
from unshardfs.tools.inspect import format_report, version_lines
from unshardfs.dest.ledger import MANIFEST, Ledger, Plan
from unshardfs.tools.walk import WalkSummary, check
from unshardfs.util.errors import ConfigError, DataError, SourceError
from unshardfs.util.logonce import collect_problems


def _one_version(args: argparse.Namespace) -> OpenOptions:
    """The options of a tool's source: the version the SOURCE names only (a versioned store's other
    versions are directories of a mount to browse, not part of what is checked or exported)."""
    return replace(open_options(args), versions=False)


def _bar(args: argparse.Namespace, unit: str) -> tqdm:
    # tqdm disables itself when stderr is not a terminal (disable=None).
    return tqdm(unit=unit, disable=True if getattr(args, "quiet", False) else None, file=sys.stderr,
                dynamic_ncols=True)


def _progress(bar: tqdm) -> Callable[[WalkSummary], None]:
    def update(summary: WalkSummary) -> None:
        bar.n = summary.files
        if summary.files % 256 == 0:
            bar.set_postfix(bytes=f"{summary.bytes / 2**20:,.0f}MiB", failed=len(summary.failures), refresh=False)
            bar.refresh()
    return update


async def _inspect(args: argparse.Namespace) -> int:
    session = await OpenedSource.open(args.source, _one_version(args))
    reports = []
    with _bar(args, "chunk") as bar:
        async for part in session.dataset.inventory():
            bar.set_description(part.path or ".")
            reports.append(await part.report(bar.update))
    archive = session.archive
    lines = archive_lines(archive) if archive else []
    versioned = session.versioned
    if versioned is not None and not args.json:
        try:
            lines += version_lines(await versioned.versions(), session.source.description, versioned.current,
                                   not versioned.pinned)
        except (DataError, SourceError) as e:
            lines.append(f"  versions      unreadable: {e}")
        summary = getattr(versioned, "summary_lines", None)  # optional: what else the store says of itself
        if summary is not None:
            lines += await summary()
    await session.aclose()
    print(json.dumps(reports, indent=2) if args.json else format_report(reports, args.source, lines))
    return 0


async def _one_part(args: argparse.Namespace) -> PartResult:
    """The whole check in this process, with a progress bar per file."""
    session = await OpenedSource.open(args.source, _one_version(args))
    try:
        with collect_problems() as problems, _bar(args, "file") as bar:
            async with session.running():
                summary = await check(session.tree, _progress(bar))
    finally:
        await session.aclose()
    return PartResult(list(problems), summary, session.source.counters.reads)


def _checks(args: argparse.Namespace, threads: int,
            early: "_EarlySurvey | None" = None) -> tuple[list[Part], PartResult]:
    """The check's tasks, planned here (from `early`'s walk if one was started); and what planning
    found (its problems, as a result)."""
    planned = (plan_tasks(args.source, _one_version(args), threads, args.parts) if early is None
               else early.wait().plan(threads, args.parts))
    parts = [Part(args.source, _one_version(args), i, work) for i, work in enumerate(planned.works)]
    return parts, PartResult(planned.problems, WalkSummary(), 0, -1)


def _exports(args: argparse.Namespace, plan: Plan, works: list[TaskWork], tasks: list[int]) -> list[Part]:
    """The export's tasks, run with this command line's tuning (concurrency, timeouts, caches)."""
    return [Part(plan.source, _one_version(args), i, works[i], dest_name(args.dest), args.jobs,
                 not args.no_fsync) for i in tasks]


def _identity(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """What the export's output depends on: the SOURCE (a local path made absolute, so a resume
    from elsewhere names the same) and the format options given (as JSON; tuning options aside)."""
    source = args.source
    if "://" not in source and "|" not in source:
        source = os.path.abspath(source)
    given = {name: changed_options(options) for name, options in open_options(args).formats.items()}
    formats = json.loads(json.dumps(given, default=str, sort_keys=True))
    return source, formats


def _on_cluster(args: argparse.Namespace, client: Any, jobs: list[Part], unit: str) -> list[PartResult]:
    """The parts on a Dask cluster. The bar counts finished parts (its rate and ETA are theirs) and
    shows the files and bytes of every part, running ones included, with the byte rate."""
    from unshardfs.app.cluster import Tally, run_parts

    tally = Tally()
    with tqdm(total=len(jobs), unit=unit, disable=True if args.quiet else None, file=sys.stderr,
              dynamic_ncols=True) as bar:
        start = time.monotonic()

        def show() -> None:
            files, size = tally.totals()
            rate = size / max(1e-6, time.monotonic() - start)
            bar.set_postfix({"files": f"{files:,}", "bytes": f"{size / 2**20:,.1f}MiB",
                             "rate": f"{rate / 2**20:,.1f}MiB/s"}, refresh=False)
            bar.refresh()

        def done(result: PartResult) -> None:
            bar.update(1)
            show()

        ticking = threading.Event()

        def tick() -> None:
            while not ticking.wait(1.0):
                show()
        ticker = threading.Thread(target=tick, daemon=True)
        if not bar.disable:
            ticker.start()
        try:
            return run_parts(client, jobs, done, tally)
        finally:
            ticking.set()
            if ticker.is_alive():
                ticker.join()


def _client(args: argparse.Namespace) -> Any:
    from unshardfs.app.cluster import open_client

    return open_client(args.scheduler, args.debug, args.quiet)


def _check_results(args: argparse.Namespace) -> list[PartResult]:
    if args.scheduler is not None:
        from unshardfs.app.cluster import warm_workers, worker_threads

        early = _EarlySurvey(args.source, _one_version(args), skip_reserved=False)
        client = _client(args)
        try:
            warming = warm_workers(client)  # the workers import while the client plans (held until the end)
            parts, planning = _checks(args, worker_threads(client), early)
            return [planning] + _on_cluster(args, client, parts, "task")
        finally:
            close_client(client)
    if args.jobs > 1:
        # The format layer is single-threaded by design; parallel checking
        # deals the shards to processes, each with its own tree and caches.
        parts, planning = _checks(args, args.jobs)
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            return [planning] + pool.map(run_part, parts, chunksize=1)
    return [trio.run(_one_part, args)]


def _problems(results: list[PartResult]) -> tuple[list[str], list[str]]:
    """Distinct problem lines, and file failures not already named by one (sorted: parts finish in any order)."""
    problems = sorted(dict.fromkeys(line for r in results for line in r.problems))
    listed = set(problems)
    failures = sorted(f for r in results for f in r.summary.failures if f.split(": ", 1)[1] not in listed)
    return problems, failures


def _check(args: argparse.Namespace) -> int:
    """Not a coroutine: worker processes must be forked outside any trio run."""
    if args.manifest is not None:
        from unshardfs.app.verify import verify_copy

        return verify_copy(args)
    results = _check_results(args)
    problems, failures = _problems(results)
    for line in problems + failures:
        print(f"damaged: {line}")
    files = sum(r.summary.files for r in results)
    size = sum(r.summary.bytes for r in results)
    reads = sum(r.reads for r in results)
    damaged = bool(problems or failures)
    print(f"{'DAMAGED' if damaged else 'intact'}: {files:,} files, {size:,} bytes read through "
          f"{reads:,} backing reads; {len(problems) + len(failures)} problem(s)")
    return 1 if damaged else 0


LOCAL_THREADS = 2  # an export in one process is planned as for two threads: 8 tasks or more


class _EarlySurvey:
    """The walk of SOURCE for a new plan, on a thread of its own while the cluster starts or is
    reached: planning waits on the store, starting a cluster on the CPU, so they overlap."""

    def __init__(self, source: str, options: OpenOptions, skip_reserved: bool) -> None:
        self.source, self.options, self.skip_reserved = source, options, skip_reserved
        self.result: Surveyed | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="unshardfs-survey", daemon=True)
        self.thread.start()

    @classmethod
    def needed(cls, args: argparse.Namespace) -> "_EarlySurvey | None":
        """Started when DEST holds no plan yet (else there is nothing to walk)."""
        out = open_dest(args.dest, open_options(args).remote)
        try:
            fresh = Ledger(out.records).plan() is None
        finally:
            out.close()
        return cls(_identity(args)[0], _one_version(args), skip_reserved=True) if fresh else None

    def _run(self) -> None:
        start = time.monotonic()
        try:
            self.result = survey_source(self.source, self.options, self.skip_reserved)
        except BaseException as e:  # noqa: BLE001 - raised again where the plan is needed
            self.error = e
        self.seconds = time.monotonic() - start

    def wait(self) -> Surveyed:
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def _plan(args: argparse.Namespace, ledger: Ledger, threads: int, phases: RunPhases,
          early: _EarlySurvey | None = None) -> tuple[Plan, list[TaskWork], list[str]]:
    """The export's plan and its tasks: those DEST already holds (with --resume), else new ones
    (from `early`'s walk if one was started); and the problems planning met (a name skipped, say)."""
    found = ledger.plan()
    source, formats = _identity(args)
    if found is None:
        start = time.monotonic()
        if early is not None:
            surveyed = early.wait()
            phases.plan = early.seconds
        else:
            surveyed = survey_source(source, _one_version(args), skip_reserved=True)
            phases.plan = time.monotonic() - start
        planned: Planned = surveyed.plan(threads, args.parts)
        phases.plan_requests, phases.plan_round_trips = planned.requests, planned.round_trips
        wanted = Plan(source, formats, len(planned.works))
        ledger.start(wanted, task_lines(planned.works))
        return wanted, planned.works, planned.problems
    if not args.resume:
        done = len(ledger.complete())
        raise ConfigError(f"DEST {args.dest} holds an export of {found.source} ({done:,} of {found.tasks:,} tasks "
                          "complete): add --resume to continue it, or choose another DEST")
    if (found.source, found.formats) != (source, formats):
        raise ConfigError(f"DEST {args.dest} holds an export of {found.source} with options {found.formats}: "
                          "--resume must name the same SOURCE and options")
    works = parse_tasks(ledger.task_list(), "the task list", found.tasks)
    if len(works) != found.tasks:
        raise ConfigError(f"DEST {args.dest}: its task list holds {len(works):,} tasks, its plan "
                          f"{found.tasks:,}: not an unshardfs export")
    if args.parts and _parts_plan(sum(w.shards for w in works), args.parts) != [w.shards for w in works if w.groups]:
        raise ConfigError(f"DEST {args.dest} holds an export planned as {found.tasks:,} tasks: --parts must "
                          "be left out or the same with --resume")
    return found, works, []


def _parts_plan(shards: int, parts: int) -> list[int]:
    """The shards of each task `--parts` deals `shards` into (what a resume with --parts must match)."""
    per_task = shards_per_task(shards, 1, parts)
    return [min(per_task, shards - at) for at in range(0, shards, per_task)]


def _prepare(args: argparse.Namespace, threads: int, phases: RunPhases,
             early: _EarlySurvey | None = None) -> tuple[Plan, list[TaskWork], list[int], list[PartResult]]:
    """Open DEST, fix the plan, clear a killed run's temporaries; (plan, its tasks, tasks to run,
    tasks done)."""
    start = time.monotonic()
    out = open_dest(args.dest, open_options(args).remote)
    try:
        ledger = Ledger(out.records)
        plan, works, problems = _plan(args, ledger, threads, phases, early)
        if args.resume:
            out.files.clear()  # temporaries, unfinished uploads
        done = ledger.complete() & set(range(plan.tasks))
        finished = [PartResult(problems, WalkSummary(), 0, -1)] if problems else []
        for task in sorted(done):
            files, _ = ledger.task_totals(task)
            finished.append(PartResult([], WalkSummary(files=files, skipped=files), 0, task, complete=True,
                                       recorded=True))
    finally:
        out.close()
    phases.ledger = max(0.0, time.monotonic() - start - phases.plan)
    return plan, works, [t for t in range(plan.tasks) if t not in done], finished


def _export_here(args: argparse.Namespace, jobs: list[Part]) -> list[PartResult]:
    """The tasks one after another in this process, one progress bar over all of them."""
    results: list[PartResult] = []
    with _bar(args, "file") as bar:
        for job in jobs:
            base = bar.n

            def update(summary: WalkSummary, base: int = base) -> None:
                bar.n = base + summary.files
                if summary.files % 256 == 0:
                    bar.set_postfix(bytes=f"{summary.bytes / 2**20:,.0f}MiB", failed=len(summary.failures),
                                    refresh=False)
                    bar.refresh()
            result = run_part(job, update)
            bar.n = base + result.summary.files
            results.append(result)
            if result.summary.stopped is not None:
                break
    return results


def _export(args: argparse.Namespace) -> int:
    args.dest = dest_name(args.dest)
    try:
        return _export_run(args)
    except WriteStopped as e:  # writing the plan: DEST is full before the first task
        print(f"unshardfs: export stopped: {e}", file=sys.stderr)
        return 1


def _export_run(args: argparse.Namespace) -> int:
    phases = RunPhases(client_start=process_age())
    client = None
    try:
        if args.scheduler is not None:
            from unshardfs.app.cluster import check_dest_visible, warm_workers, worker_threads

            early = _EarlySurvey.needed(args)
            client = _client(args)
            warming = warm_workers(client)  # the workers import while the client plans (held until the end)
            check_dest_visible(client, args.dest, open_options(args).remote)
            threads = worker_threads(client)
            phases.connect, phases.workers = time.monotonic() - phases.started, len(client.nthreads())
            plan, works, pending, finished = _prepare(args, threads, phases, early)
            submitted, start = time.time(), time.monotonic()
            results = _on_cluster(args, client, _exports(args, plan, works, pending), "task")
        else:
            plan, works, pending, finished = _prepare(args, LOCAL_THREADS, phases)
            submitted, start = time.time(), time.monotonic()
            results = _export_here(args, _exports(args, plan, works, pending))
        phases.tasks = time.monotonic() - start
        timelines = [r.timeline for r in results if r.timeline is not None]
        settle_idle(timelines, submitted)
        # The manifest before the cluster is closed: a local:N cluster takes a while to stop.
        status = _export_report(args, plan, finished + results, sum(len(w.dirs) for w in works), phases)
    finally:
        if client is not None:
            start = time.monotonic()
            close_client(client)
            phases.close = time.monotonic() - start
    phases.total = time.monotonic() - phases.started
    if args.stats is not None:
        _write_stats(args, phases, timelines)
    return status


def _write_stats(args: argparse.Namespace, phases: RunPhases, timelines: list[TaskTimeline]) -> None:
    """The run's statistics as JSON into --stats FILE (`-`: standard output), and a few lines of
    them on standard error (unless -q)."""
    stats = summary(phases, timelines)
    text = json.dumps(stats, indent=1) + "\n"
    if args.stats == "-":
        sys.stdout.write(text)
    else:
        try:
            with open(args.stats, "w") as f:
                f.write(text)
        except OSError as e:
            print(f"unshardfs: cannot write --stats {args.stats}: {e.strerror}", file=sys.stderr)
    if not args.quiet:
        for line in summary_lines(stats):
            print(line, file=sys.stderr)


def _export_report(args: argparse.Namespace, plan: Plan, results: list[PartResult], dirs: int,
                   phases: RunPhases) -> int:
    problems = sorted(dict.fromkeys(line for r in results for line in r.problems))
    failures = sorted(dict.fromkeys(f for r in results for f in r.summary.failures))
    stopped = next((r.summary.stopped for r in results if r.summary.stopped is not None), None)
    for line in problems + failures:
        print(f"not exported: {line}", file=sys.stderr)
    written = sum(r.summary.written for r in results)
    skipped = sum(r.summary.skipped for r in results)
    size = sum(r.summary.bytes for r in results)
    complete = sum(r.complete for r in results)
    tail = f"; {len(failures)} failed" if failures else ""
    finished = complete == plan.tasks and stopped is None
    if finished:
        start = time.monotonic()
        out = open_dest(args.dest, open_options(args).remote, sync=not args.no_fsync)
        try:
            ledger = Ledger(out.records)
            # Ledger entries never change once written: a manifest gathered from them stays right.
            if not ledger.has_manifest() or not all(r.recorded for r in results):
                ledger.write_manifest(plan)
            if out.remote:
                out.files.clear()  # uploads a lost worker left unfinished: every file is in place now
            tail += f"; manifest {out.where(MANIFEST)}"
        except (WriteStopped, DataError) as e:  # DataError: a ledger entry read back does not add up
            stopped, finished = str(e), False
        finally:
            out.close()
            phases.manifest = time.monotonic() - start
    if not finished:
        tail += f"; {complete:,} of {plan.tasks:,} tasks complete (run again with --resume)"
    print(f"exported {written + skipped:,} files ({written:,} written, {skipped:,} already complete, "
          f"{size / 2**20:,.1f} MiB) and {dirs:,} directories to {args.dest}{tail}")
    if stopped is not None:
        print(f"unshardfs: export stopped: {stopped}", file=sys.stderr)
    return 0 if finished and not failures and not problems else 1


def run_tool(args: argparse.Namespace) -> int:
    # Problems are printed by the command itself; keep the log quiet.
    logging.basicConfig(level=logging.CRITICAL)
    if args.command == "check":
        return _check(args)
    if args.command == "export":
        return _export(args)
    return trio.run(_inspect, args)
