"""`unshardfs refs SOURCE -o OUT` and `unshardfs check --refs OUT`.

`refs` writes kerchunk references to the tree a mount of SOURCE shows (`tools/refs.py`): readers
then need fsspec only, never unshardfs. `check --refs` stats every object the references name, in
the store the references were written from, and says which references a changed (or vanished)
object invalidated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import trio
from tqdm import tqdm

from unshardfs.app.opened import OpenedSource
from unshardfs.app.options import make_caches, open_options
from unshardfs.sources import open_source
from unshardfs.tools.refs import RECORD, RefsOptions, version_json, write_refs
from unshardfs.util.concurrency import gather
from unshardfs.util.errors import ConfigError, SourceError, expected_failure

T = TypeVar("T")

EXAMPLES = ("examples:\n"
            "  unshardfs refs /data/em.zarr -o em.json                                  # Zarr v3, unsharded\n"
            "  unshardfs refs --view zarr2 s3://bucket/em.zarr -o em2.json              # Zarr v2 / OME-Zarr 0.4\n"
            "  unshardfs refs --view zarr2 --format parquet gs://b/big.zarr -o big.parq  # millions of chunks\n"
            "  unshardfs check --refs em.json                                           # still valid?\n"
            "reading them (no unshardfs needed):\n"
            "  zarr.open('reference://', mode='r', storage_options={'fo': 'em.json'})")
# Objects stat'ed at once by `check --refs`.
PARALLEL = 32
# A reference file read by `check --refs` is at most this large (a parquet layout keeps its record in .zmetadata).
MAX_REFS_JSON = 4 << 30


def add_refs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SOURCE")
    parser.add_argument("-o", "--output", required=True, metavar="OUT",
                        help="the reference file (JSON) or directory (parquet) to write; replaced when complete")
    parser.add_argument("--format", choices=("json", "parquet"), default="json",
                        help="kerchunk reference spec version 1 as one JSON file, or kerchunk's parquet layout "
                             "(Zarr v2 arrays with '.'-separated keys: --view zarr2) for millions of chunks "
                             "(default %(default)s)")
    parser.add_argument("--inline-threshold", type=int, default=500, metavar="BYTES",
                        help="files smaller than this are written into the references instead of referenced, as "
                             "kerchunk's inline_threshold (default %(default)s; metadata always is)")
    parser.add_argument("--record-size", type=int, default=10_000, metavar="N",
                        help="parquet: references per file (default %(default)s)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run_refs(args: argparse.Namespace) -> int:
    if args.record_size <= 0 or args.inline_threshold < 0:
        raise ConfigError("--record-size must be positive and --inline-threshold not negative")
    options = RefsOptions(layout=args.format, inline_threshold=args.inline_threshold, record_size=args.record_size,
                          source=args.source)

    async def main() -> int:
        opened = await OpenedSource.open(args.source, replace(open_options(args), versions=False), make_caches(args))
        try:
            with tqdm(unit="file", disable=True if args.quiet else None, file=sys.stderr, dynamic_ncols=True,
                      desc="refs") as bar:
                async with opened.running():
                    try:
                        summary = await write_refs(opened.tree, args.output, options, bar.update)
                    except OSError as e:  # where the output goes: a missing directory, a full disk
                        raise ConfigError(f"cannot write {args.output}: {e.strerror or e}") from None
        finally:
            await opened.aclose()
        print(f"{args.output}: {summary.references:,} references to {summary.objects:,} objects, "
              f"{summary.inlined:,} files written in ({summary.inlined_bytes:,} bytes)")
        return 0

    return _run(main)


def _run(main: Callable[[], Awaitable[T]]) -> T:
    """`trio.run(main)`, an error of ours raised by a task raised as itself, not in an ExceptionGroup."""
    try:
        return trio.run(main)
    except Exception as e:
        known = expected_failure(e)
        if known is not None and known is not e:
            raise known from None
        raise


# -- check --refs ----------------------------------------------------------------------------

def _record(path: str) -> dict[str, Any]:
    """Our record in a reference file (JSON) or directory (parquet's `.zmetadata`)."""
    meta = os.path.join(path, ".zmetadata") if os.path.isdir(path) else path
    try:
        size = os.path.getsize(meta)
        if size > MAX_REFS_JSON:
            raise ConfigError(f"{meta}: {size:,} bytes is more than a reference file can be here")
        with open(meta, "rb") as f:
            doc = json.loads(f.read())
    except OSError as e:
        raise ConfigError(f"{meta}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"{meta}: not JSON ({e})") from None
    record = doc.get(RECORD) if isinstance(doc, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("objects"), dict):
        raise ConfigError(f"{meta}: no unshardfs record (not written by `unshardfs refs`)")
    return record


def _references_to(path: str, urls: set[str]) -> Iterator[tuple[str, str]]:
    """(key, url) of every reference in the file or directory `path` to one of `urls`."""
    if not urls:
        return
    if os.path.isdir(path):
        import pyarrow.parquet as pq

        with open(os.path.join(path, ".zmetadata"), "rb") as f:
            meta = json.loads(f.read())
        zmeta = meta.get("metadata", {}) if isinstance(meta, dict) else {}
        size = meta.get("record_size", 0) if isinstance(meta, dict) else 0
        for key in sorted(zmeta):
            if not key.endswith("/.zarray"):
                continue
            field = key[:-len("/.zarray")]
            shape, chunks = zmeta[key].get("shape", []), zmeta[key].get("chunks", [])
            grid = [-(-s // c) for s, c in zip(shape, chunks)] or [1]
            folder = os.path.join(path, field)
            for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
                if not (name.startswith("refs.") and name.endswith(".parq")):
                    continue
                record = int(name[5:-5])
                column = pq.read_table(os.path.join(folder, name), columns=["path"]).column("path").to_pylist()
                for row, url in enumerate(column):
                    if url in urls:
                        number, index = record * size + row, []
                        for n in reversed(grid):
                            number, i = divmod(number, n)
                            index.append(i)
                        yield f"{field}/{'.'.join(map(str, reversed(index)))}", url
        return
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    for key, value in (doc.get("refs") or {}).items():
        if isinstance(value, list) and value and value[0] in urls:
            yield key, value[0]


def check_refs(args: argparse.Namespace) -> int:
    """Stat every object the references name; one line per changed or vanished object with the references it
    invalidates. Exit 0: all unchanged; 1: some changed."""
    path = args.refs
    record = _record(path)
    objects: dict[str, dict[str, Any]] = record["objects"]
    by_root: dict[str, list[tuple[str, str, list[Any]]]] = {}
    for url, entry in objects.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("root"), str) or not isinstance(entry.get("path"), str):
            raise ConfigError(f"{path}: the unshardfs record of {url!r} is damaged")
        by_root.setdefault(entry["root"], []).append((url, entry["path"], list(entry.get("version") or [])))
    inlined = {url: entry.get("inlined", 0) for url, entry in objects.items()}
    options = open_options(args)
    changed: dict[str, str] = {}

    async def main() -> None:
        for root, items in by_root.items():
            source = open_source(root, options.remote)
            try:
                def stat(url: str, rel: str, version: list[Any]) -> Callable[[], Awaitable[None]]:
                    async def one() -> None:
                        try:
                            st = await source.stat(rel)
                        except (SourceError, ConfigError) as e:
                            changed[url] = f"cannot be stat'ed: {e}"
                            return
                        if st is None or st.is_dir:
                            changed[url] = "is gone"
                        elif version_json(st.version) != version:
                            changed[url] = f"changed (version {version} is now {version_json(st.version)})"
                    return one

                await gather([stat(url, rel, version) for url, rel, version in items], PARALLEL)
            finally:
                await source.aclose()

    _run(main)
    invalid: dict[str, list[str]] = {url: [] for url in changed}
    try:
        for key, url in _references_to(path, set(changed)):
            invalid[url].append(key)
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:
        raise ConfigError(f"{path}: cannot read its references ({type(e).__name__}: {e})") from None
    for url in sorted(changed):
        keys = sorted(invalid[url])
        shown = ", ".join(keys[:5]) + (f", ... ({len(keys) - 5:,} more)" if len(keys) > 5 else "")
        copied = inlined.get(url, 0)
        also = f" and {copied:,} files written in from it" if isinstance(copied, int) and copied else ""
        print(f"{url} {changed[url]}: {len(keys):,} references{also} invalidated{': ' + shown if keys else ''}")
    total = len(objects)
    if changed:
        print(f"{path}: {len(changed):,} of {total:,} objects changed; "
              f"{sum(map(len, invalid.values())):,} references invalid (write them again with `unshardfs refs`)")
        return 1
    print(f"{path}: all {total:,} referenced objects unchanged")
    return 0
