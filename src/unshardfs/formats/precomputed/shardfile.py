"""Reading one sharded directory: shard files, their indexes, and chunk byte ranges.

Every offset and length taken from an index is checked against the real size
of the shard before any data byte is served; a check that fails raises
`DataError` for that chunk (or that minishard) only, so the rest of the
dataset stays readable.
"""

from __future__ import annotations

import gzip
import logging
import zlib
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np

from ...caches import Caches
from ...errors import DataError
from ...logonce import log_once
from ...sources.base import ByteSource, join_key
from ...sources.blob import Blob
from ...concurrency import gather
from .sharding import ShardingSpec

log = logging.getLogger(__name__)

U64 = np.uint64
PROBE_BATCH = 256  # shard existence probes in flight at once, on sources that cannot list


@dataclass(frozen=True, slots=True)
class Shard(Blob):
    """One shard as it exists now: the current `.shard` file or an obsolete
    `.index` + `.data` pair, read as their concatenation."""

    number: int


@dataclass(frozen=True, slots=True)
class MinishardIndex:
    """A decoded minishard index: sorted unique chunk ids and their byte ranges.

    Offsets are absolute within the logical shard and already validated.
    Entries whose range was invalid are kept out of `ids` and listed in
    `bad` with the reason, so lookups of them fail loudly instead of
    pretending the chunk is absent.
    """

    ids: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    bad: dict[int, str]

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.starts.nbytes + self.sizes.nbytes + 64 * len(self.bad)

    @staticmethod
    def concat(parts: list["MinishardIndex"]) -> "MinishardIndex":
        """Several minishards as one (for listing; lookups need each one sorted)."""
        if len(parts) == 1:
            return parts[0]
        return MinishardIndex(np.concatenate([p.ids for p in parts]), np.concatenate([p.starts for p in parts]),
                              np.concatenate([p.sizes for p in parts]), {})

    def find(self, chunk_id: int) -> tuple[int, int] | None:
        i = int(np.searchsorted(self.ids, U64(chunk_id)))
        if i < len(self.ids) and int(self.ids[i]) == chunk_id:
            return int(self.starts[i]), int(self.sizes[i])
        return None


EMPTY_MINISHARD = MinishardIndex(
    np.zeros(0, dtype=U64), np.zeros(0, dtype=U64), np.zeros(0, dtype=U64), {}
)


def gunzip(data: bytes, where: str) -> bytes:
    """Decompress a gzip member chain, verifying framing, CRC32 and ISIZE."""
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(where, f"bad gzip data: {e}") from e


def decode_minishard(raw: bytes, shard_index_size: int, shard_size: int, where: str) -> MinishardIndex:
    """Turn the [3, n] delta-encoded uint64 array into validated absolute ranges."""
    if len(raw) % 24:
        raise DataError(where, f"minishard index length {len(raw)} is not a multiple of 24")
    n = len(raw) // 24
    if n == 0:
        return EMPTY_MINISHARD
    arr = np.frombuffer(raw, dtype="<u8").reshape(3, n).astype(U64)
    # All of the format's arithmetic is modulo 2**64 (numpy's uint64 cumsum
    # and addition wrap silently); validation below rejects whatever lands
    # outside the shard.
    ids = np.cumsum(arr[0], dtype=U64)
    # A copy, not a view: a view would keep the whole [3, n] array alive
    # behind the cache's back (its byte accounting counts only what it holds).
    sizes = arr[2].copy()
    ends = U64(shard_index_size) + np.cumsum(arr[1] + sizes, dtype=U64)
    starts = ends - sizes
    ok = (ends >= starts) & (starts >= U64(shard_index_size)) & (ends <= U64(shard_size))
    in_order = n == 1 or bool((ids[1:] > ids[:-1]).all())  # the usual case: writers sort ids
    if in_order:
        keep = np.arange(n)
    else:
        # Sort for binary search; on duplicate ids the first entry wins, as
        # a sequential reader of the index would find it.
        order = np.argsort(ids, kind="stable")
        uniq, first = np.unique(ids[order], return_index=True)
        if len(uniq) != n:
            log_once(log, f"dup:{where}", "%s: minishard index lists %d duplicate chunk ids; using the first of each",
                     where, n - len(uniq))
        keep = order[first]
    bad: dict[int, str] = {}
    if not ok.all():
        for i in keep[~ok[keep]][:1000]:
            bad[int(ids[i])] = (
                f"chunk range [{int(starts[i])}, +{int(sizes[i])}) lies outside the shard data "
                f"[{shard_index_size}, {shard_size})"
            )
        keep = keep[ok[keep]]
    elif in_order:
        return MinishardIndex(ids, starts, sizes, bad)
    return MinishardIndex(ids[keep], starts[keep], sizes[keep], bad)


