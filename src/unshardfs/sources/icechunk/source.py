"""An Icechunk repository as a byte source: one snapshot's Zarr v3 hierarchy as keys.

`IcechunkStore` reads a repository found under a prefix of another byte
source (local, http(s), gs, s3, or a zip member tree): its refs (spec version
1: `refs/`, a tag deleted when its `ref.json.deleted` marker is there; spec
version 2: the `repo` object, read once, which lists branches, tags, deleted
tags and every snapshot's parent), each snapshot and manifest with one read
of its object, decoded once and kept in a byte-bounded cache (concurrent
askers of a cold object share one fetch). A deleted tag or branch is never
resolved nor listed. `IcechunkSource` shows one snapshot as Icechunk's own Zarr store
shows it: `zarr.json` of every group and array (the metadata as the writer
stored it) and chunk keys `c/I/J/...` of every chunk an array's manifests
hold. A chunk read is one ranged read of the chunk object (`chunks/ID`, at
the reference's offset), a slice of the manifest for an inline chunk, or a
ranged read of the object a virtual reference names, where that location is
allowed: inside the repository, or under a prefix the user allowed
(`IcechunkOptions.virtual_prefixes`); any other virtual reference fails with
EIO (logged once), nothing outside fetched.

A source shows the snapshot it was opened with: snapshots and manifests are
never rewritten, so nothing read through it goes stale; a newer commit on a
branch is seen by opening the repository again. Chunk objects are written once
too, but a copy of an updated repository made over an old one (or a file a
virtual reference names, rewritten) changes them under a mount: a chunk key's
reads are held to the version of its object that its first read met (`Pins`),
so a chunk read in pieces gives the old bytes, the new bytes or `StaleError`,
never a mix.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import trio

from unshardfs.sources.base import (ByteSource, IndexCache, ObjectStat, Version, VersionInfo, iso_time, name_problem,
                                    TaggedRead, normalize_path, read_whole, tag_problem)
from unshardfs.sources.coalesce import RangeReads
from unshardfs.sources.pins import Pin, Pins
from unshardfs.sources.icechunk.format import (FILE_MANIFEST, FILE_REPO_INFO, FILE_SNAPSHOT, MAX_REF_JSON, ChunkManifest,
                                               ChunkRef, RepoConfig, Snapshot, SnapshotNode, decode_config, decode_id,
                                               decode_object, decode_ref, decode_snapshot, encode_id)
from unshardfs.sources.icechunk.repoinfo import RepoInfo, decode_repo_info
from unshardfs.util.errors import ConfigError, DataError, SourceError, StaleError
from unshardfs.util.flight import Flights
from unshardfs.util.limits import DataLimits
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap, payload_size

log = logging.getLogger(__name__)

OBJECT_CACHE = 64 << 20  # decoded snapshots and manifests of one repository
MAX_VERSIONS = 10_000  # snapshots listed as version directories (the newest of each ref's history first)
MAX_REFS = 10_000  # branches and tags listed
CONFIG_BYTES = 1 << 20
FIRST_READ = 256 << 10  # read with the stat of a remote object: all of most snapshots and manifests
REF_NAME = re.compile(r"(branch|tag)\.([^/\0]{1,255})\Z")
SNAPSHOT_NAME = re.compile(r"[0-9A-HJKMNP-TV-Z]{20}\Z")
# Earlier Icechunk releases kept a branch as numbered ref files, the newest first in name order.
NUMBERED_REF = re.compile(r"[0-9A-HJKMNP-TV-Z]{8}\.json\Z")
REPO_INFO = "repo"  # spec version 2: the one object naming branches, tags and snapshots
TAG_DELETED = "ref.json.deleted"  # spec version 1: beside a tag's ref.json, the tag was deleted
REPO_INFO_BYTES = 64 << 20  # a repo info object (it grows with the snapshots it lists)
COORD = re.compile(r"(0|[1-9][0-9]{0,9})\Z")


@dataclass(frozen=True)
class IcechunkOptions:
    """How a repository is read. `virtual_prefixes`: URL prefixes (`s3://bucket/data/`, `file:///data/`)
    virtual chunk references may be read from besides the repository itself; every other virtual reference
    fails (EIO). Opening one is `open_url`'s job (the front end's way to open a base URL)."""

    virtual_prefixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RefSpec:
    """A version as Neuroglancer names it: `branch.NAME`, `tag.NAME` or a snapshot id."""

    kind: str  # "branch", "tag" or "snapshot"
    name: str

    @classmethod
    def parse(cls, text: str) -> "RefSpec":
        m = REF_NAME.match(text)
        if m:
            if name_problem(m.group(2)) is not None:
                raise ConfigError(f"Icechunk ref {text!r}: {name_problem(m.group(2))}")
            return cls(m.group(1), m.group(2))
        if SNAPSHOT_NAME.match(text) and decode_id(text) is not None:
            return cls("snapshot", text)
        raise ConfigError(f"Icechunk version {text!r} is neither branch.NAME, tag.NAME nor a snapshot id "
                          f"(20 characters of Crockford base 32)")

    def __str__(self) -> str:
        return self.name if self.kind == "snapshot" else f"{self.kind}.{self.name}"


class IcechunkStore:
    """One repository: under `root` (a '/'-terminated prefix of `inner`, or '')."""

    def __init__(self, inner: ByteSource, root: str = "", limits: DataLimits | None = None,
                 description: str | None = None, url: str | None = None, options: IcechunkOptions | None = None,
                 open_url: Callable[[str], ByteSource] | None = None, cache: int = OBJECT_CACHE,
                 spec: int | None = None) -> None:
        """`spec`: the spec version, when whoever found the repository knows it by its marker (None: its
        first ref looked up finds out, reading `repo` and the spec version 1 ref at once)."""
        self.inner = inner
        self.spec = spec
        self.root = root
        self.limits = limits or DataLimits()
        self.description = description or f"{inner.description.rstrip('/')}/{root}".rstrip("/") + "|icechunk:"
        # The repository's own URL, '/'-terminated: virtual references under it are read through `inner`.
        self.url = url.rstrip("/") + "/" if url else None
        self.options = options or IcechunkOptions()
        self.open_url = open_url
        self.objects: BoundedMap[tuple[str, bytes], Any] = BoundedMap(cache, getsizeof=payload_size)
        self.flights = Flights()
        self.config: RepoConfig | None = None
        self._info: RepoInfo | None = None
        self._info_read = spec == 1  # (`repo` looked for: a spec version 1 repository has none)
        self._outside: dict[str, ByteSource] = {}
        self._taggers: dict[int, TaggedRead | None] = {}  # by source: its `TaggedRead`, decided once
        self._ranges: dict[int, RangeReads[Pin | str]] = {}  # by source: its reads of one moment, joined per object
        self._pins: dict[int, Pins] = {}  # by source: the versions its chunks' objects are read at
        self.counters = {"ref_reads": 0, "snapshot_reads": 0, "manifest_reads": 0, "object_bytes": 0,
                         "chunk_reads": 0, "chunk_bytes": 0, "virtual_refused": 0}

    # -- refs ------------------------------------------------------------------------

    async def _whole(self, path: str, limit: int, index: bool = False) -> bytes | None:
        """The whole object at `path` (None when absent), at most `limit` bytes (DataError beyond): one
        request over a remote base for an object of up to `FIRST_READ` bytes (`read_whole`)."""
        where = self.description + path

        def check(size: int) -> None:
            if index:
                self.limits.check_index(size, where, limit)
            elif size > limit:
                raise DataError(where, f"{size:,} bytes, more than {limit:,} (not this file)")

        return await read_whole(self.inner, self.root + path, where, check, index, FIRST_READ)

    async def info(self) -> RepoInfo | None:
        """The repo info object of a spec version 2 repository (read once; None for spec version 1, which
        has none). DataError when it is damaged."""
        async def load() -> None:
            if self._info_read:
                return
            where = self.description + REPO_INFO
            data = await self._whole(REPO_INFO, min(REPO_INFO_BYTES, self.limits.index_bytes), index=False)
            if data is not None:
                body = decode_object(data, where, FILE_REPO_INFO, REPO_INFO_BYTES)
                self._info = decode_repo_info(body, where, MAX_REFS, MAX_VERSIONS)
                self.counters["ref_reads"] += 1
            self._info_read = True

        await self.flights.run(("repo",), load)
        return self._info

    async def spec_version(self) -> int:
        """The repository's spec version: 2 where a `repo` object names it, else 1."""
        info = await self.info()
        return 1 if info is None else info.spec_version

    async def resolve(self, ref: RefSpec) -> bytes | None:
        """The snapshot id `ref` names, or None when the ref does not exist or was deleted (DataError when
        it is damaged). Where the spec version is not known yet, the `repo` object and the spec version 1
        ref are read at once (one round trip, as either alone)."""
        if ref.kind == "snapshot":
            return decode_id(ref.name)
        if not self._info_read and self.spec is None:
            v1: list[bytes | None | BaseException] = [None]
            failed: list[BaseException] = []

            async def old() -> None:
                try:
                    v1[0] = await self._resolve_v1(ref)
                except (DataError, SourceError) as e:
                    v1[0] = e  # (wanted only if there is no `repo`)

            async with trio.open_nursery() as nursery:
                async def new() -> None:
                    try:
                        if await self.info() is not None:
                            nursery.cancel_scope.cancel()  # spec version 2: the old way's answer is not wanted
                    except (DataError, SourceError) as e:
                        failed.append(e)  # a damaged `repo`: this repository is not read

                nursery.start_soon(new)
                nursery.start_soon(old)
            if failed:
                raise failed[0]
            if self._info is None:
                if isinstance(v1[0], BaseException):
                    raise v1[0]
                return v1[0]
        info = await self.info()
        if info is not None:
            return (info.branches if ref.kind == "branch" else info.tags).get(ref.name)
        return await self._resolve_v1(ref)

    async def _resolve_v1(self, ref: RefSpec) -> bytes | None:
        """`resolve` in a spec version 1 repository: `refs/KIND.NAME/ref.json`."""
        folder = f"refs/{ref.kind}.{ref.name}/"
        if ref.kind == "tag":
            marker = await self.inner.stat(self.root + folder + TAG_DELETED)
            if marker is not None and not marker.is_dir:
                return None  # a deleted tag: Icechunk answers "ref not found"
        data = await self._whole(folder + "ref.json", MAX_REF_JSON)
        if data is None and ref.kind == "branch" and self.inner.listable:
            numbered = [name async for name, st in self.inner.list(self.root + folder.rstrip("/"))
                        if NUMBERED_REF.match(name) and not st.is_dir]
            if numbered:
                data = await self._whole(folder + min(numbered), MAX_REF_JSON)
        self.counters["ref_reads"] += 1
        return None if data is None else decode_ref(data, self.description + folder)

    async def refs(self) -> list[RefSpec]:
        """Every branch and tag, deleted ones aside (branch main alone where a spec version 1 base cannot
        list)."""
        info = await self.info()
        if info is not None:
            found = [RefSpec("branch", name) for name in info.branches]
            found += [RefSpec("tag", name) for name in info.tags]
            return sorted(found, key=lambda r: (r.kind != "branch", r.name))
        if not self.inner.listable:
            return [RefSpec("branch", "main")]
        found = []
        async for name, st in self.inner.list(self.root + "refs"):
            m = REF_NAME.match(name)
            if m and st.is_dir and name_problem(m.group(2)) is None:
                found.append(RefSpec(m.group(1), m.group(2)))
                if len(found) >= MAX_REFS:
                    log_once(log, f"icechunk:{self.description}:refs", "%s: more than %s branches and tags; "
                             "only the first are listed", self.description, f"{MAX_REFS:,}")
                    break
        deleted = set(await self._deleted_v1(found))
        return sorted((r for r in found if r not in deleted), key=lambda r: (r.kind != "branch", r.name))

    async def _deleted_v1(self, refs: builtins.list[RefSpec]) -> builtins.list[RefSpec]:
        """Of spec version 1 `refs` (listed folders), the deleted ones: tags with the deletion marker,
        branches whose folder holds no ref any more (an object store keeps no empty folder, so those show
        only on a local disk)."""
        async def gone(ref: RefSpec) -> bool:
            folder = f"{self.root}refs/{ref.kind}.{ref.name}/"
            if ref.kind == "tag":
                marker = await self.inner.stat(folder + TAG_DELETED)
                return marker is not None and not marker.is_dir
            st = await self.inner.stat(folder + "ref.json")
            if st is not None and not st.is_dir:
                return False
            async for name, entry in self.inner.list(folder.rstrip("/")):
                if NUMBERED_REF.match(name) and not entry.is_dir:
                    return False
            return True

        found: dict[int, bool] = {}

        async def check(i: int, ref: RefSpec) -> None:
            found[i] = await gone(ref)

        async with trio.open_nursery() as nursery:
            for i, ref in enumerate(refs):
                nursery.start_soon(check, i, ref)
        return [ref for i, ref in enumerate(refs) if found.get(i)]

    async def deleted(self) -> tuple[builtins.list[str], builtins.list[str]]:
        """(deleted tags, deleted branches) as far as the repository records them: spec version 2 its lists
        and the log of recent operations; spec version 1 its tags' deletion markers (and, on a local disk,
        the empty folders of deleted branches)."""
        info = await self.info()
        if info is not None:
            return sorted(info.deleted_tags), sorted(info.deleted_branches)
        if not self.inner.listable:
            return [], []
        listed: builtins.list[RefSpec] = []
        async for name, st in self.inner.list(self.root + "refs"):
            m = REF_NAME.match(name)
            if m and st.is_dir and name_problem(m.group(2)) is None and len(listed) < MAX_REFS:
                listed.append(RefSpec(m.group(1), m.group(2)))
        gone = await self._deleted_v1(listed)
        return (sorted(r.name for r in gone if r.kind == "tag"), sorted(r.name for r in gone if r.kind == "branch"))

    async def read_config(self) -> RepoConfig | None:
        """`config.yaml`, when the repository has one (read once; spec version 2 keeps its configuration in
        the `repo` object instead, which this does not decode)."""
        if self.config is None:
            data = await self._whole("config.yaml", CONFIG_BYTES)
            if data is None:
                return None
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(self.description + "config.yaml", "not UTF-8") from None
            self.config = decode_config(text, self.description + "config.yaml")
        return self.config

    # -- snapshots and manifests -------------------------------------------------------

    async def _object(self, folder: str, raw_id: bytes, file_type: int) -> bytes:
        path = f"{folder}/{encode_id(raw_id)}"
        where = self.description + path
        cap = min(self.limits.index_bytes, int(self.objects.maxsize))
        data = await self._whole(path, cap, index=True)
        if data is None:
            raise DataError(where, "missing (the repository names an object it does not hold)")
        self.counters["snapshot_reads" if file_type == FILE_SNAPSHOT else "manifest_reads"] += 1
        self.counters["object_bytes"] += len(data)
        # The decoded body is bounded like the object: a zstd bomb stops there.
        return decode_object(data, where, file_type, cap)

    async def snapshot(self, raw_id: bytes) -> Snapshot:
        async def load() -> Snapshot:
            body = await self._object("snapshots", raw_id, FILE_SNAPSHOT)
            found = decode_snapshot(body, self.description + "snapshots/" + encode_id(raw_id), raw_id)
            info = await self.info()
            if info is not None and found.parent is None:
                # Spec version 2: the parent is the repo info's to say, not the snapshot's.
                listed = info.snapshots.get(raw_id)
                if listed is not None and listed.parent is not None:
                    found = dataclasses.replace(found, parent=listed.parent)
            for line in found.skipped[:20]:
                log_once(log, f"icechunk:{self.description}:{line}", "%s snapshot %s: %s (not shown)",
                         self.description, found.name, line)
            return found

        snapshot: Snapshot = await self.flights.cached(self.objects, ("s", raw_id), load)
        return snapshot

    async def manifest(self, raw_id: bytes) -> ChunkManifest:
        async def load() -> ChunkManifest:
            body = await self._object("manifests", raw_id, FILE_MANIFEST)
            return ChunkManifest(body, self.description + "manifests/" + encode_id(raw_id), raw_id)

        manifest: ChunkManifest = await self.flights.cached(self.objects, ("m", raw_id), load)
        return manifest

    async def history(self, start: bytes, seen: dict[bytes, Snapshot]) -> None:
        """`start` and its ancestors into `seen` (each snapshot read once; a parent chain that loops or
        exceeds `MAX_VERSIONS` stops there)."""
        current: bytes | None = start
        while current is not None and current not in seen:
            if len(seen) >= MAX_VERSIONS:
                log_once(log, f"icechunk:{self.description}:versions", "%s: more than %s snapshots; older ones "
                         "are not listed (still readable by id)", self.description, f"{MAX_VERSIONS:,}")
                return
            snapshot = await self.snapshot(current)
            seen[current] = snapshot
            current = snapshot.parent

    # -- chunk bytes ----------------------------------------------------------------

    def _pins_of(self, source: ByteSource) -> Pins:
        pins = self._pins.get(id(source))  # the repository's base, or a source of `_outside`: both live as long as the store
        if pins is None:
            pins = self._pins[id(source)] = Pins(source)
        return pins

    def pin(self, ref: ChunkRef) -> Pin | None:
        """The pin of the object holding a chunk's bytes (what a chunk key's stat hands its file), without
        I/O; None for an inline chunk, or a virtual reference that may not be read."""
        if ref.data is not None:
            return None
        try:
            source, path = self._place(ref, "", counted=False)
        except DataError:
            return None
        return self._pins_of(source).pin(path)

    def _place(self, ref: ChunkRef, where: str, counted: bool = True) -> tuple[ByteSource, str]:
        """The source and path of the object holding a chunk's bytes (DataError: a virtual reference that
        may not be read)."""
        if ref.chunk_id is not None:
            return self.inner, f"{self.root}chunks/{encode_id(ref.chunk_id)}"
        assert ref.location is not None
        return self._virtual(ref.location, where, counted)

    async def read_chunk(self, ref: ChunkRef, where: str, offset: int, size: int, index: bool,
                         pin: Pin | None = None) -> bytes:
        """Bytes of a chunk; through `pin` (from the chunk key's stat), held to the version of its object that
        the pin's first read met."""
        size = max(0, min(size, ref.size - offset))
        if ref.data is not None:
            return ref.data[offset:offset + size]
        if size == 0:
            return b""
        source, path = self._place(ref, where)
        if pin is not None and pin.path != path:
            raise StaleError(where, "the chunk lies in another object than when it was looked up")
        if ref.chunk_id is None:
            if ref.etag:  # Icechunk's checksum is one kind or the other: an ETag wins
                data = await self._tagged(source, path, ref.etag, ref.offset + offset, size, where, pin)
                return self._counted(data, size, path, where)
            if ref.last_modified:
                await self._unmodified(source, path, ref.last_modified, where)
        obj: Pin | str = pin if pin is not None else path
        return self._counted(await self._ranged(source, obj, ref.offset + offset, size, index, where), size, path,
                             where)

    @property
    def chunk_requests(self) -> int:
        """Requests sent for chunk bytes over remote sources (ranges asked for together count once)."""
        return sum(ranges.counters.reads for ranges in self._ranges.values())

    async def _ranged(self, source: ByteSource, obj: Pin | str, offset: int, size: int, index: bool,
                      where: str) -> bytes:
        """Bytes of a chunk object (or a virtual reference's object): through its pin, or (a read made
        without a version) as the object is now. Over a remote source, ranges of one object asked for at the
        same moment (chunks of a shard stored as one chunk object, read by several readers; neighbouring
        virtual chunks of one file) go out as one ranged read (`RangeReads`); index reads a disk cache keeps
        are read alone (kept by their exact range)."""
        pins = self._pins_of(source)

        async def fetch(at: Pin | str, start: int, length: int, index_read: bool) -> bytes:
            if isinstance(at, Pin):
                return await pins.read(at, start, length, where, index_read)
            return await (source.read_index if index_read else source.read)(at, start, length)

        if not source.remote or (index and source.index_cache is not None):
            return await fetch(obj, offset, size, index)
        ranges = self._ranges.get(id(source))
        if ranges is None:  # one per source: the repository's base and each allowed prefix's
            ranges = self._ranges[id(source)] = RangeReads(fetch)
        return await ranges.read(obj, offset, size, index)

    def _counted(self, data: bytes, size: int, path: str, where: str) -> bytes:
        self.counters["chunk_reads"] += 1
        self.counters["chunk_bytes"] += len(data)
        if len(data) != size:
            raise DataError(where, f"the chunk's object {path} ends inside the chunk (truncated)")
        return data

    async def _tagged(self, source: ByteSource, path: str, etag: str, offset: int, size: int, where: str,
                      pin: Pin | None) -> bytes:
        """The bytes a virtual reference with an ETag checksum names, read on the condition that its object
        still carries that tag (`If-Match` over HTTP, gs:// and s3://: the request is the check); DataError
        (EIO) when it does not, or when the source cannot tell an object's tag (a zip member). A local file's
        tag (inode, mtime, size) misses a rewrite that puts its mtime back: its reads are held to its
        pin's version too."""
        problem = tag_problem(etag)
        if problem is not None:
            raise DataError(where, f"its virtual reference's ETag checksum: {problem}")
        key = id(source)  # the repository's base, or a source of `_outside`: both live as long as the store
        if key not in self._taggers:
            self._taggers[key] = source if isinstance(source, TaggedRead) else None
        tagger = self._taggers[key]
        try:
            version = await self._pins_of(source).version(pin, where) if pin is not None and not source.remote else None
            data = await tagger.read_if_tagged(path, offset, size, etag, version) if tagger is not None else None
        except StaleError as e:
            if pin is not None:
                self._pins_of(source).drop(pin)
            raise DataError(where, f"the object of its virtual reference, {path}, changed after the reference was "
                                   f"written (checksum: ETag {etag[:100]}; {e.reason})") from None
        if data is None:
            raise DataError(where, f"the object of its virtual reference, {path}, cannot be checked against the "
                                   f"reference's ETag checksum on {source.description}")
        return data

    async def _unmodified(self, source: ByteSource, path: str, last_modified: int, where: str) -> None:
        """DataError when the object a virtual reference names changed after the writer recorded it (its
        modification time is later than the checksum's): its bytes at that range may be other bytes."""
        st = await source.stat(path)
        if st is None or st.is_dir:
            raise DataError(where, f"the object of its virtual reference, {path}, is missing")
        if st.mtime_ns > (last_modified + 1) * 1_000_000_000:
            raise DataError(where, f"the object of its virtual reference, {path}, was modified after the reference "
                                   f"was written (checksum: last modified {iso_time(last_modified * 10**9)})")

    def _virtual(self, location: str, where: str, counted: bool = True) -> tuple[ByteSource, str]:
        """The source and path a virtual reference's location may be read through; DataError (logged once
        by the front end, EIO) when the location is outside every allowed place."""
        if self.url is not None and location.startswith(self.url):
            rest = _inside(location[len(self.url):])
            if rest is not None:
                return self.inner, self.root + rest
        for prefix in self.options.virtual_prefixes:
            base = prefix.rstrip("/") + "/"
            if location.startswith(base) and self.open_url is not None:
                rest = _inside(location[len(base):])
                if rest is None:
                    break
                source = self._outside.get(base)
                if source is None:
                    source = self._outside[base] = self.open_url(base)
                return source, rest
        self.counters["virtual_refused"] += counted
        raise DataError(where, f"virtual reference to {location[:300]!r}, outside the repository and every allowed "
                               f"location (allow a prefix with --icechunk-virtual PREFIX)")

    async def aclose(self) -> None:
        for source in self._outside.values():
            await source.aclose()
        self._outside.clear()


