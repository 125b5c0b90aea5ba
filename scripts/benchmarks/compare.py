"""Across commits: the local scenarios for two checkouts of unshardfs, alternating, several runs each.

Side A is a named commit, checked out once into a temporary git worktree;
side B is the working tree (or a second named commit). Each side's daemon
runs that side's code through PYTHONPATH, in the same Python environment, so
no side is installed anywhere. The datasets are built once (the ones
`scripts/bench` uses) and shared by both sides.

The two sides are measured alternately, A B in even rounds and B A in odd
ones, figure by figure, so a machine that gets busier or quieter during the
run moves both sides alike. Each figure gets its median per side, the ratio
B/A of the medians as a speed (above 1: B is faster, also for figures in
seconds), the median and range of the per-round ratios, and a verdict from
those (see `judge`): on a shared machine the spread of either side's own
runs is mostly load, which the pairing within a round cancels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .ceiling import CeilingUnavailable, binary, options_like
from .context import KEY
from .datasets import build_datasets
from .mounts import PY, UNSHARDFS, mounted
from .measure import through
from .scenarios import remote
from .store import NginxStore, StoreUnavailable
from .workloads import parallel_read, read_files, rel_files, timed, warm_page_cache, xargs_read

MIN_NOISE = 0.03  # per-round ratios within this of 1 are not called either way
READERS = 8
REMOTE_LATENCY = 0.02  # seconds before each answer of the remote figures' Range server


@dataclass
class Side:
    """One checkout under test (`src` goes first on its daemon's PYTHONPATH), or a baseline file
    system serving the same files unsharded (`src` None, `baseline` its kind)."""

    label: str
    src: Path | None
    baseline: str = ""  # "nullfs", "ratarmount" or "ceiling"
    options: tuple[str, ...] = ()  # the baseline's mount options (the ceiling daemon's)
    readahead_kib: int | None = None  # the baseline's read-ahead (the ceiling daemon's, as unshardfs sets it)

    @property
    def env(self) -> dict[str, str] | None:
        if self.src is None:
            return None
        rest = os.environ.get("PYTHONPATH")
        return {**os.environ, "PYTHONPATH": str(self.src) + (os.pathsep + rest if rest else "")}

    @property
    def kind(self) -> str:
        return "unshardfs" if self.src is not None else self.baseline

    @property
    def tag(self) -> str:
        return self.label[:1] if self.src is not None else self.baseline


@dataclass
class Figure:
    name: str
    unit: str
    measure: Callable[["Bench", Side], float]
    higher_is_better: bool = True
    baselines: tuple[str, ...] = ()  # baseline file systems that serve this figure's files too


@dataclass
class Bench:
    data: dict[str, Any]
    work: Path
    files: list[str]  # chunk files of the small scale, relative to a mount's root
    large_files: list[str]
    results: dict[str, dict[str, list[float]]] = field(default_factory=dict[str, Any])  # figure -> side label -> values

    tar: Path | None = None  # the small scale's chunks as a tar, for ratarmount
    remote: dict[str, remote.Dataset] = field(default_factory=dict[str, Any])  # `scripts/bench --only remote`'s volumes

    def source(self, side: Side, name: str) -> Path:
        if side.kind == "ratarmount":
            return self.tar  # type: ignore[return-value]
        ds = self.data[name]
        return Path(ds["sharded"] if side.src is not None else ds["plain"])

    # -- figures -----------------------------------------------------------------------

    def mount(self, side: Side, source: Path) -> Any:
        return mounted(side.kind, source, self.work, *side.options, env=side.env, readahead_kib=side.readahead_kib)

    def first_read(self, side: Side) -> float:
        with self.mount(side, self.source(side, "small")) as m:
            return len(self.files) / timed(lambda: read_files([str(m / f) for f in self.files]))

    def warm_reread(self, side: Side) -> float:
        with mounted(side.kind, self.source(side, "small"), self.work, env=side.env) as m:
            paths = [str(m / f) for f in self.files]
            read_files(paths)
            return max(len(paths) / timed(lambda: read_files(paths)) for _ in range(2))

    def readers(self, side: Side) -> float:
        with mounted(side.kind, self.source(side, "small"), self.work, env=side.env) as m:
            return len(self.files) / parallel_read([str(m / f) for f in self.files], READERS)

    def ls_million(self, side: Side) -> float:
        with mounted(side.kind, self.data["million"], self.work, env=side.env) as m:
            start = time.perf_counter()
            out = subprocess.run(["ls", "-f", str(m / "s0")], capture_output=True, check=True).stdout
            elapsed = time.perf_counter() - start
        entries = out.count(b"\n")
        if entries < 1_000_000:
            raise RuntimeError(f"{side.label}: ls -f listed {entries} entries, not 1,000,000")
        return elapsed

    def sequential(self, side: Side) -> float:
        with self.mount(side, self.source(side, "large")) as m:
            paths = [str(m / f) for f in self.large_files]
            size = sum(os.path.getsize(p) for p in paths)
            return size / timed(lambda: read_files(paths)) / 2**20

    def remote_cp(self, side: Side, name: str) -> float:
        """`cp -r` of a volume's chunk directory over a Range server answering after REMOTE_LATENCY."""
        ds = self.remote[name]
        target = self.work / "cp-target"
        with remote_mount(ds, side, self.work) as m:
            elapsed = timed(lambda: subprocess.run(["cp", "-r", str(m / ds.chunk_dir), str(target)], check=True))
        subprocess.run(["rm", "-rf", str(target)], check=True)
        return len(ds.files) / elapsed

    def remote_readers(self, side: Side, name: str) -> float:
        ds = self.remote[name]
        with remote_mount(ds, side, self.work) as m:
            return len(ds.files) / xargs_read(m / ds.chunk_dir, READERS)

    def remote_readers_cpu(self, side: Side, name: str) -> float:
        """The daemon's CPU per file (microseconds, /proc/PID/stat) while 8 readers read over HTTP."""
        ds = self.remote[name]
        with remote_mount(ds, side, self.work) as m:
            got = through(m, len(ds.files), lambda: xargs_read(m / ds.chunk_dir, READERS))
        assert got.daemon_cpu is not None
        return got.daemon_cpu / len(ds.files) * 1e6

    def export(self, side: Side) -> float:
        """`unshardfs export` of the small volume into a fresh directory: files exported per second
        (no fsync: the figure is the export's, not the disk's)."""
        return self._export(side, str(self.source(side, "small")), len(self.files))

    def remote_export(self, side: Side, name: str) -> float:
        """`unshardfs export` of a volume served by the store stand-in with REMOTE_LATENCY per request."""
        ds = self.remote[name]
        with NginxStore(ds.root, REMOTE_LATENCY, self.work) as server:
            return self._export(side, server.url, len(ds.files))

    def _export(self, side: Side, source: str, files: int) -> float:
        target = self.work / "export-target"
        env = {**(os.environ if side.env is None else side.env), "XDG_CACHE_HOME": str(self.work)}
        elapsed = timed(lambda: subprocess.run([*UNSHARDFS, "export", "-q", "--no-fsync", source, str(target)],
                                               env=env, check=True, capture_output=True))
        subprocess.run(["rm", "-rf", str(target)], check=True)
        return files / elapsed


@contextmanager
def remote_mount(ds: remote.Dataset, side: Side, work: Path) -> Iterator[Path]:
    """A fresh mount of `ds` served by the store stand-in (nginx) with REMOTE_LATENCY per request."""
    with NginxStore(ds.root, REMOTE_LATENCY, work) as server:
        with mounted(side.kind, server.url, work, env=side.env) as m:
            yield m


FIGURES: dict[str, Figure] = {
    "first": Figure("first read, 4096 x 16 KiB", "files/s", Bench.first_read,
                    baselines=("nullfs", "ratarmount", "ceiling")),
    "warm": Figure("warm re-read, 4096 x 16 KiB", "files/s", Bench.warm_reread, baselines=("nullfs",)),
    "readers": Figure(f"{READERS} readers, first read", "files/s", Bench.readers),
    "ls": Figure("ls -f, 1,000,000 chunks", "s", Bench.ls_million, higher_is_better=False),
    "sequential": Figure("sequential, 2 MiB raw chunks", "MiB/s", Bench.sequential, baselines=("nullfs", "ceiling")),
    # Over HTTP at 20 ms per request (`scripts/bench --only remote`; not in the default set).
    "remote": Figure("cp -r precomputed, 20 ms", "files/s", lambda b, s: b.remote_cp(s, "precomputed")),
    "remote-zarr": Figure("cp -r Zarr v3, 20 ms", "files/s", lambda b, s: b.remote_cp(s, "zarr3")),
    "remote-readers": Figure(f"{READERS} readers Zarr v3, 20 ms", "files/s",
                             lambda b, s: b.remote_readers(s, "zarr3")),
    "remote-readers-precomputed": Figure(f"{READERS} readers precomputed, 20 ms", "files/s",
                                         lambda b, s: b.remote_readers(s, "precomputed")),
    # The daemon's CPU per file of those 8 readers: lower is better, and load moves it far less.
    "remote-readers-cpu": Figure(f"{READERS} rdrs Zarr 20ms CPU/file", "us", lambda b, s: b.remote_readers_cpu(s, "zarr3"),
                                 higher_is_better=False),
    "remote-readers-precomputed-cpu": Figure(f"{READERS} rdrs precomp. 20ms CPU/file", "us",
                                             lambda b, s: b.remote_readers_cpu(s, "precomputed"),
                                             higher_is_better=False),
    # `unshardfs export` (the write side): chunk files exported per second, into a directory.
    "export": Figure("export, 4096 x 16 KiB", "files/s", Bench.export),
    "export-remote": Figure("export precomputed, 20 ms", "files/s", lambda b, s: b.remote_export(s, "precomputed")),
}
REMOTE = ("remote", "remote-zarr", "remote-readers", "remote-readers-precomputed", "remote-readers-cpu",
          "remote-readers-precomputed-cpu", "export-remote")


# -- checkouts --------------------------------------------------------------------------------


def repo_root() -> Path:
    return Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True, cwd=Path(__file__).parent).stdout.strip())


