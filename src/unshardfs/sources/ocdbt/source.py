"""An OCDBT database as a byte source: its keys as paths, one version at a time.

`OcdbtStore` reads a database found under a prefix of another byte source
(local, http(s), gs, s3, or a zip member tree): the manifest once, version
tree and B+tree nodes on demand, each node with one ranged read of its data
file, decoded once and kept in a byte-bounded cache (concurrent askers of a
cold node share one fetch). `OcdbtSource` shows one version's keys (under an
optional key prefix, the pipeline's `ocdbt:PATH`) as '/'-separated paths;
every value read is one ranged read of the data file holding it, or a slice
of the leaf node for an inline value. A source shows the version it was
opened with, and a newer commit is seen by opening the store again. Data files
are written once by the format's rules, but a copy of an updated database made
over an old one rewrites them: a key's reads are held to the version of its
data file that its first read met (`Pins`), so a file read in pieces gives the
old bytes, the new bytes or `StaleError`, never a mix.

Keys that cannot be paths (not UTF-8, an empty, `.` or `..` segment, NUL, a
leading or trailing '/') are never shown (logged once); a key that is also a
directory (`a` beside `a/b`) is shown as the directory. Structures are
validated as they are reached (see `format`): a child's height must be its
parent's minus one, so no B+tree or version tree can loop, and a root
deeper than `MAX_HEIGHT` is refused before anything is fetched.
"""

from __future__ import annotations

import builtins
import logging
import re
from contextlib import aclosing
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, AsyncGenerator, AsyncIterator

from unshardfs.sources.base import Version as ObjectVersion
from unshardfs.sources.base import (ByteSource, IndexCache, ObjectStat, VersionInfo, iso_time, name_problem,
                                    read_whole)
from unshardfs.sources.coalesce import GAP, RangeReads
from unshardfs.sources.ocdbt.format import (MANIFEST_NUMBERED, MANIFEST_SINGLE, BtreeNode, Location, Manifest,
                                            Value, Version, VersionNode, VersionNodeRef, decode_btree_node,
                                            decode_manifest, decode_version_node, numbered_manifest_name)
from unshardfs.sources.pins import Pin, Pins
from unshardfs.util.errors import ConfigError, DataError, SourceError, StaleError
from unshardfs.util.flight import Flights
from unshardfs.util.limits import DataLimits
from unshardfs.util.logonce import log_once
from unshardfs.util.maps import BoundedMap, payload_size

log = logging.getLogger(__name__)

MANIFEST = "manifest.ocdbt"
NODE_CACHE = 32 << 20  # decoded B+tree and version tree nodes of one database
LOOKUPS = 1 << 16  # recent key lookups (what a chunk read asks again right after its stat)
MAX_HEIGHT = 32  # B+tree levels: a real tree of 10^12 keys has fewer than 8
MAX_VERSIONS = 100_000  # versions listed (the newest); an older one opens as `|ocdbt:@vN/`
MANIFEST_BYTES = 16 << 20  # encoded or decoded: 65,536 inline versions take under 4 MiB
NODE_CAP_FLOOR = 16 << 20
VERSION_NAME = re.compile(r"v([1-9][0-9]{0,19})\Z")
TIME_NAME = re.compile(r"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(\.\d{1,9})?Z\Z")


@dataclass(frozen=True)
class VersionSpec:
    """A version as Neuroglancer names it: `v12` (a generation) or `2024-12-31T10:23:45Z` (the newest
    version committed at or before that time)."""

    generation: int | None = None
    time_ns: int | None = None

    @classmethod
    def parse(cls, text: str) -> "VersionSpec":
        m = VERSION_NAME.match(text)
        if m:
            value = int(m.group(1))
            if value >= 1 << 64:
                raise ConfigError(f"OCDBT version {text!r}: generation number out of range")
            return cls(generation=value)
        m = TIME_NAME.match(text)
        if m:
            try:
                when = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
            except ValueError:
                raise ConfigError(f"OCDBT version {text!r} is not a valid time") from None
            fraction = (m.group(2) or ".")[1:].ljust(9, "0")
            seconds = int((when - datetime(1970, 1, 1, tzinfo=timezone.utc)).total_seconds())
            return cls(time_ns=seconds * 1_000_000_000 + int(fraction))
        raise ConfigError(f"OCDBT version {text!r} is neither vN (a generation number) nor "
                          f"YYYY-MM-DDThh:mm:ss[.fffffffff]Z (a commit time)")

    def __str__(self) -> str:
        return f"v{self.generation}" if self.generation is not None else iso_time(self.time_ns or 0)


