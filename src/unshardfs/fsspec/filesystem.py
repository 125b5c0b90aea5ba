"""Any virtual tree as a read-only fsspec filesystem, for synchronous callers in any thread.

Every call is handed to the session's trio loop (`session.Session`) and answered from the tree
exactly as a mount answers it: the same names, sizes and bytes. Failures mean what they mean at
every front end (`tree.edge`): an absent name is FileNotFoundError (zarr's fill value), damaged
data or a backend that failed is `OSError(EIO)` with one line naming the file and the cause (never
a missing key: a damaged chunk must not read as fill), a write is `OSError(EROFS)`.

Paths are those of the filesystem the dataset lives on when the instance was reached through a
chained URL (`unshard::s3://bucket/em.zarr` serves `bucket/em.zarr/zarr.json`), else relative to the
dataset's root (`info`, `8_8_8/0-64_0-64_0-64`); a path that climbs out (`..`) names nothing.
"""

from __future__ import annotations

import errno
import logging
import weakref
from datetime import datetime, timezone
from typing import Any, Hashable, Sequence

import trio
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from unshardfs.fsspec.session import SESSIONS, Opener, Session
from unshardfs.sources.base import name_problem
from unshardfs.tree import edge
from unshardfs.tree.nodes import DirNode, EntryBatch, FileNode, Node
from unshardfs.util.errors import DataError
from unshardfs.util.maps import BoundedMap

try:  # fsspec >= 2025.10: a chained URL with no path of its own hands this filesystem the next one's
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec: `fo` must be given explicitly
    _Base = AbstractFileSystem

log = logging.getLogger(__name__)

# A read is served in pieces of at most this many bytes (a huge range is not one allocation below).
PIECE = 16 << 20
# Reads of one `cat` or `cat_ranges` in flight at once (the read path coalesces and bounds requests).
PARALLEL = 64
# Directories kept resolved by path: a chunk's lookup then costs one lookup in its parent.
DIRS = 4096


def eio(where: str, error: BaseException) -> OSError:
    """The OSError a caller sees for `error` met at `where`, reported once as every front end does."""
    failure = edge.classify(error)
    edge.report(log, failure, where, error)
    return OSError(errno.EIO, f"{where}: {failure.message}")


