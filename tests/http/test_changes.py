"""`serve` while shards are replaced: a response is one version of a file, whole, or cut."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import trio

from unshardfs.app.opened import OpenedSource
from unshardfs.http.app import PIECE, TreeApp
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.testing.source_conformance import CHANGES, flipped

KEY = "1_1_1"


def test_a_shard_replaced_mid_response_cuts_it_never_mixes_versions(tmp_path):
    """Raw 2 MiB chunks (two body pieces): the shards are replaced by another version of the same
    geometry after the first piece went out. The second piece came from the new version (re-resolved
    as a new request may be): one 200 of old and new bytes under the old ETag."""
    scales = [Scale((256, 256, 128), (128, 128, 128), sharding(minishard=1, shard=1))]
    old, new = (write_volume(tmp_path / f"v{i}", scales, "uint8", seed=10 * i) for i in range(2))
    src = tmp_path / "src"
    shutil.copytree(old["sharded"], src)
    name = sorted(os.listdir(old["plain"] / KEY))[0]
    before, after = ((v["plain"] / KEY / name).read_bytes() for v in (old, new))
    assert len(before) == len(after) == 2 * PIECE and before[PIECE:] != after[PIECE:]

    async def main() -> tuple[list[dict], Exception | None]:
        session = await OpenedSource.open(str(src))
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and len(sent) == 2:
                for shard in sorted((new["sharded"] / KEY).glob("*.shard")):  # as a writer would: renamed in
                    shutil.copyfile(shard, src / KEY / (shard.name + ".tmp"))
                    os.rename(src / KEY / (shard.name + ".tmp"), src / KEY / shard.name)

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "GET", "path": f"/{KEY}/{name}", "raw_path": f"/{KEY}/{name}".encode(),
                 "headers": [], "query_string": b""}
        failure: Exception | None = None
        try:
            async with session.running():
                try:
                    await TreeApp(session.tree, session.stats)(scope, receive, send)
                except Exception as e:  # noqa: BLE001 - the app must answer its failures itself
                    failure = e
        finally:
            await session.aclose()
        return sent, failure

    sent, failure = trio.run(main)
    # The old version's first piece, then nothing: no second answer, no new bytes, not complete
    # (the server ends such a response's connection). Before: all of it, the second MiB new.
    assert [(m["type"], m.get("status"), m.get("more_body")) for m in sent] == [
        ("http.response.start", 200, None), ("http.response.body", None, True)]
    assert sent[1]["body"] == before[:PIECE] and failure is None


@pytest.fixture(scope="module")
def ocdbt_chunk(tmp_path_factory) -> tuple[Path, bytes]:
    """An OCDBT database (TensorStore) holding a Zarr group whose array `arr` is one raw 1 MiB chunk."""
    pytest.importorskip("tensorstore")
    from tests.support.ocdbt import write_one_chunk

    root = tmp_path_factory.mktemp("served") / "db"
    return root, write_one_chunk(root)


def _get(app: TreeApp, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """One GET through the app in process: status, headers, body (or the body sent before a cut)."""
    async def main() -> tuple[int, dict[str, str], bytes]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        await app(scope, receive, send)
        start = sent[0]
        return (start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]},
                b"".join(m.get("body", b"") for m in sent[1:]))
    return trio.run(main)


@pytest.mark.parametrize("how", list(CHANGES))
@pytest.mark.parametrize("store", ["ocdbt", "directory"])
def test_a_range_asked_for_under_an_old_tag_is_never_new_bytes(ocdbt_chunk, tmp_path, store, how):
    """A client reads a file in ranges, each after the first conditional on the first one's ETag
    (If-Range); the file holding its bytes changes between them -- a packed store's data file, or the file
    itself, even rewritten with its size and mtime put back. The next range is then the whole new content
    (200, a new ETag), never a 206 of new bytes under the old tag. Before, the tag was the size and mtime
    alone (and a request whose first read followed the change answered with the old node's tag)."""
    root, old = ocdbt_chunk
    new = flipped(old)
    if store == "ocdbt":
        source = tmp_path / "db"
        shutil.copytree(root, source)
        holder = next(f for f in source.rglob("*") if f.is_file() and old in f.read_bytes())
        data = holder.read_bytes()
        changed = data.replace(old, new)
        path = "/arr/c/0/0"
    else:
        source = tmp_path / "dir"
        source.mkdir()
        (source / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
        holder = source / "chunk.bin"
        holder.write_bytes(old)
        changed = new
        path = "/chunk.bin"

    async def open_session() -> OpenedSource:
        return await OpenedSource.open(str(source))

    session = trio.run(open_session)
    try:
        app = TreeApp(session.tree, session.stats)
        status, headers, body = _get(app, path, {"Range": "bytes=0-4095"})
        assert (status, body) == (206, old[:4096])
        tag = headers["etag"]
        CHANGES[how](holder, changed)
        status, again, body = _get(app, path, {"Range": "bytes=4096-8191", "If-Range": tag})
        assert (status, body) != (206, new[4096:8192]), "new bytes under the old tag"
        assert (status, body) in ((206, old[4096:8192]), (200, new)), (status, len(body))
        if status == 200:
            assert again["etag"] != tag
    finally:
        trio.run(session.aclose)