@dataclass(frozen=True)
class OcdbtOptions:
    """How a database's values are read over a remote base: values of one data file asked for at one moment
    joined across gaps of at most `gap` bytes (`--coalesce-gap`). (Scans are read ahead by the core, which
    follows them in the database's key order: `KeyOrder`.)"""

    gap: int = GAP


def version_info(v: Version, latest: bool) -> VersionInfo:
    return VersionInfo(f"v{v.generation}", v.commit_time_ns, v.num_keys, v.indirect_bytes + v.tree_bytes, latest)


class OcdbtStore:
    """One database: under `root` (a '/'-terminated prefix of `inner`, or '')."""

    def __init__(self, inner: ByteSource, root: str = "", limits: DataLimits | None = None,
                 description: str | None = None, node_cache: int = NODE_CACHE,
                 options: OcdbtOptions | None = None) -> None:
        self.inner = inner
        self.options = options or OcdbtOptions()
        self.root = root
        self.limits = limits or DataLimits()
        self.description = description or f"{inner.description.rstrip('/')}/{root}".rstrip("/") + "|ocdbt:"
        self.manifest: Manifest | None = None
        self.nodes: BoundedMap[tuple[str, object], Any] = BoundedMap(node_cache, getsizeof=payload_size)
        # Recent key lookups of every version, by (generation, key): what a chunk read asks again right after
        # its stat, answered without walking the tree.
        self.lookups: BoundedMap[Any, Any] = BoundedMap(LOOKUPS)
        self.flights = Flights()
        # The version of each data file its values are read at (a key's stat takes its data file's pin).
        self.pins = Pins(inner)
        # Value reads of one moment, per data file (and the version they are held to).
        self.values: RangeReads[Pin | str] = RangeReads(self._read_data, self.options.gap)
        self._versions: list[Version] | None = None
        self.counters = {"node_reads": 0, "node_bytes": 0, "value_reads": 0, "value_bytes": 0, "manifest_reads": 0,
                         "node_cache_dir_hits": 0}

    # -- manifest and versions ----------------------------------------------------------

    async def open(self) -> Manifest:
        """Read the manifest (the newest numbered one for a numbered database); ConfigError when unusable."""
        try:
            manifest = await self._manifest(MANIFEST)
            if manifest is None:
                raise ConfigError(f"{self.description}: no {MANIFEST} under {self.inner.description}"
                                  f"{'/' + self.root if self.root else ''} (not an OCDBT database)")
            if manifest.config.manifest_kind == MANIFEST_NUMBERED:
                manifest = await self._numbered()
        except DataError as e:
            raise ConfigError(f"{self.description}: {e.reason} ({e.where})") from None
        except SourceError as e:
            raise ConfigError(f"{self.description}: {e}") from None
        self.manifest = manifest
        return manifest

    async def _manifest(self, name: str) -> Manifest | None:
        """The manifest `name` (None when absent): one request over a remote base (`read_whole`: its size
        comes with its bytes), a stat and a read otherwise."""
        cap = min(self.limits.index_bytes, MANIFEST_BYTES)

        def check(size: int) -> None:
            if size > cap:
                raise DataError(name, f"manifest of {size:,} bytes exceeds the {cap >> 20} MiB limit")

        data = await read_whole(self.inner, self.root + name, name, check, index=True)
        if data is None:
            return None
        self.counters["manifest_reads"] += 1
        return decode_manifest(data, name, cap)

    async def _numbered(self) -> Manifest:
        if not self.inner.listable:
            raise ConfigError(f"{self.description}: a database with numbered manifests needs a base that can "
                              f"list (gs://, s3://, a local directory); plain HTTP cannot")
        newest = 0
        async for name, st in self.inner.list(self.root.rstrip("/")):
            generation = numbered_manifest_name(name)
            if generation is not None and not st.is_dir:
                newest = max(newest, generation)
        if not newest:
            raise ConfigError(f"{self.description}: numbered manifests announced but none present")
        name = f"manifest.{newest:016x}"
        manifest = await self._manifest(name)
        if manifest is None:
            raise ConfigError(f"{self.description}: {name} vanished while being read")
        if manifest.config.manifest_kind != MANIFEST_SINGLE or not manifest.versions:
            raise DataError(name, "a numbered manifest must hold its versions")
        if manifest.latest.generation != newest:
            raise DataError(name, f"holds generation {manifest.latest.generation}, its name says {newest}")
        return manifest

    async def versions(self) -> list[Version]:
        """Every version (the newest `MAX_VERSIONS`), oldest first; the version tree is read once."""
        if self._versions is None:
            assert self.manifest is not None
            found: list[Version] = list(reversed(self.manifest.versions))
            # Newest first, so a bound keeps the newest.
            for ref in self.manifest.nodes[::-1]:
                await self._collect(ref, found)
            found.reverse()
            self._versions = found
        return self._versions

    async def _collect(self, ref: VersionNodeRef, out: list[Version]) -> None:
        if len(out) >= MAX_VERSIONS:
            log_once(log, f"ocdbt:{self.description}:versions", "%s: more than %s versions; only the newest are "
                     "listed and shown", self.description, f"{MAX_VERSIONS:,}")
            return
        node = await self._version_node(ref)
        if node.height == 0:
            out.extend(reversed(node.versions))
        else:
            for child in node.children[::-1]:
                await self._collect(child, out)

    async def _version_node(self, ref: VersionNodeRef) -> VersionNode:
        assert self.manifest is not None
        arity = self.manifest.config.arity_log2
        where = self._where(ref.location)

        async def load() -> VersionNode:
            data = await self._read_node(ref.location)
            return decode_version_node(data, where, self.node_cap, ref.location.file.transitive, arity)

        node: VersionNode = await self.flights.cached(self.nodes, ("v", ref.location.identity), load)
        # On every use (a node reached twice comes from the cache): heights fall by one per level, so the
        # version tree cannot loop.
        if node.height != ref.height:
            raise DataError(where, f"version node of height {node.height} where {ref.height} is expected")
        gens = [v.generation for v in node.versions] or [c.generation for c in node.children]
        if gens[-1] != ref.generation:
            raise DataError(where, f"version node ends at generation {gens[-1]}, its parent says {ref.generation}")
        return node

    async def find(self, spec: VersionSpec | None) -> Version:
        """The version `spec` names (None: the newest); ConfigError naming it when there is none.

        One path down the version tree: a generation is under the first reference whose newest generation
        is not below it, a time under the last reference whose oldest commit is not after it."""
        assert self.manifest is not None
        latest = self.manifest.latest
        if spec is None:
            return latest
        try:
            found = await self._find(spec)
        except DataError as e:
            raise ConfigError(f"{self.description}: version tree is damaged: {e}") from None
        if found is None:
            raise ConfigError(f"{self.description}: no version {spec} (versions v1..v{latest.generation} "
                              f"may exist; older ones may have been removed)")
        return found

    async def _find(self, spec: VersionSpec) -> Version | None:
        assert self.manifest is not None
        versions, refs = self.manifest.versions, self.manifest.nodes
        while True:
            if versions and self._within(spec, versions[0]):
                return self._pick(spec, versions)
            if spec.generation is not None:
                ref = next((r for r in refs if r.generation >= spec.generation), None)
            else:
                assert spec.time_ns is not None
                ref = next((r for r in reversed(refs) if r.commit_time_ns <= spec.time_ns), None)
            if ref is None:
                return None
            node = await self._version_node(ref)
            versions, refs = node.versions, node.children

    @staticmethod
    def _within(spec: VersionSpec, first: Version) -> bool:
        """Whether what `spec` names lies at or after `first` (so among the versions starting with it)."""
        if spec.generation is not None:
            return spec.generation >= first.generation
        assert spec.time_ns is not None
        return spec.time_ns >= first.commit_time_ns

    @staticmethod
    def _pick(spec: VersionSpec, versions: list[Version]) -> Version | None:
        if spec.generation is not None:
            return next((v for v in versions if v.generation == spec.generation), None)
        assert spec.time_ns is not None
        return next((v for v in reversed(versions) if v.commit_time_ns <= spec.time_ns), None)

    # -- nodes and values -------------------------------------------------------------

    @property
    def node_cap(self) -> int:
        """The most a node's body may decode to: a few times the node size the database's configuration
        declares (TensorStore stays below it), and never beyond `--max-index-size`; a bomb stops here."""
        declared = self.manifest.config.max_decoded_node_bytes if self.manifest is not None else 0
        return min(self.limits.index_bytes, max(4 * declared, NODE_CAP_FLOOR))

    def _where(self, location: Location) -> str:
        return f"{self.description}{location.file.path}@{location.offset}+{location.length}"

    async def _read_node(self, location: Location) -> bytes:
        """An encoded node's bytes: from `--cache-dir` when it has them (data files are written once, under
        random names, so their bytes need no version; the node's checksum guards what comes back), else
        one ranged read of its data file (kept in `--cache-dir` then)."""
        where = self._where(location)
        self.limits.check_index(location.length, where)
        path = self.root + location.file.path
        kept = self.inner.index_cache
        identity = ("ocdbt-node", self.inner.description, path, location.offset, location.length)
        if kept is not None:
            hit = kept.get(identity)
            if hit is not None and len(hit) == location.length:
                self.counters["node_cache_dir_hits"] += 1
                return hit
        data = await self.inner.read_index(path, location.offset, location.length)
        self.counters["node_reads"] += 1
        self.counters["node_bytes"] += len(data)
        if len(data) != location.length:
            raise DataError(where, f"data file ends {location.length - len(data):,} bytes early (truncated)")
        if kept is not None:
            kept.put(identity, data)
        return data

    async def btree_node(self, location: Location, height: int) -> BtreeNode:
        """The B+tree node at `location`, which its parent says has height `height` (checked)."""

        async def load() -> BtreeNode:
            data = await self._read_node(location)
            return decode_btree_node(data, self._where(location), self.node_cap, location.file.transitive,
                                     self.node_cap)

        found: BtreeNode = await self.flights.cached(self.nodes, ("b", location.identity), load)
        # Checked on every use, not only the first: a node reached again as its own descendant (a cycle)
        # comes from the cache.
        if found.height != height:
            raise DataError(self._where(location), f"B+tree node of height {found.height} where {height} is "
                                                   f"expected (a cycle, or a misplaced node)")
        return found

    def pin(self, location: Location) -> Pin:
        """The pin of the data file holding the value at `location` (what a key's stat hands its file)."""
        return self.pins.pin(self.root + location.file.path)

    async def read_value(self, location: Location, offset: int, size: int, index: bool, pin: Pin | None = None
                         ) -> bytes:
        """Bytes [offset, offset+size) of an out-of-line value; through `pin` (its data file's, from the key's
        stat), held to the data file's version that pin's first read met. Over a remote base, values of one
        data file read at the same moment (neighbouring keys a writer stored side by side) go out as one
        ranged read (`RangeReads`); a local base reads each directly, and so do index reads a disk cache keeps
        (kept by their exact range, which a joined read would change from one mount to the next)."""
        size = max(0, min(size, location.length - offset))
        if size == 0:
            return b""
        obj: Pin | str = pin if pin is not None else self.root + location.file.path
        start = location.offset + offset
        if self.inner.remote and not (index and self.inner.index_cache is not None):
            data = await self.values.read(obj, start, size, index)
        else:
            data = await self._read_data(obj, start, size, index)
        if len(data) != size:
            raise DataError(self._where(location), "data file ends inside the value (truncated)")
        return data

    async def _read_data(self, obj: Pin | str, offset: int, size: int, index: bool) -> bytes:
        if isinstance(obj, Pin):
            data = await self.pins.read(obj, offset, size, self.description + obj.path[len(self.root):], index)
        else:
            read = self.inner.read_index if index else self.inner.read
            data = await read(obj, offset, size)
        self.counters["value_reads"] += 1
        self.counters["value_bytes"] += len(data)
        return data