def describe(repo: Path, rev: str) -> str:
    out = subprocess.run(["git", "log", "-1", "--format=%h %s", rev], capture_output=True, text=True, cwd=repo)
    if out.returncode:
        raise SystemExit(f"bench-compare: {rev!r} is not a commit of {repo}")
    line = out.stdout.strip()
    return line if len(line) <= 72 else line[:69] + "..."


def checkout(repo: Path, rev: str, into: Path) -> Path:
    """`rev` checked out (detached) into a temporary worktree; its src directory."""
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(into), rev], cwd=repo, check=True)
    return into / "src"


def remove_checkout(repo: Path, path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=repo, capture_output=True)
    subprocess.run(["git", "worktree", "prune"], cwd=repo, capture_output=True)


def importable(side: Side) -> None:
    """Fail early, with the cause, if a side's code does not even import in this environment."""
    # The CLI's module, wherever that side keeps it (a commit before the layered layout has unshardfs.cli).
    probe = ("import importlib, importlib.util, unshardfs; importlib.import_module('unshardfs.app.cli' "
             "if importlib.util.find_spec('unshardfs.app') else 'unshardfs.cli'); print(unshardfs.__file__)")
    out = subprocess.run([PY, "-c", probe],
                         env=side.env, capture_output=True, text=True)
    if out.returncode or not out.stdout.strip().startswith(str(side.src)):
        raise SystemExit(f"bench-compare: {side.label}'s code does not import from {side.src}:\n"
                         f"{out.stdout}{out.stderr}")


