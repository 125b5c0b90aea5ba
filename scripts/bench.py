"""unshardfs benchmark: every figure next to a baseline measured in the same run.

Baselines: a null pyfuse3 file system serving the same files from memory
(the ceiling of FUSE + pyfuse3), the unsharded files on tmpfs and on local
disk, TensorStore reading the same chunks in-process from the shards,
ratarmount serving a tar of the unsharded chunks, and for reads over HTTP a
bare httpx client and TensorStore's http kvstore on the same server.

Usage: scripts/bench [--only SCENARIO[,SCENARIO...]] [--full] [--json FILE] [--data DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the benchmarks package lives beside this script

from benchmarks.context import Context  # noqa: E402
from benchmarks.scenarios import SCENARIOS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="also list a 10,000,000-chunk scale")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--data", default=str(HERE.parent / "bench-data"), help="where datasets are built and reused")
    parser.add_argument("--only", help=f"comma-separated scenarios to run (of: {', '.join(SCENARIOS)})")
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else list(SCENARIOS)
    unknown = [name for name in chosen if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    ctx = Context(args)
    try:
        for name in chosen:
            print(f"-- {name}", file=sys.stderr, flush=True)
            SCENARIOS[name](ctx)
    finally:
        ctx.close()
    ctx.report.print()
    if args.json:
        ctx.report.save(Path(args.json))


if __name__ == "__main__":
    main()
