"""unshardfs benchmark: every figure next to a baseline measured in the same run.

Baselines: a null pyfuse3 file system serving the same files from memory
(the ceiling of FUSE + pyfuse3), the unsharded files on tmpfs and on local
disk, TensorStore reading the same chunks in-process from the shards,
ratarmount serving a tar of the unsharded chunks, and for reads over HTTP a
bare httpx client and TensorStore's http kvstore on the same server.

Usage: scripts/bench [--only SCENARIO[,SCENARIO...]] [--full] [--json FILE] [--data DIR] [--profile]

--profile samples every unshardfs daemon (and export process and worker) with py-spy and writes,
per figure, a flame graph SVG and the raw collapsed stacks beside the JSON (FILE without its
suffix, plus "-profiles"; ./bench-profiles without --json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the benchmarks package lives beside this script

from benchmarks import profiling  # noqa: E402
from benchmarks.ceiling import CeilingUnavailable  # noqa: E402
from benchmarks.context import Context  # noqa: E402
from benchmarks.store import StoreUnavailable  # noqa: E402
from benchmarks.scenarios import SCENARIOS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="also list a 10,000,000-chunk scale")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--data", default=str(HERE.parent / "bench-data"), help="where datasets are built and reused")
    parser.add_argument("--only", help=f"comma-separated scenarios to run (of: {', '.join(SCENARIOS)})")
    parser.add_argument("--profile", action="store_true",
                        help="sample the daemons with py-spy: a flame graph and raw stacks per figure")
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = [name for name in chosen if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    ctx = Context(args)
    if args.profile:
        where = Path(args.json).with_suffix("") if args.json else Path("bench")
        profiling.ACTIVE = profiling.Profiler(where.parent / f"{where.name}-profiles")
    failed = []
    try:
        for name in chosen:
            print(f"-- {name}", file=sys.stderr, flush=True)
            try:
                with profiling.figure(name):
                    SCENARIOS[name](ctx)
            except (StoreUnavailable, CeilingUnavailable) as e:  # what this machine lacks, in one line
                print(f"scripts/bench: {name} not run: {e}", file=sys.stderr, flush=True)
                ctx.report.fact(f"{name}: not run", str(e))
                failed.append(name)
    finally:
        ctx.close()
    if profiling.ACTIVE is not None:
        profiler = profiling.ACTIVE
        profiles = profiler.write()
        ctx.report.fact("daemon profiles (py-spy)", {"directory": str(profiler.directory), "failures": profiler.failures,
                                                     "figures": profiles})
        ctx.report.note(f"daemon profiles (py-spy): {len(profiles)} figures in {profiler.directory}/ "
                        "(one .svg flame graph and one .txt of raw stacks each)" if profiles else
                        f"daemon profiles: none recorded ({'; '.join(profiler.failures) or 'no daemon ran'})")
    ctx.report.print()
    if args.json:
        ctx.report.save(Path(args.json))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