# -- statistics -------------------------------------------------------------------------------


def speed(value: float, fig: Figure) -> float:
    return value if fig.higher_is_better else 1 / value


@dataclass
class Verdict:
    ratio: float  # speed of B over A, medians
    low: float  # lowest per-round ratio
    high: float
    paired: float  # median of the per-round ratios
    word: str


def judge(fig: Figure, a: list[float], b: list[float]) -> Verdict:
    """B/A of the medians, and a verdict from the per-round ratios (each round measures A and B
    back to back, so a load change moves both): a drop when their median is below 1 by more
    than MIN_NOISE and B lost every round (with 5 rounds, 2 chances in 32 of that by chance),
    "slower?" when the median is that low but not every round agrees; likewise for gains."""
    ratio = speed(statistics.median(b), fig) / speed(statistics.median(a), fig)
    per_round = [speed(y, fig) / speed(x, fig) for x, y in zip(a, b)]
    paired = statistics.median(per_round)
    if paired < 1 - MIN_NOISE:
        word = "SLOWER" if max(per_round) < 1 else "slower? (not in every round)"
    elif paired > 1 + MIN_NOISE:
        word = "faster" if min(per_round) > 1 else "faster? (not in every round)"
    else:
        word = "same"
    return Verdict(ratio, min(per_round), max(per_round), paired, word)


