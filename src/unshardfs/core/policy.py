"""The core's fixed tuning in one place: how chunk files are read and listed, and how read-ahead
recognises a scan. (What a user tunes is in `FetchPolicy`, `DataLimits` and the cache sizes.)"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CorePolicy:
    # Over the network a payload up to this size is fetched whole, once, instead
    # of in the kernel's 128 KiB pieces (each a round trip); read-ahead prefetches
    # only payloads a reader would fetch whole.
    whole_read_max: int = 1 << 20
    list_batch: int = 4096  # entries per listing batch (per-batch costs spread over enough entries)
    # Read-ahead (see readahead.py):
    max_streams: int = 16  # scans tracked per directory at once
    # Chunks prefetched ahead of a newly confirmed stream: at 20 ms per request and well under a
    # millisecond per chunk file, 8 were read before a refill arrived (a stall per doubling).
    first_window: int = 32
    # ... and of a stream confirmed by several readers' reads together (readahead.py: joint
    # readers), who read as many times as fast: 8 readers of 4 KiB files read about a hundred
    # chunks per 20 ms round trip, and outran a first window of 32 before its refill arrived.
    joint_window: int = 128
    # Chunks prefetched at once, before a scan is confirmed, when a read opens a listing at its
    # first entry (in listing order): the scan's second read then joins that prefetch instead of
    # costing a round trip of its own; a tool that lists and reads one file wastes these.
    open_window: int = 8
    max_window: int = 1024  # chunks prefetched ahead of a stream at most (the byte budget is the fetcher's)
    slack: int = 8  # a read may skip this many predicted chunks and still continue a confirmed stream
    confirm: int = 2  # matches before a guess starts prefetching
    # Parallel readers walking one order together (readahead.py): a guess is also confirmed when
    # joint_confirm of the joint_reads reads after its first are of distinct chunks among the
    # joint_span that follow it, and a stream counts reads up to `behind` chunks behind its
    # furthest one.
    joint_span: int = 16
    joint_confirm: int = 5
    joint_reads: int = 8
    behind: int = 32
    # A read follows in an order when the chunk before it there was among the last `recent` reads
    # (one reader among a few dozen reading at once). Readers each walking their own run of one
    # order (`xargs -P 8 -n 16`) confirm a scan once `spread_confirm` of them, near each other,
    # have each been followed `spread_follows` times.
    recent: int = 64
    spread_confirm: int = 3
    spread_follows: int = 3
    # Index tables (a shard's stat and index, a minishard index) read at once ahead of a scan's
    # windows, per directory: each is a chain of requests, and the windows go on past the chunks
    # they hold meanwhile (formats with hashed shards meet dozens of tables in one window).
    opens_max: int = 64
    # Listed entries remembered (listing order; id order over sparse ids; the chunks in a
    # prefetch's gaps): about 50 bytes each at most.
    listed_ids_max: int = 1 << 20


POLICY = CorePolicy()