def _relative(key: bytes, prefix: bytes) -> bytes | None:
    """`key` relative to a subtree whose keys all start with `prefix`: b'' when every key of the subtree is
    at least `key`, None when none is."""
    if key.startswith(prefix):
        return key[len(prefix):]
    return b"" if key < prefix else None


Leaf = tuple[BtreeNode, bytes, int, tuple[str, int, int]]


@dataclass(frozen=True, slots=True)
class Found:
    key: bytes
    value: Value
    node: tuple[str, int, int]  # the leaf holding it (what identifies an inline value's bytes)
    index: int  # its entry in that leaf


class OcdbtSource:
    """The keys of one version of `store` under `prefix` (a '/'-terminated key prefix, or '') as paths.

    Implements the `VersionedSource` capability too: `versions()` and `open_version(name)` answer for
    the whole database (the same store, so every version shares its node cache)."""

    listable = True

    def __init__(self, store: OcdbtStore, version: Version, prefix: str = "", pinned: bool = False,
                 owns_inner: bool = True) -> None:
        self.store = store
        self.owns_inner = owns_inner  # a version opened beside another leaves the shared base open
        # The base, for whoever walks a source stack (the mount's check that it never reads itself: the
        # data file paths a database names may lie anywhere beneath its directory).
        self.inner = store.inner
        self.version = version
        self.prefix = prefix.encode()
        self.pinned = pinned  # the pipeline named this version (no other versions are shown beside it)
        self.remote = store.inner.remote
        self.index_cache: IndexCache | None = store.inner.index_cache
        shown = f"@v{version.generation}/" if pinned else ""
        self.description = f"{store.description}{shown}{prefix}"
        if version.root_height > MAX_HEIGHT:
            raise ConfigError(f"{self.description}: B+tree of height {version.root_height} (at most {MAX_HEIGHT} "
                              f"is believable)")

    # -- the B+tree walk ---------------------------------------------------------------

    async def _first(self, key: bytes, skip: bool = False) -> Leaf | None:
        """The leaf holding the first entry at or after `key`, its key prefix, the entry's index and
        where the leaf is. `skip`: a damaged subtree below the root is passed over (logged), for listings,
        which then show every key still readable; lookups fail on damage instead."""
        v = self.version
        if v.root is None:
            return None
        return await self._descend(v.root, v.root_height, b"", key, None, skip)

    async def _descend(self, location: Location, height: int, prefix: bytes, key: bytes, low: bytes | None,
                       skip: bool = False) -> Leaf | None:
        node = await self.store.btree_node(location, height)
        if low is not None and prefix + node.keys[0] < low:
            raise DataError(self.store._where(location), "first key lies below the bound its parent gives")
        rel = _relative(key, prefix)
        if rel is None:
            return None
        if height == 0:
            i = node.keys.bisect_left(rel)
            return (node, prefix, i, location.identity) if i < len(node.keys) else None
        i = max(0, node.keys.bisect_right(rel) - 1)
        for j in range(i, len(node)):
            child = node.child(j)
            try:
                found = await self._descend(child.location, height - 1, prefix + child.key[:child.common], key,
                                            prefix + child.key, skip)
            except (DataError, SourceError) as e:
                if not skip:
                    raise
                log_once(log, f"ocdbt:{self.store.description}:skipped", "%s: keys from %r on are not listed: %s "
                         "(further damaged subtrees are not logged)", self.description,
                         (prefix + child.key)[:200], e)
                continue
            if found is not None:
                return found
        return None

    async def _scan(self, start: bytes) -> AsyncGenerator[tuple[Found, BtreeNode, bytes], None]:
        """Entries from `start` on, in key order (damaged subtrees passed over), each with its leaf and the
        leaf's key prefix: one descent per leaf."""
        key = start
        while True:
            found = await self._first(key, skip=True)
            if found is None:
                return
            node, prefix, i, identity = found
            for j in range(i, len(node.keys)):
                yield Found(prefix + node.keys[j], node.value(j), identity, j), node, prefix
            key = prefix + node.keys[-1] + b"\0"

    async def _leaf_has_under(self, below: bytes, node: BtreeNode, prefix: bytes, skip: bool = False) -> bool:
        """Whether keys start with `below`, answered from a leaf at or before where they would be (its keys
        under `prefix`) unless they would lie past its end."""
        rel = _relative(below, prefix)
        if rel is not None:
            j = node.keys.bisect_left(rel)
            if j < len(node.keys):
                return (prefix + node.keys[j]).startswith(below)
        return await self._has_under(below, skip)

    async def _entry(self, key: bytes) -> tuple[Found | None, bool]:
        """The entry of `key` (None: no such key) and whether keys lie under `key/` (a directory, which
        shadows the entry): one descent, and kept for the read that follows a stat."""
        known = (self.version.generation, key)
        hit = self.store.lookups.get(known, _ABSENT)
        if hit is not _ABSENT:
            result: tuple[Found | None, bool] = hit  # type: ignore[assignment]  # what this map holds
            return result
        first = await self._first(key)
        found, is_dir = None, False
        if first is not None:
            node, prefix, i, identity = first
            if prefix + node.keys[i] == key:
                found = Found(key, node.value(i), identity, i)
            is_dir = await self._leaf_has_under(key + b"/", node, prefix)
        result = (found, is_dir)
        self.store.lookups[known] = result
        return result

    async def _has_under(self, key: bytes, skip: bool = False) -> bool:
        first = await self._first(key, skip)
        if first is None:
            return False
        node, prefix, i, _ = first
        return (prefix + node.keys[i]).startswith(key)

    # -- paths ------------------------------------------------------------------------

    def _key(self, path: str) -> bytes:
        return self.prefix + path.encode()

    def _stat(self, found: Found) -> ObjectStat:
        """A key's stat; an out-of-line value's version carries its data file's pin (reads of the file are
        held to the data file's version the pin's first read meets)."""
        value = found.value
        if value.location is None:
            return ObjectStat(value.size, self.version.commit_time_ns, False, ("ocdbt", (found.node, found.key)))
        location = value.location
        return ObjectStat(value.size, self.version.commit_time_ns, False,
                          ("ocdbt", location.identity, self.store.pin(location)))

    def _dir(self) -> ObjectStat:
        return ObjectStat(0, self.version.commit_time_ns, True, ())

    async def stat(self, path: str) -> ObjectStat | None:
        if not path:
            return self._dir()
        if _path_problem(path):
            return None
        found, is_dir = await self._entry(self._key(path))
        if is_dir:
            return self._dir()
        return self._stat(found) if found is not None else None

    async def stat_dir(self, path: str) -> ObjectStat | None:
        st = await self.stat(path)
        return st if st is not None and st.is_dir else None

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        if path and _path_problem(path):
            return
        base = self._key(path) + b"/" if path else self.prefix
        start = base
        while True:
            restart: bytes | None = None
            # Closed here, not by the garbage collector, when the listing leaves the scan early.
            async with aclosing(self._scan(start)) as entries:
                async for found, leaf, prefix in entries:
                    if not found.key.startswith(base):
                        return
                    rest = found.key[len(base):]
                    child, slash, _ = rest.partition(b"/")
                    name = _name(child, found.key, self.store.description)
                    if slash:
                        if name is not None:
                            yield name, self._dir()
                        restart = base + child + b"0"  # past every key under base/child/ ('0' follows '/')
                        break
                    if name is None:
                        continue
                    if await self._leaf_has_under(found.key + b"/", leaf, prefix, skip=True):
                        log_once(log, f"ocdbt:{self.store.description}:shadow", "%s: key %r is also a directory; "
                                 "the directory is shown (further such keys are not logged)",
                                 self.store.description, found.key[:200])
                        continue
                    yield name, self._stat(found)
            if restart is None:
                return
            start = restart

    async def _found(self, path: str) -> Found:
        found, is_dir = await self._entry(self._key(path)) if not _path_problem(path) else (None, False)
        if found is None or is_dir:
            raise SourceError(f"{self.description}: no key {path!r}")
        return found

    async def _read(self, path: str, offset: int, size: int, index: bool, pin: Pin | None) -> bytes:
        found = await self._found(path)
        value = found.value
        if value.data is not None:
            return value.data[offset:offset + max(size, 0)]
        location = value.location
        assert location is not None
        if pin is not None and pin.path != self.store.root + location.file.path:
            raise StaleError(path, "the key names another data file than when it was looked up")
        return await self.store.read_value(location, offset, size, index, pin)

    async def read(self, path: str, offset: int, size: int, version: ObjectVersion | None = None) -> bytes:
        return await self._read(path, offset, size, False, _pin_of(version))

    async def read_index(self, path: str, offset: int, size: int, version: ObjectVersion | None = None) -> bytes:
        return await self._read(path, offset, size, True, _pin_of(version))

    def key_order(self) -> bool:
        return True  # (`KeyOrder`: the B+tree)

    async def keys_after(self, path: str, n: int) -> builtins.list[tuple[str, ObjectStat]]:
        out: builtins.list[tuple[str, ObjectStat]] = []
        if not path or _path_problem(path) or n <= 0:
            return out
        async with aclosing(self._scan(self._key(path) + b"\0")) as entries:
            async for found, _leaf, _prefix in entries:
                if not found.key.startswith(self.prefix):
                    break
                try:
                    name = found.key[len(self.prefix):].decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if not name or _path_problem(name):
                    continue
                out.append((name, self._stat(found)))
                if len(out) >= n:
                    break
        return out

    async def aclose(self) -> None:
        if self.owns_inner:
            await self.store.inner.aclose()

    def stats(self) -> dict[str, object]:
        nodes = self.store.nodes
        return {**self.store.inner.stats(), "ocdbt": {
            **self.store.counters, "value_ranges": self.store.values.counters.asked,
            "value_gap_bytes": self.store.values.counters.gap_bytes, "node_cache_bytes": int(nodes.currsize),
            "node_cache_entries": len(nodes), "node_cache_hits": nodes.hits, "node_cache_misses": nodes.misses}}

    # -- the VersionedSource capability -----------------------------------------------

    @property
    def current(self) -> str:
        return f"v{self.version.generation}"

    async def versions(self) -> builtins.list[VersionInfo]:
        found = await self.store.versions()
        latest = self.store.manifest.latest.generation if self.store.manifest else 0
        return [version_info(v, v.generation == latest) for v in found]

    async def open_version(self, name: str) -> ByteSource | None:
        """The source of version `name` (`v12`) over the same key prefix, or None when there is none."""
        m = VERSION_NAME.match(name)
        if m is None or int(m.group(1)) >= 1 << 64:
            return None
        try:
            version = await self.store.find(VersionSpec(generation=int(m.group(1))))
        except ConfigError:
            return None
        return OcdbtSource(self.store, version, self.prefix.decode(), pinned=True, owns_inner=False)