# -- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    chosen = args.only.split(",") if args.only else [name for name in FIGURES if name not in REMOTE]
    unknown = [c for c in chosen if c not in FIGURES]
    if unknown:
        raise SystemExit(f"bench-compare: unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    runs = args.runs or (3 if args.fast else 5)
    repo = repo_root()
    work = Path(tempfile.mkdtemp(prefix="unshardfs-compare-"))
    checkouts: list[Path] = []
    try:
        a_path = work / "a"
        a = Side(f"A {describe(repo, args.rev)}", checkout(repo, args.rev, a_path))
        checkouts.append(a_path)
        if args.rev_b:
            b_path = work / "b"
            b = Side(f"B {describe(repo, args.rev_b)}", checkout(repo, args.rev_b, b_path))
            checkouts.append(b_path)
        else:
            b = Side(f"B working tree of {repo} ({describe(repo, 'HEAD')[:7]} + changes)", repo / "src")
        for side in (a, b):
            importable(side)
        baselines = ([Side("null pyfuse3 fs", None, "nullfs")] if args.null else []) + \
            ([Side("ratarmount on a tar", None, "ratarmount")] if args.ratarmount else [])
        bench = prepare(Path(args.data).resolve(), work, chosen, args.ratarmount)
        if args.ceiling:
            baselines.append(ceiling_side(bench, b))
        print(f"{a.label}\n{b.label}\n{runs} runs each, alternating; load average {os.getloadavg()[0]:.1f}",
              flush=True)
        for r in range(runs):
            order = (a, b) if r % 2 == 0 else (b, a)
            for name in chosen:
                fig = FIGURES[name]
                sides = list(order) + [side for side in baselines if side.baseline in fig.baselines]
                for side in sides:
                    value = fig.measure(bench, side)
                    bench.results.setdefault(name, {}).setdefault(side.label, []).append(value)
                    print(f"  round {r + 1}/{runs} {name:10} {side.tag:10} "
                          f"{value:10,.1f} {fig.unit}", file=sys.stderr, flush=True)
        dropped = report(bench, chosen, a, b, baselines, runs)
        if args.json:
            Path(args.json).write_text(json.dumps({"a": a.label, "b": b.label, "runs": runs,
                                                   "results": bench.results}, indent=2))
        return 1 if dropped and args.fail_on_drop else 0
    finally:
        for path in checkouts:
            remove_checkout(repo, path)
        subprocess.run(["rm", "-rf", str(work)])


def prepare(data: Path, work: Path, chosen: list[str], ratarmount: bool) -> Bench:
    started = time.perf_counter()
    ds = build_datasets(data, full=False)
    for name in ("small", "large"):
        for variant in ("sharded", "plain"):
            warm_page_cache(ds[name][variant])
    if "ls" in chosen:
        warm_page_cache(ds["million"])
    bench = Bench(ds, work, rel_files(ds["small"]["plain"], KEY), rel_files(ds["large"]["plain"], KEY))
    if any(name in REMOTE for name in chosen):
        bench.remote = {volume.name: volume for volume in remote.datasets_at(data)[0]}
    if ratarmount:
        bench.tar = work / "small.tar"
        with tarfile.open(bench.tar, "w") as t:
            t.add(ds["small"]["plain"] / KEY, arcname=KEY)
        with mounted("ratarmount", bench.tar, work):
            pass  # ratarmount builds its index once, outside the timing
    print(f"datasets ready in {time.perf_counter() - started:.0f} s ({data})", file=sys.stderr, flush=True)
    return bench


def ceiling_side(bench: Bench, like: Side) -> Side:
    """The ceiling daemon (`ceilingfs.c`) with the request size and read-ahead that side `like`'s
    unshardfs negotiates on the large scale."""
    try:
        binary(bench.work)
    except CeilingUnavailable as e:
        raise SystemExit(f"bench-compare: {e}") from None
    with mounted("unshardfs", bench.data["large"]["sharded"], bench.work, env=like.env) as m:
        features = json.loads(os.getxattr(m, "user.unshardfs.stats"))["fuse"]["features"]
    options, readahead = options_like(features)
    return Side("ceiling daemon (libfuse, 1 thread)", None, "ceiling", tuple(options), readahead)


def report(bench: Bench, chosen: list[str], a: Side, b: Side, baselines: list[Side], runs: int) -> bool:
    """Print the table; whether any figure dropped beyond the noise."""
    print(f"\nacross commits, {runs} runs each (load average now {os.getloadavg()[0]:.1f})")
    print(f"  {a.label}\n  {b.label}")
    print("  B/A is a speed ratio: above 1, B is faster (for figures in seconds too)\n")
    print(f"{'figure':30} {'unit':8} {'A median':>10} {'B median':>10} {'B/A':>6} {'per-round B/A: median':>22} "
          f"{'(range)':>12}  verdict")
    dropped = False
    for name in chosen:
        fig = FIGURES[name]
        va, vb = bench.results[name][a.label], bench.results[name][b.label]
        v = judge(fig, va, vb)
        dropped |= v.word == "SLOWER"
        print(f"{fig.name:30} {fig.unit:8} {statistics.median(va):10,.1f} {statistics.median(vb):10,.1f} "
              f"{v.ratio:6.2f} {v.paired:22.2f} {f'({v.low:.2f}-{v.high:.2f})':>12}  {v.word}")
    for base in baselines:
        print(f"\nagainst {base.label} (the same files unsharded, measured in the same rounds): median "
              "(range) of the per-round ratios")
        for name in chosen:
            fig = FIGURES[name]
            if base.baseline not in fig.baselines:
                continue
            vn = bench.results[name][base.label]
            cells = []
            for side in (a, b):
                ratios = [speed(x, fig) / speed(n, fig) for x, n in zip(bench.results[name][side.label], vn)]
                cells.append(f"{side.label[:1]} {statistics.median(ratios):.2f} "
                             f"({min(ratios):.2f}-{max(ratios):.2f})")
            print(f"{fig.name:30} {base.baseline:10} {statistics.median(vn):10,.1f} {fig.unit:8} "
                  + "   ".join(cells))
    return dropped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench-compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="side A: a commit (checked out into a temporary worktree)")
    parser.add_argument("rev_b", nargs="?", help="side B: another commit (default: this working tree)")
    parser.add_argument("--runs", type=int, help="rounds per side (default 5; 3 with --fast)")
    parser.add_argument("--fast", action="store_true", help="3 rounds (about 3 minutes once datasets exist)")
    parser.add_argument("--only", help=f"comma-separated figures (of: {', '.join(FIGURES)}; all but "
                        f"{', '.join(REMOTE)} by default)")
    parser.add_argument("--null", action="store_true",
                        help="also measure the null pyfuse3 fs each round (ratios to the FUSE ceiling)")
    parser.add_argument("--ratarmount", action="store_true",
                        help="also measure ratarmount on a tar of the chunks each round (first read)")
    parser.add_argument("--ceiling", action="store_true",
                        help="also measure the ceiling daemon (libfuse, from memory) each round (first, sequential)")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "bench-data"),
                        help="where the datasets are built once and reused (shared with scripts/bench)")
    parser.add_argument("--json", help="write every measured value to this file")
    parser.add_argument("--fail-on-drop", action="store_true", help="exit 1 if any figure dropped beyond noise")
    try:
        return run(parser.parse_args(argv))
    except StoreUnavailable as e:  # the remote figures' store stand-in cannot run here: one line
        raise SystemExit(f"bench-compare: {e}") from None
