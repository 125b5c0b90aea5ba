"""The byte-source contract shared by every backend."""

from __future__ import annotations

import builtins
import posixpath
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import AsyncIterator, Callable, Iterable, NamedTuple, Protocol, runtime_checkable

import trio

from unshardfs.util.errors import ConfigError, DataError


class FdRange(NamedTuple):
    """Bytes of a file as they lie in an open descriptor of the backing file, all in the page
    cache when handed out: an engine may move them to the kernel without copying (splice).
    Fewer than `size` bytes there means the backing file shrank: the engine must not answer
    with what is left (see `FileNode.cached_range`)."""

    fd: int
    offset: int
    size: int


Version = tuple[object, ...]  # what changes whenever an object's content may have (`ObjectStat.version`)
IndexKey = tuple[object, ...]  # what identifies index bytes: (object, version, offset, length)


@dataclass(frozen=True, slots=True)
class ObjectStat:
    """What a format needs to know about a backing object.

    `version` changes whenever the object's content may have changed (for a
    local file: device, inode, size and mtime), so caches keyed on it never
    mix an old index with new data.

    `refused`: why an object that exists is not read (a symbolic link leading
    outside the source, links that loop, a FIFO where a file should be); None
    for one that is. A refused object is never absent: it is listed and found
    by name as a file (of at least one byte, so a read reaches its reader),
    and every read of it fails, saying why.
    """

    size: int
    mtime_ns: int
    is_dir: bool
    version: Version = ()
    refused: str | None = None


class IndexCache(Protocol):
    """Index bytes kept across mounts, by what identifies them (object, version, offset, length)."""

    def get(self, identity: IndexKey) -> bytes | None: ...

    def put(self, identity: IndexKey, data: bytes) -> None: ...


