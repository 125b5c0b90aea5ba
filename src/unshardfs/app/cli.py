"""The `unshardfs` command: mount, serve, unmount, stats and the offline tools."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import sys
from typing import Any, Callable

from unshardfs import __version__
from unshardfs.app.daemon import MountRequest, detach, serve, unmount
from unshardfs.app.options import add_cache_options, add_source_options, make_caches, open_options
from unshardfs.fuse.engines import ENGINES, TRANSPORTS, require
from unshardfs.fuse.ops import STATS_XATTR, MountOptions
from unshardfs.http.server import ServerLimits
from unshardfs.util.errors import ConfigError, DataError, SourceError

EXAMPLES = """\
examples:
  unshardfs mount /data/fafb-seg /mnt/fafb        # returns once mounted
  ls /mnt/fafb/8_8_8 | head                        # chunk files, unsharded names
  unshardfs mount -f --debug /data/ds /mnt/ds      # stay in the foreground, verbose
  unshardfs mount -o allow_other /data/ds /mnt/ds  # let other users read it
  unshardfs stats /mnt/fafb                        # cache use, backing reads, errors
  unshardfs mount /data/em.zarr /mnt/em            # Zarr v3: every shard's inner chunks as files
  unshardfs mount --view zarr2 /data/em.zarr /mnt/em2   # the same as Zarr v2, for v2-only readers
  unshardfs mount --info spec.json /data/dvid-export /mnt/seg  # DVID export-shards as precomputed
  unshardfs mount precomputed://gs://bucket/seg /mnt/seg    # straight from object storage (also s3://, https://)
  unshardfs mount 'gs://bucket/img.ozx|zip:|zarr3:' /mnt/img  # inside a zip, as Neuroglancer names it (also a.zip)
  unshardfs mount gs://bucket/repo.ocdbt/ /mnt/repo   # TensorStore OCDBT: newest version, and @v1/ @v2/ ...
  unshardfs mount 'gs://bucket/repo/|ocdbt:@v10/seg/|zarr3:' /mnt/v10  # one version, as Neuroglancer names it
  unshardfs mount gs://bucket/repo.icechunk/ /mnt/repo  # Icechunk: branch main, and @branch.X/ @tag.Y/ @SNAPSHOT/
  unshardfs mount 'gs://bucket/repo/|icechunk:@tag.v1/|zarr3:seg/' /mnt/v1  # one ref, as Neuroglancer names it
  unshardfs unmount /mnt/fafb
  unshardfs serve /data/fafb-seg --port 8080      # the same tree over HTTP (CORS on), no FUSE needed
  unshardfs stats http://127.0.0.1:8080            # a server's live statistics
  unshardfs inspect /data/fafb-seg                 # shards, chunks, sizes (indexes only)
  unshardfs check /data/fafb-seg                   # verify every index and payload
  unshardfs export /data/fafb-seg /data/unsharded  # write the unsharded tree (resumable)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unshardfs",
        description="Mount a sharded dataset (Neuroglancer precomputed, Zarr v3, DVID Arrow export) as its "
                    "unsharded directory tree (read-only).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"unshardfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(sub.add_parser, formatter_class=argparse.RawDescriptionHelpFormatter)

    m = command("mount", help="mount SOURCE on MOUNTPOINT", epilog=EXAMPLES)
    m.add_argument("source", metavar="SOURCE",
                   help="dataset directory or file://, http(s)://, gs://, s3:// URL, optionally prefixed precomputed://, "
                        "zarr3:// or zarr://; a zip archive as BASE|zip:[PATH]|FORMAT: (FORMAT: "
                        "neuroglancer-precomputed, zarr3, zarr2, zarr) or a path ending in .ozx/.zip; an OCDBT "
                        "database as BASE|ocdbt:[@vN/|@TIME/][PATH]|FORMAT: or a directory holding manifest.ocdbt "
                        "(every version then shows as @vN/); an Icechunk repository as "
                        "BASE|icechunk:[@branch.NAME/|@tag.NAME/|@SNAPSHOT/][PATH]|zarr3:[PATH] or a directory "
                        "holding refs/branch.main/ref.json (branches, tags and snapshots then show as @NAME/)")
    m.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing empty directory")
    m.add_argument("-f", "--foreground", action="store_true", help="stay attached; log to stderr")
    m.add_argument("-o", dest="fuse_options", action="append", default=[], metavar="OPT[,OPT...]",
                   help="FUSE mount options, e.g. allow_other")
    m.add_argument("--debug", action="store_true", help="verbose logging")
    m.add_argument("--log-file", help="log file when detached (default: ~/.cache/unshardfs/<mountpoint>.log)")
    m.add_argument("--cache-timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="how long the kernel may cache names and attributes (default 3600)")
    m.add_argument("--fuse-engine", choices=ENGINES, default="kernel",
                   help="kernel: our own FUSE protocol session (no-open, parallel lookups; default); "
                        "pyfuse3: libfuse through pyfuse3 (pip install 'unshardfs[pyfuse3]')")
    m.add_argument("--fuse-transport", choices=TRANSPORTS, default="dev",
                   help="kernel engine: dev (read and answer /dev/fuse; default) or uring (experimental: "
                        "FUSE over io_uring, Linux >= 6.14 with the fuse module's enable_uring; "
                        "dev where the kernel does not grant it)")
    m.add_argument("--fuse-passthrough", action="store_true",
                   help="kernel engine, as root, kernel >= 6.9: files stored whole in a local source "
                        "(metadata, files passed through) are read by the kernel itself, at the cost of "
                        "one daemon round trip per open() of every file (see docs/engines.md)")
    add_cache_options(m)
    add_source_options(m)
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    s = command("stats", help="print a mount's (or a server's) live statistics (JSON)",
                       epilog="examples:\n  unshardfs stats /mnt/ds | jq .caches.minishard_index\n"
                              "  unshardfs stats http://127.0.0.1:8080")
    s.add_argument("mountpoint", metavar="MOUNTPOINT|URL")

    v = command("serve", help="serve SOURCE's unsharded tree over HTTP (no FUSE needed)",
                       epilog="examples:\n  unshardfs serve /data/seg --port 8080\n"
                              "  unshardfs serve gs://bucket/seg --bind 0.0.0.0 --cors-origin https://viewer.example\n"
                              "Neuroglancer: add a layer with source precomputed://http://127.0.0.1:8080/")
    v.add_argument("source", metavar="SOURCE")
    v.add_argument("--bind", default="127.0.0.1", metavar="ADDR",
                   help="address to listen on (default %(default)s: this machine only)")
    v.add_argument("--port", type=int, default=8080, help="port (default %(default)s; 0 picks a free one)")
    v.add_argument("--cors-origin", default="*", metavar="ORIGIN",
                   help="Access-Control-Allow-Origin for browser viewers on other origins (default %(default)s)")
    v.add_argument("--no-cors", action="store_true", help="send no CORS headers")
    v.add_argument("--access-log", action="store_true", help="log one line per request (method, path, status)")
    limits = ServerLimits()
    v.add_argument("--max-connections", type=_positive(int), default=limits.max_connections, metavar="N",
                   help="open connections at most (default %(default)s; lowered to fit the file descriptor limit); "
                        "over it, the connection idle longest is closed, or the newcomer gets a 503")
    v.add_argument("--keep-alive", type=_positive(float), default=limits.keep_alive_seconds, metavar="SECONDS",
                   help="close a connection idle this long between requests (default %(default)s)")
    v.add_argument("--header-timeout", type=_positive(float), default=limits.header_seconds, metavar="SECONDS",
                   help="a request's headers must arrive whole within this of their first byte (default %(default)s)")
    v.add_argument("--send-timeout", type=_positive(float), default=limits.send_timeout_seconds, metavar="SECONDS",
                   help="drop a client that takes no byte of its answer for this long (default %(default)s)")
    v.add_argument("--response-buffer", type=_positive(int), default=limits.buffer_bytes >> 20, metavar="MiB",
                   help="response bytes held for clients that have not taken them, all together; past it the "
                        "client blocked longest is dropped (default %(default)s)")
    v.add_argument("--debug", action="store_true", help="verbose logging")
    add_cache_options(v)
    add_source_options(v)

    i = command("inspect", help="summarise SOURCE's sharded directories from their indexes",
                       epilog="example:\n  unshardfs inspect --json /data/ds | jq '.[].chunks'")
    i.add_argument("source", metavar="SOURCE")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_source_options(i)

    c = command("check", help="verify every shard index, minishard index and payload of SOURCE, "
                               "or a copy against its manifest",
                       epilog="exit status: 0 intact, 1 damaged (each problem printed with its shard and chunk id)\n"
                              "examples:\n  unshardfs check /data/ds && echo intact\n"
                              "  unshardfs check --manifest /scratch/ds/.unshardfs/manifest.jsonl /scratch/ds")
    c.add_argument("source", metavar="SOURCE|DEST", nargs="?")
    c.add_argument("--refs", metavar="REFS",
                   help="instead: say whether the objects the references REFS (written by `refs`) point into "
                        "are unchanged, and which references each changed one invalidated (exit 1)")
    c.add_argument("--manifest", metavar="MANIFEST",
                   help="verify the copy DEST against this manifest (written by export): every file's presence, "
                        "size and crc32c, and no file more; one line per difference and a summary. MANIFEST and "
                        "DEST may be s3:// or gs:// URLs")
    add_walk_options(c, 1, "worker processes (threads with --manifest)")

    e = command("export", help="write SOURCE's unsharded tree to DEST (resumable, verified)",
                       epilog="Each file is written under a temporary name and renamed into place when complete\n"
                              "(in s3:// or gs://: one conditional PUT, or an upload in parts completed when whole);\n"
                              "a full disk or a refused upload stops the export with one line. DEST/.unshardfs/ holds\n"
                              "the plan, the ledger of finished tasks and, at the end, the manifest of every file.\n"
                              "examples:\n  unshardfs export --jobs 8 /data/ds /scratch/ds-unsharded\n"
                              "  unshardfs export --resume /data/ds /scratch/ds-unsharded   # after a kill or a full disk\n"
                              "  unshardfs export --jobs 16 /data/ds s3://bucket/ds-unsharded/")
    e.add_argument("source", metavar="SOURCE")
    e.add_argument("dest", metavar="DEST", help="a directory (made if missing), file:///path, or s3://BUCKET/PREFIX/ "
                   "or gs://BUCKET/PREFIX/ in an existing bucket")
    e.add_argument("--resume", action="store_true",
                   help="continue the export DEST holds: finished tasks are skipped, files of unfinished ones kept "
                        "where DEST still matches their journal (size and crc32c), temporaries removed")
    e.add_argument("--no-fsync", action="store_true",
                   help="do not flush files to stable storage before renaming them into place (faster; a power "
                        "loss may then leave files that --resume re-verifies)")
    e.add_argument("--stats", metavar="FILE",
                   help="write where the run's time went as JSON to FILE (- for standard output): its phases, and "
                        "each task's time by what it waited for (opening SOURCE, indexes, data, DEST, the "
                        "scheduler), its requests and round trips, summed up with medians and the slowest task")
    add_walk_options(e, 4, "concurrent file writes")

    r = command("refs", help="write kerchunk references to SOURCE's unsharded view: read with fsspec alone",
                epilog=refs_examples())
    add_refs_arguments(r)
    add_cache_options(r)
    add_source_options(r)

    u = command("unmount", help="unmount MOUNTPOINT (also cleans up after a crashed daemon)",
                       epilog="example:\n  unshardfs unmount /mnt/ds")
    u.add_argument("mountpoint", metavar="MOUNTPOINT")
    u.add_argument("-z", "--lazy", action="store_true", help="detach even if busy")
    return parser


def refs_examples() -> str:
    from unshardfs.app.refs import EXAMPLES

    return EXAMPLES


def add_refs_arguments(parser: argparse.ArgumentParser) -> None:
    from unshardfs.app.refs import add_refs_arguments as add

    add(parser)


def add_walk_options(parser: argparse.ArgumentParser, jobs: int, jobs_help: str) -> None:
    """What `check` and `export` (walks of the whole tree) share: progress, jobs, cluster, source."""
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    parser.add_argument("-j", "--jobs", type=int, default=jobs, help=f"{jobs_help} (default {jobs})")
    add_cluster_options(parser)
    add_source_options(parser)


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("on a Dask cluster (pip install 'unshardfs[dask]')")
    group.add_argument("--scheduler", metavar="ADDRESS",
                       help="run the work as tasks on this Dask scheduler (tcp://host:8786), local:N to start "
                            "N local worker processes, or env for the address in DASK_SCHEDULER_ADDRESS; export's "
                            "DEST must be on a file system every worker shares")
    group.add_argument("--parts", type=_positive(int), default=0, metavar="N",
                       help="tasks to deal the shards into (default: by their bytes, at most 16 shards each, at "
                            "least one per worker thread and 4 while each keeps 256 MiB); an export's first run "
                            "fixes it")
    group.add_argument("--debug", action="store_true",
                       help="show Dask's own log lines (INFO and up; otherwise warnings, and with -q only errors)")


def default_log_file(mountpoint: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    real = os.path.realpath(mountpoint)
    tag = hashlib.sha1(real.encode()).hexdigest()[:8]
    return os.path.join(base, "unshardfs", f"{os.path.basename(real) or 'root'}-{tag}.log")


def _mount(args: argparse.Namespace, argv: list[str]) -> int:
    require(args.fuse_engine)  # a missing engine is reported here, not in a detached daemon's log
    if not args.foreground:
        open_options(args)  # a bad file argument (--info) is refused here, before detaching
        return detach([a for a in argv if a not in ("-f", "--foreground")] + ["--foreground"],
                      args.log_file or default_log_file(args.mountpoint), default_log=not args.log_file)

    _logging(args.debug)
    ready_fd = args.ready_fd

    def ready(error: str | None) -> None:
        nonlocal ready_fd
        if error is not None:
            print(f"unshardfs: {error}", file=sys.stderr)
        if ready_fd is not None:
            os.write(ready_fd, b"OK" if error is None else error.encode())
            os.close(ready_fd)
            ready_fd = None

    from unshardfs.app.opened import OpenedSource

    caches = make_caches(args)
    request = MountRequest(
        mountpoint=args.mountpoint,
        fsname=f"unshardfs:{args.source}",
        # Always read-only: a generic "rw" (mount(8) adds it by default) is dropped.
        fuse_options=[o for opts in args.fuse_options for o in opts.split(",") if o and o != "rw"],
        debug=args.debug,
        options=MountOptions(entry_timeout=args.cache_timeout, attr_timeout=args.cache_timeout,
                             passthrough=args.fuse_passthrough, transport=args.fuse_transport),
        engine=args.fuse_engine,
    )
    return serve(request, lambda: OpenedSource.open(args.source, open_options(args), caches), ready)


def _serve(args: argparse.Namespace) -> int:
    from unshardfs.app.opened import OpenedSource
    from unshardfs.app.serve import ServeRequest, run
    from unshardfs.http.app import ServeOptions

    _logging(args.debug)
    caches = make_caches(args)
    limits = ServerLimits(max_connections=args.max_connections, keep_alive_seconds=args.keep_alive,
                    header_seconds=args.header_timeout, send_timeout_seconds=args.send_timeout,
                    buffer_bytes=args.response_buffer << 20)
    request = ServeRequest(args.bind, args.port, ServeOptions("" if args.no_cors else args.cors_origin,
                                                              args.access_log), limits)
    return run(args.source, lambda: OpenedSource.open(args.source, open_options(args), caches), request)


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` above zero (a zero limit or timeout would refuse everything)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0: {text!r}")
        return value
    return parse


def _big_allocations_to_os() -> None:
    """Buffers of 4 MiB and more are mmap'ed and unmapped when freed.

    glibc otherwise raises its mmap threshold to the largest block freed (up
    to 32 MiB), and then keeps later blocks of that size in the heap of the
    thread that freed them: after a few big metadata documents parsed on
    worker threads the daemon kept a document's worth of memory per thread.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its own policy
        ctypes.CDLL(None).mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD


def _logging(debug: bool) -> None:
    from unshardfs.util.logonce import OneLineFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, handlers=[handler])
    # One line per HTTP request is noise outside --debug; failures are logged by the sources.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if debug else logging.WARNING)


def _stats(mountpoint: str) -> int:
    if mountpoint.startswith(("http://", "https://")):
        import httpx

        from unshardfs.http.app import STATS_PATH

        try:
            response = httpx.get(mountpoint.rstrip("/") + STATS_PATH, timeout=10)
            response.raise_for_status()
            print(json.dumps(response.json(), indent=2))
            return 0
        except (httpx.HTTPError, ValueError) as e:
            print(f"unshardfs: {mountpoint} is not an unshardfs server ({e})", file=sys.stderr)
            return 1
    try:
        raw = os.getxattr(mountpoint, STATS_XATTR)
    except OSError as e:
        print(f"unshardfs: {mountpoint} is not an unshardfs mount ({e.strerror})", file=sys.stderr)
        return 1
    print(json.dumps(json.loads(raw), indent=2))
    return 0


COMMANDS = ("mount", "unmount", "stats", "serve", "inspect", "check", "export", "refs")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        # `mount -t fuse.unshardfs SOURCE MNT -o OPTS` (and fstab) run us through
        # mount.fuse3 as `unshardfs SOURCE MNT -o OPTS`: that means mount.
        argv.insert(0, "mount")
    args = _parser().parse_args(argv)
    _big_allocations_to_os()
    try:
        if args.command == "mount":
            return _mount(args, argv)
        if args.command == "stats":
            return _stats(args.mountpoint)
        if args.command == "serve":
            return _serve(args)
        if args.command == "refs" or (args.command == "check" and args.refs):
            from unshardfs.app.refs import check_refs, run_refs

            return run_refs(args) if args.command == "refs" else check_refs(args)
        if args.command == "check" and not args.source:
            raise ConfigError("check needs SOURCE (or --refs REFS)")
        if args.command in ("inspect", "check", "export"):
            from unshardfs.app.commands import run_tool

            return run_tool(args)
        return unmount(args.mountpoint, args.lazy)
    except (ConfigError, SourceError, DataError) as e:
        print(f"unshardfs: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
