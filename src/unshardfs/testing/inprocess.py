"""A SOURCE opened in this process and walked over the node API: no mount, no daemon, no kernel.

The same tree a mount serves, reached the way every front end reaches it
(`OpenedSource`), so a format's behaviour can be checked in milliseconds;
what only the kernel decides (page cache, request sizes, inode numbers) stays
with the tests that mount.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import AsyncIterator

from unshardfs.app.opened import OpenedSource
from unshardfs.app.options import add_cache_options, add_source_options, make_caches, open_options
from unshardfs.sources.base import ByteSource
from unshardfs.tree.nodes import DirNode, FileNode, Node

# What one read asks for: the kernel's largest READ at the default max_pages.
READ_SIZE = 128 * 1024


def options_parser() -> argparse.ArgumentParser:
    """The options `mount` takes about a SOURCE (formats, remote, read path, bounds, caches)."""
    parser = argparse.ArgumentParser(prog="unshardfs", add_help=False)
    add_cache_options(parser)
    add_source_options(parser)
    return parser


@contextlib.asynccontextmanager
async def opened(source: str | ByteSource, *args: str, named: str | None = None) -> AsyncIterator[OpenedSource]:
    """`source` opened as `unshardfs mount SOURCE MNT *args` would open it, running (read-ahead and
    prefetch on, unless the options turn them off) until the block ends. `source` is a SOURCE as
    the command line takes it, or a byte source made by the caller (a `MemorySource`, a
    `LatencySource`), read as the format `named` (None: detected)."""
    parsed = options_parser().parse_args(list(args))
    options, caches = open_options(parsed), make_caches(parsed)
    if isinstance(source, str):
        tree = await OpenedSource.open(source, options, caches)
    else:
        tree = await OpenedSource.over(source, named, options, caches)
    try:
        async with tree.running():
            yield tree
    finally:
        await tree.aclose()


async def resolve(root: DirNode, rel: str) -> Node | None:
    """The node at the '/'-separated path `rel` below `root`, found by name alone (no listing)."""
    node: Node | None = root
    for name in filter(None, rel.split("/")):
        if not isinstance(node, DirNode):
            return None
        node = await node.lookup(name)
    return node


async def read_file(node: FileNode, piece: int = READ_SIZE) -> bytes:
    """All of a file's bytes, read in `piece`-sized reads as a reader of the mount would; a file that
    answers fewer bytes than its size before the end raises AssertionError (a short read lies)."""
    out = bytearray()
    while len(out) < node.size:
        data = await node.read(len(out), min(piece, node.size - len(out)))
        assert data, f"short read at {len(out)} of {node.size}"
        out += data
    return bytes(out)


async def walk(root: DirNode, prefix: str = "") -> dict[str, FileNode]:
    """Every file below `root` by its '/'-separated path, from the directories' listings."""
    found: dict[str, FileNode] = {}
    async for batch in root.entries():
        for name, node in batch:
            rel = f"{prefix}{name}"
            if isinstance(node, DirNode):
                found.update(await walk(node, rel + "/"))
            elif isinstance(node, FileNode):
                found[rel] = node
    return found