def _pin_of(version: Version | None) -> Pin | None:
    """The pin a chunk key's version (`IcechunkSource._chunk`) carries; None for metadata, an inline chunk,
    or a read made without a version (which reads whatever the object holds now)."""
    if version and isinstance(version[-1], Pin):
        return version[-1]
    return None


def _inside(rest: str) -> str | None:
    """`rest` (the part of a location after an allowed prefix) as a path that stays under it, or None."""
    if "\0" in rest or "?" in rest or "#" in rest or "\\" in rest:
        return None
    try:
        path = normalize_path(rest)
    except ConfigError:
        return None
    return path or None


def _coords(segments: list[str]) -> tuple[int, ...] | None:
    """Chunk coordinates as Icechunk's store names them (decimal, no sign or leading zeros), or None."""
    if not all(COORD.match(s) for s in segments):
        return None
    values = tuple(int(s) for s in segments)
    return values if all(v < 1 << 32 for v in values) else None


@dataclass(frozen=True, slots=True)
class ChunkKey:
    node: SnapshotNode
    coords: tuple[int, ...]  # all of them (a chunk) or the first few (a directory of chunk keys)


class IcechunkSource:
    """The keys of one snapshot of `store` under `prefix` (a '/'-terminated path, or '') as paths.

    Implements the `VersionedSource` capability too: `versions()` and `open_version(name)` answer for the
    whole repository (the same store, so every version shares its object cache)."""

    listable = True

    def __init__(self, store: IcechunkStore, snapshot: Snapshot, prefix: str = "", pinned: bool = False,
                 owns_inner: bool = True, label: str | None = None, ref: RefSpec | None = None) -> None:
        self.store = store
        self.snapshot = snapshot
        self.prefix = prefix
        self.pinned = pinned
        self.owns_inner = owns_inner
        # the version this source is: the ref or snapshot id it was opened by (branch main by default)
        self.ref = ref or RefSpec("branch", "main")
        self.remote = store.inner.remote
        self.index_cache: IndexCache | None = store.inner.index_cache
        shown = f"@{label}/" if pinned and label else ""
        self.description = f"{store.description}{shown}{prefix}"
        # Directories of the node tree: path -> child names (groups, arrays, and the directories between).
        self.dirs: dict[str, set[str]] = {"": set()}
        for path in snapshot.nodes:
            while path:
                parent, _, name = path.rpartition("/")
                self.dirs.setdefault(parent, set()).add(name)
                self.dirs.setdefault(path, set())
                path = parent

    # -- paths --------------------------------------------------------------------

    def _full(self, path: str) -> str | None:
        if path and any(name_problem(s) is not None for s in path.split("/")):
            return None
        return (self.prefix + path).rstrip("/")

    def _chunk_key(self, full: str) -> ChunkKey | None:
        """The array and chunk coordinates `full` names (None: not under an array's `c/`)."""
        segments = full.split("/")
        for k in range(len(segments) - 1, -1, -1):
            if segments[k] != "c":
                continue
            node = self.snapshot.nodes.get("/".join(segments[:k]))
            if node is None or node.array is None:
                continue
            coords = _coords(segments[k + 1:])
            if coords is None or len(coords) > len(node.array.shape):
                return None
            return ChunkKey(node, coords)
        return None

    async def _find(self, key: ChunkKey) -> ChunkRef | None:
        node = key.node
        assert node.array is not None
        for ref in node.array.manifests:
            if ref.covers(key.coords):
                found = (await self.store.manifest(ref.id)).find(node.id, key.coords)
                if found is not None:
                    return found
        return None

    async def _children(self, key: ChunkKey, skip: bool = False) -> builtins.list[tuple[int, ChunkRef | None]]:
        """The next coordinate after `key.coords` of every chunk under it, sorted, each with its reference
        where it is a chunk (the last dimension; the first manifest holding it wins, as for lookups) or None
        where it is a directory. `skip`: a manifest that cannot be read is passed over (logged once), for
        listings, which then show every chunk still readable; lookups fail instead."""
        node = key.node
        assert node.array is not None
        depth = len(key.coords)
        ndim = len(node.array.shape)
        last = depth + 1 == ndim
        found: dict[int, ChunkRef | None] = {}
        for ref in node.array.manifests:
            if not all(lo <= c < hi for c, (lo, hi) in zip(key.coords, ref.extents)):
                continue
            try:
                manifest = await self.store.manifest(ref.id)
            except (DataError, SourceError) as e:
                if not skip:
                    raise
                log_once(log, f"icechunk:{self.store.description}:skipped:{ref.id.hex()}", "%s: chunks of %r in "
                         "manifest %s are not listed: %s", self.description, "/" + node.path, encode_id(ref.id), e)
                continue
            if last:  # every chunk of this row, in order
                for chunk in manifest.refs_from(node.id, key.coords):
                    if chunk.index[:depth] != key.coords or len(chunk.index) != ndim:
                        break
                    found.setdefault(chunk.index[depth], chunk)
                continue
            start = key.coords
            while True:  # one lookup per subdirectory, skipping the chunks inside it
                nxt = next(manifest.refs_from(node.id, start), None)
                if nxt is None or nxt.index[:depth] != key.coords or len(nxt.index) != ndim:
                    break
                found[nxt.index[depth]] = None
                start = (*key.coords, nxt.index[depth] + 1)
        return sorted(found.items())

    def _dir(self) -> ObjectStat:
        return ObjectStat(0, self.snapshot.time_ns, True, ())

    def _file(self, size: int, identity: tuple[object, ...]) -> ObjectStat:
        return ObjectStat(size, self.snapshot.time_ns, False, ("icechunk", *identity))

    def _chunk(self, ref: ChunkRef, node: SnapshotNode, coords: tuple[int, ...]) -> ObjectStat:
        """A chunk key's stat: its version carries its object's pin (reads of the file are held to the
        object's version the pin's first read meets)."""
        pin = self.store.pin(ref)
        identity = (self.snapshot.id, node.id, coords)
        return self._file(ref.size, identity if pin is None else (*identity, pin))

    async def stat(self, path: str) -> ObjectStat | None:
        full = self._full(path)
        if full is None:
            return None
        if full in self.dirs:
            return self._dir()
        parent, _, name = full.rpartition("/")
        if name == "zarr.json":
            node = self.snapshot.nodes.get(parent)
            if node is not None:
                return self._file(len(node.zarr_json), (self.snapshot.id, parent))
        if name == "c":
            node = self.snapshot.nodes.get(parent)
            if node is not None and node.array is not None and node.array.shape:
                return self._dir() if node.array.manifests else None
        key = self._chunk_key(full)
        if key is None:
            return None
        assert key.node.array is not None
        if len(key.coords) == len(key.node.array.shape):
            ref = await self._find(key)
            if ref is None:
                return None
            return self._chunk(ref, key.node, key.coords)
        return self._dir() if await self._children(key) else None

    async def stat_dir(self, path: str) -> ObjectStat | None:
        st = await self.stat(path)
        return st if st is not None and st.is_dir else None

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        full = self._full(path)
        if full is None:
            return
        if full in self.dirs:
            node = self.snapshot.nodes.get(full)
            names = set(self.dirs[full])
            if node is not None:
                yield "zarr.json", self._file(len(node.zarr_json), (self.snapshot.id, full))
                if node.array is not None and node.array.shape and node.array.manifests:
                    names.discard("c")
                    yield "c", self._dir()
                elif node.array is not None and not node.array.shape:  # a 0-d array's one chunk is `c`
                    names.discard("c")
                    st = await self.stat(f"{path}/c" if path else "c")
                    if st is not None:
                        yield "c", st
            for name in sorted(names):
                yield name, self._dir()
            return
        key = self._chunk_key(full)
        if key is None:
            if full.endswith("/c") or full == "c":
                node = self.snapshot.nodes.get(full[:-2].rstrip("/"))
                if node is not None and node.array is not None and node.array.shape:
                    key = ChunkKey(node, ())
            if key is None:
                return
        for value, chunk in await self._children(key, skip=True):
            if chunk is not None:
                yield str(value), self._chunk(chunk, key.node, chunk.index)
            else:
                yield str(value), self._dir()

    async def _read(self, path: str, offset: int, size: int, index: bool, pin: Pin | None) -> bytes:
        full = self._full(path)
        if full is not None:
            parent, _, name = full.rpartition("/")
            node = self.snapshot.nodes.get(parent) if name == "zarr.json" else None
            if node is not None:
                return node.zarr_json[offset:offset + max(size, 0)]
            key = self._chunk_key(full)
            if key is not None and key.node.array is not None and len(key.coords) == len(key.node.array.shape):
                ref = await self._find(key)
                if ref is not None:
                    return await self.store.read_chunk(ref, f"{self.description}{path}", offset, size, index, pin)
        raise SourceError(f"{self.description}: no key {path!r}")

    async def read(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return await self._read(path, offset, size, False, _pin_of(version))

    async def read_index(self, path: str, offset: int, size: int, version: Version | None = None) -> bytes:
        return await self._read(path, offset, size, True, _pin_of(version))

    async def aclose(self) -> None:
        if self.owns_inner:
            await self.store.aclose()
            await self.store.inner.aclose()

    def stats(self) -> dict[str, object]:
        return {**self.store.inner.stats(), "icechunk": {**self.store.counters,
                                                         "chunk_requests": self.store.chunk_requests,
                                                         **self.store.objects.figures("object")}}

    @property
    def current(self) -> str:
        """The `VersionInfo.name` of the version this source is (`branch.main`, `tag.v1`, a snapshot id)."""
        return str(self.ref)

    async def summary_lines(self) -> builtins.list[str]:
        """What `inspect` says of the repository beyond its versions: the snapshot shown and the settings of
        its `config.yaml` that concern readers (a damaged one is named, not fatal)."""
        snap = self.snapshot
        message = snap.message.replace("\n", " ")[:120]
        try:
            version = await self.store.spec_version()
            tags, branches = await self.store.deleted()
        except (DataError, SourceError) as e:
            return [f"  icechunk      unreadable: {e}"]
        out = [f"  icechunk      snapshot {snap.name} of {iso_time(snap.time_ns)} ({message!r}); spec version "
               f"{version}; {len(snap.nodes):,} groups and arrays"]
        for kinds, names in ((("tag", "tags"), tags), (("branch", "branches"), branches)):
            if names:
                shown = ", ".join(names[:20]) + (f", ... ({len(names):,} in all)" if len(names) > 20 else "")
                out.append(f"  deleted       {kinds[len(names) > 1]} {shown} (not shown)")
        if version != 1:
            return [*out, "  config        in the repo object (not read: no setting of it changes what is shown)"]
        try:
            config = await self.store.read_config()
        except (DataError, SourceError) as e:
            return [*out, f"  config.yaml   unreadable: {e}"]
        if config is not None:
            if config.inline_chunk_threshold_bytes is not None:
                out.append(f"  config.yaml   chunks of at most {config.inline_chunk_threshold_bytes:,} bytes are "
                           f"stored inline")
            allowed = self.store.options.virtual_prefixes
            for c in config.containers:
                prefix = c.url_prefix.rstrip("/") + "/"
                if self.store.url is not None and prefix.startswith(self.store.url):
                    state = "read (inside the repository)"
                elif any(prefix.startswith(p.rstrip("/") + "/") for p in allowed):
                    state = "read (allowed)"
                else:
                    state = "refused (allow with --icechunk-virtual)"
                out.append(f"  virtual       chunks under {c.url_prefix}: {state}")
        return out

    # -- the VersionedSource capability -------------------------------------------

    async def versions(self) -> builtins.list[VersionInfo]:
        """Every branch and tag (`branch.NAME`, `tag.NAME`), then every snapshot in their histories (by
        id), oldest first; `latest` marks the newest commit (and the refs naming it). A ref that is damaged
        or names a missing snapshot is left out (logged once)."""
        store = self.store
        named: list[tuple[RefSpec, Snapshot]] = []
        seen: dict[bytes, Snapshot] = {}
        for ref in await store.refs():
            try:
                raw = await store.resolve(ref)
                if raw is None:
                    continue
                await store.history(raw, seen)
                named.append((ref, seen[raw]))
            except (DataError, SourceError) as e:
                log_once(log, f"icechunk:{store.description}:ref:{ref}", "%s: %s is not shown: %s",
                         store.description, ref, e)
        newest = max((s.flushed_at_us, s.id) for s in seen.values())[1] if seen else None
        out = [_info(str(ref), snap, snap.id == newest) for ref, snap in named]
        out += [_info(snap.name, snap, snap.id == newest)
                for snap in sorted(seen.values(), key=lambda s: s.flushed_at_us)]
        return out

    async def open_version(self, name: str) -> ByteSource | None:
        """The source of version `name` (`branch.NAME`, `tag.NAME`, a snapshot id) over the same path, or
        None when there is none."""
        try:
            ref = RefSpec.parse(name)
            raw = await self.store.resolve(ref)
            if raw is None:
                return None
            snapshot = await self.store.snapshot(raw)
        except (ConfigError, DataError, SourceError):
            return None
        return IcechunkSource(self.store, snapshot, self.prefix, pinned=True, owns_inner=False, label=name, ref=ref)


def _info(name: str, snapshot: Snapshot, latest: bool) -> VersionInfo:
    entries = len(snapshot.nodes) + sum(f.chunk_refs for f in snapshot.manifest_files)
    return VersionInfo(name, snapshot.time_ns, entries, sum(f.size for f in snapshot.manifest_files), latest)


async def open_icechunk(inner: ByteSource, root: str, path: str, version: str | None, limits: DataLimits | None,
                        description: str | None = None, url: str | None = None,
                        options: IcechunkOptions | None = None,
                        open_url: Callable[[str], ByteSource] | None = None, spec: int | None = None) -> IcechunkSource:
    """The source `BASE|icechunk:[@REF/][PATH]` names: the repository under `root` of `inner`, at the
    snapshot REF names (branch main without one). ConfigError (one line) when there is no repository,
    the ref does not exist or was deleted, or its snapshot cannot be read. `spec`: the spec version, if
    known from the marker the repository was found by."""
    prefix = path.strip("/")
    if prefix and any(name_problem(s) is not None for s in prefix.split("/")):
        raise ConfigError(f"icechunk:{path}: a path of empty, '.' or '..' segments is not allowed")
    ref = RefSpec.parse(version) if version is not None else RefSpec("branch", "main")
    store = IcechunkStore(inner, root, limits, description, url, options, open_url, spec=spec)
    try:
        raw = await store.resolve(ref)
        if raw is None:
            what = "no branch main (not an Icechunk repository)" if version is None else f"no {ref}"
            raise ConfigError(f"{store.description}: {what} under {inner.description}"
                              f"{'/' + root if root else ''}")
        snapshot = await store.snapshot(raw)
    except DataError as e:
        raise ConfigError(f"{store.description}@{ref}: {e.reason} ({e.where})") from None
    except SourceError as e:
        raise ConfigError(f"{store.description}@{ref}: {e}") from None
    return IcechunkSource(store, snapshot, prefix + "/" if prefix else "", pinned=version is not None,
                          label=str(ref) if version is not None else None, ref=ref)


__all__ = ["IcechunkOptions", "IcechunkSource", "IcechunkStore", "RefSpec", "open_icechunk"]
