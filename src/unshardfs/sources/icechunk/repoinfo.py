"""Icechunk's repo info object (`$ROOT/repo`, spec version 2), decoded from bytes (no I/O here).

From spec version 2 on (Icechunk 2.x) a repository has no `refs/` and no
`config.yaml`: one object, `repo`, the only one ever rewritten, holds every
branch and tag (each an index into its list of snapshots), the names of the
deleted tags, every snapshot with its parent (an index into the same list),
commit time and message, and the log of recent operations (whence the names
of deleted branches). Its body is a FlatBuffers `Repo` table behind the same
header as snapshots and manifests, file type 6; read with the same checked
reader (`format.Buffer`): every index is checked against the list it points
into, every count against the bytes it would take.
"""

from __future__ import annotations

from dataclasses import dataclass

from unshardfs.sources.icechunk.format import I32, ID_LEN, Buffer, Table
from unshardfs.util.errors import DataError

MAX_NAME = 1024  # bytes of a branch or tag name (Icechunk takes far fewer)
MAX_MESSAGE = 1 << 20  # bytes of a commit message
# Operations of the log (`UpdateType`, the union's member numbers) that name a branch in their first
# field: created, deleted, reset, committed to, amended. A branch they name that the repo info no longer
# holds was deleted (by hand, or by an expiration, which logs no deletion of its own).
BRANCH_UPDATES = (7, 8, 9, 10, 11)


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A snapshot as the repo info lists it: its parent (None: the first), commit time and message."""

    id: bytes
    parent: bytes | None
    flushed_at_us: int
    message: str


@dataclass(frozen=True)
class RepoInfo:
    spec_version: int
    branches: dict[str, bytes]  # name -> snapshot id
    tags: dict[str, bytes]  # name -> snapshot id; a deleted tag is never here
    deleted_tags: tuple[str, ...]
    deleted_branches: tuple[str, ...]  # named by the operations the log still holds (it keeps the recent ones)
    snapshots: dict[bytes, SnapshotInfo]  # by id
    nbytes: int  # what keeping it costs, about (for byte-bounded caches)


def decode_repo_info(body: bytes, where: str, max_refs: int, max_snapshots: int) -> RepoInfo:
    """The repo info from its decompressed FlatBuffers body; DataError naming what is wrong."""
    buf = Buffer(body, where)
    root = buf.root("repo info")
    ids: list[bytes] = []
    parents: list[int] = []
    infos: list[tuple[int, str]] = []
    start, n = root.tables(4, "snapshots", max_snapshots, required=True)
    for i in range(n):
        t = buf.table(buf.follow(start + 4 * i, "snapshot info"), "snapshot info")
        raw = t.struct(0, ID_LEN, "id", required=True)
        assert raw is not None
        ids.append(raw)
        pos = t.field(1, 4)
        parents.append(0 if pos is None else _i32(buf, pos))  # (absent: the schema's default, 0)
        infos.append((t.u64(2), t.string(3, "message", MAX_MESSAGE, required=True) or ""))
    snapshots: dict[bytes, SnapshotInfo] = {}
    for i, raw in enumerate(ids):
        parent = parents[i]
        if parent != -1 and not 0 <= parent < len(ids):
            raise buf.fail(f"snapshot {i}: parent index {parent} outside the {len(ids):,} snapshots")
        if raw in snapshots:
            raise buf.fail(f"snapshot {i}: listed twice")
        snapshots[raw] = SnapshotInfo(raw, None if parent == -1 else ids[parent], *infos[i])
    deleted = tuple(_strings(buf, root, 3, "deleted_tags", max_refs))
    tags = {name: raw for name, raw in _refs(buf, root, 1, "tags", ids, max_refs).items() if name not in deleted}
    branches = _refs(buf, root, 2, "branches", ids, max_refs)
    gone: list[str] = []
    start, n = root.tables(7, "latest_updates", max_refs * 16, required=True)
    for i in range(n):
        t = buf.table(buf.follow(start + 4 * i, "update"), "update")
        if t.u8(0) not in BRANCH_UPDATES:
            continue
        update = t.table(1, "update_type", required=True)
        assert update is not None
        name = update.string(0, "name", MAX_NAME, required=True) or ""
        if name not in branches and name not in gone:
            gone.append(name)
    return RepoInfo(root.u8(0), branches, tags, deleted, tuple(sorted(gone)), snapshots,
                    len(body) + 200 * len(snapshots))


def _i32(buf: Buffer, pos: int) -> int:
    buf.need(pos, 4, "a 32-bit field")
    out: int = I32.unpack_from(buf.data, pos)[0]
    return out


def _strings(buf: Buffer, table: Table, slot: int, name: str, limit: int) -> list[str]:
    start, n = table.tables(slot, name, limit, required=True)
    return [buf.string(buf.follow(start + 4 * i, name), name, MAX_NAME) for i in range(n)]


def _refs(buf: Buffer, table: Table, slot: int, name: str, ids: list[bytes], limit: int) -> dict[str, bytes]:
    """Branches or tags: name -> the snapshot its index names (checked against the list)."""
    out: dict[str, bytes] = {}
    start, n = table.tables(slot, name, limit, required=True)
    for i in range(n):
        t = buf.table(buf.follow(start + 4 * i, name), name)
        ref = t.string(0, "name", MAX_NAME, required=True) or ""
        index = t.u32(1)
        if index >= len(ids):
            raise buf.fail(f"{name} {ref[:100]!r}: snapshot index {index} outside the {len(ids):,} snapshots")
        if ref in out:
            raise DataError(buf.where, f"{name} {ref[:100]!r} is listed twice")
        out[ref] = ids[index]
    return out
