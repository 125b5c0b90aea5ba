"""Command-line options shared by mount and the offline tools: how a SOURCE is read and shown."""

from __future__ import annotations

import argparse
import os

from .caches import MiB
from .sources import RemoteOptions
from .sources.http import HttpOptions


def add_format_options(parser: argparse.ArgumentParser) -> None:
    """How a SOURCE is read (remote options) and shown (format options); mount and the tools share them."""
    parser.add_argument("--view", choices=("zarr3", "zarr2"), default=None,
                        help="Zarr stores: show unsharded Zarr v3 (default) or Zarr v2 for legacy readers")
    parser.add_argument("--info", dest="info_path", metavar="SPEC.json",
                        help="DVID exports: the Neuroglancer volume spec the export was made against "
                             "(default: an info file in SOURCE)")
    parser.add_argument("--supervoxels", action="store_true",
                        help="DVID exports: show supervoxel ids instead of agglomerated labels")
    remote = parser.add_argument_group("remote sources (http(s)://, gs://, s3://)")
    defaults = HttpOptions()
    remote.add_argument("--concurrency", type=int, default=defaults.concurrency, metavar="N",
                        help="requests in flight at once (default %(default)s)")
    remote.add_argument("--timeout", type=float, default=defaults.timeout, metavar="SECONDS",
                        help="per request attempt (default %(default)s)")
    remote.add_argument("--retries", type=int, default=defaults.retries, metavar="N",
                        help="retries after a connection error, timeout, 429 or 5xx, with backoff (default "
                             "%(default)s)")
    remote.add_argument("--backoff", type=float, default=defaults.backoff, metavar="SECONDS",
                        help="first retry delay, doubling each retry (default %(default)s)")
    remote.add_argument("--stat-ttl", type=float, default=defaults.stat_ttl, metavar="SECONDS",
                        help="how long object sizes and absences are trusted (default %(default)s)")
    remote.add_argument("--s3-endpoint", metavar="URL", help="S3-compatible endpoint (default: AWS)")
    remote.add_argument("--gcs-endpoint", metavar="URL", help="GCS endpoint (default: storage.googleapis.com)")
    remote.add_argument("--cache-dir", metavar="DIR",
                        help="keep shard/minishard indexes on disk, so a remount does not fetch them again")
    remote.add_argument("--cache-dir-size", type=int, default=1024, metavar="MiB",
                        help="budget of --cache-dir (default %(default)s)")


def format_options(args: argparse.Namespace) -> dict:
    """Keyword arguments of `formats.resolve` from the command line (picklable, for workers)."""
    http = HttpOptions(concurrency=max(1, args.concurrency), timeout=args.timeout, retries=max(0, args.retries),
                       backoff=max(0.0, args.backoff), stat_ttl=args.stat_ttl)
    remote = RemoteOptions(http, args.s3_endpoint, args.gcs_endpoint,
                           args.cache_dir and os.path.abspath(os.path.expanduser(args.cache_dir)),
                           args.cache_dir_size * MiB)
    return {"view": args.view, "info_path": args.info_path and os.path.abspath(args.info_path),
            "supervoxels": args.supervoxels, "remote": remote}
