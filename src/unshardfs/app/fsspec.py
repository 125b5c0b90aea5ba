"""`fsspec.filesystem("unshard", source=SOURCE, **options)`: the unsharded tree as an fsspec filesystem.

Registered through the `fsspec.specs` entry point as protocol `unshard`. SOURCE is anything
`unshardfs mount` takes (a path, `file://`, `http(s)://`, `gs://`, `s3://`, a URL pipeline); the
options are the mount's options about a SOURCE, as keywords (`view="zarr2"`, `s3_endpoint=URL`,
`read_ahead=False`, `chunk_cache=512`): a dash is an underscore, a flag is True, a repeated option
a list. Chained URLs work as fsspec chains them: `unshard::s3://bucket/em.zarr` opens the dataset
at `s3://bucket/em.zarr` (or, when that is a file or a directory inside a dataset, the nearest
parent that is one; when no parent is one, the nearest that holds a tree of datasets), with the `s3`
storage options' `endpoint_url` as `--s3-endpoint`.

Importing this module imports no FUSE code: reading needs neither /dev/fuse nor a daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import posixpath
from dataclasses import dataclass
from typing import Any, AsyncIterator

from unshardfs.app.opened import OpenedSource
from unshardfs.app.options import add_cache_options, add_source_options, make_caches, open_options
from unshardfs.fsspec.filesystem import TreeFileSystem
from unshardfs.fsspec.session import Served
from unshardfs.tree.nodes import DirNode
from unshardfs.util.errors import ConfigError
from unshardfs.util.logonce import log_once

log = logging.getLogger(__name__)

# Storage options of the filesystem below a chained URL that name where requests go.
ENDPOINTS = {"s3": "--s3-endpoint", "s3a": "--s3-endpoint", "gs": "--gcs-endpoint", "gcs": "--gcs-endpoint"}
SCHEMES = {"s3a": "s3", "gcs": "gs", "local": "file"}
# Parents of a chained URL's path tried for a dataset, at most (a file's path inside a dataset).
CLIMB = 16


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would exit the process
        raise TypeError(f"unshard filesystem options: {message}")


def options_argv(options: dict[str, Any]) -> list[str]:
    """Keyword options as the mount's command line: `view="zarr2"` is `--view zarr2`, `read_ahead=False`
    is `--no-read-ahead`, True a flag, a list a repeated option, None left out."""
    argv: list[str] = []
    for name, value in sorted(options.items()):
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def parse_options(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="unshard", add_help=False)
    add_cache_options(parser)
    add_source_options(parser)
    return parser.parse_args(argv)


@dataclass
class OpenedTree:
    """An opened SOURCE as the fsspec front end serves it (`session.Served`)."""

    opened: OpenedSource
    prefix: str

    @property
    def tree(self) -> DirNode:
        return self.opened.tree

    def stats(self) -> dict[str, object]:
        return self.opened.stats()


def candidates(fo: str, protocol: str | None) -> list[tuple[str, str]]:
    """(SOURCE, prefix) pairs to try for a chained URL's path `fo`, the path itself first, then its
    parents: `unshard::gs://b/seg/info` is the file `info` of the dataset at gs://b/seg."""
    scheme = SCHEMES.get(protocol or "file", protocol or "file")
    out: list[tuple[str, str]] = []
    path = fo.rstrip("/") or fo
    while len(out) < CLIMB:
        # An http(s) path keeps its scheme in fsspec's paths; a local one is a path.
        out.append((path if "://" in path or scheme == "file" else f"{scheme}://{path}", path))
        parent = posixpath.dirname(path)
        if parent in ("", "/", path) or parent.endswith(":"):
            break
        path = parent
    return out


class UnshardFileSystem(TreeFileSystem):
    """The unsharded tree of a SOURCE, read-only, through the same core a mount runs on.

    `fsspec.filesystem("unshard", source=SOURCE, view="zarr2")`; from a chained URL fsspec passes
    `fo`, `target_protocol` and `target_options` instead of `source`. The dataset is opened in the
    constructor (a SOURCE that holds none raises FileNotFoundError; bad options TypeError), in a
    trio loop on a background thread shared by every instance with the same arguments in the
    process. Pickled, it is its arguments: a Dask worker opens the dataset itself."""

    protocol = ("unshard",)

    def __init__(self, source: str | None = None, *, fo: str | None = None, target_protocol: str | None = None,
                 target_options: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__()
        for fsspec_own in ("use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "asynchronous",
                           "loop"):  # fsspec's own (zarr asks for asynchronous: a sync filesystem is wrapped)
            options.pop(fsspec_own, None)
        argv = options_argv(options)
        if source is None and fo is None:
            raise TypeError("the unshard filesystem needs source=SOURCE (or a chained URL: unshard::gs://b/ds)")
        tried: list[tuple[str, str]]
        if source is not None:
            tried = [(str(source), "")]
        else:
            assert fo is not None
            argv += self._target_argv(target_protocol, target_options or {})
            tried = candidates(str(fo), target_protocol)
        args = parse_options(argv)  # bad options fail here, before any thread or request
        key = json.dumps([tried, argv])

        @contextlib.asynccontextmanager
        async def opener() -> AsyncIterator[Served]:
            first: ConfigError | None = None
            # The nearest dataset first: a directory inside one (a scale of shard files) would open
            # as a tree of datasets showing its shards as stored. Then the nearest tree, if no
            # dataset holds the path.
            for trees in (False, True) if len(tried) > 1 else (True,):
                for url, prefix in tried:
                    try:
                        opened = await OpenedSource.open(url, open_options(args), make_caches(args))
                    except ConfigError as e:  # no dataset there: a parent may hold one
                        first = first or e
                        continue
                    if opened.dataset.format is None and not trees:
                        await opened.aclose()
                        continue
                    try:
                        async with opened.running():
                            yield OpenedTree(opened, prefix)
                    finally:
                        await opened.aclose()
                    return
            raise FileNotFoundError(errno.ENOENT, f"no dataset: {first}", tried[0][0])

        self.start(key, opener)

    @staticmethod
    def _target_argv(protocol: str | None, target: dict[str, Any]) -> list[str]:
        """The storage options of the filesystem below a chained URL, as far as they say where to
        read from (an endpoint); the rest (credentials, `anon`) is unshardfs's own business:
        credentials come from the environment as for a mount, logged once when given here."""
        argv: list[str] = []
        endpoint = target.get("endpoint_url") or (target.get("client_kwargs") or {}).get("endpoint_url")
        flag = ENDPOINTS.get(protocol or "")
        if endpoint and flag:
            argv += [flag, str(endpoint)]
        ignored = sorted(k for k in target if k not in ("endpoint_url", "client_kwargs", "anon"))
        if ignored:
            log_once(log, f"fsspec-ignored:{ignored}", "unshard: storage options %s of %s:// are not used "
                     "(credentials come from the environment, as for a mount)", ", ".join(ignored), protocol)
        return argv
