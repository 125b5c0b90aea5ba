"""What every format of one mount shares: byte source, caches, the read path, the bounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from unshardfs.core.caches import Caches
from unshardfs.core.fetch import Fetcher, FetchPolicy
from unshardfs.core.filescan import ScannedFiles
from unshardfs.sources.base import ByteSource
from unshardfs.util.limits import DataLimits


@dataclass
class Runtime:
    source: ByteSource
    caches: Caches = field(default_factory=Caches)
    limits: DataLimits = field(default_factory=DataLimits)
    policy: FetchPolicy | None = None
    # The runtime of the tree this one's dataset is part of (`beside`): its fetcher's bounds and its
    # shard scope are this one's.
    leader: "Runtime | None" = None
    fetcher: Fetcher = field(init=False)

    # What the fetcher reads, when not `source` (a layer over it reading files ahead: `beside`).
    fetched: ByteSource | None = None

    def __post_init__(self) -> None:
        self._scope: ShardScope | None = None
        if self.leader is not None:
            self.fetcher = Fetcher(self.fetched or self.source, self.policy, self.leader.fetcher)
            return  # files shown as stored are read ahead by the leader's source, which `source` reads
        self.fetcher = Fetcher(self.source, self.policy)
        if self.fetcher.policy.read_ahead and self.source.remote and self.source.listable:
            # Files shown as they are stored are read ahead of scans too (`core/filescan.py`); the
            # fetcher reads from the source below.
            self.source = ScannedFiles(self.source, self.fetcher)

    @property
    def shard_scope(self) -> "ShardScope | None":
        """Which shards chunk listings read (None: every shard the store lists). A planned
        check/export records them once, and each task lists only its own."""
        return self._scope if self.leader is None else self.leader.shard_scope

    @shard_scope.setter
    def shard_scope(self, scope: "ShardScope | None") -> None:
        self._scope = scope

    def beside(self, source: ByteSource, fetched: ByteSource | None = None) -> "Runtime":
        """The runtime of another dataset read through this one's sources (a directory of a tree of
        datasets): the same caches and bounds, its reads within this one's fetcher's, and this one's
        shard scope. `source` is what its format reads (a layer over this one's `source`), `fetched`
        what its fetcher reads (a layer over this one's fetcher's source; default: `source`)."""
        return Runtime(source, self.caches, self.limits, self.policy, self, fetched)

    def stats(self) -> dict[str, object]:
        return {"fetch": self.fetcher.stats()}


class ShardScope:
    """Which shards the chunk listings of one opened source read, for a planned check or export.

    Planning (`planning=True`): a listing enumerates its store's shards (the
    store's own listing of its directory, once) and records each as
    (`where`, store label, shard handle) without reading any index, and
    shows no chunk. A task (`planning=False`): a listing reads only the shards
    `give` handed it for that store, without listing the directory at all;
    a store it was given nothing for shows no chunk.
    """

    def __init__(self, planning: bool) -> None:
        self.planning = planning
        self.where = ""  # planning: the tree path of the directory being listed
        self.recorded: list[tuple[str, str, Hashable]] = []
        self.sizes: list[int | None] = []  # the bytes of each recorded shard, where finding it told them
        self._seen: set[tuple[str, str, str]] = set()
        self._given: dict[str, tuple[Hashable, ...]] = {}
        self._held: dict[str, frozenset[Hashable]] = {}

    def record(self, label: str, token: str, shard: Hashable, size: int | None = None) -> None:
        """A shard the listing of `where` reads (once per directory, however often it is listed), and
        its bytes if known."""
        key = (self.where, label, token)
        if key not in self._seen:
            self._seen.add(key)
            self.recorded.append((self.where, label, shard))
            self.sizes.append(size)

    def give(self, label: str, shards: tuple[Hashable, ...]) -> None:
        """The shards listings of the store `label` read from now on (the others: none)."""
        self._given = {label: shards}
        self._held = {label: frozenset(shards)}

    def given(self, label: str) -> tuple[Hashable, ...]:
        return self._given.get(label, ())

    def holds(self, label: str, shard: Hashable | None) -> bool:
        """Whether `shard` of the store `label` is one this task was given (read-ahead reads no other)."""
        held = self._held.get(label)
        return held is not None and shard in held
