"""Export a sharded dataset to its unsharded layout with workers started as SLURM jobs, then
verify the copy against its manifest on the same workers.

    python export.py SOURCE DEST [--jobs N] [--parts N]

Settings come from jobqueue.yaml (next to this file; copy it to ~/.config/dask/). Run it again
after any interruption: it always passes --resume, which starts a new export when DEST holds
none and otherwise redoes only the unfinished tasks.
"""

from __future__ import annotations

import argparse
import sys


def commands(source: str, dest: str, address: str, parts: int) -> list[list[str]]:
    """The two unshardfs runs: the export (resumable) and the verification of the copy."""
    return [
        ["export", "--resume", "--scheduler", address, "--parts", str(parts), source, dest],
        ["check", "--scheduler", address, "--manifest", f"{dest}/.unshardfs/manifest.jsonl", dest],
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("dest", help="a directory on a file system every compute node mounts")
    parser.add_argument("--jobs", type=int, default=16, help="SLURM jobs (each runs 8 workers)")
    parser.add_argument("--parts", type=int, default=4096,
                        help="tasks the export is planned as (fixed by the first run): a few shards each")
    args = parser.parse_args()

    from dask_jobqueue import SLURMCluster
    from distributed import Client

    from unshardfs.app.cli import main as unshardfs

    with SLURMCluster() as cluster, Client(cluster) as client:
        cluster.scale(jobs=args.jobs)
        client.wait_for_workers(1, timeout=3600)  # the queue decides when; tasks start with the first
        for argv in commands(args.source, args.dest, cluster.scheduler_address, args.parts):
            status = unshardfs(argv)
            if status != 0:
                return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