_ABSENT = object()


def _pin_of(version: ObjectVersion | None) -> Pin | None:
    """The data file's pin a key's version (`OcdbtSource._stat`) carries; None for an inline value, or
    a read made without a version (which reads whatever the data file holds now)."""
    if version is not None and len(version) == 3 and isinstance(version[2], Pin):
        return version[2]
    return None


def _path_problem(path: str) -> bool:
    return any(name_problem(segment) is not None for segment in path.split("/"))


def _name(raw: bytes, key: bytes, where: str) -> str | None:
    """`raw` as one path segment, or None (logged once) when a key holding it cannot be a path."""
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        name = None
    problem = "is not UTF-8" if name is None else name_problem(name)
    if problem is None:
        return name
    log_once(log, f"ocdbt:{where}:key", "%s: key %r is not shown: %s (further such keys are not logged)", where,
             key[:200], problem)
    return None


async def open_ocdbt(inner: ByteSource, root: str, path: str, version: str | None, limits: DataLimits | None,
                     description: str | None = None, options: OcdbtOptions | None = None) -> OcdbtSource:
    """The source `BASE|ocdbt:[@VERSION/][PATH]` names: the database under `root` of `inner`.

    ConfigError (one line) when there is no database, its manifest is damaged, or the version does not exist."""
    prefix = path.strip("/")
    if prefix and _path_problem(prefix):
        raise ConfigError(f"ocdbt:{path}: a key prefix of empty, '.' or '..' segments is not allowed")
    spec = VersionSpec.parse(version) if version is not None else None
    store = OcdbtStore(inner, root, limits, description, options=options)
    await store.open()
    chosen = await store.find(spec)
    return OcdbtSource(store, chosen, prefix + "/" if prefix else "", pinned=spec is not None)
