"""Files of a packed store held to one version of the object their bytes lie in.

An OCDBT value lies in a data file, an Icechunk chunk in a chunk object or in
the file a virtual reference names. Those objects are written once by the
formats' own rules, but a copy of an updated store made over an old one (`cp`,
`rsync --inplace`) rewrites them under a running mount. A file of such a store
read in pieces (a reader's 128 KiB reads of a 1 MiB chunk) must then give the
old bytes, the new bytes or an error, never the old head and the new tail.

A `Pin` names one backing object and, once its first read has happened, the
version that read came from; every later read through it is made with that
version, so a changed object fails it with `StaleError`. A file takes its pin
with its stat (`Pins.pin`: no I/O, the same pin for every file of the object,
so their versions compare equal and caches keyed on them hold) and keeps it. A
read that finds the object changed retires the pin it used: files looked up
afterwards get a new pin, of a new generation (it compares unequal to the old
one, so nothing cached under the old one is served under it), held to the new
version. A pin that `Pins` forgets (its bound reached) is retired the same way,
so two pins of one generation are always one pin, with one version learnt.

The version is learnt without a request of its own where the source's answer
names it (`VersionedRead`: an HTTP answer's ETag and size); else by a stat made
before the first read (a local file's: one system call).
"""

from __future__ import annotations

import itertools

from unshardfs.sources.base import ByteSource, Version, VersionedRead
from unshardfs.util.errors import DataError, StaleError
from unshardfs.util.maps import BoundedMap

PINS = 1 << 16  # pins handed out again to the files stat'ed next (the ones used longest ago retired past this)


class Pin:
    """One backing object (`path` of a source) in one `generation`, and the version its first read came
    from (None before that). Equal to the pin of the same object and generation (from any source over
    the same objects: stats of two mounts agree); its repr is stable across mounts (the disk cache keys
    on reprs)."""

    __slots__ = ("path", "generation", "version")

    def __init__(self, path: str, generation: int = 0) -> None:
        self.path = path
        self.generation = generation
        self.version: Version | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pin) and other.path == self.path and other.generation == self.generation

    def __hash__(self) -> int:
        return hash((self.path, self.generation))

    def __repr__(self) -> str:
        return f"Pin({self.path!r}, {self.generation})"


class Pins:
    """The pins of one source's objects (`source`): handed out by `pin`, read through by `read`."""

    def __init__(self, source: ByteSource, size: int = PINS) -> None:
        self.source = source
        self._size = size
        self._kept: BoundedMap[str, Pin] = BoundedMap(size, counted=False, on_evict=self._forgot)
        self._generations: dict[str, int] = {}  # of objects whose pins were retired
        self._base = 0  # the generation of an object none of whose pins was (since the map above was cleared)
        self._counter = itertools.count(1)
        self._versioned = source.read_versioned if isinstance(source, VersionedRead) else None

    def pin(self, path: str) -> Pin:
        """The pin files of the object at `path` take now (no I/O)."""
        found = self._kept.get(path)
        if found is None:
            found = self._kept[path] = Pin(path, self._generations.get(path, self._base))
        return found

    def _forgot(self, path: str, _pin: Pin) -> None:
        self._retire(path)

    def _retire(self, path: str) -> None:
        """Pins of `path` handed out from now on compare unequal to every one before."""
        if len(self._generations) >= self._size:  # bounded: every object starts a generation of its own
            self._generations.clear()
            self._base = next(self._counter)
        self._generations[path] = next(self._counter)

    def drop(self, pin: Pin) -> None:
        """`pin`'s object changed: files looked up from now on take a new pin (if they do not already)."""
        if pin.generation != self._generations.get(pin.path, self._base):
            return
        if self._kept.get(pin.path) is pin:
            del self._kept[pin.path]
        self._retire(pin.path)

    async def version(self, pin: Pin, where: str) -> Version:
        """The version `pin` holds its files to, learnt by a stat if no read has yet."""
        if pin.version is None:
            st = await self.source.stat(pin.path)
            if st is None or st.is_dir:
                raise DataError(where, f"{pin.path} is missing")
            if st.refused is not None:
                raise DataError(where, f"{pin.path}: refused: {st.refused}")
            self._learnt(pin, st.version, where)
        assert pin.version is not None
        return pin.version

    def _learnt(self, pin: Pin, version: Version, where: str) -> None:
        if pin.version is None:
            pin.version = version
        elif pin.version != version:  # two first reads at once, and the object changed between them
            self.drop(pin)
            raise StaleError(where, f"{pin.path} changed while it was first read")

    async def read(self, pin: Pin, offset: int, size: int, where: str, index: bool = False) -> bytes:
        """Bytes [offset, offset+size) of `pin`'s object as of its version (shorter only where it
        ends); StaleError (the pin retired) when the object is no longer that version."""
        try:
            # (An index read goes through `read_index`, where a disk cache keeps it.)
            if pin.version is None and self._versioned is not None and not (index and self.source.index_cache is not None):
                data, told = await self._versioned(pin.path, offset, size)
                if told is not None:
                    self._learnt(pin, told, where)
                    return data
            version = await self.version(pin, where)
            read = self.source.read_index if index else self.source.read
            return await read(pin.path, offset, size, version)
        except StaleError as e:
            self.drop(pin)
            raise StaleError(where, f"{pin.path} changed after this file was looked up ({e.reason})") from None
