"""What every format of one mount shares: byte source, caches, the read path, the bounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from unshardfs.core.caches import Caches
from unshardfs.core.fetch import Fetcher, FetchPolicy
from unshardfs.sources.base import ByteSource
from unshardfs.util.limits import DataLimits


@dataclass
class Runtime:
    source: ByteSource
    caches: Caches = field(default_factory=Caches)
    limits: DataLimits = field(default_factory=DataLimits)
    policy: FetchPolicy | None = None
    # Which shards listings show, by (directory label, shard token): a part of a
    # check/export split over workers lists (and so reads) only its own shards.
    shard_filter: Callable[[str, str], bool] | None = None
    fetcher: Fetcher = field(init=False)

    def __post_init__(self) -> None:
        self.fetcher = Fetcher(self.source, self.policy)

    def stats(self) -> dict[str, object]:
        return {"fetch": self.fetcher.stats()}
