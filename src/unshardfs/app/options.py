"""Command-line options shared by mount, serve and the offline tools: how a SOURCE is read and shown."""

from __future__ import annotations

import argparse
import os

from unshardfs.app.opened import OpenOptions
from unshardfs.core.caches import Caches, CacheSizes
from unshardfs.core.datasets import TREE_DEPTH
from unshardfs.core.fetch import FetchPolicy
from unshardfs.core.registry import add_format_options, given_options, index_levels
from unshardfs.sources import RemoteOptions
from unshardfs.sources.http import HttpOptions
from unshardfs.sources.icechunk import IcechunkOptions
from unshardfs.util.limits import DataLimits
from unshardfs.util.maps import MiB


def add_source_options(parser: argparse.ArgumentParser) -> None:
    """How a SOURCE is read (remote, read path, bounds) and shown (each format's own options)."""
    add_format_options(parser)
    tree = parser.add_argument_group("a tree of datasets (a SOURCE that is no one dataset)")
    tree.add_argument("--depth", type=int, default=TREE_DEPTH, metavar="N",
                      help="directories below SOURCE shown and looked into for datasets (default %(default)s)")
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
    remote.add_argument("--request-deadline", type=float, default=None, metavar="SECONDS",
                        help="the most one request may take in all (every retry, redirect and the body), so a "
                             "server dripping bytes cannot hold a slot (default 4 x --timeout)")
    remote.add_argument("--stat-ttl", type=float, default=defaults.stat_ttl, metavar="SECONDS",
                        help="how long object sizes and absences are trusted (default %(default)s)")
    remote.add_argument("--s3-endpoint", metavar="URL", help="S3-compatible endpoint (default: AWS)")
    remote.add_argument("--gcs-endpoint", metavar="URL", help="GCS endpoint (default: storage.googleapis.com)")
    remote.add_argument("--cache-dir", metavar="DIR",
                        help="keep shard/minishard indexes on disk, so a remount does not fetch them again; "
                             "they live in DIR/unshardfs-index-cache/ (made and marked by unshardfs, refused if "
                             "it holds anything else), and no file unshardfs did not write is ever deleted")
    remote.add_argument("--cache-dir-size", type=int, default=1024, metavar="MiB",
                        help="budget of --cache-dir (default %(default)s)")
    fetch = FetchPolicy()
    remote.add_argument("--no-read-ahead", dest="read_ahead", action="store_false",
                        help="do not prefetch the next chunks of a recognised scan")
    remote.add_argument("--prefetch-cache", type=int, default=fetch.prefetch_bytes // MiB, metavar="MiB",
                        help="budget of prefetched chunks waiting for their reader (default %(default)s)")
    remote.add_argument("--coalesce-gap", type=int, default=fetch.max_gap // 1024, metavar="KiB",
                        help="chunks at most this far apart in a shard are read in one request (default "
                             "%(default)s)")
    remote.add_argument("--icechunk-virtual", dest="icechunk_virtual", action="append", default=[], metavar="PREFIX",
                        help="read Icechunk virtual chunk references under this URL prefix (s3://bucket/data/, "
                             "file:///data/); repeatable. Without it only references inside the repository are "
                             "read, every other one fails (EIO)")
    limits = DataLimits()
    bounds = parser.add_argument_group("bounds on untrusted data")
    bounds.add_argument("--max-index-size", type=int, default=limits.index_bytes // MiB, metavar="MiB",
                        help="largest shard/minishard/chunk index read in one piece (default %(default)s)")
    bounds.add_argument("--max-payload-size", type=int, default=limits.payload_bytes // MiB, metavar="MiB",
                        help="largest decoded file whose size the format does not fix: meshes, skeletons, "
                             "non-raw chunks beyond their geometry's bound (default %(default)s)")
    bounds.add_argument("--max-metadata-size", type=int, default=limits.metadata_bytes // MiB, metavar="MiB",
                        help="largest metadata file (info, zarr.json, DVID spec) parsed (default %(default)s)")
    bounds.add_argument("--max-metadata-values", type=int, default=limits.metadata_values, metavar="N",
                        help="most JSON values (object members and list elements) one metadata file may hold; "
                             "consolidated Zarr metadata of very many arrays may need more (default %(default)s)")


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    """The daemon's cache budgets (mount and serve)."""
    sizes = CacheSizes()
    for level in index_levels():  # as the formats declare them
        parser.add_argument(level.option, dest=level.dest, type=int, default=level.default // MiB, metavar="MiB",
                            help=f"{level.help} (default %(default)s)")
    parser.add_argument("--chunk-cache", type=int, default=sizes.decoded_chunk_bytes // MiB, metavar="MiB",
                        help="decoded (gunzipped) chunk cache (default %(default)s; plus 1/8 of it for "
                             "compressed payloads fetched at lookup)")
    parser.add_argument("--metadata-cache", type=int, default=sizes.metadata_bytes // MiB, metavar="MiB",
                        help="metadata files (zarr.json) as built from each version, and the errors of damaged "
                             "ones (default %(default)s)")


def make_caches(args: argparse.Namespace) -> Caches:
    """The caches the command line asks for: one per declared index level, chunks, payloads."""
    chunk = args.chunk_cache * MiB
    levels = index_levels()
    sizes = CacheSizes({level.name: getattr(args, level.dest) * MiB for level in levels}, chunk,
                       encoded_chunk_bytes=chunk // 8, metadata_bytes=args.metadata_cache * MiB)
    return Caches(sizes, levels)


def open_options(args: argparse.Namespace) -> OpenOptions:
    """How `OpenedSource.open` reads and shows the SOURCE, from the command line."""
    http = HttpOptions(concurrency=max(1, args.concurrency), timeout=args.timeout, retries=max(0, args.retries),
                       backoff=max(0.0, args.backoff), stat_ttl=args.stat_ttl, deadline=args.request_deadline)
    remote = RemoteOptions(http, args.s3_endpoint, args.gcs_endpoint,
                           args.cache_dir and os.path.abspath(os.path.expanduser(args.cache_dir)),
                           args.cache_dir_size * MiB)
    policy = FetchPolicy(max_gap=max(0, args.coalesce_gap) * 1024, concurrency=max(1, args.concurrency),
                         prefetch_bytes=max(0, args.prefetch_cache) * MiB, read_ahead=args.read_ahead)
    limits = DataLimits(index_bytes=max(1, args.max_index_size) * MiB, payload_bytes=max(1, args.max_payload_size) * MiB,
                    metadata_bytes=max(1, args.max_metadata_size) * MiB,
                    metadata_values=max(1, args.max_metadata_values))
    icechunk = IcechunkOptions(tuple(getattr(args, "icechunk_virtual", None) or ()))
    return OpenOptions(remote, policy, limits, given_options(args), icechunk,
                       depth=max(0, getattr(args, "depth", TREE_DEPTH)))