class ShardedStore:
    """The chunks of one sharded directory, by chunk id."""

    def __init__(self, source: ByteSource, dir_key: str, spec: ShardingSpec, caches: Caches) -> None:
        self.source = source
        self.dir_key = dir_key
        self.spec = spec
        self.caches = caches

    # -- shard files -------------------------------------------------------

    async def shard(self, number: int) -> Shard | None:
        """The shard's current backing files, or None if the shard does not exist."""
        stem = join_key(self.dir_key, self.spec.shard_name(number))
        st = await self.source.stat(stem + ".shard")
        if st is not None and not st.is_dir:
            return Shard(((stem + ".shard", st.size, st.version),), st.size, st.mtime_ns, number)
        index_st = await self.source.stat(stem + ".index")
        if index_st is None or index_st.is_dir:
            return None
        data_st = await self.source.stat(stem + ".data")
        if data_st is None or data_st.is_dir:
            log_once(log, f"nodata:{stem}", "%s.index exists without %s.data: shard treated as damaged", stem, stem)
            raise DataError(stem + ".index", "obsolete-layout shard has no .data file")
        return Shard(
            ((stem + ".index", index_st.size, index_st.version), (stem + ".data", data_st.size, data_st.version)),
            index_st.size + data_st.size,
            max(index_st.mtime_ns, data_st.mtime_ns),
            number,
        )

    def shard_file(self, name: str) -> tuple[int, str] | None:
        """(shard number, extension) if `name` is a shard file of this spec, else None."""
        stem, dot, ext = name.rpartition(".")
        if not dot or ext not in ("shard", "index", "data"):
            return None
        number = self.spec.parse_shard_name(stem)
        return None if number is None else (number, ext)

    def is_shard_file(self, name: str) -> bool:
        return self.shard_file(name) is not None

    async def shard_numbers(self) -> AsyncIterator[int]:
        """Existing shards in ascending order, found by listing the directory
        (or, on a source that cannot list, by probing every shard number)."""
        if not self.source.listable:
            total = 1 << self.spec.shard_bits
            for at in range(0, total, PROBE_BATCH):
                numbers = range(at, min(at + PROBE_BATCH, total))
                found = await gather([lambda n=n: self._exists(n) for n in numbers])
                for n, ok in zip(numbers, found):
                    if ok:
                        yield n
            return
        numbers = set()
        async for name, st in self.source.list(self.dir_key):
            parsed = None if st.is_dir else self.shard_file(name)
            if parsed is not None and parsed[1] != "data":  # a .data alone is not a shard
                numbers.add(parsed[0])
        for number in sorted(numbers):
            yield number

    async def _exists(self, number: int) -> bool:
        try:
            return await self.shard(number) is not None
        except DataError:
            return True  # damaged, but there: listing will report it

    # -- indexes ------------------------------------------------------------

    async def shard_index(self, shard: Shard) -> np.ndarray:
        """The (2**minishard_bits, 2) array of absolute minishard index ranges."""
        key = (shard.label, shard.version)
        cached = self.caches.shard_index.get(key)
        if cached is not None:
            return cached
        size = self.spec.shard_index_size
        if shard.size < size:
            raise DataError(shard.label, f"file has {shard.size} bytes, shorter than its {size}-byte shard index")
        raw = await shard.read(self.source, 0, size, index=True)
        index = np.frombuffer(raw, dtype="<u8").reshape(-1, 2).astype(U64)
        self.caches.put(self.caches.shard_index, key, index)
        return index

    async def minishard(self, shard: Shard, minishard: int) -> MinishardIndex:
        key = (shard.label, shard.version, minishard)
        cached = self.caches.minishard_index.get(key)
        if cached is not None:
            return cached
        index = await self.shard_index(shard)
        start, end = int(index[minishard, 0]), int(index[minishard, 1])
        where = f"{shard.label} minishard {minishard}"
        base = self.spec.shard_index_size
        if start == end:
            result = EMPTY_MINISHARD
        elif start > end or base + end > shard.size:
            raise DataError(where, f"minishard index range [{start}, {end}) lies outside the file ({shard.size} bytes)")
        else:
            raw = await shard.read(self.source, base + start, end - start, index=True)
            if self.spec.minishard_index_encoding == "gzip":
                raw = gunzip(raw, where)
            result = decode_minishard(raw, base, shard.size, where)
            for cid, reason in list(result.bad.items())[:20]:
                log_once(log, f"bad:{shard.label}:{cid}", "%s chunk %d: %s", shard.label, cid, reason)
        self.caches.put(self.caches.minishard_index, key, result)
        return result

    # -- chunks -------------------------------------------------------------

    async def locate(self, chunk_id: int) -> tuple[Shard, int, int] | None:
        """(shard, absolute start, stored length) of a chunk, or None if absent."""
        shard_no, minishard_no = self.spec.location(chunk_id)
        shard = await self.shard(shard_no)
        if shard is None:
            return None
        mini = await self.minishard(shard, minishard_no)
        reason = mini.bad.get(chunk_id)
        if reason is not None:
            raise DataError(f"{shard.label} chunk {chunk_id}", reason)
        found = mini.find(chunk_id)
        if found is None:
            return None
        return shard, found[0], found[1]

    async def listing(self, batch: int = 4096) -> AsyncIterator[tuple[Shard, MinishardIndex]]:
        """Every listable chunk, as runs of whole minishards of one shard of
        about `batch` chunks.

        Small minishards are merged so that per-run costs (numpy calls, node
        batches) are spread over enough chunks. Damaged shards or minishards
        are logged and skipped so a listing still shows everything else. Ids
        that hash to another shard or minishard can never be looked up, so
        they are not listed either.
        """
        run: list[MinishardIndex] = []
        numbers: list[int] = []
        count = 0
        current: Shard | None = None
        async for shard, number, mini in self._minishards():
            if run and (shard is not current or count >= batch):
                yield current, self._owned(current, run, numbers)  # type: ignore[arg-type]
                run, numbers, count = [], [], 0
            current = shard
            run.append(mini)
            numbers.append(number)
            count += len(mini.ids)
        if run:
            yield current, self._owned(current, run, numbers)  # type: ignore[arg-type]

    def _owned(self, shard: Shard, run: list[MinishardIndex], numbers: list[int]) -> MinishardIndex:
        merged = MinishardIndex.concat(run)
        expected = np.repeat(np.array(numbers, dtype=U64), [len(m.ids) for m in run])
        shards, minis = self.spec.locations_array(merged.ids)
        belongs = (shards == U64(shard.number)) & (minis == expected)
        if belongs.all():
            return merged
        log_once(log, f"misplaced:{shard.label}:{numbers[0]}",
                 "%s: %d chunk ids listed in the wrong minishard; not listed", shard.label, int((~belongs).sum()))
        return MinishardIndex(merged.ids[belongs], merged.starts[belongs], merged.sizes[belongs], {})

    async def _minishards(self) -> AsyncIterator[tuple[Shard, int, MinishardIndex]]:
        """Every readable, non-empty minishard, with its number."""
        async for number in self.shard_numbers():
            try:
                shard = await self.shard(number)
                if shard is None:
                    continue
                index = await self.shard_index(shard)
            except DataError as e:
                log_once(log, f"list:{e}", "listing %s: skipping shard: %s", self.dir_key or ".", e)
                continue
            for m in np.nonzero(index[:, 0] != index[:, 1])[0].tolist():
                try:
                    mini = await self.minishard(shard, m)
                except DataError as e:
                    log_once(log, f"list:{e}", "listing %s: skipping minishard: %s", self.dir_key or ".", e)
                    continue
                if len(mini.ids):
                    yield shard, m, mini