class ByteSource(Protocol):
    """Bytes by path. Paths are relative, '/'-separated, '' is the root.

    `listable` is False for stores that cannot enumerate paths (a plain HTTP
    server): formats then work from their metadata alone. `remote` says each
    request costs a network round trip, so formats fetch small payloads
    whole rather than in the kernel's 128 KiB pieces.
    """

    description: str
    listable: bool
    remote: bool

    @property
    def index_cache(self) -> IndexCache | None:
        """Where index reads may be kept across mounts (`--cache-dir`); None without one."""

    async def stat(self, path: str) -> ObjectStat | None:
        """None when the object does not exist."""

    async def read(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        """Up to `size` bytes at `offset`; shorter only at end of object.

        With `version` (from an earlier `stat`), raise `StaleError` rather
        than read an object that has since been replaced or modified.
        """

    def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        """Direct children of a directory-like path, as (name, stat)."""

    async def stat_dir(self, path: str) -> ObjectStat | None:
        """A directory (object-store prefix) at `path`, or None when there is none or it cannot be known."""

    async def read_index(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        """`read`, for index structures: a disk cache may keep these across mounts."""

    async def aclose(self) -> None:
        """Release connections (called when the mount ends)."""

    def stats(self) -> dict[str, object]:
        """Live counters of this source and the layers below it, by section (for `unshardfs stats`)."""


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """One version of a versioned store, as `inspect` lists it and the version directories name it."""

    name: str  # shown as the directory `@NAME` ("v12" for an OCDBT generation)
    time_ns: int  # commit time, nanoseconds since the Unix epoch
    entries: int  # keys (files) in the version, as the writer recorded
    size: int  # bytes the version's values and index take, as the writer recorded
    latest: bool

    @property
    def time_text(self) -> str:
        """The commit time as Neuroglancer writes it in a URL: seconds, then a fraction without trailing zeros."""
        return iso_time(self.time_ns)


def iso_time(ns: int) -> str:
    """`YYYY-MM-DDThh:mm:ss[.fffffffff]Z` of nanoseconds since the Unix epoch (trailing zeros dropped)."""
    seconds, fraction = divmod(ns, 1_000_000_000)
    text = datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return text + (f".{fraction:09d}".rstrip("0") if fraction else "") + "Z"


@runtime_checkable
class VersionedSource(Protocol):
    """A byte source that is one version of a store holding several (OCDBT generations; Icechunk
    branches, tags and snapshots): it lists the versions and opens any of them as a byte source."""

    pinned: bool  # the user named this version: no other versions are shown beside it

    @property
    def current(self) -> str:
        """The `VersionInfo.name` of the version this source is."""

    async def versions(self) -> list[VersionInfo]:
        """Every version, oldest first (DataError when the store's version records are damaged)."""

    async def open_version(self, name: str) -> ByteSource | None:
        """The version called `name` (a `VersionInfo.name`) over the same path, or None when there is none.

        It shares this source's connection: closing it leaves this source open."""


# -- optional capabilities of a source -----------------------------------------------------
# A source has one by defining its method; callers check with isinstance once (at construction,
# never per read: an isinstance against a runtime-checkable Protocol costs microseconds) and
# keep the answer. Each answers None where it cannot help this time; the caller then does what
# every source can (`read`, `stat`).


@runtime_checkable
class ReadNow(Protocol):
    """A source that may have bytes at once, without waiting (a local file's page-cached bytes):
    a small READ is then answered where its request was read, with no task and no thread."""

    def read_now(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes | bytearray | None:
        """Bytes [offset, offset+size) if they can be had without waiting, else None (`read`
        them). With `version`, StaleError as `read` raises it."""


@runtime_checkable
class CachedRange(Protocol):
    """A source whose bytes lie in files it holds open (a local source): a READ may be answered
    by moving page-cached bytes of that file to the kernel without copying them (splice)."""

    def cached_range(self, path: str, offset: int, size: int, version: Version | None = None) -> FdRange | None:
        """Where bytes [offset, offset+size) lie in an open descriptor, if known without I/O and
        all in the page cache; else None."""


@runtime_checkable
class StatTail(Protocol):
    """A source that can stat an object and give its last bytes in one request (an HTTP suffix
    range, as TensorStore reads a Zarr shard's index without a HEAD first: one round trip
    instead of two)."""

    async def stat_tail(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        """`stat(path)`, and the object's last `size` bytes (all of a shorter one), or None for
        them where this request could not give them (read them as usual)."""


@runtime_checkable
class VersionedRead(Protocol):
    """A source whose ranged read says which version of the object the bytes came from (an HTTP
    answer names its ETag or generation and, in Content-Range, the object's size): a reader that
    holds later reads to the version of its first one (`Pins`) learns it without a stat first."""

    async def read_versioned(self, path: str, offset: int, size: int) -> tuple[bytes, Version | None]:
        """`read(path, offset, size)`, and the version the answer came from (what `stat` would give
        as `ObjectStat.version` for it), or None where this answer did not tell (stat it then)."""


@runtime_checkable
class StatHead(Protocol):
    """A source that can stat an object and give its first bytes in one request (an HTTP range
    from 0, whose Content-Range states the size: a precomputed shard's index with its stat, one
    round trip instead of two)."""

    async def stat_head(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        """`stat(path)`, and the object's first `size` bytes (all of a shorter one), or None for
        them where this request could not give them (read them as usual)."""


@runtime_checkable
class KeyOrder(Protocol):
    """A source that holds its keys in an index in key order (a database's B+tree): what follows a
    key there, across directories, costs no request per page. Read-ahead follows scans of files in
    that order, however the reader found them (by name, never listing)."""

    def key_order(self) -> bool:
        """Whether `keys_after` answers here (a layer asks the source below)."""

    async def keys_after(self, path: str, n: int) -> list[tuple[str, ObjectStat]]:
        """Up to `n` objects (files, not directories) after `path` in key order, as paths with their
        stats; fewer at the end."""


async def stat_and_head(source: ByteSource, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
    """`source.stat(path)`, and the object's first `size` bytes where the source gives them in
    the same request (`StatHead`); None where it does not (read them as usual)."""
    if isinstance(source, StatHead):
        return await source.stat_head(path, size)
    return await source.stat(path), None


async def stat_and_tail(source: ByteSource, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
    """`source.stat(path)`, and the object's last `size` bytes where the source gives them in
    the same request (`StatTail`); None where it does not (read them as usual). Once per shard
    opened, not per read: the capability is checked here."""
    if isinstance(source, StatTail):
        return await source.stat_tail(path, size)
    return await source.stat(path), None


PROBE_HEAD = 64 << 10  # bytes a probe asks for with its stat: a small metadata file comes whole


async def stat_all(source: ByteSource, paths: Iterable[str]) -> None:
    """Stat `paths` of `source` at once, for the stats it keeps (a remote source's stat cache): probes
    that would each wait a round trip one after another then wait for one together. Where the source
    gives an object's first bytes with its stat (`StatHead`), a probe asks for PROBE_HEAD of them,
    so that a small metadata file found comes whole with it and reading it costs no further request.
    What fails is left for the stat that needs it, which asks again."""
    async def one(path: str) -> None:
        try:
            await stat_and_head(source, path, PROBE_HEAD)
        except Exception:  # the caller's own stat meets it and says what it is
            pass

    async with trio.open_nursery() as nursery:
        for path in dict.fromkeys(paths):
            nursery.start_soon(one, path)


async def end_listing(listing: AsyncIterator[object]) -> None:
    """Close a listing (`ByteSource.list`) left part way: an async generator's frame, and what it holds
    open (a directory's descriptor, a connection), now rather than whenever it is collected. A layer's
    listing ends the one below it so, whoever stopped reading."""
    aclose = getattr(listing, "aclose", None)
    if aclose is not None:
        await aclose()


@runtime_checkable
class TaggedRead(Protocol):
    """A source whose objects carry entity tags as object stores give them (an HTTP ETag; for local
    files, the tag object-store clients derive from inode, mtime and size): a read may be made on the
    condition that the object still carries the tag a writer recorded, so bytes of a replaced object
    are never returned as the recorded one's."""

    async def read_if_tagged(self, path: str, offset: int, size: int, etag: str,
                             version: Version | None = None) -> bytes | None:
        """`read`, if the object's entity tag is still `etag` (compared as opaque tags: a `W/` prefix and
        the quotes aside); StaleError when it is not, or the object is gone. None: this source cannot
        tell the object's tag (nothing was read). With `version` (from an earlier stat), StaleError too
        when the object is no longer that version (a tag may miss a change a version sees)."""


def tag_problem(etag: str) -> str | None:
    """Why `etag` cannot be an entity tag a server sent (so cannot be sent back in `If-Match`), or None:
    an opaque tag is visible ASCII but `"`, at most 1,024 characters; a control character (a CR LF that
    would start another header field), a space or a non-ASCII one is damage."""
    opaque = opaque_tag(etag)
    if not opaque or len(opaque) > 1024:
        return f"an entity tag of {len(opaque)} characters"
    if any(not 0x21 <= ord(c) <= 0x7E or c == '"' for c in opaque):
        return f"{etag[:100]!r} is not an entity tag (characters a server cannot send)"
    return None


def opaque_tag(etag: str) -> str:
    """An entity tag without its weakness prefix and quotes (`W/"abc"`, `"abc"` and `abc` are `abc`): how
    a recorded tag is compared with a server's, which may quote it or not."""
    tag = etag.strip()
    if tag[:2] in ("W/", "w/"):
        tag = tag[2:]
    if len(tag) >= 2 and tag[0] == tag[-1] == '"':
        tag = tag[1:-1]
    return tag


WHOLE_FIRST = 256 << 10  # `read_whole`: bytes asked for with the stat of a remote object


async def read_whole(source: ByteSource, path: str, where: str, check: Callable[[int], None],
                     index: bool = False, first: int = WHOLE_FIRST) -> bytes | None:
    """All of the object at `path` (None when absent), for a small structure read whole (a manifest, a
    snapshot). `check(size)` raises for a size that must not be read, before anything more is. Over a
    remote source without a disk cache, an object of up to `first` bytes is one request (its size comes
    with its last bytes: `stat_and_tail`); otherwise a stat, then a read of the rest. `index` reads with
    `read_index` (a disk cache may keep the bytes). A short read is a DataError at `where`."""
    tail: bytes | None = None
    if source.remote and source.index_cache is None:
        st, tail = await stat_and_tail(source, path, first)
    else:
        st = await source.stat(path)
    if st is None or st.is_dir:
        return None
    check(st.size)
    if tail is not None and len(tail) >= st.size:
        data = tail[len(tail) - st.size:]
    else:
        read = source.read_index if index else source.read
        data = await read(path, 0, st.size - len(tail or b""), st.version) + (tail or b"")
    if len(data) != st.size:
        raise DataError(where, f"{len(data):,} bytes read of {st.size:,} (truncated)")
    return data


@runtime_checkable
class BackingFiles(Protocol):
    """A source whose objects are local files, stored byte for byte (a capability; `LocalSource`
    and the layers over it): an engine may hand such a file to the kernel to read itself."""

    def open_backing(self, path: str, version: Version) -> int | None:
        """A new O_RDONLY descriptor of the object at `path`, if it is the regular file `version`
        (from `stat`) describes, unchanged; None otherwise (replaced, changed, gone, or not a
        plain local file). The caller closes it."""


@dataclass(frozen=True, slots=True)
class UrlLocation:
    """Where an object's bytes are stored, as any reader can fetch them by URL: bytes from `offset` of
    the object `path` of the store at `root` (a local directory as `file:///abs/dir`, an `http(s)://`
    base URL, `gs://bucket/prefix`, `s3://bucket/prefix`), which had `version` (as `ObjectStat.version`
    of that store's `stat`) when the location was given."""

    root: str
    path: str
    url: str  # the stored object's own URL: root and path, spelled as that store's readers spell it
    offset: int
    version: Version

    def at(self, offset: int) -> "UrlLocation":
        """The same object, `offset` bytes further in."""
        return UrlLocation(self.root, self.path, self.url, self.offset + offset, self.version)


@runtime_checkable
class StoredAt(Protocol):
    """A source whose objects are stored where a reader elsewhere can fetch them by URL, byte for
    byte (a local directory, HTTP, GCS, S3, and a zip archive's STORED members over one of them):
    what `unshardfs refs` writes into a reference file."""

    async def stored_at(self, path: str, version: Version | None) -> UrlLocation | None:
        """Where the object at `path` (as `version`, from `stat`; StaleError when it changed) is stored;
        None when its bytes are not stored as they are read (a compressed zip member, a value of a
        versioned store) or the store has no URL a reader could use."""


async def stored_at(source: ByteSource, path: str, version: Version | None) -> UrlLocation | None:
    """`source.stored_at(path, version)`, or None for a source that cannot tell (`StoredAt`)."""
    return await source.stored_at(path, version) if isinstance(source, StoredAt) else None


class SourceLayer:
    """A byte source layered over another (counting, disk cache): everything not
    overridden goes to `inner`, and `stats` merges this layer's section with the
    ones below, so no caller needs to know how deep the stack is."""

    def __init__(self, inner: ByteSource) -> None:
        self.inner = inner
        self.description = inner.description
        self.listable = inner.listable
        self.remote = inner.remote
        self.index_cache: IndexCache | None = inner.index_cache
        # The optional capabilities below, decided once (every small page-cached READ asks).
        self._read_now_below = inner.read_now if isinstance(inner, ReadNow) else None
        self._cached_range_below = inner.cached_range if isinstance(inner, CachedRange) else None
        self._stat_tail_below = inner.stat_tail if isinstance(inner, StatTail) else None
        self._stat_head_below = inner.stat_head if isinstance(inner, StatHead) else None
        self._read_if_tagged_below = inner.read_if_tagged if isinstance(inner, TaggedRead) else None
        self._read_versioned_below = inner.read_versioned if isinstance(inner, VersionedRead) else None

    async def stat(self, path: str) -> ObjectStat | None:
        return await self.inner.stat(path)

    async def read(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return await self.inner.read(path, offset, size, version)

    async def read_index(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return await self.inner.read_index(path, offset, size, version)

    def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        return self.inner.list(path)

    async def stat_dir(self, path: str) -> ObjectStat | None:
        return await self.inner.stat_dir(path)

    def cached_range(self, path: str, offset: int, size: int, version: Version | None = None) -> FdRange | None:
        """The `CachedRange` of the source below, through (None where it has none)."""
        below = self._cached_range_below
        return below(path, offset, size, version) if below is not None else None

    def open_backing(self, path: str, version: Version) -> int | None:
        """The optional `open_backing` of a local source (`BackingFiles`), through: every layer
        here leaves an object's bytes as they are."""
        below = self.inner
        return below.open_backing(path, version) if isinstance(below, BackingFiles) else None

    def read_now(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes | bytearray | None:
        """The `ReadNow` of the source below, through (None where it has none)."""
        below = self._read_now_below
        return below(path, offset, size, version) if below is not None else None

    async def stat_tail(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        """The `StatTail` of the source below, through; its `stat` alone where it has none."""
        below = self._stat_tail_below
        if below is None:
            return await self.inner.stat(path), None
        return await below(path, size)

    def key_order(self) -> bool:
        """The `KeyOrder` of the source below, through."""
        inner = self.inner
        return isinstance(inner, KeyOrder) and inner.key_order()

    async def keys_after(self, path: str, n: int) -> "builtins.list[tuple[str, ObjectStat]]":
        inner = self.inner
        return await inner.keys_after(path, n) if isinstance(inner, KeyOrder) and inner.key_order() else []

    async def stat_head(self, path: str, size: int) -> tuple[ObjectStat | None, bytes | None]:
        """The `StatHead` of the source below, through; its `stat` alone where it has none."""
        below = self._stat_head_below
        if below is None:
            return await self.inner.stat(path), None
        return await below(path, size)

    async def read_if_tagged(self, path: str, offset: int, size: int, etag: str,
                             version: Version | None = None) -> bytes | None:
        """The `TaggedRead` of the source below, through (None where it has none): a layer never
        answers a conditional read from bytes it kept."""
        below = self._read_if_tagged_below
        return await below(path, offset, size, etag, version) if below is not None else None

    async def read_versioned(self, path: str, offset: int, size: int) -> tuple[bytes, Version | None]:
        """The `VersionedRead` of the source below, through; a plain `read` (no version told) where
        it has none."""
        below = self._read_versioned_below
        if below is None:
            return await self.inner.read(path, offset, size), None
        return await below(path, offset, size)

    async def stored_at(self, path: str, version: Version | None) -> UrlLocation | None:
        """The `StoredAt` of the source below, through: every layer here leaves bytes as they are."""
        return await stored_at(self.inner, path, version)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def own_stats(self) -> dict[str, object]:
        """This layer's sections of `stats` (none by default)."""
        return {}

    def stats(self) -> dict[str, object]:
        return {**self.inner.stats(), **self.own_stats()}


def name_problem(name: str) -> str | None:
    """Why `name` cannot be one segment of a path, or None when it can.

    Names come from listings, probes and metadata written by others: `..`
    would climb out of the dataset (and, put into a URL, into another prefix
    or bucket), `/` would smuggle in several segments, NUL ends C strings,
    and a name that is not UTF-8 cannot be shown or requested faithfully.
    """
    if name in ("", ".", ".."):
        return f"name {name!r} is not a file name"
    if "/" in name or "\0" in name:
        return f"name {name!r} contains '/' or NUL"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes from os.scandir (surrogate escapes)
        return f"name {name.encode('utf-8', 'backslashreplace').decode()!r} is not UTF-8"
    return None


def join_path(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def normalize_path(path: str) -> str:
    """Resolve '.', '..' and redundant slashes; refuse anything escaping the root.

    Scale keys in an info file may hold '..' components; they are allowed only
    while they stay inside the mounted source, so a crafted info file cannot
    expose other files of the machine.
    """
    if path.startswith("/"):
        raise ConfigError(f"absolute path {path!r} is not allowed")
    norm = posixpath.normpath(path) if path else ""
    if norm in (".", ""):
        return ""
    if norm == ".." or norm.startswith("../"):
        raise ConfigError(f"path {path!r} points outside the source")
    return norm