class TreeFileSystem(_Base):  # type: ignore[misc]  # fsspec ships no type information
    """A read-only fsspec filesystem over a tree opened by a subclass (`start`), in a shared session.

    Subclasses parse their own options in `__init__` and call `start(key, opener)`; fsspec
    pickles an instance as its constructor's arguments (`storage_options`), so a Dask worker
    unpickling one opens the same tree in its own process."""

    protocol: Any = ("unshard",)
    root_marker = ""
    cachable = True
    async_impl = False

    def start(self, key: Hashable, opener: Opener) -> None:
        """Serve the tree `opener` yields (shared with every instance of this process given the
        same `key`), at paths below its `prefix`. The opener's failure (no dataset) is raised
        from here."""
        self._key = key
        self._opener = opener
        self._bind()
        self.prefix = self._session_.served.prefix.rstrip("/")

    def _bind(self) -> None:
        session = SESSIONS.acquire(self._key, self._opener)
        self._session_ = session
        # Used in the loop only; a new session's nodes are its own (replaced, never cleared from here).
        self._dirs: BoundedMap[tuple[str, ...], DirNode] = BoundedMap(DIRS)
        # Collected as garbage (in whatever thread, the loop's included): a note, never a wait.
        self._release = weakref.finalize(self, SESSIONS.dropped, self._key, session)

    @property
    def _session(self) -> Session:
        session = self._session_
        if not session.alive:  # closed, or this process is a fork of the one that opened it
            self._release.detach()
            self._bind()
            session = self._session_
        return session

    def close(self) -> None:
        """Release this instance's use of the session (the last user closes the tree and its
        connections, and ends the loop thread). The instance opens the tree again if used later."""
        if self._release.detach() is not None:
            SESSIONS.release(self._key, self._session_)
        self._dirs = BoundedMap(DIRS)

    def stats(self) -> dict[str, object]:
        """What serving the tree has cost so far (requests, backing reads, caches), as
        `unshardfs stats` shows it for a mount; shared by the instances of one session."""
        session = self._session
        return session.call(_stats, session)

    # -- paths ---------------------------------------------------------------------------

    def _names(self, path: str) -> tuple[str, ...]:
        """The names below the root that `path` spells; FileNotFoundError for one outside it."""
        stripped = self._strip_protocol(path)
        if not isinstance(stripped, str):
            raise TypeError(f"a path must be a string, not {type(path).__name__}")
        rel = stripped
        if self.prefix:
            if stripped == self.prefix:
                rel = ""
            elif stripped.startswith(self.prefix + "/"):
                rel = stripped[len(self.prefix) + 1:]
            else:
                raise FileNotFoundError(errno.ENOENT, "outside the dataset", path)
        names = tuple(name for name in rel.split("/") if name not in ("", "."))
        if any(name_problem(name) is not None for name in names):
            raise FileNotFoundError(errno.ENOENT, "not a path in the dataset", path)
        return names

    def _full(self, names: Sequence[str]) -> str:
        rel = "/".join(names)
        if not self.prefix:
            return rel
        return f"{self.prefix}/{rel}" if rel else self.prefix

    # -- in the loop ---------------------------------------------------------------------

    async def _resolve(self, names: tuple[str, ...], path: str) -> Node:
        served = self._session_.served
        node: Node = served.tree
        start = 0
        cached = self._dirs.get(names[:-1]) if len(names) > 1 else None
        if cached is not None:
            node, start = cached, len(names) - 1
        for i in range(start, len(names)):
            if not isinstance(node, DirNode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
            try:
                child = await node.lookup(names[i])
            except Exception as e:
                raise eio(self._full(names[:i + 1]), e) from e
            if child is None:
                raise FileNotFoundError(errno.ENOENT, "no such file or directory", path)
            node = child
            if isinstance(node, DirNode):
                self._dirs[names[:i + 1]] = node
        return node

    async def _info_in_loop(self, names: tuple[str, ...], path: str) -> dict[str, Any]:
        return self._info_of(names, await self._resolve(names, path))

    def _info_of(self, names: Sequence[str], node: Node) -> dict[str, Any]:
        if isinstance(node, DirNode):
            return {"name": self._full(names), "size": 0, "type": "directory", "mtime": node.mtime_ns / 1e9}
        assert isinstance(node, FileNode)
        return {"name": self._full(names), "size": node.size, "type": "file", "mtime": node.mtime_ns / 1e9}

    async def _ls_in_loop(self, names: tuple[str, ...], path: str) -> list[dict[str, Any]]:
        node = await self._resolve(names, path)
        if not isinstance(node, DirNode):
            return [self._info_of(names, node)]
        out: list[dict[str, Any]] = []
        base = self._full(names)
        lead = f"{base}/" if base else ""
        try:
            async for batch in node.entries():
                if isinstance(batch, EntryBatch):  # chunk files: names and sizes, no nodes built
                    mtime = batch.mtime_ns / 1e9
                    out.extend({"name": lead + name, "size": size, "type": "file", "mtime": mtime}
                               for name, size in zip(batch.names, batch.sizes))
                    continue
                for name, child in batch:
                    kind = "directory" if isinstance(child, DirNode) else "file"
                    size = child.size if isinstance(child, FileNode) else 0
                    out.append({"name": lead + name, "size": size, "type": kind, "mtime": child.mtime_ns / 1e9})
        except Exception as e:
            raise eio(base or "/", e) from e
        return out

    async def _read_in_loop(self, names: tuple[str, ...], path: str, start: int | None, end: int | None,
                            known: FileNode | None = None) -> bytes:
        node = known or await self._resolve(names, path)
        if isinstance(node, DirNode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        assert isinstance(node, FileNode)
        lo, hi = byte_range(node.size, start, end)
        out = bytearray()
        where = self._full(names)

        async def resolve() -> Node | None:
            self._dirs.pop(names[:-1], None)  # the directory may be stale too: from the root
            return await self._resolve(names, path) if known is None else None

        offset = lo
        try:
            while offset < hi:
                node, data = await edge.read_current(node, offset, min(PIECE, hi - offset), resolve)
                if not data:
                    raise DataError(where, f"short read at {offset}: the file ends before its size {node.size:,}")
                out += data
                offset += len(data)
        except OSError:  # ours: the name is gone now
            raise
        except Exception as e:
            raise eio(where, e) from e
        return bytes(out)

    async def _read_many(self, requests: list[tuple[str, int | None, int | None]]) -> list[bytes | Exception]:
        results: list[bytes | Exception] = [b""] * len(requests)
        limit = trio.Semaphore(PARALLEL)

        async def one(i: int, path: str, start: int | None, end: int | None) -> None:
            async with limit:
                try:
                    results[i] = await self._read_in_loop(self._names(path), path, start, end)
                except Exception as e:
                    results[i] = e

        async with trio.open_nursery() as nursery:
            for i, (path, start, end) in enumerate(requests):
                nursery.start_soon(one, i, path, start, end)
        return results

    # -- the fsspec API ------------------------------------------------------------------

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        names = self._names(path)
        session = self._session
        return session.call(self._info_in_loop, names, path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        names = self._names(path)
        session = self._session
        entries = session.call(self._ls_in_loop, names, path)
        return entries if detail else [entry["name"] for entry in entries]

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        names = self._names(path)
        session = self._session
        return session.call(self._read_in_loop, names, path, start, end)

    def cat_ranges(self, paths: list[str], starts: int | None | list[int | None], ends: int | None | list[int | None],
                   max_gap: int | None = None, on_error: str = "return", **kwargs: Any) -> list[bytes | Exception]:
        """Many ranges read at once (one trip to the loop; the read path coalesces neighbours)."""
        if not isinstance(paths, list):
            raise TypeError("paths must be a list")
        starts_ = starts if isinstance(starts, list) else [starts] * len(paths)
        ends_ = ends if isinstance(ends, list) else [ends] * len(paths)
        if len(starts_) != len(paths) or len(ends_) != len(paths):
            raise ValueError("paths, starts and ends differ in length")
        session = self._session
        results = session.call(self._read_many, list(zip(paths, starts_, ends_)))
        if on_error != "return":
            for result in results:
                if isinstance(result, Exception):
                    raise result
        return results

    def cat(self, path: str | list[str], recursive: bool = False, on_error: str = "raise",
            **kwargs: Any) -> bytes | dict[str, bytes | Exception]:
        """Whole files; many of them read at once (zarr-python 2 reads a selection's chunks so)."""
        paths = self.expand_path(path, recursive=recursive)
        if len(paths) == 1 and not isinstance(path, list) and paths[0] == self._strip_protocol(path):
            return self.cat_file(paths[0], **kwargs)
        session = self._session
        results = session.call(self._read_many, [(p, kwargs.get("start"), kwargs.get("end")) for p in paths])
        out: dict[str, bytes | Exception] = {}
        for p, result in zip(paths, results):
            if isinstance(result, Exception):
                if on_error == "raise":
                    raise result
                if on_error == "omit":
                    continue
            out[p] = result
        return out

    def modified(self, path: str) -> datetime:
        return datetime.fromtimestamp(self.info(path)["mtime"], timezone.utc)

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, autocommit: bool = True,
              cache_options: dict[str, Any] | None = None, **kwargs: Any) -> "TreeFile":
        if mode != "rb":
            raise OSError(errno.EROFS, "read-only file system", path)
        names = self._names(path)
        session = self._session
        node = session.call(self._resolve, names, path)
        if isinstance(node, DirNode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        assert isinstance(node, FileNode)
        return TreeFile(self, path, names, node, block_size=block_size, cache_options=cache_options,
                        cache_type=kwargs.get("cache_type", "readahead"))

    # -- writes: none --------------------------------------------------------------------

    def _read_only(self, path: object = "", *args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "read-only file system", str(path))

    pipe_file = put_file = rm_file = _rm = rm = mkdir = makedirs = rmdir = touch = mv = cp_file = _read_only
    copy = move = put = pipe = _read_only


class TreeFile(AbstractBufferedFile):  # type: ignore[misc]  # fsspec ships no type information
    """An open file: every read from the node the open found, so a file whose shard is replaced
    while it is open reads EIO from then on, never part old and part new bytes."""

    def __init__(self, fs: TreeFileSystem, path: str, names: tuple[str, ...], node: FileNode,
                 block_size: int | None = None, cache_options: dict[str, Any] | None = None,
                 cache_type: str = "readahead") -> None:
        self._names = names
        self._node = node
        super().__init__(fs, path, mode="rb", block_size=block_size or "default", cache_type=cache_type,
                         cache_options=cache_options, size=node.size)

    def _fetch_range(self, start: int, end: int) -> bytes:
        fs: TreeFileSystem = self.fs
        session = fs._session
        data: bytes = session.call(fs._read_in_loop, self._names, self.path, start, end, self._node)
        return data


def byte_range(size: int, start: int | None, end: int | None) -> tuple[int, int]:
    """[lo, hi) of a file of `size` bytes for fsspec's `start`/`end`: None is the start or the end,
    a negative one counts from the end, anything past the end is the end; an empty range when
    start is at or past end. Not an int (a float, a string): TypeError."""
    for value in (start, end):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"a byte offset must be an int or None, not {type(value).__name__}")
    lo = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
    hi = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
    return lo, max(lo, hi)


async def _stats(session: Session) -> dict[str, object]:
    return session.served.stats()

